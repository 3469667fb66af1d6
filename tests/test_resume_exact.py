"""Resume is exact: N steps, a stop, a fresh process, the rest == the run without the stop.

torchtitan's two-run test, for the plans a user can pick (one device; the averaging,
shared-gradients, sharded, tensor and hybrid modes on 2 workers), each with the precisions
it takes (float, bfloat16, mixed-fp16; tensor and hybrid refuse master weights and loss
scaling at the start, so their 16-bit case is mixed-bf16) and two kinds of data (Parquet
files streamed by a TableDirectoryIterator, a shuffling torch DataLoader). The network has
dropout and Adam; the loss scale changes often. ``resume_exact_run.py`` runs each phase in
a process of its own: the reference, the run stopped by a real Ctrl-C mid-way through its
second epoch (side by side), then the resumed run in a fresh process. The resumed run's
parameters, master weights, updater state, loss scaler, counters and score, and the loss of
every iteration of both parts, must equal the reference's bit for bit.

The default suite runs every precision and kind on one device and each parallel plan once
(together covering every fix); the whole matrix is ``slow``. On a GPU (``gpu`` marker): every
precision and kind on one device (a CUDA GradScaler's state; dropout from the GPU's generator,
seeded per batch) and the averaging and shared-gradients plans, whose two workers share cuda:0
(gloo), bit for bit as on the CPU. Then, in this process: what cannot be replayed is refused
before training, a DataLoader's own generator, and the ``--resume`` line that says what was
restored, the last three on each device.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, Sampler, TensorDataset

from devices import backend_for, on_devices
from dl4py import DataError, load
from dl4py.config.run import RunConfig
from dl4py.nn.model_file import read_model_file
from dl4py.nn.serialization import model_bytes
from dl4py.parallel import ParallelWrapper
from dl4py.runner import train_run
from dl4py.train import TrainingInterrupted
from dl4py.train.listeners import TrainingListener
from resume_exact_run import BATCH, EPOCHS, ROWS, STOP_AT, case_folder, network, toy_rows, write_table

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("resume_exact_run.py")
PHASE_TIMEOUT = 600  # s a phase (several cases, each starting its workers) may take on a loaded machine

DATA = ("stream", "loader")
PRECISIONS = {"single": ("float", "bfloat16", "mixed-fp16"), "averaging": ("float", "bfloat16", "mixed-fp16"),
              "shared_gradients": ("float", "bfloat16", "mixed-fp16"), "sharded": ("float", "bfloat16", "mixed-fp16"),
              "tensor": ("float", "mixed-bf16"), "hybrid": ("float", "mixed-bf16")}
MATRIX = [f"{plan}:{precision}:{data}" for plan, precisions in PRECISIONS.items() for precision in precisions
          for data in DATA]
# Each parallel plan once, chosen so that every fix is in the default suite: the workers'
# loss scales made one at each average, the coordinator's seeded reading of a DataLoader, the
# sharded twin's loss scale, a tensor group's shared batches, the step modes' score.
FAST = [case for case in MATRIX if case.startswith("single:")] + [
    "averaging:mixed-fp16:loader", "shared_gradients:float:loader", "sharded:mixed-fp16:stream",
    "tensor:float:loader", "hybrid:float:stream"]
SLOW = [case for case in MATRIX if case not in FAST]
# The sharded, tensor and hybrid plans are left out on a GPU: with two workers on one GPU they
# would run over gloo, which the machines they are meant for (a GPU per worker, NCCL) do not.
CUDA = [f"{case}:cuda" for case in FAST if case.startswith("single:")] + [
    "averaging:mixed-fp16:loader:cuda", "shared_gradients:float:stream:cuda"]
ON_DEVICES = [pytest.param(case, id=case) for case in FAST] + [
    pytest.param(case, id=case, marks=pytest.mark.gpu) for case in CUDA]


def _start(phase: str, folder: Path, cases: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, str(SCRIPT), phase, str(folder), *cases], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _finish(proc: subprocess.Popen, phase: str) -> None:
    try:
        _, err = proc.communicate(timeout=PHASE_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {phase} phase took over {PHASE_TIMEOUT} s")
    if proc.returncode != 0:
        pytest.fail(f"the {phase} phase failed ({proc.returncode}):\n{err[-3000:]}")


def _end(proc: subprocess.Popen) -> None:
    """A phase still running (over its time, or the test failed) is killed with its session:
    its workers; one that has ended took its workers with it (they die with their parent)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def two_runs(folder: Path, cases: list[str]) -> None:
    """The three phases for ``cases`` in ``folder``: the reference and the stopped run side by
    side, then the resumed one."""
    write_table(folder / "table")
    started = [_start("reference", folder, cases), _start("first", folder, cases)]
    try:
        for proc, phase in zip(started, ("reference", "first")):
            _finish(proc, phase)
        started.append(_start("resume", folder, cases))
        _finish(started[-1], "resume")
    finally:
        for proc in started:
            _end(proc)


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("resume-fast")
    two_runs(folder, FAST)
    return folder


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("resume-cuda")
    two_runs(folder, CUDA)
    return folder


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("resume-slow")
    two_runs(folder, SLOW)
    return folder


def _differences(reference: Path, resumed: Path) -> list[str]:
    """What differs, bit for bit, between two model files."""
    a, b = read_model_file(reference), read_model_file(resumed)
    found = [f"{name} differs" for name in ("weights", "masters", "updater")
             if not _same(getattr(a, name), getattr(b, name))]
    for key in ("epoch_count", "iteration_count", "batch_in_epoch", "update_count", "scaler", "score"):
        if a.meta.get(key) != b.meta.get(key):
            found.append(f"{key} is {a.meta.get(key)} uninterrupted, {b.meta.get(key)} resumed")
    return found


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def assert_resumed_exactly(folder: Path, case: str) -> None:
    out = case_folder(folder, case)
    stopped = read_model_file(out / "checkpoint.dl4py").meta
    per_epoch = ROWS // BATCH
    # Mid-way through the second epoch: its first batches are read again and skipped.
    assert stopped["epoch_count"] == 1 and 0 < stopped["batch_in_epoch"] < per_epoch, stopped
    assert _differences(out / "reference.dl4py", out / "resume.dl4py") == []
    reference = json.loads((out / "reference.json").read_text())
    resumed = json.loads((out / "first.json").read_text()) + json.loads((out / "resume.json").read_text())
    assert resumed == reference  # every iteration's loss, the stopped run's and the resumed run's
    assert reference[-1][0] == EPOCHS * per_epoch


@pytest.mark.slow
@pytest.mark.timeout(2 * PHASE_TIMEOUT + 60)  # includes the module's runs, when this case is the first
@pytest.mark.parametrize("case", ON_DEVICES)
def test_a_run_stopped_and_resumed_in_a_fresh_process_is_the_run_without_the_stop(request, case):
    runs = request.getfixturevalue("cuda_runs" if case.endswith(":cuda") else "fast_runs")
    assert_resumed_exactly(runs, case)


@pytest.mark.soak
@pytest.mark.timeout(2 * PHASE_TIMEOUT + 60)
@pytest.mark.parametrize("case", SLOW)
def test_every_plan_precision_and_data_resumes_exactly(slow_runs, case):
    assert_resumed_exactly(slow_runs, case)


# ---- in this process: what cannot be replayed, a loader's own generator, the resume line ----

class StopAt(TrainingListener):
    """Asks the fit to stop after iteration ``at`` (the model keeps its place in the epoch)."""

    def __init__(self, at: int):
        self.at = at

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if iteration == self.at:
            model.request_stop("test")


class CtrlCAt(TrainingListener):
    def __init__(self, at: int):
        self.at = at

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if iteration == self.at:
            os.kill(os.getpid(), signal.SIGINT)


def _stopped_model(data, precision: str = "float", device: str = "cpu"):
    model = network(precision, device)
    model.fit(data, epochs=EPOCHS, listeners=[StopAt(STOP_AT)], verbose=0)
    assert (model.epoch_count, model.batch_in_epoch) == (1, STOP_AT - ROWS // BATCH)
    return model


class Reversed(Sampler):
    """A sampler of the user's, with nothing that says its order is the same when read again."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class ReversedByEpoch(Reversed):
    def set_epoch(self, epoch: int) -> None:  # the promise: the order depends on the epoch alone
        self.epoch = epoch


def test_a_dataloader_that_cannot_replay_its_epoch_is_refused_before_training():
    dataset = TensorDataset(*toy_rows())
    model = _stopped_model(DataLoader(dataset, batch_size=BATCH, shuffle=True))
    before = model_bytes(model)
    kept = DataLoader(dataset, batch_size=BATCH, num_workers=1, persistent_workers=True)
    with pytest.raises(DataError, match=r"cannot continue epoch 2 after batch 10: the DataLoader keeps its worker "
                                        r"processes \(persistent_workers=True\)"):
        model.fit(kept, epochs=1, verbose=0)
    with pytest.raises(DataError, match="cannot continue epoch 2 after batch 10: the DataLoader's Reversed may give "
                                        "another order each time it is read.*set_epoch"):
        model.fit(DataLoader(dataset, batch_size=BATCH, sampler=Reversed(ROWS)), epochs=1, verbose=0)
    assert model_bytes(model) == before  # refused before a step
    model.fit(DataLoader(dataset, batch_size=BATCH, sampler=ReversedByEpoch(ROWS)), epochs=1, verbose=0)
    assert (model.epoch_count, model.iteration_count) == (2, EPOCHS * ROWS // BATCH)


@pytest.mark.timeout(60)
def test_averaging_without_averaged_updaters_refuses_to_continue_an_epoch_before_any_worker_starts():
    model = _stopped_model(DataLoader(TensorDataset(*toy_rows()), batch_size=BATCH, shuffle=True))
    with ParallelWrapper(model, workers=2, average_updaters=False) as wrapper:
        with pytest.raises(DataError, match="cannot continue epoch 2 after batch 10: with average_updaters=False "
                                            "each worker keeps its own updater state"):
            wrapper.fit(DataLoader(TensorDataset(*toy_rows()), batch_size=BATCH), epochs=1, verbose=0)
        assert wrapper._pool.starts == 0


@on_devices
def test_a_dataloaders_own_generator_gives_the_resumed_epoch_its_order(device):
    """A fresh process's loader has a fresh generator, seeded as the first run's was: the epoch
    it resumes is shuffled as the first run's second epoch was, not as its first."""
    def loader():
        return DataLoader(TensorDataset(*toy_rows()), batch_size=BATCH, shuffle=True,
                          generator=torch.Generator().manual_seed(7))

    straight = network("float", device)
    straight.fit(loader(), epochs=EPOCHS, verbose=0)
    resumed = load(model_bytes(_stopped_model(loader(), device=device)), backend=backend_for(device))
    resumed.fit(loader(), epochs=1, verbose=0)
    assert _same(straight.module.state_dict(), resumed.module.state_dict())
    per_epoch, same_loader = network("float", device), loader()  # a fit per epoch (DL4J's loop), on one loader
    for _ in range(EPOCHS):
        per_epoch.fit(same_loader, epochs=1, verbose=0)
    assert _same(straight.module.state_dict(), per_epoch.module.state_dict())


def test_a_loaders_generator_needs_no_weak_reference_and_few_are_remembered(monkeypatch):
    """torch 2.11's Generator takes no weak reference (on the first GPU run: a TypeError at
    the first epoch of any fit on a DataLoader with a generator): here weak references to a
    generator fail as they did there, and a fit still resumes its order. dl4py remembers at
    most ``REMEMBERED_GENERATORS`` generators; one it reseeds again counts from its first seed."""
    import weakref

    from dl4py.data import batch_stream

    real = weakref.ref

    class NoneToGenerators(real):  # weakref's own classes (KeyedRef) call ref.__new__ too
        def __new__(cls, obj, *callback):
            if isinstance(obj, torch.Generator):
                raise TypeError(f"cannot create weak reference to {type(obj).__name__!r} object")
            return real.__new__(cls, obj, *callback)

    monkeypatch.setattr(weakref, "ref", NoneToGenerators)
    straight = network("float", "cpu")
    straight.fit(DataLoader(TensorDataset(*toy_rows()), batch_size=BATCH, shuffle=True,
                            generator=torch.Generator().manual_seed(7)), epochs=2, verbose=0)
    assert straight.epoch_count == 2
    generators = [torch.Generator().manual_seed(seed) for seed in range(batch_stream.REMEMBERED_GENERATORS + 5)]
    for generator in generators:
        batch_stream._reseed(generator, 1)
    assert len(batch_stream._FIRST_SEEDS) == batch_stream.REMEMBERED_GENERATORS
    last = generators[-1]
    batch_stream._reseed(last, 3)
    assert last.initial_seed() == len(generators) - 1 + 3


class Augmented(TensorDataset):
    """Noise from numpy's and python's global generators on every example it gives."""

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x + float(np.random.normal(scale=0.1)) + random.uniform(-0.1, 0.1), y


@on_devices
def test_a_dataset_drawing_from_numpy_and_python_generators_resumes_exactly(device):
    def loader():
        return DataLoader(Augmented(*toy_rows()), batch_size=BATCH, shuffle=True)

    straight = network("float", device)
    straight.fit(loader(), epochs=EPOCHS, verbose=0)
    stopped = model_bytes(_stopped_model(loader(), device=device))
    np.random.seed(1)  # whatever the generators hold where the run goes on: a fresh process's, a later call's
    random.seed(1)
    resumed = load(stopped, backend=backend_for(device))
    resumed.fit(loader(), epochs=1, verbose=0)
    assert _same(straight.module.state_dict(), resumed.module.state_dict())


def _csv_config(tmp_path: Path, precision: str, device: str) -> RunConfig:
    x, y = toy_rows()
    rows = "\n".join(",".join(f"{v:.6f}" for v in features) + f",{label}" for features, label in zip(x.tolist(),
                                                                                                   y.tolist()))
    (tmp_path / "toy.csv").write_text(rows + "\n")
    return RunConfig.from_dict(yaml.safe_load(f"""
network:
  seed: 5
  updater: {{type: adam, learning_rate: 0.01}}
  input_type: {{type: feed_forward, size: 5}}
  layers:
    - {{type: dropout, rate: 0.25}}
    - {{type: dense, n_out: 16, activation: tanh}}
    - {{type: output, n_out: 3, activation: softmax, loss: negativeloglikelihood}}
data: {{dataset: csv, train_path: {tmp_path / 'toy.csv'}, num_classes: 3, seed: 3}}
training: {{epochs: {EPOCHS}, batch_size: {BATCH}, backend: {backend_for(device)}, precision: {precision}, score_every: 0}}
"""))


@pytest.mark.parametrize("precision, restored", [
    ("float", "weights, updater state, RNG and data position restored"),
    ("mixed-fp16", "weights, updater state, loss scale, RNG and data position restored"),
], ids=["float", "mixed-fp16"])
@on_devices
def test_dl4py_train_resume_says_what_it_restored_and_ends_as_the_run_without_the_stop(
        tmp_path, monkeypatch, caplog, precision, restored, device):
    config = _csv_config(tmp_path, precision, device)
    train_run(config, tmp_path / "straight", progress=False)
    # The run stopped by a Ctrl-C after iteration STOP_AT, as a terminal's would.
    monkeypatch.setattr("dl4py.runner.console_listeners", lambda *args: [CtrlCAt(STOP_AT)])
    with pytest.raises(TrainingInterrupted):
        train_run(config, tmp_path / "run", progress=False)
    monkeypatch.undo()
    with caplog.at_level("INFO", logger="dl4py"):
        train_run(config, tmp_path / "run", resume=True, progress=False)
    per_epoch = ROWS // BATCH
    line = (f"resuming {tmp_path / 'run'} in epoch 2 after batch {STOP_AT - per_epoch} of {per_epoch} "
            f"(iteration {STOP_AT}); {restored}")
    assert line in caplog.messages
    assert _differences(tmp_path / "straight" / "model.dl4py", tmp_path / "run" / "model.dl4py") == []
