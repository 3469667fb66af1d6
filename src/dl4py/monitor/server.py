"""``dl4py ui``: DL4J's UIServer for dl4py runs, a local web page that follows training live.

It serves one page (``page.live_page``), its scripts from the package (no CDN: it works
offline) and one JSON call, ``/api/poll?offsets=A,B,...``, which the page makes every two
seconds: the runs' status and each run's metrics.jsonl records past the byte offsets the
page already holds, so a new epoch or stats point appears without a reload and a poll
reads only what was added. A poll reads at most about 4 MiB of lines, never a line over
1 MiB, and answers with at most 2,000 records of each kind per run (``runs.read_metrics``):
its answer and the server's memory stay bounded whatever the files hold. The server reads
the run directories and keeps no store of its own. It binds to 127.0.0.1 unless told another host: the page is for the user
at the machine (or through an SSH tunnel).

    server = UIServer([Path("runs/a"), Path("runs/b")], port=0)
    print(server.url)
    server.serve_forever()
"""

from __future__ import annotations

import json
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from dl4py.errors import ConfigError, bind_error
from dl4py.monitor.page import STATIC, STATIC_FILES, live_page, page_data, title_for
from dl4py.monitor.runs import open_folders

DEFAULT_PORT = 9000  # DL4J's UIServer's
POLL_MS = 2000


class UIServer(ThreadingHTTPServer):
    """The HTTP server of ``dl4py ui`` over run directories, or one sweep folder."""

    daemon_threads = True  # a page left open does not keep the process alive

    def __init__(self, paths: list[Path], host: str = "127.0.0.1", port: int = DEFAULT_PORT):
        if not 0 <= port <= 65535:
            raise ConfigError("--port", f"must be 0 to 65535 (0: any free port), got {port}")
        self.runs, self.sweep = open_folders(paths, waiting=True)
        self.title = f"dl4py ui: {title_for(self.runs, self.sweep)}"
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

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    def poll(self, query: str) -> dict:
        offsets = []
        for text in (parse_qs(query).get("offsets") or [""])[0].split(","):
            offsets.append(int(text) if text.strip().isdigit() else 0)
        return page_data(self.runs, self.sweep, self.title, offsets)


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
