"""The rows DL4J's integration tests fed their networks, reproduced without Java.

``MnistDataSetIterator(batch, train, seed)`` serves MNIST in the order of ``MnistDataFetcher``'s
shuffle: ``MathUtils.shuffleArray`` over ``0..N-1`` with ``new java.util.Random(seed)``, once, when
the fetcher is made, and pixels divided by 255 (``binarize`` off). ``JavaRandom`` is
java.util.Random's generator, so ``dl4j_mnist_order`` gives the same permutation; the import
test checks it against values a JDK printed. Helpers only: no tests here.
"""

from __future__ import annotations

import numpy as np

from dl4py.data.mnist import load_mnist
from conftest import require_mnist


class JavaRandom:
    """java.util.Random: its 48-bit linear congruential generator, as the JDK documents it."""

    def __init__(self, seed: int):
        self.state = (seed ^ 0x5DEECE66D) & ((1 << 48) - 1)

    def _next(self, bits: int) -> int:
        self.state = (self.state * 0x5DEECE66D + 0xB) & ((1 << 48) - 1)
        return self.state >> (48 - bits)

    def next_int(self, bound: int) -> int:
        if bound & -bound == bound:  # a power of two
            return (bound * self._next(31)) >> 31
        while True:
            bits = self._next(31)
            value = bits % bound
            if bits - value + bound - 1 < 1 << 31:  # Java's int overflow test
                return value


def dl4j_mnist_order(examples: int, seed: int) -> list[int]:
    """MnistDataFetcher's order: MathUtils.shuffleArray (Fisher-Yates from the end) with
    new Random(seed), once, at construction."""
    order, rng = list(range(examples)), JavaRandom(seed)
    for i in range(examples - 1, 0, -1):
        j = rng.next_int(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def mnist_rows(train: bool, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """MNIST's ``rows`` as MnistDataSetIterator serves them: features ``float32 [n, 784]``,
    pixel / 255; labels as class indices. Skips (with the reason) where MNIST is missing."""
    images, labels = load_mnist(train, require_mnist())
    return (images.numpy()[rows].reshape(len(rows), 784).astype(np.float32) / np.float32(255),
            labels.numpy()[rows])


# DL4J's activations written out in numpy, for the tests' equations.
def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
