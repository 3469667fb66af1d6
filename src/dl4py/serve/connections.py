"""How ``dl4py serve`` bounds its connections, so that no client can take every descriptor.

uvicorn's h11 protocol (always: also where httptools is installed, which uvicorn would
prefer) under four bounds, ``ConnectionLimits``:

- ``max_connections``: connections served at once. One more is answered 503 as soon as it is
  accepted, and closed: its descriptor is back at once, however many come.
- ``header_timeout``: a request's line and headers must be complete within this many seconds
  of the connection opening, or of the first byte of the next request on it; else 408 and
  closed (closed without a word when nothing came).
- ``keep_alive_timeout``: an idle connection between requests is closed (uvicorn's timer).
- ``max_header_bytes``: the request line and headers together; more gets 431.

Not uvicorn's ``limit_concurrency``: it counts connections but refuses only a request whose
headers are complete, so a connection that never completes them is never refused, and each
holds a descriptor until the process has none left to accept with. uvicorn's ``backlog`` is
``accept_burst``: how many connections asyncio accepts at one wake-up before any of them is
counted, so the descriptors the connections hold stay within ``descriptors`` (the server
lengthens the kernel's queue again once asyncio has listened: a connection waiting there
holds no descriptor of ours).

Every refusal is JSON, ``{"error": ...}``. After a 408, 431 or 400 the server drops what the
client still sends until the client closes, for at most LINGER_SECONDS: closing with unread
bytes resets the connection, and a reset may destroy the answer before the client reads it.
A 503 closes at once, so that refusals hold no descriptors (Linux keeps an answer received
before a reset readable; other systems' clients may see a reset instead).
"""

from __future__ import annotations

import http
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, replace

from dl4py.errors import ConfigError

log = logging.getLogger("dl4py.serve")

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0
DEFAULT_MAX_HEADER_BYTES = 16 * 1024  # h11's own default
MIN_HEADER_BYTES = 1024  # a request line and a few headers
LINGER_SECONDS = 1.0
RESERVED_FILES = 64  # beyond those open when the server is made: logs, model files, a margin
WARN_EVERY_SECONDS = 10.0
_HEADER_END = re.compile(rb"\r?\n\r?\n")


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds above; ``max_connections=None`` is DEFAULT_MAX_CONNECTIONS, or fewer where
    the process's open-file limit (``ulimit -n``) leaves less room."""

    max_connections: int | None = None
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES

    @property
    def accept_burst(self) -> int:
        """How many connections asyncio accepts at one wake-up, before any is counted."""
        return _accept_burst(self.max_connections)

    @property
    def descriptors(self) -> int:
        """The most descriptors the connections hold at once: those served, one burst being
        refused and one accepted but not yet counted."""
        return _descriptors(self.max_connections)

    def validate(self) -> "ConnectionLimits":
        """These limits checked (a ConfigError names the option), ``max_connections`` resolved."""
        for name in ("header_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(name, f"must be seconds > 0, got {value!r}")
        value = self.max_header_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < MIN_HEADER_BYTES:
            raise ConfigError("max_header_bytes", f"must be a whole number >= {MIN_HEADER_BYTES}, got {value!r}")
        value = self.max_connections
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError("max_connections", f"must be a whole number >= 1, got {value!r}")
        room = _free_descriptors()
        if room is None:  # no open-file limit to respect here
            return self if value is not None else replace(self, max_connections=DEFAULT_MAX_CONNECTIONS)
        limit, room = room
        if value is None:
            value = DEFAULT_MAX_CONNECTIONS
            while value > 0 and _descriptors(value) > room:
                value -= 1
            if value == 0:
                raise ConfigError("max_connections", f"this process may open {limit} files (ulimit -n) and uses "
                                                     "nearly all of them: no room for connections; raise the limit")
            return replace(self, max_connections=value)
        if _descriptors(value) > room:
            raise ConfigError("max_connections", f"{value} connections may hold {_descriptors(value)} open files, "
                                                 f"but this process may open {limit} (ulimit -n) and keeps "
                                                 f"{limit - room} for itself; lower it or raise the limit")
        return self

    def uvicorn_settings(self) -> dict:
        """The keyword arguments of ``uvicorn.Config`` that carry these limits."""
        return {"http": guarded_protocol(self), "timeout_keep_alive": self.keep_alive_timeout,
                "h11_max_incomplete_event_size": self.max_header_bytes, "backlog": self.accept_burst}


def _accept_burst(max_connections: int) -> int:
    return max(16, max_connections // 4)


def _descriptors(max_connections: int) -> int:
    return max_connections + 2 * _accept_burst(max_connections)


def _free_descriptors() -> tuple[int, int] | None:
    """(the soft open-file limit, how many more files this process may open less a reserve),
    or None where there is no such limit (no ``resource`` module, or unlimited)."""
    try:
        import resource  # optional: resource (POSIX only: a missing limit is no limit to keep under)
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume a process's usual few dozen
        in_use = 64
    return soft, soft - in_use - RESERVED_FILES


def answer_bytes(status: int, message: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response with a JSON error, written past h11: there may be no request
    for h11 to answer (the connection was refused on arrival, or its headers never came)."""
    body = json.dumps({"error": message}).encode("utf-8")
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


def guarded_protocol(limits: ConnectionLimits):
    """uvicorn's h11 protocol under ``limits`` (validated): a class for ``uvicorn.Config(http=...)``."""
    # uvicorn and h11 are the optional dependencies of dl4py[serve]: loaded when a server is made.
    import h11  # optional: h11 (extra serve, through uvicorn)
    from uvicorn.protocols.http.h11_impl import H11Protocol  # optional: uvicorn (extra serve)

    class GuardedH11Protocol(_ConnectionGuard, H11Protocol):
        _limits = limits
        _idle = h11.IDLE
        _refusal_warning = _ThrottledWarning()  # one per server: a flood gets a line every so often
        HEADERS_TOO_LARGE = (f"the request's line and headers are over {limits.max_header_bytes} bytes, the most "
                             "this server reads (max_header_bytes)")

    return GuardedH11Protocol


class _ThrottledWarning:
    """The warning that new connections are refused, logged at most every WARN_EVERY_SECONDS."""

    def __init__(self) -> None:
        self._last = -math.inf

    def warn(self, open_now: int, max_connections: int) -> None:
        now = time.monotonic()
        if now - self._last >= WARN_EVERY_SECONDS:
            self._last = now
            log.warning("dl4py serve: %d connections open, more than max_connections %d: refusing new ones "
                        "with 503 (logged at most every %g s)", open_now, max_connections, WARN_EVERY_SECONDS)


class _DeadlinesAndRefusals:
    """A guarded connection's one timer (its headers' deadline, then the linger after a
    refusal) and its refusals: a JSON answer, then the end of the connection."""

    def _start_header_clock(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self._limits.header_timeout, self._headers_late)

    def _stop_clock(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self.conn.their_state is not self._idle:
            return
        if self.conn.trailing_data[0]:  # part of a request came: tell its client why
            self._refuse(408, f"the request's line and headers did not all arrive within "
                              f"{self._limits.header_timeout:g} s (header_timeout)")
        else:  # nothing came: a connection opened and left idle
            self.transport.close()

    def _refuse(self, status: int, message: str, retry_after: int | None = None, linger: bool = True) -> None:
        self._stop_clock()
        self._refused = True
        self.transport.write(answer_bytes(status, message, retry_after))
        if not linger or not self.transport.can_write_eof():
            self.transport.close()  # once the answer is written
            return
        try:
            self.transport.write_eof()  # the answer, then the end; the client's close ends the rest
        except OSError:  # the client is gone already (it connected and closed at once)
            self.transport.abort()
            return
        self._timer = self.loop.call_later(LINGER_SECONDS, self.transport.abort)


class _ConnectionGuard(_DeadlinesAndRefusals):
    """The bounds on one connection, mixed in before uvicorn's H11Protocol (which ``super()``
    reaches). ``guarded_protocol`` sets ``_limits``, ``_idle`` (h11.IDLE, so that h11 stays an
    optional import), ``_refusal_warning`` and ``HEADERS_TOO_LARGE``."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)  # counted in self.connections from here
        self._timer = None
        self._refused = False
        open_now = len(self.connections)
        if open_now > self._limits.max_connections:
            self._refusal_warning.warn(open_now, self._limits.max_connections)
            self._refuse(503, f"the server is serving its most connections, {self._limits.max_connections} "
                              "(max_connections); retry later", retry_after=1, linger=False)
        else:
            self._start_header_clock()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered already: what the client still sends is dropped
        if self.conn.their_state is self._idle and self._headers_over_limit(data):
            self._refuse(431, self.HEADERS_TOO_LARGE)
            return
        super().data_received(data)
        if self._refused or self.transport.is_closing():
            return
        if self.conn.their_state is self._idle:
            self._start_header_clock()  # part of a request: its headers have their deadline
        else:
            self._stop_clock()  # a whole request's headers came

    def connection_lost(self, exc) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # h11 refused what came (uvicorn logs "Invalid HTTP request received."): say why, as JSON.
        # Headers over the limit are refused before h11 sees them, except those of a request
        # sent before the previous one was answered.
        if len(self.conn.trailing_data[0]) > self._limits.max_header_bytes:
            self._refuse(431, self.HEADERS_TOO_LARGE)
        else:
            self._refuse(400, "the request is not valid HTTP/1.1 (its request line or headers are malformed)")

    def _headers_over_limit(self, data: bytes) -> bool:
        trailing = self.conn.trailing_data[0]
        if len(trailing) + len(data) <= self._limits.max_header_bytes:
            return False  # the headers are a part of these bytes: within the limit (no copy, no search)
        pending = trailing + data
        end = _HEADER_END.search(pending, 0, self._limits.max_header_bytes + 4)
        return (end.end() if end else len(pending)) > self._limits.max_header_bytes
