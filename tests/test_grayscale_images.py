"""One-channel images without their channel axis, ``[n, height, width]``, as Hugging Face's MNIST
and torchvision's tensors come: the README's LeNet (``convolutional_flat``) and a
``convolutional`` network take them as ``[n, 1, height, width]`` (a view, the same numbers), in
fit, output and evaluate; the docs' Hugging Face example, on a local Dataset of that form."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dl4py import ConvolutionLayer, GlobalPoolingLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer
from dl4py.config import RunConfig
from dl4py.errors import DataError

LENET = Path(__file__).resolve().parents[1] / "examples" / "lenet_mnist.yaml"


def _images(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 28, 28)).astype(np.float32), rng.integers(0, 10, n)


@pytest.mark.parametrize("kind", ["convolutional_flat", "convolutional"])
def test_images_without_a_channel_axis_are_the_same_as_with_it(kind):
    if kind == "convolutional_flat":
        config = RunConfig.from_file(LENET).network
    else:
        config = NetworkConfig(layers=[ConvolutionLayer(n_out=3, kernel_size=5), GlobalPoolingLayer(),
                                       OutputLayer(n_out=10)], input_type=InputType.convolutional(28, 28, 1), seed=4)
    x, y = _images()
    with_axis = x.reshape(32, -1) if kind == "convolutional_flat" else x[:, None]
    bare, given = MultiLayerNetwork(config).init(), MultiLayerNetwork(config).init()
    torch.testing.assert_close(bare.output(x), given.output(with_axis), rtol=0, atol=0)
    first = bare.fit(x, y, batch_size=16, verbose=0)
    second = given.fit(with_axis, y, batch_size=16, verbose=0)
    assert first.history["loss"] == second.history["loss"]
    assert bare.evaluate((x, y)).accuracy() == given.evaluate((with_axis, y)).accuracy()


def test_other_shapes_are_still_named():
    config = RunConfig.from_file(LENET).network
    with pytest.raises(DataError, match=r"features have shape \[4, 27, 28\] but the network's input type "
                                        r"convolutional_flat expects \[n, 784\]"):
        MultiLayerNetwork(config).init().output(torch.zeros(4, 27, 28))


def test_the_docs_hugging_face_example_feeds_the_readme_lenet():
    datasets = pytest.importorskip("datasets")
    x, y = _images(64)
    ds = datasets.Dataset.from_dict({"image": list(x), "label": y.tolist()}).with_format("numpy")
    model = MultiLayerNetwork(RunConfig.from_file(LENET).network).init()
    history = model.fit(ds, features="image", label="label", batch_size=32, verbose=0)  # docs/data.md's call
    assert history[0].examples == 64
