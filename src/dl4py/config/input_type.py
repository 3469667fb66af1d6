"""InputType: the shape of the network's input, from which every layer's n_in is inferred.

The counterpart of DL4J's ``InputType.feedForward / convolutional / convolutionalFlat /
recurrent``.
``convolutional_flat`` means each example arrives as a flat vector of ``height*width*channels``
values (as MNIST iterators give it) and is reshaped to ``[channels, height, width]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dl4py.config.schema import TaggedConfig, join
from dl4py.errors import ConfigError


class InputType(TaggedConfig):
    registry: ClassVar[dict[str, type]] = {}
    type_name: ClassVar[str | None] = None

    @staticmethod
    def feed_forward(size: int) -> "FeedForward":
        return FeedForward(size)

    @staticmethod
    def convolutional(height: int, width: int, channels: int) -> "Convolutional":
        return Convolutional(height, width, channels)

    @staticmethod
    def convolutional_flat(height: int, width: int, channels: int) -> "ConvolutionalFlat":
        return ConvolutionalFlat(height, width, channels)

    @staticmethod
    def recurrent(size: int, length: int | None = None) -> "Recurrent":
        return Recurrent(size, length)

    def example_shape(self) -> tuple[int, ...]:
        """Shape of one example as the data iterator delivers it."""
        raise NotImplementedError


def _positive(obj, where: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(join(where, name), f"must be positive, got {value}")


@InputType.register("feed_forward")
@dataclass(frozen=True)
class FeedForward(InputType):
    size: int

    def validate(self, where: str) -> None:
        _positive(self, where, "size")

    def example_shape(self) -> tuple[int, ...]:
        return (self.size,)


@InputType.register("convolutional")
@dataclass(frozen=True)
class Convolutional(InputType):
    height: int
    width: int
    channels: int

    def validate(self, where: str) -> None:
        _positive(self, where, "height", "width", "channels")

    def example_shape(self) -> tuple[int, ...]:
        return (self.channels, self.height, self.width)


@InputType.register("convolutional_flat")
@dataclass(frozen=True)
class ConvolutionalFlat(Convolutional):
    """Convolutional input that arrives flat, ``height*width*channels`` values per example."""

    def example_shape(self) -> tuple[int, ...]:
        return (self.height * self.width * self.channels,)


@InputType.register("recurrent")
@dataclass(frozen=True)
class Recurrent(InputType):
    """Sequences of ``size`` values per step, ``[batch, time, size]`` (batch first: DL4J's
    ``RNNFormat.NWC``, not its default NCW). ``length`` None means any length: batches of
    padded sequences of different lengths carry a mask (``docs/layers.md``)."""

    size: int
    length: Optional[int] = None

    def validate(self, where: str) -> None:
        _positive(self, where, "size")
        if self.length is not None:
            _positive(self, where, "length")

    def example_shape(self) -> tuple[int | None, ...]:
        return (self.length, self.size)
