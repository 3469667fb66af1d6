"""Learning-rate schedules (DL4J's ISchedule family), as data.

A schedule gives a factor applied to the updater's ``learning_rate`` as a pure function
of the step count ``t``: applied updates (``unit: iteration``, DL4J's ScheduleType.ITERATION)
or completed epochs (``unit: epoch``). Updates skipped by loss scaling (an fp16 overflow)
are not counted, so the schedule does not advance on them. Being a pure function of
counters saved with the model, a schedule resumes exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from dl4py.config.schema import TaggedConfig, join
from dl4py.errors import ConfigError

Unit = Literal["iteration", "epoch"]


class Schedule(TaggedConfig):
    registry: ClassVar[dict[str, type]] = {}
    type_name: ClassVar[str | None] = None
    unit: Unit

    def factor(self, t: int) -> float:
        raise NotImplementedError

    def step_count(self, updates: int, epochs: int) -> int:
        return updates if self.unit == "iteration" else epochs


def _positive(obj, where: str, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ConfigError(join(where, name), f"must be positive, got {getattr(obj, name)}")


@Schedule.register("step")
@dataclass(frozen=True)
class StepSchedule(Schedule):
    """``decay_rate ** floor(t / step)``."""

    decay_rate: float
    step: int
    unit: Unit = "iteration"

    def validate(self, where: str) -> None:
        _positive(self, where, "decay_rate", "step")

    def factor(self, t: int) -> float:
        return self.decay_rate ** (t // self.step)


@Schedule.register("exponential")
@dataclass(frozen=True)
class ExponentialSchedule(Schedule):
    """``gamma ** t``."""

    gamma: float
    unit: Unit = "iteration"

    def validate(self, where: str) -> None:
        _positive(self, where, "gamma")

    def factor(self, t: int) -> float:
        return self.gamma**t


@Schedule.register("poly")
@dataclass(frozen=True)
class PolySchedule(Schedule):
    """``(1 - t / max_steps) ** power``, then 0."""

    power: float
    max_steps: int
    unit: Unit = "iteration"

    def validate(self, where: str) -> None:
        _positive(self, where, "power", "max_steps")

    def factor(self, t: int) -> float:
        return max(0.0, 1.0 - t / self.max_steps) ** self.power


@Schedule.register("one_cycle")
@dataclass(frozen=True)
class OneCycleSchedule(Schedule):
    """Linear warm-up from ``start_factor`` to 1 over ``warmup_fraction`` of ``total_steps``,
    then linear (or cosine) decay to ``end_factor`` at ``total_steps`` (DL4J's CycleSchedule idea)."""

    total_steps: int
    warmup_fraction: float = 0.25
    start_factor: float = 0.1
    end_factor: float = 0.0
    anneal: Literal["linear", "cosine"] = "linear"
    unit: Unit = "iteration"

    def validate(self, where: str) -> None:
        _positive(self, where, "total_steps")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ConfigError(join(where, "warmup_fraction"), f"must be in [0, 1), got {self.warmup_fraction}")
        for name in ("start_factor", "end_factor"):
            if getattr(self, name) < 0:
                raise ConfigError(join(where, name), f"must be zero or more, got {getattr(self, name)}")

    def factor(self, t: int) -> float:
        warmup = self.warmup_fraction * self.total_steps
        if t < warmup:
            return self.start_factor + (1.0 - self.start_factor) * t / warmup
        progress = min(1.0, (t - warmup) / max(self.total_steps - warmup, 1e-9))
        if self.anneal == "cosine":
            progress = 0.5 * (1.0 - math.cos(math.pi * progress))
        return 1.0 + (self.end_factor - 1.0) * progress
