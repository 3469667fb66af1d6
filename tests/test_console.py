"""The console: a progress bar that reaches 100% in the run's own epoch numbers (after a
resume, with two workers) and that log records do not break; one line per epoch where the
output is no terminal; the command that continues a stopped run; quiet closed pipes; and
``fit(verbose=...)`` from Python.

A bar is checked as a person sees it: the bytes a real ``dl4py train`` writes to a
pseudo-terminal, played back as a terminal shows them ("\\r" returns to the line's start).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.cli import main
from dl4py.errors import ConfigError, MissingDependencyError
from dl4py.train import ProgressBar, ScoreIterationListener, TrainingListener

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux pseudo-terminals")

ROOT = Path(__file__).resolve().parents[1]
BATCHES = 12  # 512 examples, a quarter held out for validation, in batches of 32
CONFIG = """\
network:
  seed: 123
  updater: {type: sgd, learning_rate: 0.1}
  input_type: {type: convolutional_flat, height: 28, width: 28, channels: 1}
  layers:
    - {type: dense, n_out: 32, activation: relu}
    - {type: output, n_out: 10, activation: softmax, loss: negativeloglikelihood}
data:
  dataset: mnist
  seed: 1
  limit_train: 512
  limit_test: 100
  validation: {split: 0.25}
training:
  epochs: 2
  batch_size: 32
  backend: cpu
  score_every: 4
logging: {stats_every: 0, report: false}
"""
LONG_BATCHES = 600  # an epoch long enough (a second or more) for Ctrl-C to land in it
LONG_CONFIG = f"""\
network:
  seed: 123
  updater: {{type: sgd, learning_rate: 0.05}}
  input_type: {{type: convolutional_flat, height: 28, width: 28, channels: 1}}
  layers:
    - {{type: dense, n_out: 64, activation: relu}}
    - {{type: output, n_out: 10, activation: softmax, loss: negativeloglikelihood}}
data:
  dataset: mnist
  seed: 1
  limit_train: {LONG_BATCHES * 32}
  limit_test: 100
training:
  epochs: 1
  batch_size: 32
  backend: cpu
  score_every: 0
logging: {{stats_every: 0, report: false}}
"""
SCORE = r"Score at iteration \d+ is \d+\.\d+"
AVERAGED = (r"\[worker 0\] epoch \d+, round \d+, iteration \d+: averaged score \d+\.\d+ across 2 workers "
            r"\(averaging took \d+\.\d ms\)")
# The training accuracy where the fit counts it (a single process; ParallelWrapper's fits not yet).
SCORES = r"loss \d+\.\d+(?:, accuracy \d+\.\d+)?, val_loss \d+\.\d+, val_accuracy \d+\.\d+"


@pytest.fixture
def config(tmp_path, mnist) -> Path:
    path = tmp_path / "mlp.yaml"
    path.write_text(CONFIG)
    return path


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "PYTHONUNBUFFERED")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **extra}


def in_terminal(*args, columns: int | None = None, timeout: float = 120.0) -> str:
    """What ``python -m dl4py ARGS`` writes to a pseudo-terminal (``columns`` wide; None:
    a terminal that tells no size, as one nobody sized does), once it has ended."""
    import fcntl
    import pty
    import struct
    import termios

    controller, terminal = pty.openpty()
    if columns is not None:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "dl4py", *map(str, args)], stdin=terminal, stdout=terminal,
                            stderr=terminal, env=child_env(), start_new_session=True)
    os.close(terminal)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([controller], [], [], 0.1)[0]:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
        else:
            pytest.fail(f"dl4py {' '.join(map(str, args))} still ran after {timeout:.0f} s")
        assert proc.wait(timeout=30) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(controller)
    return b"".join(chunks).decode("utf-8", errors="replace")


def screen(raw: str) -> list[str]:
    """The lines a terminal shows once ``raw`` is written: each "\\r" goes back to the line's
    start, and what follows overwrites what was there."""
    shown = []
    for row in raw.replace("\r\n", "\n").split("\n"):
        line = ""
        for part in row.split("\r"):
            line = part + line[len(part):]
        if line.strip():
            shown.append(line.rstrip())
    return shown


def bar_lines(shown: list[str]) -> list[str]:
    return [line for line in shown if line.startswith("epoch ")]


def assert_logs_kept_apart(shown: list[str], *patterns: str) -> None:
    """Each log record on a line of its own: no bar before it, none glued after it."""
    logged = [line for line in shown if any(re.search(p, line) for p in patterns)]
    assert logged, "no log record during training: nothing checked"
    for line in logged:
        assert any(re.fullmatch(p, line) for p in patterns), f"a log line broken by the bar: {line!r}"


@pytest.mark.soak  # make test's budget (DEVELOPERS.md): make soak runs it
def test_a_run_resumed_with_two_workers_shows_its_own_epoch_numbers_and_every_batch(config, tmp_path, capsys):
    """Epoch 1 of 3 on one device, then the rest resumed with two workers in a terminal: the
    bars say "epoch 2/3" and "epoch 3/3" (the run's numbers, not the resumed fit's) and
    count every batch, though the coordinator replays worker 0's rounds, each two batches
    on. Log records, the coordinator's and the workers' own ([worker 0] ...), stay above the bar."""
    out = tmp_path / "run"
    # Output that is no terminal (captured here): one flushed line per epoch.
    assert main(["train", str(config), "--epochs", "1", "--output", str(out)]) == 0
    epochs = [line for line in capsys.readouterr().err.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 1 and re.fullmatch(rf"epoch 1/1: {SCORES}, \d+\.\d s, \d+ samples/s", epochs[0]), epochs
    assert ", accuracy " in epochs[0]  # Keras' line: the training accuracy beside the loss

    raw = in_terminal("train", config, "--epochs", 3, "--output", out, "--resume", "--workers", 2,
                      "--averaging-frequency", 3, "--set", "training.report_score_after_averaging=true", columns=200)
    shown = screen(raw)
    bars = bar_lines(shown)
    assert len(bars) == 2, shown
    for number, line in zip((2, 3), bars):
        assert re.fullmatch(rf"epoch {number}/3 100%\|\S+\| {BATCHES}/{BATCHES} \[\d\d:\d\d<00:00, "
                            rf"[\d.]+k? samples/s, {SCORES}\]", line), line
    assert_logs_kept_apart(shown, SCORE, AVERAGED)
    assert re.search(AVERAGED, raw)


def test_a_terminal_that_tells_no_size_gets_a_bar_80_columns_wide():
    """A pseudo-terminal nobody sized says 0 columns, 0 rows; tqdm would draw nothing there."""
    import pty

    controller, terminal = pty.openpty()
    try:
        with open(terminal, "w", encoding="utf-8", closefd=True) as stream:
            tiny_net().fit(DATA, epochs=1, batch_size=10, listeners=[ProgressBar(1, 10, stream=stream)])
        raw = b""
        while select.select([controller], [], [], 0)[0]:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's writer is gone
                break
            if not chunk:
                break
            raw += chunk
    finally:
        os.close(controller)
    bars = bar_lines(screen(raw.decode("utf-8")))
    assert len(bars) == 1 and bars[0].startswith("epoch 1/1 100%|") and "| 10/10 [" in bars[0], bars
    assert len(bars[0]) <= 80


@pytest.mark.slow
def test_ctrl_c_prints_the_command_that_continues_the_run(tmp_path, mnist):
    config = tmp_path / "long run.yaml"  # a space: the command must quote it
    config.write_text(LONG_CONFIG)
    out, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    typed = ["train", str(config), "--set", "training.score_every=1", "--output", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "dl4py", *typed], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (metrics.is_file() and '"kind": "iteration"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "no training step logged"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert not [line for line in err.splitlines() if line.startswith("epoch")]  # no epoch ended
    said = [line for line in err.splitlines() if line.startswith("dl4py train: to continue: ")]
    assert len(said) == 1, err
    command = said[0].removeprefix("dl4py train: to continue: ")
    assert command == shlex.join(["dl4py", *typed, "--resume"])
    assert main(shlex.split(command)[1:] + ["--verbose", "0"]) == 0  # it continues the run to its end
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "completed" and result["iterations"] == LONG_BATCHES


def test_a_reader_gone_away_ends_the_command_quietly():
    """``dl4py info | head -1`` where head is gone before the output comes (the reader's end
    closed before the command writes, every time): the buffered output fails as it is
    flushed, which Python would otherwise report at exit."""
    proc = subprocess.Popen([sys.executable, "-m", "dl4py", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=child_env())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err  # as a tool that SIGPIPE ends
    assert "Traceback" not in err and "BrokenPipe" not in err and "Broken pipe" not in err, err


def test_a_reader_gone_away_during_a_print_ends_quietly_too(monkeypatch, capsys):
    """Unbuffered output (``python -u``, PYTHONUNBUFFERED) fails in the print itself."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w", buffering=1) as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        assert main(["info"]) == 141
        closed_pipe.flush()  # nothing left to fail at exit
        monkeypatch.undo()
    assert "Broken pipe" not in capsys.readouterr().err


def tiny_net() -> MultiLayerNetwork:
    return MultiLayerNetwork(NetworkConfig(
        layers=[DenseLayer(n_out=8, activation="relu"), OutputLayer(n_out=3)],
        input_type=InputType.feed_forward(5), updater=Sgd(0.1), seed=1,
    ), backend="cpu")


DATA = (torch.rand(100, 5), torch.randint(0, 3, (100,)))


def test_fit_from_python_prints_what_verbose_asks_for(capfd):
    net = tiny_net().init()
    net.fit(DATA, epochs=2, batch_size=10, verbose=0)
    assert capfd.readouterr() == ("", "")
    net.fit(DATA, epochs=2, batch_size=10, verbose=2, validation=DATA)  # the model's epochs 3 and 4
    out, err = capfd.readouterr()
    assert out == "" and len(err.splitlines()) == 2, err
    for number, line in zip((3, 4), err.splitlines()):
        assert re.fullmatch(rf"epoch {number}/4: {SCORES}, \d+\.\d s, \d+ samples/s", line), line
    net.fit(DATA, epochs=1, batch_size=10)  # "auto": no terminal here, so lines
    assert capfd.readouterr().err.startswith("epoch 5/5: loss ")
    net.fit(DATA, epochs=1, batch_size=10, listeners=[ProgressBar(stream=io.StringIO())])  # "auto": that bar only
    assert capfd.readouterr() == ("", "")
    with pytest.raises(ConfigError, match="verbose: must be 0 .*, got 3"):
        net.fit(DATA, epochs=1, verbose=3)


class Terminal(io.StringIO):
    """Output that says it is a terminal, as stderr does in one."""

    def isatty(self) -> bool:
        return True


def test_log_records_go_above_a_bar_and_the_console_handler_comes_back(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    logger = logging.getLogger("dl4py")
    console = logging.StreamHandler(sys.stderr)  # as logging.basicConfig would set up, on the root
    before = (logger.level, list(logger.handlers))
    logger.setLevel(logging.INFO)
    logger.addHandler(console)
    try:
        tiny_net().fit(DATA, epochs=2, batch_size=10, listeners=[ScoreIterationListener(3)], verbose=1)
        assert logger.handlers == [*before[1], console]  # the handler itself again, not a stand-in
    finally:
        logger.removeHandler(console)
        logger.setLevel(before[0])
    shown = screen(sys.stderr.getvalue())
    assert [line[:len("epoch 1/2 100%|")] for line in bar_lines(shown)] == ["epoch 1/2 100%|", "epoch 2/2 100%|"]
    assert_logs_kept_apart(shown, SCORE)


def test_auto_draws_a_bar_on_a_terminal_and_lines_there_without_tqdm(monkeypatch):
    net = tiny_net()
    monkeypatch.setattr(sys, "stderr", Terminal())
    net.fit(DATA, epochs=1, batch_size=10)
    assert sys.stderr.getvalue().rsplit("\r", 1)[-1].startswith("epoch 1/1 100%|")

    for name in ("tqdm", "tqdm.std", "tqdm.auto"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it fails
    monkeypatch.setattr(sys, "stderr", Terminal())
    net.fit(DATA, epochs=1, batch_size=10)
    assert sys.stderr.getvalue().startswith("epoch 2/2: loss ")
    with pytest.raises(MissingDependencyError, match=r'pip install "dl4py\[progress\]"'):
        net.fit(DATA, epochs=1, batch_size=10, verbose=1)


class _StopAfter(TrainingListener):
    def __init__(self, batches: int):
        self.batches = batches

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if model.batch_in_epoch == self.batches:
            model.request_stop("test")


def test_a_bar_resumed_mid_epoch_starts_at_the_batch_it_resumed_at():
    """tqdm's speed (and so its ETA) is (n - initial) / elapsed: the batches trained
    before the stop are the bar's ``initial``, outside this fit's speed."""
    net, stream = tiny_net(), io.StringIO()
    net.fit(DATA, epochs=1, batch_size=10, listeners=[_StopAfter(4)], verbose=0)
    assert (net.epoch_count, net.batch_in_epoch) == (0, 4)
    net.fit(DATA, epochs=1, batch_size=10, listeners=[ProgressBar(1, 10, stream=stream, interval=0.0)])
    frames = stream.getvalue().split("\r")[1:]
    assert frames[0].startswith("epoch 1/1  40%|") and "| 4/10 [00:00<?" in frames[0], frames[0]
    assert frames[1].startswith("epoch 1/1  50%|") and "| 5/10 [" in frames[1], frames[1]
    assert frames[-1].startswith("epoch 1/1 100%|") and frames[-1].rstrip().endswith("]"), frames[-1]
