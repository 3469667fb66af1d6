"""One process is the degenerate case of the rank program: ``run_rank(0, 1, ...)`` trains
with no process group (``parallel/collectives.py`` answers every collective for one rank) and
gives what ``Model.fit`` gives on the same batches, bit for bit, for each way the data plan
meets (averaging, shared gradients), dropout and the updater's state included. No processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dl4py import (
    Adam,
    ArrayDataSetIterator,
    DenseLayer,
    DropoutLayer,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
)
from dl4py.config.parallel import ParallelOptions, ParallelPlan
from dl4py.nn.loading import load
from dl4py.nn.serialization import model_bytes
from dl4py.parallel.rank import run_rank
from dl4py.parallel.sources import ShardedSource
from dl4py.parallel.worker import WorkerSpec

from toy import toy  # noqa: E402

BATCH, EPOCHS = 8, 2


def network() -> MultiLayerNetwork:
    config = NetworkConfig(layers=[DenseLayer(n_out=16, activation="relu"), DropoutLayer(rate=0.25), OutputLayer(n_out=3)],
                           input_type=InputType.feed_forward(5), updater=Adam(0.01), seed=7)
    return MultiLayerNetwork(config, backend="cpu").init()


@pytest.mark.parametrize("plan", [ParallelPlan(), ParallelPlan("data", sync="shared_gradients")], ids=str)
def test_the_rank_program_alone_trains_as_fit_does_without_a_process_group(plan):
    x, y = toy(70)  # 9 batches, the last of 6
    alone, fitted = network(), network()
    source = ShardedSource(ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False))
    spec = WorkerSpec(model_file=model_bytes(alone), torch_model=None, source=source, num_batches=9, epochs=EPOCHS,
                      options=ParallelOptions(parallelism=plan).validate(), devices=["cpu"],
                      precision=alone.precision)
    report = run_rank(0, 1, spec, source, keep_state=True)
    assert not dist.is_initialized()
    fitted.fit(ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False), epochs=EPOCHS, verbose=0)
    trained = load(report.state, backend="cpu")
    assert [s.batches for s in report.summaries] == [9, 9]
    assert (trained.epoch_count, trained.iteration_count) == (fitted.epoch_count, fitted.iteration_count) == (2, 18)
    for (name, mine), theirs in zip(trained.module.state_dict().items(), fitted.module.state_dict().values()):
        assert torch.equal(mine, theirs), name
    states = [trained.optimizer.state_dict()["state"], fitted.optimizer.state_dict()["state"]]
    for index, values in states[0].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(states[1][index][key])), (index, key)
    assert float(trained.last_score) == float(fitted.last_score)
