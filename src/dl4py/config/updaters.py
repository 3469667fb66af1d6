"""Updaters (optimizers) as data, with DL4J's names and defaults.

L2 regularisation is set on the network or per layer (``l2``), as in DL4J: it adds
``l2 * w`` to the gradient of weights (not biases), which is what PyTorch's coupled
``weight_decay`` does for SGD, Nesterov, Adam and RMSProp. AdamW instead decays weights
directly (decoupled) with its own ``weight_decay``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from dl4py.config.schedules import Schedule
from dl4py.config.schema import TaggedConfig, join
from dl4py.errors import ConfigError


@dataclass(frozen=True)
class Updater(TaggedConfig):
    """Base of the updaters; each has ``learning_rate`` and an optional ``schedule`` for it."""

    registry: ClassVar[dict[str, type]] = {}
    type_name: ClassVar[str | None] = None
    # How many copies of the parameters the updater keeps (for the memory estimator).
    state_copies: ClassVar[int] = 0
    schedule: Optional[Schedule] = field(default=None, kw_only=True)

    def learning_rate_at(self, updates: int, epochs: int) -> float:
        """The learning rate after ``updates`` applied updates and ``epochs`` completed epochs."""
        if self.schedule is None:
            return self.learning_rate
        return self.learning_rate * self.schedule.factor(self.schedule.step_count(updates, epochs))

    def validate(self, where: str) -> None:
        if not self.learning_rate > 0:
            raise ConfigError(
                join(where, "learning_rate"), f"must be positive, got {self.learning_rate}"
            )
        for name in ("momentum", "beta1", "beta2", "rms_decay"):
            value = getattr(self, name, None)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(join(where, name), f"must be in [0, 1), got {value}")
        for name in ("epsilon", "weight_decay"):
            value = getattr(self, name, None)
            if value is not None and value < 0:
                raise ConfigError(join(where, name), f"must be zero or more, got {value}")


@Updater.register("sgd")
@dataclass(frozen=True)
class Sgd(Updater):
    learning_rate: float = 1e-3


@Updater.register("nesterovs")
@dataclass(frozen=True)
class Nesterovs(Updater):
    learning_rate: float = 0.1
    momentum: float = 0.9
    state_copies: ClassVar[int] = 1


@Updater.register("adam")
@dataclass(frozen=True)
class Adam(Updater):
    learning_rate: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    state_copies: ClassVar[int] = 2


@Updater.register("adamw")
@dataclass(frozen=True)
class AdamW(Adam):
    """Adam with decoupled weight decay (applied to weights, not biases)."""

    weight_decay: float = 0.01


@Updater.register("rmsprop")
@dataclass(frozen=True)
class RmsProp(Updater):
    learning_rate: float = 0.1
    rms_decay: float = 0.95
    epsilon: float = 1e-8
    state_copies: ClassVar[int] = 1
