"""The ParallelWrapper's workers live across fits: started once, given each fit's model as
it is, and started afresh after a failure or when a fit needs other processes."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from dl4py import ArrayDataSetIterator, DataSet, MultiLayerNetwork
from dl4py.errors import TrainingError, WorkerError
from dl4py.nn.serialization import model_bytes, restore_state
from dl4py.parallel import EarlyStoppingParallelTrainer, ParallelWrapper
from dl4py.train.early_stopping import DataSetLossCalculator, EarlyStoppingConfiguration, MaxEpochs
from dl4py.train.early_stopping.conditions import IterationTerminationCondition

from toy import DiesInItsThirdBatch, mlp, toy  # noqa: E402

BATCH, BATCHES = 16, 8  # 4 rounds of two workers an epoch


def _parameters(net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


def _no_workers_left() -> bool:
    return multiprocessing.active_children() == []


def test_repeated_fits_reuse_the_workers_and_train_the_model_as_it_is_then():
    x, y = toy(BATCH * BATCHES)
    data = ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=True, seed=1)
    net = MultiLayerNetwork(mlp(), backend="cpu")
    with ParallelWrapper(net, workers=2, averaging_frequency=3) as wrapper:
        wrapper.fit(data)
        pids, after_first = wrapper._pool.pids, model_bytes(net)
        wrapper.fit(data)
        after_second = _parameters(net)
        restore_state(net, after_first)  # the user takes the model back one fit
        wrapper.fit(data)  # trains the model as it is now, not as the workers left it
        assert wrapper._pool.starts == 1 and wrapper._pool.pids == pids
        assert _same(_parameters(net), after_second)
        assert (net.epoch_count, net.iteration_count) == (2, 2 * BATCHES)
    assert _no_workers_left()

    # Two fits of one epoch train as one fit of two.
    reference = MultiLayerNetwork(mlp(), backend="cpu")
    ParallelWrapper(reference, workers=2, averaging_frequency=3).fit(data, epochs=2)
    assert _same(_parameters(reference), after_second)


class PlainIterator:
    """A user iterator: its batches are dealt by the coordinator through the workers' inboxes.
    From batch ``slow_from`` on, each takes a while to read."""

    def __init__(self, x, y, slow_from=None):
        self.x, self.y, self.slow_from = x, y, slow_from

    def __len__(self):
        return len(self.x) // BATCH

    def __iter__(self):
        for index, i in enumerate(range(0, len(self.x), BATCH)):
            if self.slow_from is not None and index >= self.slow_from:
                time.sleep(0.3)
            yield DataSet(self.x[i:i + BATCH], self.y[i:i + BATCH])


class StopAtStep(IterationTerminationCondition):
    """Fires at a worker's ``step``-th step of the fit: a stop in the middle of an epoch."""

    def __init__(self, step):
        self.step = step

    def initialize(self):
        self.count = 0

    def terminate(self, score):
        self.count += 1
        return self.count >= self.step

    def __str__(self):
        return f"StopAtStep({self.step})"


def _numbered(first: int):
    """Toy data whose feature 0 is the example's number, from ``first`` on."""
    x, y = toy(BATCH * BATCHES, seed=first)
    x[:, 0] = torch.arange(first, first + len(x), dtype=torch.float32)
    return x, y


@pytest.mark.parametrize("prefetch_buffer, slow_from", [(0, None), (1, 4)], ids=["batches left", "reader left"])
def test_a_fit_after_a_mid_epoch_stop_reads_only_its_own_dealt_batches(prefetch_buffer, slow_from):
    # The stopped fit leaves batches in the inboxes (its feeder was ahead) or, when its
    # feeder was behind, a prefetch thread waiting on an inbox; the next fit must train
    # its own batches, each once, and none of the stopped fit's.
    old, new = _numbered(0), _numbered(1000)
    config = EarlyStoppingConfiguration(score_calculator=DataSetLossCalculator(ArrayDataSetIterator(*old, 64)),
                                        epoch_conditions=[MaxEpochs(5)], iteration_conditions=[StopAtStep(2)])
    net = MultiLayerNetwork(mlp(), backend="cpu")
    with EarlyStoppingParallelTrainer(config, net, PlainIterator(*old, slow_from), workers=2,
                                      prefetch_buffer=prefetch_buffer) as trainer:
        result = trainer.fit()
        assert result.termination_details.startswith("StopAtStep(2)")
        assert (net.epoch_count, net.batch_in_epoch) == (0, 4)  # two rounds of two workers
        trainer.wrapper.fit(PlainIterator(*new), _record_examples=True)  # continues the epoch at batch 4
        seen = sorted(int(v) for records in trainer.wrapper.last_records.values() for v in records)
        assert seen == list(range(1000 + 4 * BATCH, 1000 + BATCHES * BATCH))
        assert trainer.wrapper._pool.starts == 1
    assert _no_workers_left()


class UnreadableAfterTwoBatches(PlainIterator):
    def __iter__(self):
        for index, batch in enumerate(super().__iter__()):
            if index == 2:
                raise RuntimeError("the disk went away")
            yield batch


def test_a_fit_after_a_failure_or_with_other_workers_starts_fresh_ones():
    x, y = toy(BATCH * BATCHES * 4)
    net = MultiLayerNetwork(mlp(), backend="cpu")
    wrapper = ParallelWrapper(net, workers=2, prefetch_buffer=0)
    with pytest.raises(WorkerError, match=r"worker 1 \(device cpu\) failed: was killed by SIGKILL"):
        wrapper.fit(DiesInItsThirdBatch(x, y, batch_size=BATCH), epochs=5)
    assert _no_workers_left()  # a failed fit leaves no worker behind

    data = ArrayDataSetIterator(x, y, batch_size=BATCH)
    wrapper.fit(data)
    assert wrapper._pool.starts == 2 and net.epoch_count == 1
    pids = wrapper._pool.pids
    wrapper.parallelism = {"kind": "data", "sync": "shared_gradients"}  # the next fit starts its own workers
    wrapper.fit(data)
    assert wrapper._pool.starts == 3 and set(wrapper._pool.pids).isdisjoint(pids) and net.epoch_count == 2

    # A failure in this process, the workers alive and waiting for batches: they go too.
    with pytest.raises(TrainingError, match="reading batches for the workers failed: RuntimeError"):
        wrapper.fit(UnreadableAfterTwoBatches(x, y))
    assert _no_workers_left()
    wrapper.close()  # closing a closed pool is harmless


def test_the_epoch_decision_is_awaited_even_after_a_stop_in_the_epochs_last_round(tmp_path):
    # Worker 0's relay has sent the epoch's end and the coordinator answers it: unread, that
    # answer would be the first one the pool's next fit reads.
    import torch.distributed as dist

    from dl4py.config.parallel import ParallelOptions
    from dl4py.parallel.rank import run_rank
    from dl4py.parallel.sources import ShardedSource
    from dl4py.parallel.worker import WorkerSpec

    x, y = toy(BATCH)
    net = MultiLayerNetwork(mlp(), backend="cpu").init()
    source = ShardedSource(ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False))  # one round an epoch
    spec = WorkerSpec(model_file=model_bytes(net), torch_model=None, source=source, num_batches=1, epochs=3,
                      options=ParallelOptions(), devices=["cpu"], precision="float", early_stopping=True)
    asked = []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        report = run_rank(0, 1, spec, source, should_stop=lambda: True,
                          decide=lambda replica: asked.append(replica.epoch_count - 1))
    finally:
        dist.destroy_process_group()
    assert report.interrupted and [s.completed for s in report.summaries] == [True]
    assert asked == [0]


def _loss_reading_the_environment(outputs, labels):
    """Fails in a worker that does not have the coordinator's variables of this fit."""
    if os.environ.get("DL4PY_TEST_POOL_MARKER") != "set after the first pool":
        raise RuntimeError("the worker does not see DL4PY_TEST_POOL_MARKER")
    return torch.nn.functional.cross_entropy(outputs, labels)


def test_workers_get_the_coordinators_environment_as_it_is_when_they_start(monkeypatch):
    """On Linux workers are forked from a forkserver started with the first pool: they must
    still see the variables set since, as spawned workers would."""
    from dl4py import TorchModel

    x, y = toy(64)
    ParallelWrapper(MultiLayerNetwork(mlp(), backend="cpu"), workers=2).fit(
        ArrayDataSetIterator(x, y, batch_size=BATCH), epochs=1)  # the forkserver runs from here on
    monkeypatch.setenv("DL4PY_TEST_POOL_MARKER", "set after the first pool")
    model = TorchModel(torch.nn.Linear(5, 3), loss=_loss_reading_the_environment,
                       optimizer=_sgd, backend="cpu")
    ParallelWrapper(model, workers=2).fit(ArrayDataSetIterator(x, y, batch_size=BATCH), epochs=1)
    assert model.iteration_count == 4


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)
