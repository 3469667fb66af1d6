"""One rank of several: a signal to it alone, a rank that stops answering, one that dies.

Item 8: a SIGTERM to one rank (not the coordinator) stops every rank after the same round,
the checkpoint is kept and a resumed run ends where an uninterrupted one does. Item 9: a
rank that keeps the others waiting is named, with the phase it is in, within the
``timeout`` (a few seconds here), and no process of the run is left. The faults come from
a toy data source that rank 1 reads (``distributed_faults.py``), in a pool's workers and in
processes torchrun starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from dl4py import MultiLayerNetwork, load
from dl4py.config.run import RunConfig
from dl4py.errors import ConfigError, WorkerError
from dl4py.parallel import ParallelPlan, ParallelWrapper
from dl4py.parallel.phase import PHASES
from dl4py.parallel import watchdog
from dl4py.parallel.watchdog import Record, missing
from dl4py.train import TrainingInterrupted
from dl4py.train.listeners import CheckpointListener

from distributed_faults import BATCHES, toy_data  # noqa: E402
from toy import mlp  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
HANG_TIMEOUT = 5  # seconds: the watchdog's bound in these tests
# torchrun's ranks each import torch and dl4py before they meet: on a busy machine one may
# reach the process group seconds after the other, which a bound of 5 s would call a hang.
TORCHRUN_HANG_TIMEOUT = 10
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


# ---- the rule that names the missing rank -------------------------------------------------
def _record(collectives, phase="training", since=0.0, beat=100.0, epoch=0, round_index=2):
    return Record(collectives, PHASES.index(phase), epoch, round_index, since, beat)


def test_the_rank_behind_is_named_and_ranks_that_all_compute_never_are():
    now, bound = 100.0, 5.0
    waiting, behind = _record(13, since=90.0), _record(12, since=99.0)
    found = missing([waiting, behind], now, bound, "worker")
    assert found.rank == 1 and found.reason.startswith("did not arrive at collective 13 within timeout=5 s: it is "
                                                       "still in 'training' (epoch 1, round 3), at collective 12")
    assert "worker 0 has waited 10 s" in found.reason
    assert missing([waiting, behind], now=94.0, timeout=bound) is None  # not waited long enough yet
    # Every rank at the same collective, however long it computes: nobody is missing.
    assert missing([_record(13, since=0.0), _record(13, since=0.0)], now, bound) is None
    # Silent (dead or frozen) or never heard from: named as such.
    silent = missing([waiting, _record(13, since=0.0, beat=80.0)], now, bound)
    assert silent.rank == 1 and "nothing was heard from it for 20 s (it died or froze)" in silent.reason
    never = missing([_record(0, phase="setup", since=90.0), None], now, bound)
    assert never.rank == 1 and never.reason.startswith("did not arrive at the process group within timeout=5 s: "
                                                       "nothing was heard from it")
    with pytest.raises(ConfigError, match="training.timeout: must be a positive number of seconds"):
        RunConfig.from_dict({"network": {"layers": [{"type": "output", "n_out": 2}],
                                         "input_type": {"type": "feed_forward", "size": 3}},
                             "training": {"workers": 2, "timeout": 0}})



class _WriteRecorder:
    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return len(text)

    def flush(self):
        pass


class _EndedBoard:
    def ended(self):
        return "rank 1 did not arrive at collective 9 within timeout=10 s"


def test_a_rank_says_why_it_stops_in_one_write_so_two_ranks_lines_never_run_together(monkeypatch):
    # Every torchrun rank shares one stderr: a line written in two parts (print's text, then
    # its newline) ran into the other rank's line when both stopped at once.
    stderr, codes = _WriteRecorder(), []
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(watchdog, "end_process", codes.append)
    dog = watchdog.Watchdog(rank=0, board=_EndedBoard(), timeout=5.0, judge=True)
    dog._judge(_record(9), now=100.0)
    assert stderr.writes == ["dl4py: rank 0 stops: rank 1 did not arrive at collective 9 within timeout=10 s\n"]
    assert codes == [watchdog.HANG_EXIT_CODE]

# ---- spawned workers -----------------------------------------------------------------------
SESSION_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")  # kept for the session


class RunProcesses:
    """This test's child processes (a pool's workers are the forkserver's children), less the
    ones that were there before it and multiprocessing's helpers, kept for the session."""

    def __init__(self):
        self.before = {p.pid for p in psutil.Process().children(recursive=True)}

    def left(self, patience: float = 5.0) -> list[str]:
        deadline = time.monotonic() + patience
        while True:
            found = []
            for proc in psutil.Process().children(recursive=True):
                try:
                    command = " ".join(proc.cmdline())
                    if proc.pid not in self.before and proc.status() != psutil.STATUS_ZOMBIE and \
                            not any(helper in command for helper in SESSION_HELPERS):
                        found.append(f"{proc.pid} {command}")
                except psutil.NoSuchProcess:
                    continue
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


def _parameters(net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.module.parameters()]


def _uninterrupted(mode: str, options: dict) -> list[torch.Tensor]:
    net = MultiLayerNetwork(mlp(), backend="cpu")
    with ParallelWrapper(net, workers=2, parallelism=ParallelPlan.from_training_mode(mode), prefetch_buffer=0,
                         **options) as wrapper:
        wrapper.fit(toy_data(), verbose=0)
    return _parameters(net)


def _resumed(checkpoint: Path, mode: str, options: dict):
    net = load(checkpoint, backend="cpu")
    with ParallelWrapper(net, workers=2, parallelism=ParallelPlan.from_training_mode(mode), prefetch_buffer=0,
                         **options) as wrapper:
        wrapper.fit(toy_data(), verbose=0)  # the rest of the stopped epoch
    return net


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, options, stopped_after", [
    # Rank 1 signals itself reading its 5th batch (round 5): averaging votes with each average,
    # after rounds 2, 4 and 6; sharded every round.
    ("averaging", {"averaging_frequency": 2}, 6),
    ("sharded", {}, 5),
])
def test_sigterm_to_one_worker_stops_every_worker_after_the_same_round_and_resumes_exactly(
        tmp_path, mode, options, stopped_after):
    processes = RunProcesses()
    checkpoint = tmp_path / "checkpoint.dl4py"
    net = MultiLayerNetwork(mlp(), backend="cpu")
    wrapper = ParallelWrapper(net, workers=2, parallelism=ParallelPlan.from_training_mode(mode), prefetch_buffer=0,
                         **options)
    try:
        with pytest.raises(TrainingInterrupted) as stopped:
            wrapper.fit(toy_data("sigterm", at=5), listeners=[CheckpointListener(checkpoint)], verbose=0)
    finally:
        wrapper.close()
    batches = 2 * stopped_after  # a whole round of both workers
    assert str(stopped.value) == (
        f"parallel training stopped by SIGTERM at worker 1; every worker was stopped after a whole round, at "
        f"iteration {batches} (epoch 1, batch {batches}); the model is consistent")
    saved = load(checkpoint, backend="cpu")
    assert (saved.epoch_count, saved.iteration_count, saved.batch_in_epoch) == (0, batches, batches)

    resumed = _resumed(checkpoint, mode, options)
    assert (resumed.epoch_count, resumed.iteration_count, resumed.batch_in_epoch) == (1, BATCHES, 0)
    expected = _uninterrupted(mode, options)
    assert all(torch.equal(a, b) for a, b in zip(_parameters(resumed), expected))
    assert processes.left() == []


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_worker_that_stops_answering_is_named_with_its_phase_within_the_timeout():
    processes = RunProcesses()
    net = MultiLayerNetwork(mlp(), backend="cpu")
    wrapper = ParallelWrapper(net, workers=2, prefetch_buffer=0, timeout=HANG_TIMEOUT)
    try:
        with pytest.raises(WorkerError) as failed:  # rank 1 sleeps a minute before its 3rd batch
            wrapper.fit(toy_data("sleep", at=3), verbose=0)
    finally:
        wrapper.close()
    message = str(failed.value)
    assert message.startswith("worker 1 (device cpu) failed: did not arrive at collective ") and \
        f"within timeout={HANG_TIMEOUT} s: it is still in 'training' (epoch 1, round 3)" in message, message
    assert "worker 0 has waited" in message and "\n" not in message
    assert processes.left() == []


@pytest.mark.timeout(60)
def test_a_worker_that_dies_in_setup_is_named_with_its_phase():
    processes = RunProcesses()
    net = MultiLayerNetwork(mlp(), backend="cpu")
    wrapper = ParallelWrapper(net, workers=2, prefetch_buffer=0, timeout=HANG_TIMEOUT)
    try:
        with pytest.raises(WorkerError, match=r"^worker 1 \(device cpu\) failed: was killed by SIGKILL, in 'setup'"):
            wrapper.fit(toy_data("kill in setup"), verbose=0)  # as worker 1 unpacks its job
    finally:
        wrapper.close()
    assert processes.left() == []


# ---- under torchrun ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Torchrun:
    """``torchrun ... PROGRAM`` on this machine, once per ``nodes`` (each a launcher of its
    own), every process tagged with a marker in its environment: scanning ``/proc/*/environ``
    finds all of them, whoever their parent is."""

    def __init__(self, program: list[str], nodes: int = 1):
        self.marker = uuid.uuid4().hex
        env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1",
               "DL4PY_TEST_MARK": self.marker}
        port = _free_port()
        per_node = ["--nproc-per-node=2"] if nodes == 1 else ["--nnodes=2", "--nproc-per-node=1"]
        self.launchers = [
            subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *per_node, f"--node-rank={node}",
                              "--master-addr=127.0.0.1", f"--master-port={port}", *map(str, program)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for node in range(nodes)
        ]

    @classmethod
    def faults(cls, out: Path, fault: str, mode: str, timeout: float, nodes: int = 1) -> "Torchrun":
        return cls([HERE / "distributed_faults.py", fault, mode, timeout, out], nodes)

    def finish(self, timeout: float) -> tuple[str, list[int]]:
        """Every launcher's output, and the processes of the run still alive a few seconds
        after the launchers ended (killed then, so that a failing test leaves none)."""
        try:
            output = "".join(self.outputs(timeout))
            deadline = time.monotonic() + 5
            while self.processes() and time.monotonic() < deadline:
                time.sleep(0.1)
            return output, self.processes()
        finally:
            self.kill()

    def outputs(self, timeout: float) -> list[str]:
        """Each launcher's output, all within one ``timeout``; a launcher still running then
        fails the test naming its node (``finish`` kills what is left)."""
        deadline = time.monotonic() + timeout
        outputs = []
        for node, launcher in enumerate(self.launchers):
            try:
                outputs.append(launcher.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                raise AssertionError(f"torchrun node {node} did not finish within {timeout:g} s") from None
        return outputs

    def kill(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def processes(self, environ: bytes = b"") -> list[int]:
        """The run's live processes (with ``environ``, those whose environment has it too)."""
        needle = f"DL4PY_TEST_MARK={self.marker}".encode()
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    variables = f.read().split(b"\0")
            except OSError:
                continue
            if needle in variables and (not environ or environ in variables):
                found.append(int(entry))
        return found

    def no_rank_traceback(self, output: str) -> bool:
        """Only torchrun's own report of the failed ranks has a traceback, once per launcher."""
        return output.count("Traceback") == len(self.launchers)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_to_one_torchrun_rank_stops_every_rank_after_the_same_round_and_resumes_exactly(tmp_path):
    run = Torchrun.faults(tmp_path, "sigterm", "sharded", 60)
    output, left = run.finish(timeout=180)
    assert all(p.returncode != 0 for p in run.launchers), output[-3000:]  # the ranks exit 130
    lines = sorted(line for line in output.splitlines() if line.startswith("rank "))
    stopped = ("interrupted (parallel training stopped by SIGTERM at rank 1; every rank was stopped after a whole "
               "round, at iteration 10 (epoch 1, batch 10); the model is consistent) epoch 0 iteration 10 batch 10")
    assert lines == [f"rank 0: {stopped}", f"rank 1: {stopped}"], output[-3000:]
    assert "exitcode  : 130" in output and run.no_rank_traceback(output), output[-3000:]
    saved = load(tmp_path / "checkpoint.dl4py", backend="cpu")
    assert (saved.epoch_count, saved.iteration_count, saved.batch_in_epoch) == (0, 10, 10)
    resumed = _resumed(tmp_path / "checkpoint.dl4py", "sharded", {})
    # The first part trained in torchrun's processes, whose threads may differ from a pool's.
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(_parameters(resumed), _uninterrupted("sharded", {})))
    assert left == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_torchrun_rank_that_stops_answering_is_named_by_every_rank_within_the_timeout(tmp_path):
    run = Torchrun.faults(tmp_path, "sleep", "averaging", TORCHRUN_HANG_TIMEOUT)
    output, left = run.finish(timeout=180)  # rank 1 sleeps a minute before its 3rd batch
    lines = sorted(line for line in output.splitlines() if line.startswith("dl4py: "))
    assert len(lines) == 2, output[-3000:]
    for rank, line in enumerate(lines):
        assert line.startswith(f"dl4py: rank {rank} stops: rank 1 did not arrive at collective "), line
        assert f"within timeout={TORCHRUN_HANG_TIMEOUT} s: it is still in 'training' (epoch 1, round 3)" in line, line
    assert "exitcode  : 124" in output and run.no_rank_traceback(output), output[-3000:]
    assert left == []


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_a_torchrun_rank_that_dies_before_the_group_forms_is_named_on_the_other_node(tmp_path):
    # Two launchers, as two machines: node 0's torchrun cannot see rank 1 end.
    run = Torchrun.faults(tmp_path, "exit", "averaging", HANG_TIMEOUT, nodes=2)
    output, left = run.finish(timeout=180)
    assert (f"dl4py: rank 0 stops: rank 1 did not arrive at the process group within timeout={HANG_TIMEOUT} s: "
            "nothing was heard from it (it died or never started: see its own output); rank 0 has waited") in output, \
        output[-3000:]
    assert "exitcode  : 124" in output and "exitcode  : 3" in output and run.no_rank_traceback(output)
    assert left == []


MNIST_RUN = """\
network:
  seed: 123
  updater: {type: sgd, learning_rate: 0.03}
  input_type: {type: convolutional_flat, height: 28, width: 28, channels: 1}
  layers:
    - {type: dense, n_out: 256, activation: relu}
    - {type: output, n_out: 10, activation: softmax, loss: negativeloglikelihood}
data: {dataset: mnist, seed: 12345, limit_train: 25600, limit_test: 200}
training: {epochs: 1, batch_size: 64, backend: cpu, score_every: 1}
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dl4py_train_under_torchrun_keeps_a_checkpoint_when_one_rank_gets_sigterm(tmp_path, mnist):
    config, out = tmp_path / "mlp.yaml", tmp_path / "run"
    config.write_text(MNIST_RUN)
    run = Torchrun(["-m", "dl4py", "train", config, "--output", out, "--no-progress"])
    try:
        deadline = time.monotonic() + 200
        while sum('"kind": "iteration"' in line for line in _lines(out / "metrics.jsonl")) < 4:
            assert run.launchers[0].poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.1)
        os.kill(run.processes(environ=b"RANK=1")[0], signal.SIGTERM)  # rank 1 alone: neither torchrun nor rank 0
        output, left = run.finish(timeout=120)
    finally:
        run.kill()
    assert output.count("dl4py train: parallel training stopped by SIGTERM at rank 1; every rank was stopped") == 2, \
        output[-3000:]
    assert "checkpoint saved to" in output and run.no_rank_traceback(output), output[-3000:]
    saved = load(out / "checkpoint.dl4py", backend="cpu")
    assert saved.epoch_count == 0 and 0 < saved.batch_in_epoch < 400 and saved.batch_in_epoch % 2 == 0
    assert json.loads((out / "result.json").read_text())["status"] == "interrupted"
    assert left == []


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []
