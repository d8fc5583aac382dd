"""The server's errors in OpenAI's shape: :class:`APIError`, raised anywhere on a request's path (the app's checks,
:mod:`.serving`, :mod:`.choices`) and answered as an :class:`ErrorResponse`, which always encodes."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from .fields import FieldError
from .protocol import error_body, field_error_message


class APIError(Exception):
    """An answer in OpenAI's error shape: ``status`` (400, 401, 404, 429, 503, 504, 500), ``message``, ``type``,
    ``param`` / ``fields`` (the bad fields), ``code`` and extra ``headers`` (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        fields: list[FieldError] | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.fields, self.headers = fields, headers

    @classmethod
    def bad_fields(cls, fields: list[FieldError]) -> APIError:
        ctx = any(_is_context_error(f) for f in fields)
        return cls(
            400, field_error_message(fields), fields=fields, code="context_length_exceeded" if ctx else "invalid_field"
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code, self.fields)

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorResponse(JSONResponse):
    """An error body in ASCII JSON: a value quoted from the request (a lone surrogate, a control character) is
    escaped, so the answer can always be encoded (starlette's JSONResponse encodes ``ensure_ascii=False``)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _is_context_error(f: FieldError) -> bool:
    return (
        f.field.split("[")[0] in ("prompt", "messages", "max_tokens", "max_completion_tokens")
        and "context" in f.message
    )


def closed_error() -> APIError:
    """The 503 of a server that is shutting down."""
    return APIError(
        503, "the server is shutting down: it takes no new requests", "server_shutting_down", code="shutting_down"
    )


def unknown_model(name, served: str) -> APIError:
    """The 404 of a request naming a model other than the one served (``served``)."""
    return APIError(
        404,
        f"the model {name!r} does not exist: this server serves {served!r} (GET /v1/models)",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )
