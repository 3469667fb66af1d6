"""``dl4py ui``: DL4J's UIServer for dl4py runs, a local web page that follows training live.

It serves one page (``page.live_page``), its scripts from the package (no CDN: it works
offline) and one JSON call, ``/api/poll?offsets=A,B,...``, which the page makes every two
seconds: the runs' status and each run's metrics records past the offsets the page already
holds (bytes of a run's metrics.jsonl, indices of an in-memory storage's records), so a new
epoch or stats point appears without a reload and a poll reads only what was added. A poll
reads at most about 4 MiB of lines, never a line over 1 MiB, and answers with at most 2,000
records of each kind per run (``runs.read_metrics``): its answer and the server's memory
stay bounded whatever the runs hold. The server reads the run directories (or the attached
storages' records) and keeps no store of its own. It binds to 127.0.0.1 unless told another
host: the page is for the user at the machine (or through an SSH tunnel).

    server = UIServer([Path("runs/a"), Path("runs/b")], port=0)      # dl4py ui runs/a runs/b --port 0
    print(server.url)
    server.serve_forever()

From a notebook or a script, DL4J's way: one server for the process, started on first use
in a daemon thread, on port 9000 (a free one when 9000 is taken); storages come and go:

    ui = UIServer.get_instance()
    storage = InMemoryStatsStorage()
    ui.attach(storage)                     # a FileStatsStorage or a run directory too
    model.fit(train, epochs=5, listeners=[StatsListener(storage)])
    ui.detach(storage); ui.stop()
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from dl4py.errors import ConfigError, bind_error
from dl4py.monitor.memory_run import MemoryRun
from dl4py.monitor.page import STATIC, STATIC_FILES, live_page, page_data, title_for
from dl4py.monitor.runs import METRICS, RunFolder, open_folders
from dl4py.monitor.storage import FileStatsStorage, InMemoryStatsStorage

log = logging.getLogger("dl4py")

DEFAULT_PORT = 9000  # DL4J's UIServer's
POLL_MS = 2000

_instance: UIServer | None = None  # get_instance's server, until it is stopped
_instance_lock = threading.Lock()


class UIServer(ThreadingHTTPServer):
    """The HTTP server of ``dl4py ui`` over run directories, or one sweep folder; and DL4J's
    UIServer of a process (``get_instance``), to which storages are attached and detached.
    ``start`` serves in a daemon thread, ``stop`` ends that and frees the port."""

    daemon_threads = True  # a page left open does not keep the process alive

    def __init__(self, paths: list[Path] = (), host: str = "127.0.0.1", port: int = DEFAULT_PORT):
        if not 0 <= port <= 65535:
            raise ConfigError("--port", f"must be 0 to 65535 (0: any free port), got {port}")
        runs, self.sweep = open_folders(list(paths), waiting=True)
        self._lock = threading.Lock()  # the run list: attach and detach change it while polls read it
        # What is shown, in the page's order, and what each run came from (detach finds it there).
        self._runs: list[RunFolder | MemoryRun] = list(runs)
        self._attached: list[tuple[object, RunFolder | MemoryRun]] = (
            [] if self.sweep is not None else [(_path_key(run.path), run) for run in runs])
        self._memory_serial = 0
        self._thread: threading.Thread | None = None
        self._requests: list[tuple[threading.Thread, socket.socket]] = []  # in flight: stop ends them
        self._stopped = False
        self._polls = threading.Condition()
        self._polls_started = self._polls_finished = 0
        self._last_poll: float | None = None  # time.monotonic() of the last answer
        self.page = live_page(POLL_MS).encode("utf-8")
        try:
            super().__init__((host, port), _Handler)
        except socket.gaierror as exc:
            raise ConfigError("--host", f"{host!r} is not a host name or address here: {exc.strerror}") from None
        except OSError as exc:
            error = bind_error(exc, host, port, busy_hint=" (another dl4py ui?)")
            if error is not None:
                raise error from None
            raise

    # ---- DL4J's UIServer of a process -------------------------------------------------------
    @classmethod
    def get_instance(cls) -> UIServer:
        """The process's UI server (DL4J's ``UIServer.getInstance()``): started on the first
        call, on 127.0.0.1 port 9000, or a free port when 9000 is taken; the same server on
        every later call until it is stopped."""
        global _instance
        with _instance_lock:
            if _instance is None:
                _instance = cls.empty().start()
                log.info("dl4py ui: the training UI at %s", _instance.url)
            return _instance

    @classmethod
    def empty(cls, port: int | None = None) -> UIServer:
        """A server showing nothing yet, for storages to be attached to, bound (not started) on
        127.0.0.1 ``port``; None: 9000, or any free port when 9000 is taken."""
        if port is not None:
            return cls([], port=port)
        try:
            return cls([], port=DEFAULT_PORT)
        except ConfigError as exc:
            if exc.where != "--port":
                raise
            return cls([], port=0)  # 9000 is taken (another dl4py ui?)

    def attach(self, storage, name: str | None = None) -> None:
        """Show ``storage``'s records on the page, live (DL4J's ``attach``): an
        ``InMemoryStatsStorage``, a ``FileStatsStorage``, or a run directory (one training
        has not made yet too). ``name``: the run's name on the page (default: the run
        directory's, or "in-memory 1", "in-memory 2", ...). Attaching it again does nothing."""
        with self._lock:
            if self.sweep is not None:
                raise ConfigError("UIServer.attach", f"this server shows sweep {self.sweep.path}: attach runs "
                                                     "to a server of run directories or to UIServer.get_instance()")
            if self._find(storage) is not None:
                return
            run = self._run_for(storage, name)
            self._runs.append(run)
            self._attached.append((_path_key(storage) if isinstance(storage, (str, Path)) else storage, run))

    def detach(self, storage) -> bool:
        """Take ``storage`` (or a run directory) off the page (DL4J's ``detach``); whether it was attached."""
        with self._lock:
            found = self._find(storage)
            if found is None:
                return False
            self._attached.remove(found)
            self._runs.remove(found[1])
            return True

    def is_attached(self, storage) -> bool:
        with self._lock:
            return self._find(storage) is not None

    def start(self) -> UIServer:
        """Serve in a daemon thread, which does not keep the process alive; returns this server."""
        if self._stopped:
            raise RuntimeError("UIServer: this server was stopped; UIServer.get_instance() starts a new one")
        if self._thread is None:
            self._thread = threading.Thread(target=self.serve_forever, name=f"dl4py-ui-{self.server_address[1]}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: the serving thread and the requests in flight end, the port is free
        again (DL4J's ``stop``). A later ``get_instance()`` starts a new server."""
        global _instance
        with _instance_lock:
            if _instance is self:
                _instance = None
        if self._thread is not None:
            self.shutdown()  # serve_forever returns
            self._thread.join()
            self._thread = None
        self._stopped = True
        self.server_close()
        with self._lock:
            requests, self._requests = self._requests, []
        for thread, connection in requests:
            # A connection a browser opened ahead and sent nothing on would wait forever: its
            # reading side ends; a poll being answered still writes its whole answer.
            try:
                connection.shutdown(socket.SHUT_RD)
            except OSError:
                pass  # closed already
            thread.join()

    # ---- what the page shows -------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    @property
    def runs(self) -> list[RunFolder | MemoryRun]:
        """The runs shown, in the page's order (a copy: attach and detach do not change it)."""
        with self._lock:
            return list(self._runs)

    @property
    def title(self) -> str:
        return self._title(self.runs)

    def poll(self, query: str) -> dict:
        offsets = []
        for text in (parse_qs(query).get("offsets") or [""])[0].split(","):
            offsets.append(int(text) if text.strip().isdigit() else 0)
        with self._polls:
            self._polls_started += 1
            this_poll = self._polls_started
        runs = self.runs
        data = page_data(runs, self.sweep, self._title(runs), offsets)
        with self._polls:
            self._polls_finished = max(self._polls_finished, this_poll)
            self._last_poll = time.monotonic()
            self._polls.notify_all()
        return data

    def page_open(self) -> bool:
        """Whether a page polled in the last two poll periods (one is open, or was just now)."""
        with self._polls:
            return self._last_poll is not None and time.monotonic() - self._last_poll < 2 * POLL_MS / 1000

    def wait_for_next_poll(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) for a poll that starts after this call to be
        answered: a page that is open then holds what the runs hold now (``dl4py train --ui``
        lets the page see the run's end before the server stops). Whether one was."""
        with self._polls:
            wanted = self._polls_started + 1
            return self._polls.wait_for(lambda: self._polls_finished >= wanted, timeout)

    def _title(self, runs: list) -> str:
        shown = title_for(runs, self.sweep) if runs or self.sweep is not None else "nothing attached yet"
        return f"dl4py ui: {shown}"

    # ---- attach's parts (called holding the lock) ---------------------------------------------
    def _find(self, storage):
        key = _path_key(storage) if isinstance(storage, (str, Path)) else None
        for attached in self._attached:
            if attached[0] is storage or (key is not None and attached[0] == key):
                return attached
        return None

    def _run_for(self, storage, name: str | None) -> RunFolder | MemoryRun:
        if isinstance(storage, InMemoryStatsStorage):
            self._memory_serial += 1
            return MemoryRun(storage, self._unique(name or f"in-memory {self._memory_serial}"),
                             key=f"memory {self._memory_serial}")
        if isinstance(storage, FileStatsStorage):
            folder = storage.path.parent
            default = folder.name if storage.path.name == METRICS else storage.path.stem
            return RunFolder(folder, self._unique(name or default), metrics_path=storage.path)
        if isinstance(storage, (str, Path)):
            runs, sweep = open_folders([Path(storage)], waiting=True)
            if sweep is not None:
                raise ConfigError(str(storage), "is a sweep folder: show it with dl4py ui (or UIServer([path])), "
                                                "attach run directories")
            # Its absolute path: the server reads it wherever the process's working directory goes.
            return RunFolder(_path_key(storage), self._unique(name or runs[0].name))
        raise TypeError(f"UIServer.attach: the page shows an InMemoryStatsStorage, a FileStatsStorage or a run "
                        f"directory, got {type(storage).__name__} (TensorBoard and MLflow show their own storages)")

    def _unique(self, name: str) -> str:
        """``name``, or ``name (2)``, ... where a run shown has it already."""
        names = {run.name for run in self._runs}
        candidate, n = name, 1
        while candidate in names:
            n += 1
            candidate = f"{name} ({n})"
        return candidate

    # ---- the requests in flight (socketserver's, with each one's thread kept for stop) ---------
    def process_request(self, request, client_address):
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name="dl4py-ui-request", daemon=True)
        with self._lock:
            self._requests = [(t, c) for t, c in self._requests if t.is_alive()] + [(thread, request)]
        thread.start()


def _path_key(path) -> Path:
    return Path(path).resolve()


class _Handler(BaseHTTPRequestHandler):
    server: UIServer

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path in ("/", "/index.html"):
            return self._send(self.server.page, "text/html; charset=utf-8")
        if url.path == "/api/poll":
            body = json.dumps(self.server.poll(url.query), separators=(",", ":")).encode("utf-8")
            return self._send(body, "application/json")
        name = url.path.removeprefix("/static/")
        if url.path.startswith("/static/") and name in STATIC_FILES:
            return self._send((STATIC / name).read_bytes(), STATIC_FILES[name])
        self.send_error(HTTPStatus.NOT_FOUND, "dl4py ui serves /, /api/poll and its scripts only")

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", content_type)
        self.send_header("X-Content-Type-Options", "nosniff")  # a run's strings in the JSON never read as HTML
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")  # a reload after `pip install -U` gets the new page
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # one line per poll would bury the terminal
        pass


def serve(paths: list[Path], host: str = "127.0.0.1", port: int = DEFAULT_PORT, announce=print) -> None:
    """Serve until Ctrl-C (or SIGTERM, which the CLI turns into one)."""
    server = UIServer(paths, host, port)
    what = (f"sweep {server.sweep.path} ({len(server.runs)} experiments)" if server.sweep is not None
            else f"{len(server.runs)} run{'s' * (len(server.runs) > 1)}")
    announce(f"dl4py ui: {what} at {server.url} (Ctrl-C to stop)")
    for run in server.runs:
        if not run.path.is_dir() or not any(run.path.iterdir()):
            announce(f"dl4py ui: {run.path} has no run in it yet: shown as pending until training writes there")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
