"""The one page behind ``dl4py ui`` and ``dl4py report``, and the data it draws.

The page (``static/page.html``) and its drawing code (``static/dashboard.js``) are the
same for both: the UI links the scripts and polls ``/api/poll`` for what ``page_data``
returns; the report inlines the scripts and one ``page_data`` answer, so it opens
anywhere, offline, as one file.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from dl4py.monitor.runs import MAX_READ_BYTES, RunFolder, SweepFolder, thin

STATIC = Path(__file__).parent / "static"
# What the server hands out, and as what; nothing else under static/ is served.
STATIC_FILES = {
    "chart.umd.min.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
CHART_JS_VERSION = "4.6.1"  # static/chart.umd.min.js (MIT licence, static/chart.js-LICENSE.md)
# A report keeps at most this many per-iteration points per run: a long run's charts look
# the same, and the file stays small enough to send.
REPORT_POINTS = 2000


def page_data(runs: list[RunFolder], sweep: SweepFolder | None, title: str,
              offsets: list[int] | None = None, max_bytes: int | None = MAX_READ_BYTES) -> dict:
    """What the page draws: each run's info, its metrics from ``offsets`` on (0 where not
    given), and the sweep's table."""
    offsets = list(offsets or [])
    offsets += [0] * (len(runs) - len(offsets))
    return {
        "title": title,
        "runs": [run.info() for run in runs],
        "sweep": sweep.info() if sweep is not None else None,
        "metrics": [run.metrics(offset, max_bytes).to_dict() for run, offset in zip(runs, offsets)],
    }


def title_for(runs: list[RunFolder], sweep: SweepFolder | None) -> str:
    if sweep is not None:
        return f"sweep {sweep.path.name}"
    names = [run.name for run in runs]
    return ", ".join(names) if len(names) <= 3 else f"{', '.join(names[:3])} and {len(names) - 3} more"


def live_page(every_ms: int = 2000) -> str:
    """The UI's page: scripts from /static/, data from /api/poll every ``every_ms``."""
    head = "\n".join([
        '<link rel="stylesheet" href="static/dashboard.css">',
        '<script src="static/chart.umd.min.js"></script>',
        '<script src="static/dashboard.js"></script>',
    ])
    start = f'<script>DL4PY.start({{poll: "api/poll", every: {int(every_ms)}}});</script>'
    return _fill(head, start)


def report_page(runs: list[RunFolder], sweep: SweepFolder | None, title: str) -> str:
    """The report: one HTML file holding the styles, Chart.js, the drawing code and the data."""
    data = page_data(runs, sweep, title, max_bytes=None)
    for chunk in data["metrics"]:
        chunk["records"] = _thinned(chunk["records"])
    data["generated"] = datetime.now().strftime("%Y-%m-%d %H:%M")
    head = "\n".join([
        f"<style>\n{_static('dashboard.css')}</style>",
        f"<script>\n{_script(_static('chart.umd.min.js'))}</script>",
        f"<script>\n{_script(_static('dashboard.js'))}</script>",
    ])
    # "</" inside a string would end the <script> element early; "<\/" is the same JSON string.
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    start = (f'<script type="application/json" id="dl4py-data">{payload}</script>\n'
             '<script>DL4PY.start({data: JSON.parse(document.getElementById("dl4py-data").textContent)});</script>')
    return _fill(head, start)


def _thinned(records: list[dict]) -> list[dict]:
    kept = {kind: thin([r for r in records if r["kind"] == kind], REPORT_POINTS) for kind in ("stats", "iteration")}
    ids = {id(r) for kind in kept.values() for r in kind}
    return [r for r in records if r["kind"] not in kept or id(r) in ids]


def _static(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def _script(code: str) -> str:
    # The source-map comment points at a file the report does not carry.
    code = "\n".join(line for line in code.splitlines() if not line.startswith("//# sourceMappingURL="))
    if "</script" in code.lower():  # would end the element early; never true of the files shipped
        raise ValueError("a script to inline holds '</script'")
    return code + "\n"


def _fill(head: str, start: str) -> str:
    return _static("page.html").replace("<!--DL4PY:HEAD-->", head).replace("<!--DL4PY:START-->", start)
