"""Backend choice: CPU or GPU, by one setting or by ND4J's priority variables.

Order of authority: an explicit choice (``set_backend``, a config's ``training.backend``,
``--backend``) beats the environment. With ``auto``, ``BACKEND_PRIORITY_CPU`` (default 0)
and ``BACKEND_PRIORITY_GPU`` (default 100) rank the backends, as in ND4J, and the
highest-ranked one that is available wins (a tie goes to the GPU). Nothing here runs at
import time; the choice is made when a network is built and passed down as a ``Backend``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping

import torch

from dl4py.backend.cuda_environment import environment
from dl4py.errors import BackendError

log = logging.getLogger("dl4py")

CHOICES = ("auto", "cpu", "gpu")
_default_choice = "auto"
_fallback_reported = False


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu" or "gpu"
    device: torch.device
    reason: str  # which setting or variable decided

    def __str__(self) -> str:
        return f"{self.name} ({self.device})"


def set_backend(name: str) -> None:
    """Process-wide default for networks built later: ``"cpu"``, ``"gpu"`` or ``"auto"``."""
    global _default_choice
    _default_choice = _check_choice(name, "set_backend")


def get_backend_choice() -> str:
    return _default_choice


def _check_choice(name, where: str) -> str:
    if not isinstance(name, str) or name.lower() not in CHOICES:
        raise BackendError(f"{where}: backend must be one of {', '.join(CHOICES)}; got {name!r}")
    return name.lower()


def _priority(env: Mapping[str, str], var: str, default: int) -> int:
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise BackendError(f"{var} must be an integer priority, got {raw!r}") from None


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used here, or None when it can."""
    if torch.version.cuda is None:
        return f"this PyTorch build ({torch.__version__}) has no CUDA support"
    try:
        count = torch.cuda.device_count()
    except RuntimeError as exc:  # driver too old, broken install
        return f"CUDA failed to initialise: {exc}"
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"no CUDA device is visible{hint}"
    if not torch.cuda.is_available():
        return "CUDA devices are present but the driver reports them unusable"
    return None


def _first_permitted_gpu() -> torch.device:
    # The environment's device list decides, and asking it does not initialise CUDA, so
    # allocator settings can still be applied after the choice.
    devices = environment().usable_cuda_devices()
    if not devices:
        raise BackendError("no CUDA device is permitted by the environment's device list")
    local_rank = os.environ.get("LOCAL_RANK", "")
    if local_rank.isdigit():  # under torchrun: each process of a node its own GPU, by local rank
        return torch.device("cuda", devices[int(local_rank) % len(devices)])
    return torch.device("cuda", devices[0])


def resolve_backend(requested: str | None = None, env: Mapping[str, str] | None = None, *,
                    quiet: bool = False) -> Backend:
    """Decide the backend. ``requested`` (from code, config or CLI) beats the process default.
    A fall-back to the CPU is said once per process, unless ``quiet`` (a caller that reports the
    backend's ``reason`` itself, as ``dl4py info`` does)."""
    env = os.environ if env is None else env
    cpu_priority = _priority(env, "BACKEND_PRIORITY_CPU", 0)
    gpu_priority = _priority(env, "BACKEND_PRIORITY_GPU", 100)
    if requested is not None and _check_choice(requested, "backend") != "auto":
        choice, source = requested.lower(), "requested explicitly"
    elif _default_choice != "auto":
        choice, source = _default_choice, "set by dl4py.set_backend"
    else:
        choice, source = "auto", None

    if choice == "cpu":
        return Backend("cpu", torch.device("cpu"), f"cpu {source}")
    if choice == "gpu":
        why = cuda_unavailable_reason()
        if why is not None:
            raise BackendError(f"the GPU backend was {source} but cannot be used: {why}")
        return Backend("gpu", _first_permitted_gpu(), f"gpu {source}")

    ranking = f"BACKEND_PRIORITY_GPU={gpu_priority}, BACKEND_PRIORITY_CPU={cpu_priority}"
    if cpu_priority > gpu_priority:
        return Backend("cpu", torch.device("cpu"), f"auto: cpu ranks higher ({ranking})")
    why = cuda_unavailable_reason()
    if why is None:
        return Backend("gpu", _first_permitted_gpu(), f"auto: gpu ranks higher ({ranking})")
    global _fallback_reported
    if not _fallback_reported and not quiet:
        log.info("dl4py: GPU backend unavailable (%s); using the CPU", why)
        _fallback_reported = True
    return Backend("cpu", torch.device("cpu"), f"auto: gpu ranks higher ({ranking}) but {why}; fell back to cpu")
