"""dl4py ui and dl4py report, looked at in a real headless browser (Debian's Chromium, driven
by Playwright): the charts hold the runs' data, a running training's new epoch appears
without a reload, and the reports of a run and of a sweep draw every chart with no error.
Every axis reads well (at least four labelled y ticks, none overlapping, 1, 2 and 5 x 10^k on a
log axis, the data off the frame) and a sweep table wider than the page scrolls inside its box:
tested on runs written with known ranges, which need no training.

The other tests' runs are real: a 2-point sweep (its two experiments are the finished runs) and a long
`dl4py train` in a subprocess, paused after its first epoch, let go on once the page is open,
and stopped once the page has shown it grow.
DL4PY_DOCS_SCREENSHOTS=1 also saves docs/images/ui.png and docs/images/report.png.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dl4py.cli import main
from dl4py.monitor.runs import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = os.environ.get("DL4PY_DOCS_SCREENSHOTS", "") not in ("", "0")
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run"]
MLP = """\
network:
  seed: 7
  updater: {type: sgd, learning_rate: 0.1}
  input_type: {type: feed_forward, size: 784}
  layers:
    - {type: dense, n_out: 16, activation: relu}
    - {type: output, n_out: 10, activation: softmax, loss: negativeloglikelihood}
data: {limit_train: 512, limit_test: 200, validation: {split: 0.25}}
training: {epochs: 2, batch_size: 32, score_every: 0, backend: cpu}
logging: {stats_every: 4}
"""
RUN_CHARTS = {"score", "epoch_loss", "validation", "learning_rate", "throughput", "memory", "update_ratio",
              "parameters", "gradients", "activations", "classes"}
LAYERS = ["0_DenseLayer", "1_OutputLayer"]
# Per chart id: {dataset label: its number of points}, read from the Chart.js objects.
CHART_POINTS = """id => Object.fromEntries(
  DL4PY.charts[id].data.datasets.map(d => [d.label, (d._data || d.data).length]))"""
# Every chart card of the page: shown or not, its Chart.js object's points and drawn width.
CARDS = """() => [...document.querySelectorAll('.card[id^=card-]')].map(card => {
  const canvas = card.querySelector('canvas');
  const chart = canvas && Chart.getChart(canvas);
  return {id: card.id.slice(5), hidden: card.hidden,
          points: chart ? chart.data.datasets.map(d => (d._data || d.data).length) : null,
          width: chart ? chart.chartArea.right - chart.chartArea.left : null,
          cells: [...card.querySelectorAll('td')].map(td => Number(td.textContent))};
})"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished 2-point sweep, and a `dl4py train` of many epochs paused (SIGSTOP) after its
    first: the UI test lets it go on once the page is open, so its next epoch is new to the page."""
    from conftest import require_mnist

    require_mnist()
    tmp = tmp_path_factory.mktemp("ui")
    config = tmp / "mlp.yaml"
    config.write_text(MLP)
    running = tmp / "running"
    log = open(tmp / "running.log", "w")
    training = subprocess.Popen(
        [sys.executable, "-m", "dl4py", "train", str(config), "--output", str(running), "--no-progress",
         "--epochs", "1000"], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    pauser = threading.Thread(target=pause_after_first_epoch, args=(training, running / "metrics.jsonl"))
    pauser.start()
    try:
        sweep = tmp / "sweep"
        assert main(["sweep", str(config), "--grid", "network.updater.learning_rate=0.02,0.2", "--devices", "cpu",
                     "--per-device", "2", "--output", str(sweep)]) == 0
        pauser.join(timeout=60)
        assert not pauser.is_alive() and training.poll() is None, \
            f"the training wrote no epoch:\n{(tmp / 'running.log').read_text()}"
        finished = sorted(p for p in sweep.iterdir() if (p / "result.json").is_file())
        yield {"tmp": tmp, "sweep": sweep, "finished": finished, "running": running, "training": training}
    finally:
        stop(training)
        pauser.join()
        log.close()


def pause_after_first_epoch(process, metrics: Path) -> None:
    offset = 0
    while process.poll() is None:
        chunk = read_metrics(metrics, offset)
        if any(r["kind"] == "epoch" for r in chunk.records):
            process.send_signal(signal.SIGSTOP)
            return
        offset = chunk.offset
        time.sleep(0.05)


def stop(process, wait: bool = True) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)  # a paused process takes SIGTERM only once it runs
        process.terminate()  # dl4py stops at a step boundary, as on Ctrl-C
    if wait:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Server:
    """`dl4py ui` in a subprocess; ``url`` waits for the line it prints."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        with open(log, "w") as err:
            self.process = subprocess.Popen([sys.executable, "-m", "dl4py", "ui", *args], stdout=subprocess.PIPE,
                                            stderr=err, text=True)
        self._url = None

    @property
    def url(self) -> str:
        if self._url is None:
            line = self.process.stdout.readline()
            match = re.search(r"http://127\.0\.0\.1:\d+/", line)
            assert match, f"dl4py ui printed {line!r}; its log: {self.log.read_text()}"
            self._url = match.group(0)
        return self._url

    def close(self) -> None:
        stop(self.process)
        self.process.stdout.close()


@pytest.fixture(scope="module")
def ui(runs):
    """`dl4py ui` on a free port over the two finished runs and the running one (it starts
    while the browser does)."""
    server = Server([*map(str, runs["finished"]), str(runs["running"]), "--port", "0"], runs["tmp"] / "ui.log")
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _without_browser("the browser tests need Playwright's Python package: pip install -e '.[test]' "
                         "(or pip install playwright); the browser itself comes from the OS")
    chromium = shutil.which("chromium")
    if chromium is None:
        _without_browser("the browser tests need Chromium: run `make browser` as root (apt-get install "
                         "chromium); Playwright drives the OS's browser, not one of its own downloads")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=BROWSER_ARGS, headless=True)
        yield browser
        browser.close()


def _without_browser(reason: str) -> None:
    """Skip, saying what is missing and how to get it: make test installs Chromium where it can (as
    root), and elsewhere the browser tests are skipped with the reason, never passed without running.
    A run that requires them (CI sets DL4PY_REQUIRE_BROWSER=1) fails instead."""
    if os.environ.get("DL4PY_REQUIRE_BROWSER") == "1":
        pytest.fail(reason + " (DL4PY_REQUIRE_BROWSER=1)", pytrace=False)
    pytest.skip(reason)


class Page:
    """A browser tab that collects the page's console errors and uncaught exceptions."""

    def __init__(self, browser, url: str):
        self.errors: list[str] = []
        self.fetched: list[str] = []  # anything asked of a network
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.page.on("request", lambda request: request.url.startswith(("file:", "data:", url))
                     or self.fetched.append(request.url))
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.goto(url)
        try:
            self.page.wait_for_function("window.DL4PY && DL4PY.polls > 0", timeout=15_000)
        except Exception as exc:  # playwright's TimeoutError: say what the page said
            pytest.fail(f"the page drew nothing ({type(exc).__name__}); its errors: {self.errors}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.page.close()

    def cards(self) -> dict:
        return {card["id"]: card for card in self.page.evaluate(CARDS)}

    def screenshot(self, name: str) -> None:
        if SCREENSHOTS:
            (ROOT / "docs" / "images").mkdir(parents=True, exist_ok=True)
            # Bytes, written here: with path= Playwright writes from a thread pool that outlives the test.
            (ROOT / "docs" / "images" / name).write_bytes(self.page.screenshot(full_page=True))


@pytest.mark.slow
def test_ui_overlays_the_runs_and_shows_a_running_training_grow_without_a_reload(runs, ui, browser):
    names = [p.name for p in runs["finished"]] + ["running"]
    with Page(browser, ui.url) as tab:
        page = tab.page
        page.wait_for_function("DL4PY.charts.score && DL4PY.charts.update_ratio")
        statuses = page.eval_on_selector_all("#runs-body tr", "rows => rows.map(r => r.cells[1].textContent)")
        assert statuses == ["completed", "completed", "running"]
        for chart in ("score", "learning_rate", "throughput", "memory"):  # every run overlaid
            points = page.evaluate(CHART_POINTS, chart)
            assert set(points) == set(names) and all(points.values()), (chart, points)
        epochs = page.evaluate(CHART_POINTS, "epoch_loss")
        shown = epochs["running"]  # 1, or more where the pause came late
        assert shown >= 1 and epochs == {**{name: 2 for name in names[:2]}, "running": shown,
                                         **{f"{name} (validation)": n for name, n in zip(names, (2, 2, shown))}}
        ratios = page.evaluate(CHART_POINTS, "update_ratio")  # the first run's layers, in detail
        assert set(ratios) == set(LAYERS) and all(ratios.values())
        environment = page.text_content("#environment")
        assert "backend" in environment and "cpu" in environment and "float" in environment
        assert "Total parameters: 12,730" in page.text_content("#model-summary")

        # The paused training goes on; its next epoch reaches the chart by polling, in the same page.
        page.evaluate("window.notReloaded = true")
        runs["training"].send_signal(signal.SIGCONT)
        page.wait_for_function(
            "n => DL4PY.charts.epoch_loss.data.datasets.find(d => d.label === 'running').data.length > n",
            arg=shown, timeout=30_000)
        assert page.evaluate("window.notReloaded === true")
        runs["training"].send_signal(signal.SIGSTOP)  # paused again: the picture shows a run a few epochs in
        tab.screenshot("ui.png")
        stop(runs["training"], wait=False)  # the CPU is the report tests' now
        shown = page.evaluate("() => DL4PY.charts.epoch_loss.data.datasets.find(d => d.label === 'running')"
                              ".data.map(p => p.x)")
        assert shown == list(range(1, len(shown) + 1))  # each epoch once: a poll adds only what is new
        page.select_option("#run-select", str(names.index("running")))
        assert set(page.evaluate(CHART_POINTS, "update_ratio")) == set(LAYERS)
        assert tab.errors == []


def test_the_report_of_a_run_draws_every_chart_with_no_error(runs, browser, tmp_path, capsys):
    run = runs["finished"][1]
    assert (run / "report.html").is_file()  # dl4py train writes one at the end
    output = tmp_path / "run.html"
    assert main(["report", str(run), "--output", str(output)]) == 0
    assert capsys.readouterr().out.strip() == str(output)
    with Page(browser, output.as_uri()) as tab:
        cards = tab.cards()
        assert {c for c, card in cards.items() if not card["hidden"]} == RUN_CHARTS | {"confusion"}
        for chart in RUN_CHARTS:
            assert cards[chart]["width"] > 0 and cards[chart]["points"] and all(cards[chart]["points"]), chart
        assert cards["classes"]["points"] == [10, 10]  # per-class precision and recall
        cells = cards["confusion"]["cells"]
        evaluation = json.loads((run / "result.json").read_text())
        assert len(cells) == 100 and sum(cells) == evaluation["test_examples"] == 200
        assert tab.errors == [] and tab.fetched == []  # one file: nothing asked of a network
        tab.screenshot("report.png")


def test_the_report_of_a_sweep_ranks_its_experiments_and_sorts_by_any_column(runs, browser, tmp_path):
    from dl4py.monitor.report import write_report

    output = write_report(runs["sweep"], tmp_path / "sweep.html")
    with open(runs["sweep"] / "results.csv", newline="") as f:
        ranked = [row["experiment"] for row in csv.DictReader(f)]
    with Page(browser, output.as_uri()) as tab:
        page = tab.page
        rows = lambda: page.eval_on_selector_all(  # noqa: E731
            "#sweep-body tr", "rows => rows.map(r => r.cells[0].textContent)")
        assert rows() == ranked  # best first, as results.csv
        page.click("#sweep-head th[data-key='values.network.updater.learning_rate']")
        assert rows() == sorted(ranked)  # 001-learning_rate=0.02 first
        page.click("#sweep-head th[data-key='values.network.updater.learning_rate']")
        assert rows() == sorted(ranked, reverse=True)
        for key in ("test_accuracy", "seconds"):  # any column: a result's figure, the process's time
            page.click(f"#sweep-head th[data-key='{key}']")
            column = page.eval_on_selector_all("#sweep-head th",
                                               f"ths => ths.findIndex(th => th.dataset.key === '{key}')")
            values = page.eval_on_selector_all(
                "#sweep-body tr", f"rows => rows.map(r => Number(r.cells[{column}].textContent))")
            assert values == sorted(values) and len(set(values)) == 2, (key, values)
        cards = tab.cards()
        assert cards["sweep_0"]["points"] == [2] and cards["sweep_0"]["width"] > 0  # metric against learning rate
        assert {c for c, card in cards.items() if not card["hidden"]} == RUN_CHARTS | {"confusion", "sweep_0"}
        assert page.evaluate(CHART_POINTS, "epoch_loss") == {"learning_rate=0.02": 2, "learning_rate=0.2": 2,
                                                             "learning_rate=0.02 (validation)": 2,
                                                             "learning_rate=0.2 (validation)": 2}
        assert tab.errors == []


def test_ui_and_report_name_a_folder_they_cannot_show_and_a_port_in_use(runs, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["report", str(missing)]) == 2  # the live UI waits for it instead: test_monitor_waiting.py
    assert capsys.readouterr().err.strip() == f"dl4py report: error: {missing}: no such run directory or sweep folder"
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("not a run")
    assert main(["report", str(other)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"dl4py report: error: {other}: is neither a run directory") and "\n" not in error
    assert main(["ui", str(runs["sweep"]), str(runs["finished"][0])]) == 2
    assert "is a sweep folder: show it alone" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["ui", str(runs["finished"][0]), "--port", str(port)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"dl4py ui: error: --port: port {port} on 127.0.0.1 is already in use (another dl4py ui?); "
                     "choose another with --port, or --port 0 for any free one")


def test_metrics_are_read_from_an_offset_past_a_torn_last_line_and_unknown_kinds(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = [{"time": 0.1, "kind": "epoch", "epoch": 0, "loss": float("nan")}, {"time": 0.2, "kind": "someday"}]
    torn = json.dumps({"time": 0.3, "kind": "stats", "iteration": 10, "score": 1.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + torn[:20])
    first = read_metrics(path)
    assert first.records == [{"time": 0.1, "kind": "epoch", "epoch": 0, "loss": None}]  # NaN: null for the browser
    assert first.offset == len(path.read_bytes()) - 20 and not first.reset
    with open(path, "a") as f:  # the writer finishes its line
        f.write(torn[20:] + "\n")
    second = read_metrics(path, first.offset)
    assert [r["iteration"] for r in second.records] == [10] and second.offset == path.stat().st_size
    assert read_metrics(path, second.offset).records == []
    path.write_text(json.dumps(whole[0]) + "\n")  # replaced by a shorter file: start over
    assert read_metrics(path, second.offset).reset


def test_a_run_reads_as_running_until_its_result_and_again_once_resumed(tmp_path):
    from dl4py.monitor.runs import RunFolder

    run = RunFolder(tmp_path / "run")
    assert run.info()["status"] == "pending"
    (tmp_path / "run").mkdir()
    assert run.info()["status"] == "starting"
    metrics, result = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "result.json"
    metrics.write_text('{"time": 0, "kind": "epoch", "epoch": 0, "loss": 1.0}\n')
    assert run.info()["status"] == "running"
    result.write_text('{"status": "interrupted", "epochs": 1}')
    os.utime(metrics, ns=(1_000_000_000, 1_000_000_000))
    os.utime(result, ns=(2_000_000_000, 2_000_000_000))
    assert run.info()["status"] == "interrupted" and run.info()["result"]["epochs"] == 1
    os.utime(metrics, ns=(3_000_000_000, 3_000_000_000))  # --resume appends an epoch
    assert run.info()["status"] == "running"


# -- the axes and the tables, on runs of known ranges -------------------------------------------
#
# Each run's statistics go from one end of a chosen range to the other, so the test knows what
# each axis must show: the narrow |parameter| range (0.08 to 0.1, where Chart.js's own
# log ticks wrote "0.100" over "0.080"), many decades, a little over one decade, a constant.

RANGES = {  # per stats field: (low, high) of its values
    "typical": {"parameters": (0.08, 0.1), "gradients": (1e-6, 0.1), "activations": (0.012, 0.15),
                "update_ratio": (2e-4, 5e-3), "learning_rate": (0.1, 0.1), "score": (0.2, 2.4)},
    "extreme": {"parameters": (1.0e-5, 1.02e-5), "gradients": (1e-14, 100.0), "activations": (3.0, 3.0),
                "update_ratio": (1e-3, 1e-3), "learning_rate": (1e-4, 1.0), "score": (1500.0, 1510.0)},
}
# What some y axes show at 1400 x 900; "parameters" is the chart: Chart.js gave it two labels.
EXPECTED = {
    "typical": {"parameters": ["0.080", "0.085", "0.090", "0.095", "0.100"],
                "gradients": ["1e-6", "1e-5", "1e-4", "1e-3", "0.01", "0.1"],  # five decades: whole ones
                "activations": ["0.01", "0.02", "0.05", "0.1"],  # 1.1 decades: widened to hold four
                "learning_rate": ["0.096", "0.098", "0.100", "0.102", "0.104"]},  # a constant: in the middle
    "extreme": {"parameters": ["1.000e-5", "1.005e-5", "1.010e-5", "1.015e-5", "1.020e-5"],
                "gradients": ["1e-12", "1e-9", "1e-6", "1e-3", "1"],  # 16 decades: every third
                "learning_rate": ["1e-4", "1e-3", "0.01", "0.1", "1"]},
}
LOG_CHARTS = {"learning_rate", "parameters", "gradients", "activations"}  # drawn log when they span a decade
# Every shown line or scatter chart's axes: their type and range, their labelled ticks (value,
# label, pixel, drawn width) and the data's extremes.
AXES = """() => Object.entries(DL4PY.charts).filter(([id, chart]) =>
    chart.config.type !== "bar" && !document.getElementById("card-" + id).hidden).map(([id, chart]) => {
  const axes = {};
  for (const key of ["x", "y"]) {
    const scale = chart.scales[key], font = scale._resolveTickFontOptions(0);
    chart.ctx.save();
    chart.ctx.font = font.string;
    const ticks = scale.ticks.filter(t => t.label !== "" && t.label != null).map(t => ({
      value: t.value, label: String(t.label), pixel: scale.getPixelForValue(t.value),
      width: chart.ctx.measureText(String(t.label)).width}));
    chart.ctx.restore();
    const values = chart.data.datasets.filter((d, i) => chart.isDatasetVisible(i))
      .flatMap(d => (d._data || d.data).map(p => p[key]));
    axes[key] = {type: scale.type, min: scale.min, max: scale.max, ticks, lineHeight: font.lineHeight,
                 low: Math.min(...values), high: Math.max(...values),
                 lowPixel: scale.getPixelForValue(Math.min(...values)), minPixel: scale.getPixelForValue(scale.min),
                 highPixel: scale.getPixelForValue(Math.max(...values)), maxPixel: scale.getPixelForValue(scale.max)};
  }
  return {id, axes};
})"""


def known_run(folder: Path, ranges: dict, records: int = 40) -> Path:
    """A finished run of two layers whose statistics sweep ``ranges`` (evenly in log): the first
    layer the lower half of each range, the second the upper half."""
    run = folder / "run"
    run.mkdir(parents=True)
    layers = ["0_DenseLayer", "1_OutputLayer"]

    def at(field, fraction):
        low, high = ranges[field]
        return low * (high / low) ** fraction

    lines = [{"time": 0, "kind": "static", "workers": 1, "model": {"summary": "s", "parameters": 3, "layers": layers}}]
    for i in range(records):
        f = i / (records - 1)
        lines.append({
            "time": 0.1 * i, "kind": "stats", "iteration": 4 * i, "score": at("score", f),
            "learning_rate": at("learning_rate", 1 - f), "samples_per_second": 1000.0 + 10 * i,
            "memory": {"process_rss_bytes": (300 + i) * 2 ** 20},
            "layers": {name: {field: at(field, (f + half) / 2) for field in ("parameters", "gradients", "activations",
                                                                               "update_ratio")}
                       for half, name in enumerate(layers)}})
    for epoch in range(3):
        lines.append({"time": 5 + epoch, "kind": "epoch", "epoch": epoch, "loss": 1.0 / (epoch + 1),
                      "val_loss": 1.2 / (epoch + 1), "val_accuracy": 0.5 + 0.1 * epoch})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "result.json").write_text(json.dumps({"status": "completed", "epochs": 3}))
    return run


def wide_sweep(folder: Path, keys: int = 16) -> Path:
    """A finished sweep of three learning rates (two decades apart) and ``keys`` more swept keys
    of long text values: a table wider than any screen."""
    sweep = folder / "sweep"
    experiments = []
    for i, rate in enumerate(["0.001", "0.01", "0.3"]):
        overrides = {"network.updater.learning_rate": rate,
                     **{f"training.option_{k:02d}": f"a-long-choice-{k}-{i % 2}" for k in range(keys)}}
        experiments.append({"name": f"{i + 1:03d}-learning_rate={rate}", "overrides": overrides})
        run = sweep / experiments[-1]["name"]
        run.mkdir(parents=True)
        (run / "result.json").write_text(json.dumps({"status": "completed", "epochs": 1,
                                                     "test_accuracy": 0.5 + 0.1 * i, "wall_seconds": 1.0 + i}))
    grid = {key: sorted({e["overrides"][key] for e in experiments}) for key in experiments[0]["overrides"]}
    (sweep / "sweep.json").write_text(json.dumps({
        "version": 1, "config_name": "wide", "metric": "test_accuracy", "grid": grid, "random": None, "seed": 0,
        "ranges": {}, "config": {}, "experiments": experiments}))
    return sweep


def is_one_two_five(value: float) -> bool:
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return any(math.isclose(mantissa, m, rel_tol=1e-9) for m in (1, 2, 5))


def check_axes(charts: list[dict]) -> None:
    """Every chart: >= 4 labelled y ticks, labels that do not overlap and say their value (1, 2
    or 5 x 10^k on a log axis), and the data strictly inside the axes, a few pixels off the frame."""
    for chart in charts:
        for key, axis in chart["axes"].items():
            where = (chart["id"], key, axis["type"], [t["label"] for t in axis["ticks"]])
            ticks = sorted(axis["ticks"], key=lambda t: t["pixel"])
            labels = [t["label"] for t in ticks]
            if key == "y":
                assert len(ticks) >= 4, where
            assert len(set(labels)) == len(labels), where
            for tick in ticks:
                if re.fullmatch(r"-?[0-9][0-9,]*(\.[0-9]+)?(e-?[0-9]+)?", tick["label"]) is None:
                    continue  # a category's name (a swept value that is no number)
                assert math.isclose(float(tick["label"].replace(",", "")), tick["value"], rel_tol=0.01,
                                    abs_tol=1e-12), where
                if axis["type"] == "logarithmic":
                    assert is_one_two_five(tick["value"]), where
            for before, after in zip(ticks, ticks[1:]):
                room = axis["lineHeight"] if key == "y" else (before["width"] + after["width"]) / 2
                assert after["pixel"] - before["pixel"] > room, where
            assert axis["min"] < axis["low"] <= axis["high"] < axis["max"], where
            assert abs(axis["lowPixel"] - axis["minPixel"]) >= 3 and abs(axis["maxPixel"] - axis["highPixel"]) >= 3, \
                where


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(RANGES))
def test_every_axis_has_enough_ticks_that_do_not_overlap_and_room_around_the_data(browser, tmp_path, case):
    from dl4py.monitor.report import write_report

    ranges = RANGES[case]
    report = write_report(known_run(tmp_path, ranges))
    with Page(browser, report.as_uri()) as tab:
        charts = tab.page.evaluate(AXES)
        assert tab.errors == []
    shown = {chart["id"]: chart["axes"] for chart in charts}
    assert set(shown) == {"score", "epoch_loss", "validation", "learning_rate", "throughput", "memory",
                          "update_ratio", "parameters", "gradients", "activations"}
    check_axes(charts)
    for chart in LOG_CHARTS:  # log where the data spans a decade or more; under that, linear
        low, high = ranges[chart]
        assert shown[chart]["y"]["type"] == ("logarithmic" if high / low >= 10 else "linear"), chart
    labels = {chart: [t["label"] for t in shown[chart]["y"]["ticks"]] for chart in EXPECTED[case]}
    assert labels == EXPECTED[case]


@pytest.mark.timeout(120)
def test_a_wide_sweep_table_scrolls_inside_its_box_and_its_log_axis_ticks_are_1_2_5(browser, tmp_path):
    from dl4py.monitor.report import write_report

    report = write_report(wide_sweep(tmp_path))
    with Page(browser, report.as_uri()) as tab:
        page = tab.page
        table = page.evaluate("""() => {
          const box = document.querySelector("#sweep .scroll");
          return {scrollWidth: box.scrollWidth, clientWidth: box.clientWidth, overflowX: getComputedStyle(box).overflowX,
                  pageWidth: document.documentElement.scrollWidth, viewport: window.innerWidth,
                  shaded: box.parentNode.classList.contains("more-right")};
        }""")
        assert table["overflowX"] == "auto" and table["scrollWidth"] > table["clientWidth"] + 200, table
        assert table["pageWidth"] <= table["viewport"] and table["shaded"], table  # the page does not scroll
        page.evaluate("() => { const box = document.querySelector('#sweep .scroll'); box.scrollLeft = box.scrollWidth; }")
        page.wait_for_function("!document.querySelector('#sweep .table-box').classList.contains('more-right')")
        ends = page.evaluate("""() => {
          const box = document.querySelector("#sweep .scroll"), frame = box.getBoundingClientRect();
          const first = box.querySelector("thead th:first-child").getBoundingClientRect();
          const last = box.querySelector("thead th:last-child"), shown = last.getBoundingClientRect();
          const hit = document.elementFromPoint(shown.left + shown.width / 2, shown.top + shown.height / 2);
          return {text: last.textContent, hit: hit === last, firstLeft: first.left - frame.left,
                  right: frame.right - shown.right, left: shown.left - frame.left};
        }""")
        assert ends["text"] == "status" and ends["hit"], ends  # the last column in view, on top
        assert ends["left"] >= 0 and ends["right"] >= 0, ends
        assert abs(ends["firstLeft"]) <= 1, ends  # the experiment column stays in view
        charts = page.evaluate(AXES)
        assert tab.errors == []
    shown = {chart["id"]: chart["axes"] for chart in charts}
    assert len([c for c in shown if c.startswith("sweep_")]) == 17
    assert shown["sweep_0"]["x"]["type"] == "logarithmic"  # the learning rates: 0.001 to 0.3
    assert [t["label"] for t in shown["sweep_0"]["x"]["ticks"]] == ["0.001", "0.002", "0.005", "0.01", "0.02",
                                                                    "0.05", "0.1", "0.2"]
    check_axes(charts)


@pytest.mark.timeout(60)
def test_a_live_chart_turns_log_once_its_data_spans_a_decade(browser, tmp_path):
    from dl4py.monitor.server import UIServer

    run = known_run(tmp_path, {**RANGES["typical"], "gradients": (0.01, 0.05)})
    server = UIServer([run], port=0)
    thread = threading.Thread(target=server.serve_forever, name="dl4py-ui-test")
    thread.start()
    try:
        with Page(browser, server.url) as tab:
            gradients = "DL4PY.charts.gradients.scales.y"
            assert tab.page.evaluate(f"{gradients}.type") == "linear"  # 0.01 to 0.05: under a decade
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            last = [r for r in records if r["kind"] == "stats"][-1]
            last["iteration"] += 4
            last["layers"]["0_DenseLayer"]["gradients"] = 1e-4  # the next poll brings it
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps(last) + "\n")
            tab.page.wait_for_function(f"{gradients}.type === 'logarithmic'", timeout=20_000)
            assert tab.page.evaluate(f"{gradients}.ticks.map(t => t.label)") == [  # whole decades: only three
                "1e-4", "2e-4", "5e-4", "1e-3", "2e-3", "5e-3", "0.01", "0.02", "0.05"]
            check_axes(tab.page.evaluate(AXES))
            assert tab.errors == []
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)
