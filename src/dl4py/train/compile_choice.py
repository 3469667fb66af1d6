"""``compile: auto`` (the default): compile the network where the planned training pays for it.

``torch.compile`` makes the seed LeNet's CPU step about 1.5x faster, but compiling costs
seconds before the first step, so a short fit is slower compiled. Under ``auto`` each
single-device fit decides before its first step, from what it knows then (the rule, and
the measurements behind its threshold, are in docs/performance.md, "compile: auto"):

- off where torch.compile cannot run here: dynamo refuses this Python or platform, or a CPU
  fit has no C++ compiler for Inductor (a GPU one no Triton);
- off for a 16-bit precision on a CPU without native kernels for it (``nn/cpu_precision.py``):
  emulated 16-bit arithmetic is slow compiled or not;
- off where the number of steps is unknown (an iterator without a length);
- on where the planned steps (epochs x batches per epoch) reach ``AUTO_MIN_STEPS``, else off.

A model compiled once stays compiled: the cost is paid. Parallel ranks do not decide: they
run eager under ``auto`` (``compile: default`` compiles them). ``off``, ``default`` and
``max-autotune`` are obeyed as set. The choice is logged once at INFO and recorded in the
run's ``result.json`` (``compile``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from dataclasses import asdict, dataclass

import torch

from dl4py.backend.cuda_environment import environment
from dl4py.nn.cpu_precision import slow_dtype
from dl4py.train.progress import batches_of

log = logging.getLogger("dl4py")

# Planned steps from which auto compiles: the seed LeNet's break-even on a 2-core CPU with
# a cold Inductor cache, 30 s of compilation over 3.5-5 ms saved per step of 128 (6,000-8,500
# steps; benchmarks/compile_cost.py, docs/performance.md). The low end: with the cache warm
# (a later run of the same network on the machine) compiling pays after a few hundred.
AUTO_MIN_STEPS = 6000


@dataclass(frozen=True)
class CompileChoice:
    """What a fit runs: the environment's ``setting``, whether the module is compiled, and why."""

    setting: str
    on: bool
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


def planned_steps(iterator, epochs: int, done_in_epoch: int = 0) -> int | None:
    """Training steps a fit of ``epochs`` over ``iterator`` will run (less the batches a
    resumed epoch already did); None where the iterator cannot say its length."""
    batches = batches_of(iterator)
    if batches is None:
        return None
    return max(epochs * batches - (done_in_epoch if epochs else 0), 0)


def choose_compile(setting: str, steps: int | None, precision, device: torch.device) -> CompileChoice:
    """The rule above, for a fit of ``steps`` planned steps (None: unknown)."""
    slow = slow_dtype(precision, device)
    if setting == "off" or (setting != "auto" and slow is None):
        return CompileChoice(setting, setting != "off", "set")
    if slow is not None:  # an explicit compile too runs eager (train/step.py says so)
        return CompileChoice(setting, False, f"precision {precision} has no native "
                                             f"{str(slow).removeprefix('torch.')} kernels on this CPU")
    if steps is None:
        return CompileChoice(setting, False, "number of steps unknown")
    if steps < AUTO_MIN_STEPS:
        return CompileChoice(setting, False, f"{steps} steps planned, under {AUTO_MIN_STEPS}")
    missing = unsupported(device)  # last: it imports dynamo, which a fit that compiles needs anyway
    if missing is not None:
        return CompileChoice(setting, False, missing)
    return CompileChoice(setting, True, f"{steps} steps planned, at least {AUTO_MIN_STEPS}")


def unsupported(device: torch.device) -> str | None:
    """Why torch.compile cannot run for ``device`` in this process; None where it can."""
    import torch._dynamo  # lazy: 1-3 s to import, asked only of a fit that would compile

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python or platform"
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "no Triton for Inductor's GPU kernels"
    compilers = (os.environ.get("CXX"), "c++", "g++", "clang++", "cl")
    if not any(shutil.which(c) for c in compilers if c):
        return "no C++ compiler for Inductor's CPU kernels"
    return None


def choose_for_fit(model, iterator, epochs: int) -> CompileChoice:
    """Decide for a single-device fit (before its first step) and keep the choice on the model;
    the step is rebuilt where the choice changes what it runs."""
    setting = environment().compile
    before = model.compile_choice
    if setting == "auto" and before is not None and before.setting == "auto" and before.on:
        return before  # compiled already: the cost is paid
    steps = planned_steps(iterator, epochs, model.batch_in_epoch)
    choice = choose_compile(setting, steps, model.precision, model.backend.device)
    if choice.on and setting == "auto":
        model.discard_train_step()  # made eager by an earlier fit: made again, compiled
    if setting == "auto" and choice != before:
        log.info("compile: auto -> %s (%s)", "on" if choice.on else "off", choice.why)
    model.compile_choice = choice
    return choice


def compile_record(model) -> dict:
    """The choice for ``result.json``: the last fit's, else what the setting alone says (a
    parallel run's ranks, which run eager under auto)."""
    choice = getattr(model, "compile_choice", None)
    if choice is not None:
        return choice.to_dict()
    setting = environment().compile
    if setting == "auto":
        return CompileChoice(setting, False, "not decided here: parallel ranks run eager under auto").to_dict()
    return CompileChoice(setting, setting != "off", "set").to_dict()
