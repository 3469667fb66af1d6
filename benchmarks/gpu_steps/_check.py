"""What a step of the GPU check is handed, and how it reports.

A step is a function ``run(check: Check) -> None`` in a module of this folder. It runs in a
process of its own (``benchmarks/gpu_check.py`` starts it and kills it at its budget), so it
may hang, crash or leak without harming the others. It reports through ``check``:

- ``check.figure(name, value)``: a measured figure (JSON-able), written to the result file at
  once, so the figures taken before a hang or a crash survive it;
- ``check.expect(ok, message)``: a target; a step with one unmet target is ``failed``, but it
  runs on and records the rest;
- ``check.skip(reason)``: the step cannot apply here (no GPU, a missing package); never a pass;
- ``with check.part(name):``: a block whose exception is recorded as an unmet target (named,
  traceback to the log) while the step goes on to its next part: a GPU session is short, and
  one broken path must not hide the figures of the others.

An exception fails the step with its message; the traceback goes to the step's log.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dl4py.io import atomic_write_json


class Skipped(Exception):
    """Raised by ``Check.skip``: the step does not apply on this machine."""


@dataclass
class Check:
    device: torch.device
    quick: bool
    result_path: Path
    work_dir: Path  # a scratch folder of this step's own, removed afterwards
    figures: dict = field(default_factory=dict)
    unmet: list[str] = field(default_factory=list)

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        return "gpu" if self.gpu else "cpu"

    def steps(self, full: int, quick: int) -> int:
        """A count that depends on --quick (steps, epochs, requests)."""
        return quick if self.quick else full

    def figure(self, name: str, value) -> None:
        self.figures[name] = value
        self.save()

    def expect(self, ok: bool, message: str) -> bool:
        if not ok:
            self.unmet.append(message)
            self.save()
        return bool(ok)

    @contextmanager
    def part(self, name: str):
        try:
            yield
        except Skipped:
            raise
        except Exception as exc:  # noqa: BLE001: recorded, and the step goes on
            traceback.print_exc()
            self.expect(False, f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")

    def skip(self, reason: str) -> None:
        raise Skipped(reason)

    def save(self, **extra) -> None:
        atomic_write_json(self.result_path, {"figures": self.figures, "unmet": self.unmet, **extra})
