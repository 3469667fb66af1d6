"""The seed's multi-GPU MNIST tutorial in dl4py: LeNet trained by a ParallelWrapper.

    python examples/lenet_mnist_parallel.py [--workers 2] [--epochs 1] [--backend auto|cpu|gpu]
    torchrun --nproc-per-node 4 examples/lenet_mnist_parallel.py      # one process per GPU

As in the tutorial: MNIST iterators with seed 12345, the LeNet configuration, then a
ParallelWrapper with prefetch buffer 24, averaging every 3 rounds, and the averaged score
reported after each average. Workers run on the GPUs (worker i on GPU i % count), or as
CPU processes when there is no GPU. DL4J's guide advises a learning rate about 20% higher
for data-parallel training; so does this example.
"""

import argparse
import logging

from dl4py import MnistDataSetIterator, MultiLayerNetwork, RunConfig
from dl4py.parallel import ParallelWrapper, launched_by_torchrun

CONFIG = __file__.replace("lenet_mnist_parallel.py", "lenet_mnist.yaml")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=None, help="default: one per GPU, or 2 on CPU")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--backend", default="auto", choices=["auto", "cpu", "gpu"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    batch_size = 128
    mnist_train = MnistDataSetIterator(batch_size, train=True, seed=12345)
    mnist_test = MnistDataSetIterator(batch_size, train=False, seed=12345)

    run = RunConfig.from_file(CONFIG)
    lr = run.network.updater.learning_rate * 1.2  # +20% for data-parallel training
    config = run.with_overrides([f"network.updater.learning_rate={lr}"]).network
    model = MultiLayerNetwork(config, backend=args.backend).init()

    wrapper = ParallelWrapper(
        model,
        prefetch_buffer=24,
        workers=None if launched_by_torchrun() else args.workers,
        averaging_frequency=3,
        report_score_after_averaging=True,
    )
    wrapper.fit(mnist_train, epochs=args.epochs)
    if not launched_by_torchrun() or int(__import__("os").environ["RANK"]) == 0:
        print(model.evaluate(mnist_test).stats())


if __name__ == "__main__":
    main()
