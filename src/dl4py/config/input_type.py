"""InputType: the shape of the network's input, from which every layer's n_in is inferred.

The counterpart of DL4J's ``InputType.feedForward / convolutional / convolutionalFlat``.
``convolutional_flat`` means each example arrives as a flat vector of ``height*width*channels``
values (as MNIST iterators give it) and is reshaped to ``[channels, height, width]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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
