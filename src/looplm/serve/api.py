"""The old home of the HTTP server, kept so that its imports still work: the names moved to :mod:`.app`
(:func:`build_app`, ``DEFAULT_MAX_BODY_BYTES``), :mod:`.server` (:class:`Server`, :func:`run_server`),
:mod:`.errors` (:class:`APIError`) and :mod:`.detokenizer` (:class:`IncrementalText`); the request path of the
OpenAI endpoints is :mod:`.serving`."""

from .app import DEFAULT_MAX_BODY_BYTES, build_app
from .detokenizer import IncrementalText
from .errors import APIError
from .server import Server, run_server

__all__ = ["APIError", "DEFAULT_MAX_BODY_BYTES", "IncrementalText", "Server", "build_app", "run_server"]
