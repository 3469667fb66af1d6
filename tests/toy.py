"""What several test modules share: a tiny classification problem and network (the parallel
and early-stopping tests), an iterator that kills worker 1 mid-epoch, and a small MLP
trained on an MNIST slice (the inference tests)."""

import os
import signal

import torch

from dl4py import ArrayDataSetIterator, DenseLayer, InputType, NetworkConfig, OutputLayer, Sgd


def mlp(lr=0.1) -> NetworkConfig:
    return NetworkConfig(
        layers=[DenseLayer(n_out=12, activation="tanh"), OutputLayer(n_out=3)],
        input_type=InputType.feed_forward(5), updater=Sgd(lr), seed=11,
    )


def toy(n: int = 256, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


class DiesInItsThirdBatch(ArrayDataSetIterator):
    """Kills worker 1 (SIGKILL) as it reads its third batch, in the middle of the ranks' collectives."""

    def _batch(self, indices):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == 1:
            self._served = getattr(self, "_served", 0) + 1
            if self._served == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        return super()._batch(indices)


def trained_mnist_mlp(examples: int, batch: int):
    """An MLP 784-32-10 with a standardizing normalizer, trained one epoch on the first
    ``examples`` MNIST training images (shuffled by seed 1); skips without the MNIST files."""
    from conftest import require_mnist
    from dl4py import MnistDataSetIterator, MultiLayerNetwork, NormalizerStandardize

    require_mnist()
    train = MnistDataSetIterator(batch, train=True, seed=1, limit=examples)
    config = NetworkConfig(seed=3, updater=Sgd(learning_rate=0.1), input_type=InputType.feed_forward(784),
                           layers=[DenseLayer(n_out=32, activation="relu"), OutputLayer(n_out=10)])
    model = MultiLayerNetwork(config, backend="cpu").init()
    model.set_normalizer(NormalizerStandardize().fit(train.features))
    model.fit(train, epochs=1, verbose=0)
    return model
