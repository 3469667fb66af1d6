"""Signals and killed parents: SIGTERM is a clean stop, nothing outlives its parent.

Real ``dl4py train`` / ``dl4py sweep`` processes on a slice of MNIST. Every process a
test starts carries a marker in its environment, which its children (parallel workers,
the sweep's experiments) inherit: scanning ``/proc/*/environ`` for it finds all of them,
whoever their parent is now.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dl4py.cli import main

ROOT = Path(__file__).resolve().parents[1]
BATCHES = 200  # 12800 examples in batches of 64: long enough (seconds) for a signal to land mid-epoch
CONFIG = f"""\
network:
  seed: 123
  weight_init: xavier
  updater: {{type: nesterovs, learning_rate: 0.03, momentum: 0.9}}
  input_type: {{type: convolutional_flat, height: 28, width: 28, channels: 1}}
  layers:
    - {{type: dense, n_out: 512, activation: relu}}
    - {{type: output, n_out: 10, activation: softmax, loss: negativeloglikelihood}}
data:
  dataset: mnist
  seed: 12345
  limit_train: {BATCHES * 64}
  limit_test: 200
training:
  epochs: 1
  batch_size: 64
  backend: cpu
  score_every: 1
"""
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture
def config(tmp_path, mnist) -> Path:
    path = tmp_path / "mlp.yaml"
    path.write_text(CONFIG)
    return path


class Run:
    """``python -m dl4py ARGS`` (or ``python ARGS`` with ``dl4py=False``) in a session of
    its own, tagged with a marker."""

    def __init__(self, *args, dl4py: bool = True):
        self.marker = uuid.uuid4().hex
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "DL4PY_TEST_MARK": self.marker}
        argv = [sys.executable, *(["-m", "dl4py"] if dl4py else []), *map(str, args)]
        self.proc = subprocess.Popen(argv, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    def processes(self) -> list[int]:
        """Live processes carrying this run's marker (zombies have an empty environment)."""
        needle = f"DL4PY_TEST_MARK={self.marker}".encode()
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except (OSError, ValueError):
                continue
        return found

    def wait_for(self, condition, what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended ({self.proc.returncode}) before {what}: {self.proc.communicate()[1][-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout:.0f} s")
            time.sleep(0.02)

    def wait_gone(self, timeout: float = 10.0) -> list[int]:
        """The marked processes still alive after ``timeout`` seconds (empty: all gone)."""
        deadline = time.monotonic() + timeout
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.processes()

    def finish(self, timeout: float = 60.0) -> str:
        """Wait for the main process; its stderr."""
        return self.proc.communicate(timeout=timeout)[1]

    def kill_all(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def iterations_logged(metrics: Path) -> int:
    try:
        return sum('"kind": "iteration"' in line for line in metrics.read_text().splitlines())
    except FileNotFoundError:
        return 0


def checkpoint_counters(path: Path) -> tuple[int, int, int]:
    from dl4py.nn.loading import load

    model = load(path, backend="cpu")
    return model.epoch_count, model.iteration_count, model.batch_in_epoch


def started_training(run: Run, metrics: Path, workers: int) -> bool:
    # The coordinator, its workers and multiprocessing's resource tracker.
    return iterations_logged(metrics) >= 2 and len(run.processes()) >= 1 + workers


@pytest.mark.slow
def test_sigterm_stops_a_two_worker_run_with_a_checkpoint_and_no_process_left(config, tmp_path):
    out = tmp_path / "run"
    run = Run("train", config, "--workers", 2, "--output", out, "--no-progress")
    try:
        run.wait_for(lambda: started_training(run, out / "metrics.jsonl", 2), "two training workers")
        run.proc.send_signal(signal.SIGTERM)  # the coordinator only, as `kill PID` does
        err = run.finish()
        left = run.wait_gone()
    finally:
        run.kill_all()
    assert "Traceback" not in err, err
    assert run.proc.returncode == 130, err
    assert "parallel training stopped by SIGTERM" in err and "checkpoint saved to" in err
    epoch, iteration, batch = checkpoint_counters(out / "checkpoint.dl4py")
    assert epoch == 0 and 0 < batch < BATCHES and iteration == batch  # the partial epoch is kept
    assert json.loads((out / "result.json").read_text())["status"] == "interrupted"
    assert left == [], "processes of the run still alive 10 s after it ended"


@pytest.mark.slow
def test_workers_die_with_a_killed_parent(config, tmp_path):
    out = tmp_path / "run"
    # Epochs enough that orphans would still be training when the test looks for them.
    run = Run("train", config, "--workers", 2, "--epochs", 50, "--output", out, "--no-progress")
    try:
        run.wait_for(lambda: started_training(run, out / "metrics.jsonl", 2), "two training workers")
        run.proc.kill()  # SIGKILL: nothing of the parent runs any more
        run.proc.wait(timeout=10)
        left = run.wait_gone()
    finally:
        run.kill_all()
    assert left == [], "workers still alive 10 s after their parent was killed"


@pytest.mark.soak  # suite budget: SIGTERM's twin above and the resume tests stay in make test
def test_ctrl_c_in_the_first_parallel_epoch_keeps_a_checkpoint_that_resume_continues(config, tmp_path):
    out = tmp_path / "run"
    run = Run("train", config, "--workers", 2, "--output", out, "--no-progress")
    try:
        run.wait_for(lambda: started_training(run, out / "metrics.jsonl", 2), "two training workers")
        os.killpg(run.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
        err = run.finish()
    finally:
        run.kill_all()
    assert "Traceback" not in err, err
    assert run.proc.returncode == 130, err
    assert "parallel training stopped by Ctrl-C" in err
    epoch, iteration, batch = checkpoint_counters(out / "checkpoint.dl4py")
    assert epoch == 0 and 0 < batch < BATCHES and iteration == batch
    assert batch % 2 == 0  # a whole round of two workers

    resumed = Run("train", config, "--workers", 2, "--output", out, "--resume", "--no-progress")
    try:
        err = resumed.finish(timeout=120)
    finally:
        resumed.kill_all()
    assert "Traceback" not in err, err
    assert resumed.proc.returncode == 0, err
    assert f"resuming {out} in epoch 1 after batch {batch} of {BATCHES} (iteration {iteration})" in err
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"kind": "epoch"' in line]
    assert len(epochs) == 1  # the stopped epoch, finished by the resumed run
    assert epochs[0]["epoch"] == 0 and epochs[0]["completed"]
    assert epochs[0]["batches"] == BATCHES - batch and epochs[0]["iteration"] == BATCHES  # none repeated or skipped
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "completed" and result["epochs"] == 1 and result["iterations"] == BATCHES


@pytest.mark.slow
def test_sigterm_keeps_the_partial_epoch_of_a_single_process_run(config, tmp_path):
    out = tmp_path / "run"
    run = Run("train", config, "--output", out, "--no-progress")
    try:
        run.wait_for(lambda: iterations_logged(out / "metrics.jsonl") >= 2, "training")
        run.proc.send_signal(signal.SIGTERM)
        err = run.finish()
    finally:
        run.kill_all()
    assert "Traceback" not in err, err
    assert run.proc.returncode == 130, err
    assert "training stopped by SIGTERM" in err and "checkpoint saved to" in err
    epoch, iteration, batch = checkpoint_counters(out / "checkpoint.dl4py")
    assert epoch == 0 and 0 < batch < BATCHES and iteration == batch


@pytest.mark.parametrize("workers, message", [
    (1_000_000, f"workers: is 1000000 but an epoch has only {BATCHES} batches"),
    (100, "workers: is 100, which puts 100 workers on the 2 CPU cores this process may use; use at most 8"),
])
def test_too_many_workers_is_one_line_naming_workers_before_any_process_starts(
        config, tmp_path, capsys, monkeypatch, workers, message):
    import torch.multiprocessing

    import dl4py.parallel.preflight as preflight

    def no_spawning(*args, **kwargs):
        raise AssertionError("a process context was asked for")

    monkeypatch.setattr(torch.multiprocessing, "get_context", no_spawning)
    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)  # the same message on any machine
    code = main(["train", str(config), "--workers", str(workers), "--output", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("dl4py train: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


# What `dl4py sweep` does with each experiment (sweep/processes.py), with one experiment.
SWEEP = """
import sys
from pathlib import Path
from dl4py.sweep.processes import Job, ProcessQueue
from dl4py.sweep.slots import Slot

config, out = sys.argv[1], Path(sys.argv[2])
job = Job("exp", lambda slot: [sys.executable, "-m", "dl4py", "train", config, "--workers", "2", "--epochs", "50",
                               "--output", str(out / "exp"), "--no-progress"], out / "exp.log")
ProcessQueue([job], [Slot(None, 0, 2)], lambda *args: None).run()
"""


@pytest.mark.soak  # make test's budget (DEVELOPERS.md): make soak runs it
def test_a_killed_sweep_leaves_no_process_of_its_parallel_experiment(config, tmp_path):
    out = tmp_path / "sweep"
    run = Run("-c", SWEEP, config, out, dl4py=False)
    try:
        run.wait_for(lambda: started_training(run, out / "exp" / "metrics.jsonl", 3),
                     "the experiment and its workers training")  # the sweep, the experiment, 2 workers
        run.proc.kill()
        run.proc.wait(timeout=10)
        left = run.wait_gone()
        err = run.proc.communicate()[1]
    finally:
        run.kill_all()
    assert left == [], "processes of the sweep still alive 10 s after it was killed"
    assert "Traceback" not in err
    log = (out / "exp.log").read_text()
    assert "Traceback" not in log, log
    # The experiment got SIGTERM when the sweep died: it stopped cleanly and kept a checkpoint.
    assert "parallel training stopped by SIGTERM" in log and (out / "exp" / "checkpoint.dl4py").is_file(), log
