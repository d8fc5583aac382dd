"""The OpenAI-compatible FastAPI app over an :class:`~looplm.serve.engine.Engine`. :func:`build_app` makes it: the
routes, the checks that come before any parsing (the API key, the content type, the body's bound), the lifespan
(it starts the engine and shuts it down with the app), the error handlers, ``/health``, ``/metrics`` and
``/v1/models``. The OpenAI endpoints' request path is :mod:`.serving` (one object per endpoint, which the routes
call); :mod:`.server` runs the app with uvicorn. ``docs/serving.md`` is the user's guide.

Its state (:class:`~looplm.serve.state.ServerState`, also ``app.state.looplm``) is shared with :mod:`.serving`;
the app's shutdown drains it (with no grace) at the latest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import APIError, ErrorResponse, closed_error, unknown_model
from .metrics import CONTENT_TYPE
from .protocol import ModelCard, ModelList, error_body
from .serving import ChatServing, CompletionServing
from .state import DEFAULT_MAX_BODY_BYTES, ServerState

__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app"]


def build_app(
    engine,
    tokenizer,
    model_name: str,
    api_key: str | None = None,
    request_timeout_s: float = 600.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The OpenAI-compatible app over a started (or not yet started: the app's startup starts it) ``engine``.

    ``tokenizer``: looplm's (``encode`` / ``decode`` / ``eos_id``; an :class:`HFTokenizer` of kind
    ``transformers`` with a ``chat_template`` for the chat endpoint). ``model_name``: the id ``/v1/models``
    lists and requests must name. ``api_key``: when set, ``/v1/*`` wants ``Authorization: Bearer KEY``
    (``/health`` and ``/metrics`` stay open). ``request_timeout_s``: a request still running after it is
    aborted and answered with an error. ``max_body_bytes``: a larger request body is a 413, read no further. The
    engine is shut down with the app (at the latest)."""
    state = ServerState(engine, tokenizer, model_name, api_key, request_timeout_s, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not _engine_running(engine):
            engine.start()
        yield
        await asyncio.to_thread(state.drain, 0.0)

    app = FastAPI(
        title="looplm serve",
        summary="an OpenAI-compatible server of a looped language model",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.looplm = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        msg = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return ErrorResponse(error_body(msg, kind, code=exc.status_code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return ErrorResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    def guard(request: Request) -> None:
        """401 without the API key, 503 while shutting down."""
        if state.api_key is not None:
            auth = request.headers.get("authorization", "")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
                raise APIError(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer KEY' (the "
                    "key the server was started with, --api-key)",
                    "authentication_error",
                    code="invalid_api_key",
                )
        if state.draining:
            raise closed_error()

    async def admit(request: Request) -> bytes:
        """The checks before any parsing (:func:`guard`, a JSON content type, the body's bound): the body."""
        guard(request)
        _require_json(request)
        return await _read_body(request, state.max_body_bytes)

    completion_serving, chat_serving = CompletionServing(state, admit), ChatServing(state, admit)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> ModelCard:
        describe = getattr(engine, "describe", None)
        return ModelCard(
            id=state.model_name,
            created=state.created,
            max_model_len=getattr(engine, "max_model_len", None),
            looplm={"K": getattr(engine, "K", None), "engine": describe() if describe else None},
        )

    @app.get("/v1/models")
    async def models(request: Request):
        guard(request)
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        guard(request)
        if model_id != state.model_name:
            raise unknown_model(model_id, state.model_name)
        return model_card().model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion_serving.create(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat_serving.create(request)

    app.state.guard = guard
    return app


def _engine_running(engine) -> bool:
    t = getattr(engine, "_thread", None)
    return t is not None and (t.is_alive() or getattr(engine, "_closed", False))


def _require_json(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (as vLLM: a cross-site form or ``text/plain`` POST,
    which a browser sends without a preflight, never reaches the model)."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"the body must be JSON with the header 'Content-Type: application/json', got "
            f"{ctype[:60] or 'no Content-Type'!r} (curl: add -H 'Content-Type: application/json')",
            param="Content-Type",
            code="unsupported_media_type",
        )


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it passes ``limit`` bytes (by its Content-Length, or while it streams in).
    By hand: neither starlette nor uvicorn bounds a request body."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large("sent without a Content-Length", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body ({size}) is over this server's bound of {limit} bytes (--max-body-mib): "
        "send a shorter prompt or fewer prompts per request",
        param="body",
        code="request_too_large",
    )
