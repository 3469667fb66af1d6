"""MultiLayerNetwork: a network built from a NetworkConfig (DL4J's class of that name)."""

from __future__ import annotations

import torch

from dl4py.backend import Backend, Precision
from dl4py.backend.cuda_environment import environment
from dl4py.config.input_type import Convolutional, ConvolutionalFlat
from dl4py.config.network import NetworkConfig
from dl4py.errors import DataError
from dl4py.config.layers_conv import CnnLossLayer
from dl4py.config.recurrent import RnnOutputLayer
from dl4py.nn.builder import OutputLoss, build_module
from dl4py.nn.model import Model
from dl4py.nn.optimizers import make_optimizer, optimizer_kernel, param_groups
from dl4py.nn.recurrent import RnnOutputLoss, SequenceMask
from dl4py.nn.signature import Signature, network_signature
from dl4py.nn.summary import summary_table


class MultiLayerNetwork(Model):
    """A sequential network from ``config``. Example::

        net = MultiLayerNetwork(conf).init()
        net.fit(MnistDataSetIterator(128, train=True, seed=12345), epochs=1)
        print(net.evaluate(MnistDataSetIterator(128, train=False, seed=12345)).stats())
    """

    kind = "multilayer"

    def __init__(
        self,
        config: NetworkConfig,
        backend: str | Backend | None = None,
        precision: str | Precision | None = None,
    ):
        if not isinstance(config, NetworkConfig):
            raise TypeError(f"MultiLayerNetwork needs a NetworkConfig, got {type(config).__name__}")
        super().__init__(backend, precision)
        self.config = config
        self.seed = config.seed
        self._masks = SequenceMask()  # the batch's sequence mask, read by layers and loss
        output = config.layers[-1]
        self._loss = RnnOutputLoss(output, self._masks) if isinstance(output, RnnOutputLayer) else OutputLoss(output)
        self._shapes = config.layer_shapes()

    def _build_module(self, device: torch.device, dtype: torch.dtype):
        # Parameters come from a generator seeded by the config, so the same config and
        # seed give the same network whatever else the program did with torch's RNG.
        generator = torch.Generator().manual_seed(self.config.seed)
        return build_module(self.config, generator, self._masks).to(device=device, dtype=dtype)

    def _make_optimizer(self, module, plain_name):
        # The groups come from the layers, whatever a distributed plan renamed: plain_name unused.
        kernel = optimizer_kernel(environment().fused_optimizer, self.config.updater, self.backend.device,
                                  loss_scaling=self.precision.uses_loss_scaling)
        return make_optimizer(self.config.updater, param_groups(self.config, module), kernel)

    def loss(self, outputs, labels):
        return self._loss(outputs, labels)

    def activate(self, outputs):
        return self._loss.activate(outputs)

    def learning_rate_at(self, updates: int, epochs: int) -> float | None:
        updater = self.config.updater
        return None if updater.schedule is None else updater.learning_rate_at(updates, epochs)

    @property
    def n_out(self) -> int:
        return self.config.layers[-1].n_out

    def signature(self) -> Signature:
        return network_signature(self.config)

    def set_mask(self, mask: torch.Tensor | None) -> None:
        self._masks.current = mask

    def check_features(self, features: torch.Tensor, where: str) -> None:
        check_features_for(self.config.input_type, features, where)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        return super().prepare_input(with_channel_axis(self.config.input_type, x))

    def save_dl4j(self, path) -> None:
        """Write this network as a DL4J ModelSerializer zip (``dl4py.dl4j.save_dl4j``): its
        configuration, parameters, updater state and normalizer, for a Java serving stack or
        ``dl4py.import_dl4j``. One DL4JFileError, with nothing written, for what DL4J cannot hold."""
        from dl4py.dl4j.writer import save_dl4j  # cycle: dl4py.dl4j.writer imports this module

        save_dl4j(self, path)

    def check_labels(self, labels: torch.Tensor, where: str) -> None:
        check_labels_for(self.config.layers[-1], labels, where, self._shapes[-1].output)

    def check_data(self, iterator) -> None:
        check_data_for(iterator, self.n_out, f"network.layers[{len(self.config.layers) - 1}].n_out")

    def summary(self) -> str:
        """Per layer: type, input and output shapes, parameter count; then the total."""
        self.init()
        table, _ = summary_table(self.config, self.module)
        return f"{table}  (precision {self.precision}, backend {self.backend})"


def _grayscale_without_channels(input_type, features: torch.Tensor) -> bool:
    """One-channel images given as ``[n, height, width]`` (Hugging Face's MNIST, torchvision's
    tensors): what a convolutional input type of one channel takes, the channel axis added."""
    return (isinstance(input_type, (Convolutional, ConvolutionalFlat)) and input_type.channels == 1
            and features.dim() == 3 and tuple(features.shape[1:]) == (input_type.height, input_type.width))


def with_channel_axis(input_type, x: torch.Tensor) -> torch.Tensor:
    """``x`` in the layout ``input_type`` describes, where it is one-channel images without
    their channel axis (a view: no copy)."""
    if not _grayscale_without_channels(input_type, x):
        return x
    return x.reshape(x.shape[0], -1) if isinstance(input_type, ConvolutionalFlat) else x.unsqueeze(1)


def check_features_for(input_type, features: torch.Tensor, where: str) -> None:
    """DataError when ``features`` do not have the shape ``input_type`` describes (one-channel
    images may come without their channel axis, ``[n, height, width]``)."""
    if _grayscale_without_channels(input_type, features):
        return
    expected = input_type.example_shape()  # None: a sequence of any length
    got = tuple(features.shape[1:])
    if len(got) != len(expected) or any(e is not None and g != e for g, e in zip(got, expected)):
        shown = ", ".join("time" if e is None else str(e) for e in expected)
        raise DataError(
            f"{where}: features have shape {list(features.shape)} but the network's input type "
            f"{input_type.type_name} expects [n, {shown}]"
        )


def check_labels_for(output, labels: torch.Tensor, where: str, output_shape=None) -> None:
    """DataError when ``labels`` do not fit the output layer ``output`` (of ``output_shape``,
    where the layer's own fields do not say it: a CNN loss layer's)."""
    if isinstance(output, CnnLossLayer):
        expected = [labels.shape[0], *output_shape.dims] if output_shape is not None else None
        if not labels.is_floating_point() or labels.dim() != 4 or (expected and list(labels.shape) != expected):
            shown = "[n, channels, height, width]" if expected is None else str(expected)
            raise DataError(f"{where}: labels have shape {list(labels.shape)} ({labels.dtype}) but cnn_loss needs "
                            f"float targets {shown}, the output's shape (one-hot over the channels for mcxent)")
        return
    n_out = output.n_out
    if isinstance(output, RnnOutputLayer):  # per step: [n, time] or [n, time, k]
        if labels.dim() == 3 and labels.shape[2] == n_out:
            return
        if labels.dim() != 2:
            raise DataError(
                f"{where}: labels have shape {list(labels.shape)} but rnn_output needs one label per "
                f"step: [n, time] class indices or [n, time, {n_out}] targets"
            )
        labels = labels.reshape(-1)
    if labels.dim() == 1:
        if labels.is_floating_point():
            raise DataError(f"{where}: 1-D labels must be integer class indices, got {labels.dtype}")
        if labels.numel():
            low, high = int(labels.min()), int(labels.max())
            if low < 0 or high >= n_out:
                bad = low if low < 0 else high
                raise DataError(
                    f"{where}: label {bad} is outside the output layer's {n_out} classes [0, {n_out})"
                )
    elif labels.dim() != 2 or labels.shape[1] != n_out:
        raise DataError(
            f"{where}: labels have shape {list(labels.shape)} but the output layer has "
            f"{n_out} outputs: give [n] class indices or [n, {n_out}] targets"
        )


def check_data_for(iterator, n_out: int, key: str) -> None:
    """DataError naming the example when any label the iterator found is not below ``n_out``
    (``key``: the config key of the output layer's n_out)."""
    found = iterator.max_label() if hasattr(iterator, "max_label") else None
    if found is not None and found[0] >= n_out:
        value, index = found
        where = iterator.locate(index) if hasattr(iterator, "locate") else f"example {index}"
        raise DataError(
            f"{where}: label {value} is outside the output layer's {n_out} classes "
            f"({key}={n_out}): labels must be in [0, {n_out})"
        )
