"""Launched by tests/test_multinode.py under torchrun: trains with a ParallelWrapper and
saves the result (rank 0). Called without torchrun (the test's single-node reference, in
its own process), it spawns its workers."""

import os
import sys

import torch

from dl4py import ArrayDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.parallel import ParallelPlan, ParallelWrapper, launched_by_torchrun

# A rank kept waiting this long at a collective names the rank that did not arrive and ends
# the fit (the library's watchdog): within the test's own bound on the launchers, so a
# desynchronised or dead rank is reported by the ranks themselves, not only as a timeout.
# Generous beside the seconds each rank takes to import torch on a busy 2-core machine.
RANK_TIMEOUT = 60


def main(out: str, mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    config = NetworkConfig(layers=[DenseLayer(n_out=12, activation="tanh"), OutputLayer(n_out=3)],
                           input_type=InputType.feed_forward(5), updater=Sgd(0.1), seed=11)
    model = MultiLayerNetwork(config, backend="cpu")
    options = {"averaging_frequency": 2} if mode == "averaging" else {}
    workers = None if launched_by_torchrun() else 2
    plan = ParallelPlan.from_training_mode(mode)
    with ParallelWrapper(model, workers=workers, parallelism=plan, timeout=RANK_TIMEOUT, **options) as wrapper:
        wrapper.fit(ArrayDataSetIterator(x, y, batch_size=16, shuffle=True, seed=3), epochs=2)
    if os.environ.get("RANK", "0") == "0":
        model.save(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
