"""The example run configs load, validate and build; no training here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dl4py import MultiLayerNetwork, RunConfig
from dl4py.config import BatchNormalization, OneCycleSchedule

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MNIST_TRAINING_EXAMPLES = 60_000


@pytest.fixture(scope="module")
def fast():
    return RunConfig.from_file(EXAMPLES / "lenet_mnist_fast.yaml")


def test_fast_lenet_round_trips_and_says_compile_explicitly(fast):
    assert RunConfig.from_dict(fast.to_dict()) == fast
    # Explicit, so that the benchmark's figure does not move with the library's compile default.
    assert fast.environment.compile == "default"


def test_fast_lenet_is_the_seed_lenet_with_batch_normalization(fast):
    seed = RunConfig.from_file(EXAMPLES / "lenet_mnist.yaml").network
    added = ("batch_normalization", "activation")  # what the fast network adds; the rest is the seed's shape
    kept = [shape.output.dims for shape, layer in zip(fast.network.layer_shapes(), fast.network.layers)
            if layer.type_name not in added]
    assert kept == [shape.output.dims for shape in seed.layer_shapes()]
    assert sum(isinstance(layer, BatchNormalization) for layer in fast.network.layers) == 2


def test_fast_lenet_schedule_spans_the_training_dl4py_train_runs(fast):
    schedule = fast.network.updater.schedule
    assert isinstance(schedule, OneCycleSchedule)
    # `dl4py train` keeps the last, partial batch: a schedule shorter than the run would end at
    # zero early, a longer one would stop before its decay.
    updates = fast.training.epochs * math.ceil(MNIST_TRAINING_EXAMPLES / fast.training.batch_size)
    assert schedule.total_steps == updates


def test_fast_lenet_builds(fast):
    net = MultiLayerNetwork(fast.network).init()
    assert net.num_params() > 0
