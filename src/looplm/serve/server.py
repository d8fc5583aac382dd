"""Running the app of :func:`~looplm.serve.app.build_app` with uvicorn: :func:`run_server` in the foreground with
the signals handled (``looplm serve``), :class:`Server` in a thread of this process (tests, notebooks). uvicorn is
imported when a server is made, not with this module.

Shutdown (SIGTERM / SIGINT, or :meth:`Server.stop`): the app stops taking requests (503), the engine lets the
requests in flight finish for up to ``grace_s`` and ends the rest (their streams get an error event: the drain,
:meth:`~looplm.serve.state.ServerState.drain`), then uvicorn closes the connections (``timeout_graceful_shutdown``)
and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time

from fastapi import FastAPI

from .state import ServerState

__all__ = ["Server", "run_server"]

log = logging.getLogger("looplm.serve")


def _uvicorn_server_class():
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """uvicorn with looplm's shutdown: the first SIGTERM / SIGINT drains (503 for new requests, the engine
        finishes what it has for up to ``grace_s``), then uvicorn exits; a second SIGINT exits at once. The
        signal is not raised again after the exit (uvicorn's default), so the process exits 0."""

        def __init__(self, config, state: ServerState, grace_s: float):
            super().__init__(config)
            self.looplm_state, self.grace_s, self._draining = state, float(grace_s), None

        def handle_exit(self, sig, frame) -> None:  # from a signal handler: start the drain, return at once
            if self._draining is not None:
                if sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True
                return
            log.info("looplm serve: signal %s, draining (grace %.0f s)", sig, self.grace_s)
            self.drain_async()

        def drain_async(self) -> threading.Thread:
            if self._draining is None:
                self._draining = threading.Thread(target=self._drain, name="looplm-drain", daemon=True)
                self.looplm_state.draining = True
                self._draining.start()
            return self._draining

        def _drain(self) -> None:
            try:
                self.looplm_state.drain(self.grace_s)
            finally:
                self.should_exit = True

    return _DrainingServer


def _config(app: FastAPI, host: str, port: int, log_level: str, **kw):
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5, **kw
    )


def run_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0, log_level: str = "info"
) -> None:
    """Serve ``app`` (from :func:`build_app`) in the foreground until SIGTERM / SIGINT, then drain: new
    requests get 503, the requests in flight get up to ``grace_s`` seconds, the rest an error, and it returns."""
    sock = _bind(host, port)
    port = sock.getsockname()[1]
    print(
        f"looplm serve: listening on http://{host}:{port}/v1 (Ctrl-C or SIGTERM drains and stops, grace {grace_s:g} s)",
        file=sys.stderr,
        flush=True,
    )
    server = _uvicorn_server_class()(_config(app, host, port, log_level), app.state.looplm, grace_s)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), bound before uvicorn starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on an accepted connection only when its socket says
    # so (the accepted socket inherits this one's proto). Without it Nagle holds each streamed chunk until the
    # client's delayed ACK (~40 ms on Linux): on a reused keep-alive connection a whole stream then arrived at once
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or --host") from e
    return sock


class Server:
    """``app`` served by uvicorn in a thread of this process, on ``host`` (127.0.0.1) at ``port`` (0: a free
    one, bound before the thread starts; :attr:`port` / :attr:`url` say which).

    ``with Server(app) as s: openai.OpenAI(base_url=s.url + "/v1", ...)``; :meth:`stop` drains like SIGTERM
    (``grace_s``) and joins the thread."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, grace_s: float = 5.0, log_level: str = "warning"
    ):
        self.app, self.host, self.grace_s = app, host, grace_s
        self._sock = _bind(host, port)
        self.port = self._sock.getsockname()[1]
        self._server = _uvicorn_server_class()(_config(app, host, self.port, log_level), app.state.looplm, grace_s)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Server:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="looplm-uvicorn", daemon=True
        )
        self._thread.start()
        t_end = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError(f"the server on {self.url} did not start within {timeout_s:g} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Drain (503 for new requests, ``grace_s`` for those in flight), stop uvicorn, join its thread."""
        if self._thread is None:
            return
        self._server.drain_async()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(10)
        self._thread = None
        self._sock.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
