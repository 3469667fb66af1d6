"""Running the app: ``PredictionServer``, uvicorn on a socket of our own, stopped gracefully.

A stop (SIGTERM or SIGINT in ``serve_forever``, or ``stop()``) first marks the service
draining, so ``/health`` answers 503 and a request arriving now gets 503; then uvicorn stops
accepting connections, lets every request already received finish and closes each connection
after its response; after at most ``shutdown_timeout`` seconds it cancels what is left. Last,
the app's lifespan closes ParallelInference. Connections are bounded by ``ConnectionLimits``
(``connections.py``): how many, how long headers and idle keep-alive may take, header size.

    server = PredictionServer("runs/lenet", port=0).start()   # a thread of this process
    print(server.url)          # http://127.0.0.1:PORT
    server.stop()
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time

from dl4py.errors import ConfigError, DL4PyError, MissingDependencyError, bind_error
from dl4py.serve.app import make_app
from dl4py.serve.connections import (DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE_TIMEOUT, DEFAULT_MAX_HEADER_BYTES,
                                     ConnectionLimits)

log = logging.getLogger("dl4py.serve")

DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
LISTEN_BACKLOG = 2048  # connections the kernel queues before this process accepts them
STARTUP_SECONDS = 60.0


def _uvicorn():
    try:
        import uvicorn  # optional: uvicorn (extra serve)
    except ImportError:
        raise MissingDependencyError("dl4py serve", "uvicorn", "serve") from None
    return uvicorn


class PredictionServer:
    """``make_app(model, **options)`` served over HTTP on ``host:port`` (port 0: any free one).

    ``max_connections`` (default 256, fewer under a low ``ulimit -n``), ``header_timeout``,
    ``keep_alive_timeout`` and ``max_header_bytes`` bound the connections (``ConnectionLimits``).
    """

    def __init__(self, model, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, log_level: str = "warning",
                 max_connections: int | None = None, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                 keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, **options):
        uvicorn = _uvicorn()
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError("--port", f"must be 0 to 65535 (0: any free port), got {port!r}")
        if isinstance(shutdown_timeout, bool) or not isinstance(shutdown_timeout, (int, float)) or shutdown_timeout < 0:
            raise ConfigError("shutdown_timeout", f"must be seconds >= 0, got {shutdown_timeout!r}")
        self.limits = ConnectionLimits(max_connections, header_timeout, keep_alive_timeout,
                                       max_header_bytes).validate()
        # First: a port in use is told before the model loads.
        self.socket = _bind(host, port)
        self.host, self.port = self.socket.getsockname()[:2]  # the port chosen, for port 0
        try:
            self.app = make_app(model, **options)
        except BaseException:
            self.socket.close()
            raise
        self.service = self.app.state.service
        # log_config=None: uvicorn's records go to the program's handlers (the command's one
        # format) rather than handlers of its own ("INFO:     ..."); log_level still applies.
        config = uvicorn.Config(self.app, log_level=log_level, log_config=None,
                                timeout_graceful_shutdown=shutdown_timeout,
                                lifespan="on", access_log=False, **self.limits.uvicorn_settings())
        self._server = _uvicorn_server(uvicorn, config, self._drain)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.in_flight_at_stop: int | None = None  # requests under way when the stop began
        self._ran = False

    @property
    def url(self) -> str:
        return f"http://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"

    def serve_forever(self) -> None:
        """Serve in this thread until SIGTERM or SIGINT (from the main thread) or ``stop()``;
        returns once the requests received are answered. A second SIGINT stops at once."""
        self._ran = True
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._closed()

    def start(self) -> "PredictionServer":
        """Serve in a background thread; returns once the server accepts requests."""
        def run():
            try:
                self._server.run(sockets=[self.socket])
            except BaseException as error:  # noqa: BLE001 - start() or stop() tells it
                self._failure = error
            finally:
                self._closed()

        self._ran = True
        self._thread = threading.Thread(target=run, name="dl4py-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(0.01)
        if not self._server.started:
            self.stop(timeout=10)
            raise DL4PyError(f"dl4py serve: the server did not start within {STARTUP_SECONDS:g} s: "
                             f"{self._failure!r}")
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop gracefully (see the module's docstring); with ``start()``, wait up to
        ``timeout`` seconds (default: the shutdown timeout and a margin) for the thread."""
        self._drain()
        self._server.should_exit = True  # uvicorn's loop looks every 0.1 s
        if not self._ran:  # never served: nothing else will close the replicas
            self._closed()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout if timeout is not None else self._server.config.timeout_graceful_shutdown + 30)

    def _drain(self) -> None:
        if self.in_flight_at_stop is None:
            self.in_flight_at_stop = self.service.drain()
            log.info("dl4py serve: stopping; answering the %d requests in flight", self.in_flight_at_stop)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _closed(self) -> None:
        # The app's lifespan closed the service already, unless uvicorn failed before it ran.
        self.service.close()
        with contextlib.suppress(OSError):
            self.socket.close()

    def __enter__(self) -> "PredictionServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, with errors that name the flag at fault."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ConfigError("--host", f"{host!r} is not a host name or address here: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        error = bind_error(exc, host, port)
        if error is not None:
            raise error from None
        raise
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(uvicorn, config, on_stop):
    """uvicorn's Server, with our signal handling: SIGTERM or SIGINT starts a graceful stop
    (``on_stop`` first, a second SIGINT forces it) and, unlike uvicorn's own, is not raised
    again once the server is down: stopping is how a server ends, so it exits normally."""

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            # asyncio listened again with uvicorn's backlog, which is also how many connections
            # it accepts at one wake-up before any is counted (ConnectionLimits.accept_burst). The
            # kernel's queue may be long again: a connection waiting there holds no descriptor
            # of ours, and a short queue would drop a burst's connections for a second.
            for sock in sockets or ():
                sock.listen(LISTEN_BACKLOG)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach the main thread only
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                on_stop()
                self.should_exit = True

    return Server(config)
