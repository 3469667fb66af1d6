"""dl4py.spark when a process dies under a fit: the fit names what died, in one line.

Each Spark test runs ``dl4py train --launcher spark --workers 2`` (local[2]) in a process
of its own, as a user would, waits until an epoch has ended, kills one process of the
run, and reads what the command printed: one error line naming the rank (or the JVM) and
how it ended, no rank's traceback, and nothing of the run left running. Every process
of a run carries a mark in its environment (``MARK``), so what it left is found even
after its parents are gone. Spark needs Java: without it those tests skip and say so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
HAS_JAVA = shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))
MARK = "DL4PY_TEST_SPARK_RUN"
# As tests/test_spark.py: C1 alone and the serial collector start Spark with less CPU.
QUICK_SPARK = ("--conf spark.ui.enabled=false --conf "
               "'spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1 -XX:+UseSerialGC' pyspark-shell")
# Well under the ranks' collective timeout (300 s): the survivors must not wait for it.
AFTER_KILL_SECONDS = 150

needs_java = pytest.mark.skipif(not HAS_JAVA, reason="Spark needs a Java 17 runtime (java on PATH or JAVA_HOME)")


def write_run_config(folder: Path) -> Path:
    """A tiny CSV classification whose training never ends by itself (it is killed first)."""
    x = torch.randn(64, 5, generator=torch.Generator().manual_seed(0))
    rows = [",".join(f"{v:.4f}" for v in row) + f",{int(row[0] > 0)}" for row in x.tolist()]
    (folder / "train.csv").write_text("\n".join(rows) + "\n")
    config = folder / "run.yaml"
    config.write_text(f"""
network:
  seed: 1
  updater: {{type: sgd, learning_rate: 0.1}}
  input_type: {{type: feed_forward, size: 5}}
  layers:
    - {{type: dense, n_out: 8, activation: tanh}}
    - {{type: output, n_out: 2}}
data: {{dataset: csv, train_path: "{folder / 'train.csv'}", num_classes: 2}}
training: {{epochs: 100000, batch_size: 8}}
""")
    return config


def marked_processes(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == mark:
                found.append(proc)
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


class SparkRun:
    """``dl4py train --launcher spark`` in a session of its own, every process it starts marked."""

    def __init__(self, tmp_path: Path):
        self.mark = uuid.uuid4().hex
        self.run_dir = tmp_path / "run"
        env = {**os.environ, "PYTHONPATH": str(SRC), MARK: self.mark, "PYSPARK_SUBMIT_ARGS": QUICK_SPARK}
        env.pop("DL4PY_DEBUG", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "dl4py", "train", str(write_run_config(tmp_path)),
                                      "--launcher", "spark", "--workers", "2", "--output", str(self.run_dir),
                                      "--no-progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def wait_for_an_epoch(self) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        while not (metrics.is_file() and '"kind": "epoch"' in metrics.read_text()):
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended before its first epoch: {self.proc.communicate()[1][-3000:]}")
            time.sleep(0.2)

    def find(self, test) -> psutil.Process:
        """The run's process that ``test(proc)`` picks (retried while the run starts it)."""
        while True:
            for proc in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    if test(proc):
                        return proc
                except psutil.Error:
                    continue
            time.sleep(0.2)

    def finish(self) -> tuple[int, str]:
        """The command's exit code and stderr, once it has ended (within AFTER_KILL_SECONDS)."""
        _, err = self.proc.communicate(timeout=AFTER_KILL_SECONDS)
        return self.proc.returncode, err

    def close(self) -> None:
        """Kill whatever of the run still runs (only when a test failed part way)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
        for proc in marked_processes(self.mark):
            try:
                proc.kill()
            except psutil.Error:
                pass

    def left_behind(self, patience: float = 20.0) -> list[str]:
        deadline = time.monotonic() + patience  # a stopped task's processes take a moment to go
        while marked_processes(self.mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = []
        for proc in marked_processes(self.mark):
            try:
                left.append(f"{proc.pid}: {' '.join(proc.cmdline())}")
            except psutil.Error:
                continue
        return left


@pytest.fixture
def spark_run(tmp_path):
    runs = []

    def start() -> SparkRun:
        runs.append(SparkRun(tmp_path))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("dl4py train: error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def task_wrapper(rank: int):
    """Picks the wrapper TorchDistributor starts torchrun with in rank ``rank``'s task
    (``--node_rank`` is the rank: one per task); its parent is the task's Python worker."""
    def test(proc) -> bool:
        command = proc.cmdline()
        return "pyspark.ml.torch.torch_run_process_wrapper" in command and f"--node_rank={rank}" in command
    return test


def training_process(wrapper) -> psutil.Process:
    """Below a task's wrapper, torchrun starts ``train.py``, which forks the process that
    trains (its parent only watches it): that one."""
    scripts = [proc for proc in wrapper.children(recursive=True)
               if proc.cmdline()[-1:] and proc.cmdline()[-1].endswith("train.py") and "-m" not in proc.cmdline()]
    watchers = {proc.pid for proc in scripts}
    return next(proc for proc in scripts if proc.ppid() in watchers)


@pytest.mark.soak  # long for make test's budget: make soak runs it (DEVELOPERS.md)
@needs_java
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_a_killed_task_names_its_rank_and_its_python_worker_in_one_line(spark_run):
    """SIGKILL to rank 1's Spark task (its Python worker) mid-training: the command says
    rank 1's task died, not that rank 0 lost a peer, prints no rank's traceback, and ends
    well before the collectives' timeout with nothing of the run left running."""
    run = spark_run()
    run.wait_for_an_epoch()
    worker = run.find(task_wrapper(1)).parent()
    worker.kill()
    code, err = run.finish()

    assert code == 2, err[-3000:]
    line = error_line(err)
    assert line.startswith("dl4py train: error: worker 1 (device cpu on "), line
    assert f"its Spark task's Python worker (pid {worker.pid}) died" in line, line
    assert line.endswith("(then worker 0 stopped as well)"), line
    assert "Traceback" not in err and "Connection reset" not in err, err[-3000:]
    assert not run.left_behind()


@needs_java
@pytest.mark.spark
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_a_rank_killed_by_a_signal_is_named_with_the_signal(spark_run):
    """SIGKILL to rank 1's own process (as the out-of-memory killer sends it): its parent,
    which only watches it, tells the driver the signal, and the line names it."""
    run = spark_run()
    run.wait_for_an_epoch()
    rank = training_process(run.find(task_wrapper(1)))
    rank.kill()
    code, err = run.finish()

    assert code == 2, err[-3000:]
    line = error_line(err)
    assert line.startswith("dl4py train: error: worker 1 (device cpu on "), line
    assert f"its process (pid {rank.pid}) was killed by SIGKILL" in line, line
    assert "Traceback" not in err and "Connection reset" not in err, err[-3000:]
    assert not run.left_behind()


@pytest.mark.soak  # long for make test's budget: make soak runs it (DEVELOPERS.md)
@needs_java
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_a_killed_spark_jvm_is_named_in_one_line(spark_run):
    """SIGKILL to the Spark JVM (under a local master, the driver's py4j gateway and the
    executor both): one line naming the JVM and the signal, not "Connection refused", and
    the ranks, whose tasks died with it, do not outlive it."""
    run = spark_run()
    run.wait_for_an_epoch()
    jvm = run.find(lambda proc: proc.name() == "java")
    jvm.kill()
    code, err = run.finish()

    assert code == 2, err[-3000:]
    line = error_line(err)
    assert line.startswith(f"dl4py train: error: the Spark JVM (pid {jvm.pid}) died during training "
                           f"(killed by SIGKILL)"), line
    assert "Traceback" not in err and "Connection refused" not in err, err[-3000:]
    assert not run.left_behind()


# Each end in a process of its own: a watcher (``supervise``'s parent) never returns. The
# report goes through a pipe; "told" says whether the driver got it. A told watcher waits
# for the job's cancellation: here a SIGTERM, sent once its report is in and it still runs.
WATCHED_ENDS = """
import json, os, signal, sys, time
from dl4py.spark.supervisor import supervise

outcome = {}
for end, told in (("kill", True), ("kill", False), ("exit", False), ("return", True)):
    read, write = os.pipe()
    helper = os.fork()
    if helper == 0:  # becomes the watcher; its child ends as told
        os.close(read)
        if supervise(lambda pid, code: os.write(write, str(code).encode()) and told):
            if end == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3 if end == "exit" else 0)
    os.close(write)
    report = os.read(read, 100).decode() or None  # at the report, or at the watcher's end
    for _ in range(100):  # one that does not wait ends at once: give it 5 s
        pid, status = os.waitpid(helper, os.WNOHANG)
        if pid:
            break
        time.sleep(0.05)
    waiting = not pid
    if waiting:
        os.kill(helper, signal.SIGTERM)  # the cancellation
        status = os.waitpid(helper, 0)[1]
    outcome[f"{end}, told" if told else end] = [report, waiting, os.waitstatus_to_exitcode(status)]
print(json.dumps(outcome))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_ranks_watcher_reports_a_bad_end_then_waits_for_the_cancellation_or_passes_it_on():
    """``supervise`` without Spark: the child ends as told; its parent reports a bad end
    (not a clean one). Once the driver has the report, the parent waits for the job's
    cancellation (it still runs until the SIGTERM that stands for it); when the driver
    could not be told, it ends as the child did, so torchrun reports that."""
    proc = subprocess.run([sys.executable, "-c", WATCHED_ENDS], env={**os.environ, "PYTHONPATH": str(SRC)},
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"kill, told": ["-9", True, -signal.SIGTERM],
                                       "kill": ["-9", False, -signal.SIGKILL],
                                       "exit": ["3", False, 3], "return, told": [None, False, 0]}
