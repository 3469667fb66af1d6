"""Precision as one setting: a small policy object chosen by name.

``float``/``double``/``half``/``bfloat16`` store parameters and compute in that type
(DL4J's ``DataTypeUtil.setDTypeForContext``). ``half`` and ``bfloat16`` also keep a
float32 master copy of every parameter that the updater steps, because updates smaller
than the 16-bit spacing of a weight would otherwise be rounded away; ``half`` adds
dynamic loss scaling so small gradients do not flush to zero. ``mixed-bf16`` and
``mixed-fp16`` keep float parameters and run the forward pass under autocast, with
dynamic loss scaling for fp16. Model code never mentions a dtype: the trainer asks the policy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dl4py.backend.precision_state import DEFAULT_MAX_SKIPPED_STEPS, PrecisionState
from dl4py.errors import BackendError

_ALIASES = {
    "float": "float", "float32": "float", "fp32": "float", "single": "float",
    "double": "double", "float64": "double", "fp64": "double",
    "half": "half", "float16": "half", "fp16": "half",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "mixed-fp16": "mixed-fp16", "mixed_fp16": "mixed-fp16", "mixed": "mixed-fp16",
    "mixed-bf16": "mixed-bf16", "mixed_bf16": "mixed-bf16",
    # Lightning's names (Trainer(precision=...)).
    "bf16-mixed": "mixed-bf16", "16-mixed": "mixed-fp16", "bf16-true": "bfloat16", "16-true": "half",
    "32-true": "float", "64-true": "double",
}
_PARAM_DTYPE = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16,
    "bfloat16": torch.bfloat16, "mixed-fp16": torch.float32, "mixed-bf16": torch.float32,
}
_AUTOCAST_DTYPE = {"mixed-fp16": torch.float16, "mixed-bf16": torch.bfloat16}
NAMES = tuple(_PARAM_DTYPE)

_default_name = "float"


@dataclass(frozen=True)
class Precision:
    name: str
    # Under loss scaling: updates skipped for overflowing gradients, in a row, that stop
    # training with an error naming the loss scale (0: never stop). See precision_state.py.
    max_skipped_steps: int = DEFAULT_MAX_SKIPPED_STEPS

    @property
    def param_dtype(self) -> torch.dtype:
        return _PARAM_DTYPE[self.name]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _AUTOCAST_DTYPE.get(self.name)

    @property
    def uses_loss_scaling(self) -> bool:
        return self.name in ("half", "mixed-fp16")

    @property
    def master_weights(self) -> bool:
        """Parameters are 16-bit; the updater steps float32 master copies."""
        return self.name in ("half", "bfloat16")

    @property
    def uses_fp16(self) -> bool:
        return torch.float16 in (self.param_dtype, self.autocast_dtype)

    @property
    def uses_bf16(self) -> bool:
        return torch.bfloat16 in (self.param_dtype, self.autocast_dtype)

    def convert_input(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != self.param_dtype:
            return x.to(self.param_dtype)
        return x

    def forward_context(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def bind(self, module: torch.nn.Module, device: torch.device) -> PrecisionState:
        """This policy's state for a built module (float32 where masters are kept, as the
        optimizer steps it): masters, loss scaler, skipped steps."""
        return PrecisionState(self, module, device, self.max_skipped_steps)

    def __str__(self) -> str:
        return self.name


def resolve_precision(name: str | Precision | None = None) -> Precision:
    """Policy for ``name``; None means the process default (``set_default_dtype``)."""
    if isinstance(name, Precision):
        return name  # a policy object travels as itself (to a parallel worker), settings and all
    if name is None:
        return Precision(_default_name)
    canonical = _ALIASES.get(str(name).lower()) if isinstance(name, str) else None
    if canonical is None:
        raise BackendError(f"unknown precision {name!r}; choose one of: {', '.join(NAMES)}")
    return Precision(canonical)


def set_default_dtype(name: str) -> None:
    """Process-wide precision for networks built later (DL4J's setDTypeForContext)."""
    global _default_name
    _default_name = resolve_precision(name).name


def get_default_dtype() -> str:
    return _default_name
