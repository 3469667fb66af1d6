"""dl4py ui and dl4py report over run files that are huge or hostile.

Bounded: a metrics.jsonl line over 1 MiB is stepped over in small reads, never held whole,
and named once (file, line number, size); each kind of record is thinned to at most 2,000
evenly spread points, the last one kept, and the page says so; result.json and config.yaml
are read only up to their limits. Memory is measured in a real process (its peak RSS), the
server's answers and the report's bytes by their size.

Hostile: no string a run wrote (folder name, config comment, result, environment, layer
and metric names, class labels, a sweep's keys, values and errors) changes the structure of
the report's HTML, and the embedded JSON gives every string back unchanged. Python's
html.parser ends a script element at "</script" but knows nothing of "<!--" and "<script"
inside one (after which a browser reads on past the end), so the tests also assert that no
script element holds any of the three. The browser tests (the pages draw, show the strings
as text, and say what they left out) need Chromium, as those of test_monitor_ui.py do.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import tracemalloc
import urllib.request
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import pytest

from dl4py.errors import ConfigError
from dl4py.monitor.bounded import MAX_FILE_BYTES, MAX_LINE_BYTES, MAX_TEXT_BYTES, SERIES_POINTS, Series
from dl4py.monitor.page import live_page
from dl4py.monitor.report import write_report
from dl4py.monitor.runs import MAX_READ_BYTES, RunFolder, SweepFolder, read_metrics
from dl4py.monitor.server import POLL_MS, UIServer
from test_monitor_ui import Page
from test_monitor_ui import browser as chromium  # noqa: F401  (a fixture: Chromium through Playwright)

# Each opens a state of the HTML parser, ends an element, a CDATA section or a JavaScript line.
# None holds "-->", which would end the state "<!--" opens and hide a missing escape.
HOSTILE = ["<!--<script>", "</script><script>pwned = 1; alert(1)</script>", "<![CDATA[", "]]>",
           "a\u2028b\u2029c", "\"'`\\", "</style>", "&amp;&lt;"]
H = " ".join(HOSTILE)
KEY = "network." + H  # a swept key
SCRIPT_STATES = re.compile(r"<!--|<script|</script", re.IGNORECASE)
STATS = '{"time":%d,"kind":"stats","iteration":%d,"score":0.5,"layers":{%s:{"update_ratio":0.001}}}\n'


def metrics_file(path: Path, records: int, long_line: int = 0, long_at: int = 2, layer: str = "0_DenseLayer") -> None:
    """A static record, ``records`` stats records with one line of ``long_line`` bytes (a
    valid stats record) as line ``long_at`` (when given), then an epoch record."""
    with open(path, "w") as f:
        f.write(json.dumps({"time": 0, "kind": "static", "workers": 1,
                            "model": {"summary": "s", "parameters": 3, "layers": [layer]}}) + "\n")
        for i in range(records):
            if long_line and i == long_at - 2:
                head = '{"time":0,"kind":"stats","iteration":-1,"pad":"'
                f.write(head + "x" * (long_line - len(head) - 3) + '"}\n')
            f.write(STATS % (i, i, json.dumps(layer)))
        f.write(json.dumps({"time": records, "kind": "epoch", "epoch": 0, "loss": 0.25}) + "\n")


class Events(HTMLParser):
    """An HTML file as its parser reads it: each tag, text and comment, and the script elements."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=False)
        self.events: list[tuple] = []
        self.scripts: list[tuple[dict, str]] = []
        self._script: dict | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.events.append(("start", tag, attrs))
        if tag == "script":
            self._script = dict(attrs)
            self.scripts.append((self._script, ""))

    def handle_endtag(self, tag):
        self.events.append(("end", tag))
        self._script = None

    def handle_data(self, data):
        if self._script is not None:  # the data embedded differs: its place is what must not
            self.scripts[-1] = (self._script, self.scripts[-1][1] + data)
        else:
            self.events.append(("data", data))

    def handle_comment(self, data):
        self.events.append(("comment", data))

    def handle_entityref(self, name):
        self.events.append(("entity", name))

    def handle_charref(self, name):
        self.events.append(("charref", name))


def run_dir(folder: Path, text: str, records: int = 3) -> Path:
    """A finished run whose every string the page shows is ``text``."""
    run = folder / ("run " + text.replace("/", "|"))  # a folder name holds anything but "/"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"# {text}\nnetwork: {{name: {json.dumps(text)}}}\n")
    (run / "result.json").write_text(json.dumps({"status": "completed", "epochs": 1, "test_accuracy": 0.5,
                                                 "error": text, text: text}))
    (run / "environment.json").write_text(json.dumps({k: text for k in ("backend", "device", "precision",
                                                                        "platform", "dl4py", "torch")}))
    metrics = run / "metrics.jsonl"
    metrics_file(metrics, records, layer=text)
    with open(metrics, "a") as f:
        for record in ({"time": 9, "kind": "epoch", "epoch": 1, "loss": 0.5, f"val_{text}": 0.3},
                       {"time": 9, "kind": "evaluation", "epoch": 1, "test_accuracy": 0.5,
                        "class_labels": [text, "b"], "confusion_matrix": [[1, 0], [0, 1]],
                        "class_precision": [1.0, 1.0], "class_recall": [1.0, 1.0]}):
            f.write(json.dumps(record) + "\n")
    return run


def sweep_dir(folder: Path, text: str) -> Path:
    """A sweep of two experiments over a key named ``text``: the run above, and one that failed with ``text``."""
    sweep = folder / "sweep"
    run = run_dir(sweep, text)
    key = "network." + text
    (sweep / "sweep.json").write_text(json.dumps({
        "version": 1, "config_name": text, "metric": "test_accuracy", "grid": {key: [text, "b"]}, "random": None,
        "seed": 0, "ranges": {}, "config": {"note": text},
        "experiments": [{"name": run.name, "overrides": {key: text}}, {"name": "failed", "overrides": {key: "b"}}]}))
    (sweep / "outcomes.json").write_text(json.dumps({"failed": {"status": "failed", "error": text, "seconds": 1.0}}))
    return sweep


def report_of(folder: Path) -> tuple[Events, dict]:
    html = write_report(folder).read_text(encoding="utf-8")
    page = Events(html)
    data = [text for attrs, text in page.scripts if attrs.get("id") == "dl4py-data"]
    return page, json.loads(data[0])


def assert_same_structure(plain: Events, hostile: Events) -> None:
    assert hostile.events == plain.events
    assert [attrs for attrs, _ in hostile.scripts] == [{}, {}, {"type": "application/json", "id": "dl4py-data"}, {}]
    for attrs, text in hostile.scripts:
        assert not SCRIPT_STATES.search(text), (attrs, SCRIPT_STATES.search(text).group(0))


# -- a run's strings never change the page ----------------------------------------------------


def test_no_string_of_a_run_changes_the_reports_structure(tmp_path):
    plain, _ = report_of(run_dir(tmp_path / "plain", "x"))
    run = run_dir(tmp_path / "hostile", H)
    hostile, data = report_of(run)
    assert_same_structure(plain, hostile)
    data_text = hostile.scripts[2][1]
    assert not any(c in data_text for c in "<>&\u2028\u2029")
    info = data["runs"][0]
    assert data["title"] == f"dl4py report: {run.name}" and info["name"] == run.name
    assert info["config"] == (run / "config.yaml").read_text()
    assert info["result"]["error"] == H and info["result"][H] == H
    assert set(info["environment"].values()) == {H}
    records = {r["kind"]: r for r in data["metrics"][0]["records"]}
    assert records["static"]["model"]["layers"] == [H] and list(records["stats"]["layers"]) == [H]
    assert records["epoch"][f"val_{H}"] == 0.3 and records["evaluation"]["class_labels"] == [H, "b"]


def test_no_string_of_a_sweep_changes_the_reports_structure(tmp_path):
    plain, _ = report_of(sweep_dir(tmp_path / "plain", "x"))
    hostile, data = report_of(sweep_dir(tmp_path / "hostile", H))
    assert_same_structure(plain, hostile)
    sweep = data["sweep"]
    assert sweep["keys"] == [KEY] and data["title"] == "dl4py report: sweep sweep"
    rows = {row["experiment"]: row for row in sweep["rows"]}
    assert rows.pop("failed")["error"] == H
    (run,) = rows.values()
    assert run["label"] == f"{H}={H}" and run["values"] == {KEY: H} and run[KEY] == H
    assert [run["label"] for run in data["runs"]] == [f"{H}={H}", f"{H}=b"]


@contextmanager
def serving(paths: list[Path]):
    """``dl4py ui``'s server on a free port of 127.0.0.1, in a thread of this process."""
    server = UIServer(paths, port=0)
    thread = threading.Thread(target=server.serve_forever, name="dl4py-ui-test")
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def get(url: str) -> tuple[bytes, dict]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read(), dict(response.headers)


@pytest.mark.timeout(60)
def test_the_live_page_holds_no_string_of_a_run_and_its_json_gives_them_back(tmp_path):
    run = run_dir(tmp_path, H)
    with serving([run]) as server:
        page, _ = get(server.url)
        body, headers = get(server.url + "api/poll?offsets=0")
    # The page is the same bytes whatever the runs hold: their strings come as JSON, drawn as text.
    assert page == live_page(POLL_MS).encode("utf-8")
    assert not any(part.encode() in page for part in HOSTILE if part != "]]>")
    assert headers["Content-Type"] == "application/json" and headers["X-Content-Type-Options"] == "nosniff"
    data = json.loads(body)
    assert data["runs"][0]["name"] == run.name and data["runs"][0]["config"] == (run / "config.yaml").read_text()
    assert data["runs"][0]["result"]["error"] == H
    assert any(r["kind"] == "evaluation" and r["class_labels"] == [H, "b"] for r in data["metrics"][0]["records"])


# -- bounded memory and answers -----------------------------------------------------------------


def test_a_line_over_the_limit_is_skipped_named_once_and_never_held_whole(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    metrics_file(metrics, records=4, long_line=8 * MAX_LINE_BYTES, long_at=3)
    folder = RunFolder(run)
    caplog.set_level(logging.WARNING, logger="dl4py")
    tracemalloc.start()
    try:
        chunk = folder.metrics(0, max_bytes=None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_LINE_BYTES  # the 8 MiB line was never in memory whole
    assert [r.get("iteration") for r in chunk.records] == [None, 0, 1, 2, 3, None]  # static ... epoch
    assert chunk.offset == metrics.stat().st_size and chunk.skipped == [(3, 8 * MAX_LINE_BYTES)]
    note = "metrics.jsonl: line 3 (8.0 MiB) over the 1.0 MiB a record may be: skipped"
    assert chunk.to_dict()["notes"] == [note]
    assert [r.getMessage() for r in caplog.records] == [f"dl4py: {run}/{note}"]
    folder.metrics(0)  # a reload of the page reads it again: told once is enough
    assert len(caplog.records) == 1

    # A line still being written waits for its newline; past the limit it is skipped then, by its number.
    with open(metrics, "a") as f:
        f.write("{" + "y" * (2 * MAX_LINE_BYTES))
    waiting = read_metrics(metrics, chunk.offset)
    assert (waiting.records, waiting.offset, waiting.skipped) == ([], chunk.offset, [])
    with open(metrics, "a") as f:
        f.write("}\n" + STATS % (4, 4, '"0_DenseLayer"'))
    done = folder.metrics(chunk.offset)
    assert [r["iteration"] for r in done.records] == [4] and done.skipped == [(8, 2 * MAX_LINE_BYTES + 3)]
    assert len(caplog.records) == 2 and "line 8 (2.0 MiB)" in caplog.records[1].getMessage()


@pytest.mark.parametrize("count", [1, 2, 99, 100, 101, 10_007])
def test_a_series_keeps_at_most_its_points_evenly_spread_and_the_last(count):
    series = Series(points=100)
    for i in range(count):
        series.add(i, {"i": i}, 50)
    kept = [order for order, _ in series.kept()]
    assert series.seen == count and kept[0] == 0 and kept[-1] == count - 1
    assert len(kept) <= 100 and (count <= 99 or len(kept) >= 50)
    steps = {b - a for a, b in zip(kept, kept[1:-1])}
    assert steps <= {series.stride} and all(order % series.stride == 0 for order in kept[:-1])
    by_bytes = Series(points=100, budget=1000)  # big records: the byte budget thins first
    for i in range(count):
        by_bytes.add(i, {"i": i}, 300)
    assert len(by_bytes.kept()) <= 1000 // 300 + 1 and by_bytes.kept()[-1][0] == count - 1


def test_a_long_history_reads_as_evenly_thinned_series_and_the_last_static_and_evaluation(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics_file(metrics, records=5000)
    with open(metrics, "a") as f:
        for record in ({"kind": "evaluation", "test_accuracy": 0.1}, {"kind": "static", "workers": 2},
                       {"kind": "evaluation", "test_accuracy": 0.9}, {"kind": "epoch", "epoch": 1}):
            f.write(json.dumps(record) + "\n")
    chunk = read_metrics(metrics, 0, max_bytes=None, points=50)
    kinds = [r["kind"] for r in chunk.records]
    stats = [r["iteration"] for r in chunk.records if r["kind"] == "stats"]
    assert kinds.count("static") == 1 and chunk.records[kinds.index("static")]["workers"] == 2
    assert [r["test_accuracy"] for r in chunk.records if r["kind"] == "evaluation"] == [0.9]
    assert [r["epoch"] for r in chunk.records if r["kind"] == "epoch"] == [0, 1]
    assert 25 <= len(stats) <= 50 and stats[0] == 0 and stats[-1] == 4999 and stats == sorted(stats)
    assert chunk.seen == {"stats": 5000, "iteration": 0, "epoch": 2}


def test_files_over_their_limits_are_left_out_with_a_note_and_read_only_up_to_it(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "result.json").write_text('{"status": "completed", "pad": "' + "x" * (2 * MAX_FILE_BYTES) + '"}')
    (run / "config.yaml").write_text("# " + "x" * (2 * MAX_TEXT_BYTES))
    (run / "environment.json").write_text('{"device": "cpu"}')
    caplog.set_level(logging.WARNING, logger="dl4py")
    tracemalloc.start()
    try:
        info = RunFolder(run).info()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_FILE_BYTES + MAX_TEXT_BYTES + (4 << 20)  # never the 32 MiB result.json whole
    assert info["notes"] == ["result.json is 32.0 MiB, over the 16.0 MiB the page reads: left out",
                             "config.yaml is 2.0 MiB, over the 1.0 MiB the page reads: left out"]
    assert info["config"] is None and info["result"] == {} and info["environment"] == {"device": "cpu"}
    assert [r.getMessage() for r in caplog.records] == [f"dl4py: {run}: {note}" for note in info["notes"]]
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(" " * (MAX_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match=r"sweep.json: cannot be read as a sweep plan \(sweep.json is 16.0 MiB"):
        SweepFolder(sweep)


# The child: serve until told, then write the report; its peak RSS over its RSS at the start after
# each. The peak is Linux's VmHWM: getrusage's ru_maxrss carries the parent's over the exec.
CHILD = """
import json, re, sys, threading
from pathlib import Path
from dl4py.monitor.report import write_report
from dl4py.monitor.server import UIServer

def mib(field):
    status = Path("/proc/self/status").read_text()
    return int(re.search(field + r":\\s+(\\d+) kB", status).group(1)) / 1024

run = Path(sys.argv[1])
start = mib("VmRSS")
server = UIServer([run], port=0)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(json.dumps({"url": server.url}), flush=True)
sys.stdin.readline()
ui = mib("VmHWM") - start
write_report(run, run.parent / "report.html")
print(json.dumps({"ui": ui, "report": mib("VmHWM") - start}), flush=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak RSS from /proc (Linux)")
@pytest.mark.parametrize("long_line, records", [
    (64 << 20, 150_000),
    pytest.param(150 << 20, 2_000_000, marks=pytest.mark.soak),  # issue 28's sizes: a 150 MB line, 200 MB in all
])
@pytest.mark.slow
def test_report_and_ui_memory_and_answers_stay_bounded(tmp_path, long_line, records):
    run = tmp_path / "run"
    run.mkdir()
    metrics_file(run / "metrics.jsonl", records, long_line=long_line, long_at=2)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(child.stdout.readline() or "null")
        assert started is not None, "the child printed nothing: see its stderr above"
        offset, answers, seen, notes = 0, [], 0, []
        while True:
            body, _ = get(started["url"] + f"api/poll?offsets={offset}")
            answers.append(len(body))
            chunk = json.loads(body)["metrics"][0]
            offset, seen, notes = chunk["offset"], seen + chunk["seen"]["stats"], notes + chunk["notes"]
            assert sum(r["kind"] == "stats" for r in chunk["records"]) <= SERIES_POINTS
            if not chunk["more"]:
                break
        child.stdin.write("done\n")
        child.stdin.flush()
        ended = json.loads(child.stdout.readline() or "null")
        assert ended is not None, "the child printed nothing: see its stderr above"
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdin.close()
        child.stdout.close()
    size = f"{long_line / (1 << 20):.1f} MiB"
    # The long line alone is 64 MiB or more: holding it whole (or the history) would fail these.
    assert ended["ui"] < 32 and ended["report"] < 32, ended
    assert max(answers) < MAX_READ_BYTES + MAX_LINE_BYTES + (64 << 10)
    assert seen == records and offset == (run / "metrics.jsonl").stat().st_size
    assert notes == [f"metrics.jsonl: line 2 ({size}) over the 1.0 MiB a record may be: skipped"]
    html = (tmp_path / "report.html").read_text()
    assert len(html) < 1 << 20  # Chart.js, the drawing code and 2,000 points
    data = json.loads([text for attrs, text in Events(html).scripts if attrs.get("id") == "dl4py-data"][0])
    kept = [r["iteration"] for r in data["metrics"][0]["records"] if r["kind"] == "stats"]
    assert data["metrics"][0]["seen"]["stats"] == records and len(kept) <= SERIES_POINTS
    assert kept[0] == 0 and kept[-1] == records - 1 and data["metrics"][0]["notes"] == notes


# -- in a browser (Chromium): what the user sees ------------------------------------------------

SHOWN = """() => ({
  title: document.title, config: document.getElementById("config-text").textContent,
  summary: document.getElementById("model-summary").textContent,
  cells: [...document.querySelectorAll("#environment td, #card-confusion th, #runs-body td")].map(c => c.textContent),
  notes: [...document.querySelectorAll("#notes li")].map(li => li.textContent),
  pwned: window.pwned || null})"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_pages_show_a_runs_strings_as_text_and_say_what_they_left_out(chromium, tmp_path):  # noqa: F811
    # About 25 MiB: the live page takes six polls of at most 2,000 points each, more than it
    # keeps, so it thins them too.
    records = 100_000
    run = run_dir(tmp_path, H, records=records)
    with open(run / "metrics.jsonl", "a") as f:  # the last line
        f.write('{"kind": "stats", "pad": "' + "x" * (2 * MAX_LINE_BYTES) + '"}\n')
    _, data = report_of(run)
    report = run / "report.html"
    in_report = sum(r["kind"] == "stats" for r in data["metrics"][0]["records"])
    with serving([run]) as server:
        for url, what in ((report.as_uri(), "report"), (server.url, "ui")):
            with Page(chromium, url) as tab:
                tab.page.wait_for_function(f"DL4PY.state.runs[0].seen.stats === {records}")
                page = tab.page.evaluate(SHOWN)
                assert tab.errors == [] and page["pwned"] is None, what
                assert page["title"] == f"dl4py {what}: {run.name}"
                assert page["config"] == (run / "config.yaml").read_text() and page["summary"].startswith("s")
                assert H in page["cells"] and run.name in page["cells"], what
                held, last = tab.page.evaluate("[DL4PY.state.runs[0].stats.length, "
                                               "DL4PY.state.runs[0].stats.slice(-1)[0].iteration]")
                assert held == in_report if what == "report" else held <= 2 * SERIES_POINTS
                assert last == records - 1
                assert page["notes"] == [
                    f'{run.name}: showing {held:,} of {records:,} points of its "stats" records '
                    "(evenly spread, the last one kept)",
                    f"{run.name}: metrics.jsonl: line {records + 5} (2.0 MiB) over the 1.0 MiB a record may be: "
                    "skipped"], what


def test_histograms_stay_in_the_file_and_out_of_the_pages_answers(tmp_path):
    """A stats record's histograms (for TensorBoard and W&B) are left out of what the page
    gets: it draws none, and they triple a small model's record."""
    histogram = {"min": -1.0, "max": 1.0, "counts": [1] * 20, "sum": 0.0, "sum_squares": 20.0}
    record = {"time": 1, "kind": "stats", "iteration": 10, "score": 0.5,
              "layers": {"0_DenseLayer": {"update_ratio": 0.001}},
              "histograms": {"0_DenseLayer": {"parameters": histogram}}}
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(record) + "\n")
    chunk = read_metrics(path)
    assert [r["iteration"] for r in chunk.records] == [10]
    assert "histograms" not in chunk.records[0] and chunk.records[0]["layers"] == record["layers"]
