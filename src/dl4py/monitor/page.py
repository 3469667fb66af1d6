"""The one page behind ``dl4py ui`` and ``dl4py report``, and the data it draws.

The page (``static/page.html``) and its drawing code (``static/dashboard.js``) are the
same for both: the UI links the scripts and polls ``/api/poll`` for what ``page_data``
returns; the report inlines the scripts and one ``page_data`` answer, so it opens
anywhere, offline, as one file. Nothing a run wrote reaches the page as HTML: the report's
data sits in a JSON script element with every ``<``, ``>`` and ``&`` escaped
(``script_json``), and the drawing code sets text, never markup.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from dl4py.monitor.bounded import SERIES_POINTS
from dl4py.monitor.runs import MAX_READ_BYTES, RunFolder, SweepFolder

STATIC = Path(__file__).parent / "static"
# What the server hands out, and as what; nothing else under static/ is served.
STATIC_FILES = {
    "chart.umd.min.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
CHART_JS_VERSION = "4.6.1"  # static/chart.umd.min.js (MIT licence, static/chart.js-LICENSE.md)
# In JSON text these appear only inside strings, where the escapes mean the same characters;
# in a <script> element "<!--", "<script" and "</script" change how the HTML parser reads on.
_SCRIPT_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def page_data(runs: list[RunFolder], sweep: SweepFolder | None, title: str,
              offsets: list[int] | None = None, max_bytes: int | None = MAX_READ_BYTES) -> dict:
    """What the page draws: each run's info (with its ``key``: a live page starts a run afresh
    when another takes its place in the list), its metrics from ``offsets`` on (0 where not
    given; each series thinned to ``points``, the most the page keeps), and the sweep's table.
    ``runs``: ``RunFolder``s, or ``MemoryRun``s of the storages attached to a ``UIServer``."""
    offsets = list(offsets or [])
    offsets += [0] * (len(runs) - len(offsets))
    return {
        "title": title, "points": SERIES_POINTS,
        "runs": [{**run.info(), "key": run.key} for run in runs],
        "sweep": sweep.info() if sweep is not None else None,
        "metrics": [run.metrics(offset, max_bytes, SERIES_POINTS).to_dict() for run, offset in zip(runs, offsets)],
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
    data["generated"] = datetime.now().strftime("%Y-%m-%d %H:%M")
    head = "\n".join([
        f"<style>\n{_static('dashboard.css')}</style>",
        f"<script>\n{_script(_static('chart.umd.min.js'))}</script>",
        f"<script>\n{_script(_static('dashboard.js'))}</script>",
    ])
    start = (f'<script type="application/json" id="dl4py-data">{script_json(data)}</script>\n'
             '<script>DL4PY.start({data: JSON.parse(document.getElementById("dl4py-data").textContent)});</script>')
    return _fill(head, start)


def script_json(value) -> str:
    """``value`` as JSON text that can sit inside a ``<script>`` element whatever its strings
    hold: no ``<``, ``>`` or ``&`` (the HTML parser's business) and no U+2028/U+2029 (line
    ends to older JavaScript) in it; ``JSON.parse`` gives back the same strings."""
    text = json.dumps(value, separators=(",", ":"))  # ASCII: a lone surrogate is written as its escape
    return text.translate(str.maketrans(_SCRIPT_ESCAPES))


def _static(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def _script(code: str) -> str:
    # The source-map comment points at a file the report does not carry.
    code = "\n".join(line for line in code.splitlines() if not line.startswith("//# sourceMappingURL="))
    # Each would end the element early or change how the HTML parser reads on; never true of
    # the files shipped.
    for marker in ("</script", "<script", "<!--"):
        if marker in code.lower():
            raise ValueError(f"a script to inline holds {marker!r}")
    return code + "\n"


def _fill(head: str, start: str) -> str:
    return _static("page.html").replace("<!--DL4PY:HEAD-->", head).replace("<!--DL4PY:START-->", start)
