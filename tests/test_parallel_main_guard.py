"""A script that calls ``fit`` at its top level gets one line saying what to add, before any
worker starts; a guarded script trains, and ends without closing its wrapper."""

from __future__ import annotations

import os
import py_compile
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = """\
import torch
from dl4py import ArrayDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.parallel import ParallelWrapper


def train():
    x = torch.randn(64, 5)
    y = (x[:, 0] > 0).long()
    config = NetworkConfig(layers=[DenseLayer(n_out=8), OutputLayer(n_out=2)],
                           input_type=InputType.feed_forward(5), updater=Sgd(0.1))
    net = MultiLayerNetwork(config, backend="cpu")
    wrapper = ParallelWrapper(net, workers=2)
    for _ in range(2):  # DL4J's loop, and no close(): the pool ends with the program
        wrapper.fit(ArrayDataSetIterator(x, y, batch_size=8))
    print("trained", net.epoch_count, "epochs; worker starts:", wrapper._pool.starts)
    return wrapper

"""
UNGUARDED = TRAIN + "\ntrain()\n"
# The wrapper stays referenced to the end: its workers are closed at the interpreter's exit.
GUARDED = TRAIN + '\nif __name__ == "__main__":\n    wrapper = train()\n'
ADVICE = 'wrap the training code of train.py in `if __name__ == "__main__":`'
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


class Run:
    """``python SCRIPT`` in a session of its own (its workers join it), run to its end."""

    def __init__(self, script: Path):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=script.parent, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            self.stdout, self.stderr = proc.communicate(timeout=120)  # a program that cannot exit fails here
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        self.pid, self.returncode = proc.pid, proc.returncode


def _session_left(pid: int) -> list[int]:
    """Processes still in the session the script led (its workers, had they outlived it)."""
    left = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if fields[0] != "Z" and int(fields[3]) == pid:
            left.append(int(entry))
    return left


def test_fit_at_the_top_level_of_a_script_says_what_to_add_before_starting_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED)
    proc = Run(script)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    line = UNGUARDED.splitlines().index("train()") + 1
    assert last.startswith(f"dl4py.errors.ConfigError: train.py, line {line}: ParallelWrapper.fit is reached from the "
                           "top level of the script: " + ADVICE), last
    assert "exited with code" not in proc.stderr and "bootstrapping phase" not in proc.stderr  # no worker started


@pytest.mark.slow
def test_a_worker_that_reaches_fit_while_importing_the_script_is_named_as_the_cause(tmp_path):
    # A compiled script has no source to read, so the check before spawning cannot see the
    # missing guard: the workers find it, each while importing the script, and say so.
    source = tmp_path / "train.py"
    source.write_text(UNGUARDED)
    compiled = tmp_path / "train.pyc"
    py_compile.compile(str(source), cfile=str(compiled), doraise=True)
    source.unlink()
    proc = Run(compiled)
    assert proc.returncode == 1
    assert ("ParallelWrapper.fit was reached while a worker process was importing the main script: "
            'wrap the training code of train.pyc in `if __name__ == "__main__":`') in proc.stderr
    error = next(line for line in proc.stderr.splitlines() if line.startswith("dl4py.errors.WorkerError"))
    assert error.startswith("dl4py.errors.WorkerError: worker 0 (device cpu) failed: exited with code 1 while "
                            "starting, before it ran any of dl4py's code"), error
    assert "bootstrapping phase" not in proc.stderr  # multiprocessing's riddle is not what the user reads


@pytest.mark.slow
def test_a_guarded_script_trains_and_its_unclosed_workers_end_with_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(GUARDED)
    proc = Run(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained 2 epochs; worker starts: 1" in proc.stdout
    time.sleep(0.5)
    assert _session_left(proc.pid) == []
