"""ParallelWrapper on CPU worker processes (gloo): exactness, coverage, accuracy, faults.

The exactness and coverage tests run on a GPU too: there two workers share cuda:0 (gloo,
as NCCL refuses two ranks on one device), against a reference on the same GPU."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from dl4py import (
    ArrayDataSetIterator,
    MnistDataSetIterator,
    MultiLayerNetwork,
    RunConfig,
    TorchModel,
)
from devices import backend_for, on_devices, tolerance
from dl4py.errors import ConfigError, WorkerError
from dl4py.parallel import ParallelPlan, ParallelWrapper

from toy import mlp, toy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def mean_gradient_steps(module, loss, batches, workers, lr):
    """One process: each round, step ``module`` on the mean gradient of the round's batches."""
    params = list(module.parameters())
    for start in range(0, len(batches), workers):
        grads = []
        for x, y in batches[start:start + workers]:
            module.zero_grad()
            loss(module(x), y).backward()
            grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                p -= lr * torch.stack([g[i] for g in grads]).mean(0)
    return module


def one_gpu(device: str) -> dict:
    """The wrapper's devices: on a GPU both workers on cuda:0, whatever the machine has."""
    return {"devices": ["cuda:0"]} if device == "cuda" else {}


@on_devices
@pytest.mark.parametrize("mode", ["averaging", "shared_gradients"])
def test_matches_a_single_process_on_the_mean_gradient(mode, device):
    x, y = toy(88)  # 11 batches of 8: 5 full rounds and one with worker 0 alone
    data = ArrayDataSetIterator(x, y, batch_size=8, shuffle=False)
    batches = [(x[i:i + 8].to(device), y[i:i + 8].to(device)) for i in range(0, 88, 8)]
    reference = MultiLayerNetwork(mlp(), backend=backend_for(device)).init()
    expected = mean_gradient_steps(reference.module, reference.loss, batches, workers=2, lr=0.1)

    net = MultiLayerNetwork(mlp(), backend=backend_for(device))
    options = {"averaging_frequency": 1} if mode == "averaging" else {}
    summaries = ParallelWrapper(net, workers=2, parallelism=ParallelPlan.from_training_mode(mode), **options, **one_gpu(device)).fit(data, epochs=1)
    assert summaries[0].batches == 11 and summaries[0].examples == 88
    for (name, a), b in zip(net.module.named_parameters(), expected.parameters()):
        assert a.device.type == device, name
        assert torch.allclose(a.cpu(), b.cpu(), **tolerance(device, cpu=1e-5)), name
    assert net.epoch_count == 1 and net.iteration_count == 11


class PlainIterator:
    """A user iterator that is not one of dl4py's: it goes through the bounded queues."""

    def __init__(self, x, y, batch_size):
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __iter__(self):
        from dl4py import DataSet

        for i in range(0, len(self.x), self.batch_size):
            yield DataSet(self.x[i:i + self.batch_size], self.y[i:i + self.batch_size])


@on_devices
@pytest.mark.parametrize("kind", ["built-in", "user iterator"])
def test_every_example_is_trained_exactly_once_per_epoch(kind, device):
    n = 1000
    x, y = toy(n, seed=1)
    x[:, 0] = torch.arange(n, dtype=torch.float32)  # feature 0 names the example
    if kind == "built-in":
        data = ArrayDataSetIterator(x, y, batch_size=64, shuffle=True, seed=5)  # 16 batches
    else:
        data = PlainIterator(x, y, batch_size=64)
    wrapper = ParallelWrapper(MultiLayerNetwork(mlp(lr=0.001), backend=backend_for(device)), workers=3, prefetch_buffer=2,
                              **one_gpu(device))
    wrapper.fit(data, epochs=1, _record_examples=True)
    seen = [int(v) for records in wrapper.last_records.values() for v in records]
    counts = torch.bincount(torch.tensor(seen), minlength=n)
    assert len(seen) == n and bool((counts == 1).all())
    # 16 batches over 3 workers: 6 rounds, the last with worker 0 alone
    assert [len(wrapper.last_records[r]) for r in range(3)] == [6 * 64 - 24, 5 * 64, 5 * 64]


@pytest.mark.soak  # long for make test's budget: make soak runs it (DEVELOPERS.md)
def test_lenet_two_workers_matches_single_worker_accuracy(mnist):
    """The seed's set-up (2 workers, averaging every 3 rounds), with the learning rate 20%
    higher for data-parallel training as DL4J's guide advises; same epochs as one worker."""
    run = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml")
    lr = run.network.updater.learning_rate
    train = MnistDataSetIterator(128, train=True, seed=12345, limit=12_800)
    test = MnistDataSetIterator(1000, train=False, shuffle=False, limit=5000)
    single = MultiLayerNetwork(run.network, backend="cpu")
    single.fit(train, epochs=6)
    boosted = run.with_overrides([f"network.updater.learning_rate={lr * 1.2}"]).network
    parallel = MultiLayerNetwork(boosted, backend="cpu")
    ParallelWrapper(parallel, workers=2, averaging_frequency=3, prefetch_buffer=24).fit(train, epochs=6)
    single_acc, parallel_acc = single.evaluate(test).accuracy(), parallel.evaluate(test).accuracy()
    assert single_acc > 0.95
    assert abs(parallel_acc - single_acc) <= 0.005, (single_acc, parallel_acc)


class FaultyIterator(ArrayDataSetIterator):
    """Makes worker 1 fail in its third batch: by raising, or by being killed."""

    fault = "raise"

    def _batch(self, indices):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == 1:
            self._served = getattr(self, "_served", 0) + 1
            if self._served == 3:
                if self.fault == "raise":
                    raise RuntimeError("disk on fire while reading a batch")
                os.kill(os.getpid(), signal.SIGKILL)
        return super()._batch(indices)


class KilledIterator(FaultyIterator):
    fault = "kill"


def _processes():
    """(pid, stat fields after the name, command line) of every live process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if fields[0] != "Z":
                yield int(entry), fields, cmdline


def _children() -> list[int]:
    """Live child processes of this test process, except Python's multiprocessing resource
    tracker and the forkserver workers are forked from: one each per interpreter, started by
    the first pool and kept until the interpreter exits; they are no workers."""
    return [pid for pid, fields, cmdline in _processes()
            if int(fields[1]) == os.getpid() and b"multiprocessing.resource_tracker" not in cmdline
            and b"multiprocessing.forkserver" not in cmdline]


@pytest.mark.parametrize("iterator_class, detail", [
    (FaultyIterator, "RuntimeError: disk on fire while reading a batch"),
    (KilledIterator, "was killed by SIGKILL"),
])
def test_a_failing_worker_stops_fit_naming_it(iterator_class, detail):
    x, y = toy(4096)
    data = iterator_class(x, y, batch_size=16, shuffle=False)
    net = MultiLayerNetwork(mlp(), backend="cpu")
    before = [p.detach().clone() for p in net.init().module.parameters()]
    with pytest.raises(WorkerError, match=r"worker 1 \(device cpu\) failed") as info:
        ParallelWrapper(net, workers=2, prefetch_buffer=0).fit(data, epochs=50)
    # The worker's own error or its death, seen as such: not a peer's watchdog timing out on it.
    assert detail in str(info.value) and "did not arrive" not in str(info.value)
    assert info.value.rank == 1
    assert multiprocessing.active_children() == [] and _children() == []
    assert all(torch.equal(a, b) for a, b in zip(before, net.module.parameters()))  # untouched


def test_options_that_cannot_apply_are_errors():
    net = MultiLayerNetwork(mlp())
    with pytest.raises(ConfigError, match="averaging_frequency: applies to the data plan with averaging only"):
        ParallelWrapper(net, parallelism={"kind": "data", "sync": "shared_gradients"}, averaging_frequency=3)
    with pytest.raises(ConfigError, match="average_updaters: applies to the data plan with averaging"):
        ParallelWrapper(net, parallelism={"kind": "data", "sync": "shared_gradients"}, average_updaters=False)
    with pytest.raises(ConfigError, match="report_score_after_averaging: applies"):
        ParallelWrapper(net, parallelism={"kind": "data", "sync": "shared_gradients"},
                        report_score_after_averaging=True)
    with pytest.raises(ConfigError, match="parallelism: must be one of data, sharded, tensor, hybrid; got 'async'"):
        ParallelWrapper(net, parallelism="async")
    with pytest.raises(ConfigError, match="training_mode: must be one of averaging, shared_gradients"):
        ParallelWrapper(net, training_mode="async")  # an earlier spelling, still checked
    with pytest.raises(ConfigError, match="workers: must be a positive integer, got 0"):
        ParallelWrapper(net, workers=0)
    with pytest.raises(ConfigError, match="prefetch_buffer: must be an integer >= 0"):
        ParallelWrapper(net, prefetch_buffer=-1)
    with pytest.raises(ConfigError, match=r"devices\[1\]: names no GPU: give its index"):
        ParallelWrapper(net, devices=["cuda:0", "cuda"])
    with pytest.raises(ConfigError, match=r"devices\[0\]: must be cpu, cuda:N or a GPU index, got 'gpu7'"):
        ParallelWrapper(net, devices=["gpu7"])
    assert ParallelWrapper(net, devices=[1, "cpu:0", torch.device("cuda", 0)]).devices == ["cuda:1", "cpu", "cuda:0"]
    with pytest.raises(ConfigError, match="cuda:0 is not usable"):
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        ParallelWrapper(net, devices=["cuda:0"], workers=2).fit(ArrayDataSetIterator(*toy(64), batch_size=8))


def test_process_groups_use_nccl_only_for_one_process_per_gpu():
    rule = ParallelWrapper._process_group_backend
    assert rule(["cuda:0", "cuda:1"], 2) == "nccl"
    assert rule(["cuda:0", "cuda:1"], 4) == "gloo"  # two workers per GPU: NCCL would refuse the duplicate
    assert rule(["cuda:0"], 2) == "gloo" and rule(["cpu"], 2) == "gloo"


def test_updater_state_on_another_device_travels_in_its_own_bucket():
    # torch keeps RMSprop's (and unfused Adam's) step counts on the CPU beside CUDA
    # parameters; one flat buffer cannot hold both, and NCCL moves CUDA tensors only.
    from dl4py.parallel.averaging import _buckets

    weight, step, elsewhere = torch.zeros(3), torch.zeros(()), torch.zeros(2, device="meta")
    wide = torch.zeros(2, dtype=torch.float64)
    buckets = _buckets([weight, elsewhere, step, wide])
    assert [[t.device.type for t in b] for b in buckets] == [["cpu", "cpu"], ["meta"], ["cpu"]]
    assert buckets[0][1] is step and buckets[2][0] is wide


def _cross_entropy(outputs, labels):
    return torch.nn.functional.cross_entropy(outputs, labels)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _sgd_half(params):
    return torch.optim.SGD(params, lr=0.5)


@on_devices
def test_plain_torch_module_replicas_are_private_copies(device):
    # Spawn's pickler would share the parent's tensors with every worker (shared memory; CUDA
    # IPC on a GPU): replicas on one device would all step the same weights. Each must be its
    # own copy, so that two workers equal one process stepping on the mean gradient.
    x, y = toy(64)
    torch.manual_seed(1)
    module = torch.nn.Linear(5, 3)
    reference = torch.nn.Linear(5, 3)
    reference.load_state_dict(module.state_dict())
    reference.to(device)
    # A round: two batches, one per worker.
    batches = [(x[b:b + 16].to(device), y[b:b + 16].to(device)) for b in range(0, 64, 16)]
    mean_gradient_steps(reference, _cross_entropy, batches, workers=2, lr=0.5)
    model = TorchModel(module, loss=_cross_entropy, optimizer=_sgd_half, backend=backend_for(device))
    ParallelWrapper(model, workers=2, parallelism={"kind": "data", "sync": "shared_gradients"}, **one_gpu(device)).fit(
        ArrayDataSetIterator(x, y, batch_size=16, shuffle=False), epochs=1)
    for a, b in zip(model.module.parameters(), reference.parameters()):
        assert a.device.type == device
        assert torch.allclose(a.cpu(), b.cpu(), **(tolerance(device) if device == "cuda" else {"atol": 1e-6}))


@on_devices
def test_plain_torch_module_trains_in_parallel(device):
    x, y = toy(512)
    torch.manual_seed(0)  # the module's initial weights: the same whatever ran before
    module = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model = TorchModel(module, loss=_cross_entropy, optimizer=_sgd, backend=backend_for(device))
    before = model.score((x, y))
    ParallelWrapper(model, workers=2, **one_gpu(device)).fit(ArrayDataSetIterator(x, y, batch_size=32), epochs=3)
    assert model.score((x, y)) < 0.8 * before
    lambda_model = TorchModel(torch.nn.Linear(5, 3), loss=_cross_entropy, optimizer=lambda p: _sgd(p))
    with pytest.raises(ConfigError, match="must be picklable"):
        ParallelWrapper(lambda_model, workers=2).fit(ArrayDataSetIterator(x, y, batch_size=32))


def _session_processes(sid: int) -> list[int]:
    return [pid for pid, fields, _ in _processes() if int(fields[3]) == sid]  # fields[3]: session id


def _session_workers(sid: int) -> list[int]:
    """The workers of the coordinator ``sid`` (a session leader): spawned, or forked by its
    forkserver (whose own parent is the coordinator)."""
    return [pid for pid, fields, cmdline in _processes() if int(fields[3]) == sid and (
        b"spawn_main" in cmdline or (b"multiprocessing.forkserver" in cmdline and int(fields[1]) != sid))]


@pytest.mark.slow
def test_ctrl_c_stops_every_worker():
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "ctrl_c_train.py")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_session_workers(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_session_workers(proc.pid)) == 2, "workers did not start"
        time.sleep(2.0)  # let them train
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        output = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output[-2000:]
    assert "interrupted: parallel training stopped by Ctrl-C; every worker was stopped" in output
    time.sleep(0.5)
    assert _session_processes(proc.pid) == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["shared_gradients", pytest.param("averaging", marks=pytest.mark.soak)])
def test_history_training_accuracy_counts_every_workers_batches(mode):
    # A learning rate far below float32's resolution of the weights leaves them as they are:
    # every batch of every worker meets the initial model, so History's "accuracy" must be that
    # model's accuracy on the whole training set (11 batches: worker 0 trains 6, worker 1 5).
    x, y = toy(88)
    config = mlp(lr=1e-12)
    expected = MultiLayerNetwork(config).init().evaluate(ArrayDataSetIterator(x, y, batch_size=88)).accuracy()
    net = MultiLayerNetwork(config)
    options = {"averaging_frequency": 2} if mode == "averaging" else {}
    history = ParallelWrapper(net, workers=2, parallelism=ParallelPlan.from_training_mode(mode), **options).fit(
        ArrayDataSetIterator(x, y, batch_size=8, shuffle=False), epochs=2, verbose=0)
    assert history.history["accuracy"] == [pytest.approx(expected, abs=1e-12)] * 2
    assert 0.1 < expected < 0.9  # an untrained model: the count is not trivially all or none
