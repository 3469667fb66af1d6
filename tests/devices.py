"""The devices a test family runs on: the CPU always, CUDA where there is one.

``@on_devices`` parametrizes a test over ``device`` ("cpu", "cuda"); the CUDA case carries the
``gpu`` marker, so ``pytest -m gpu`` selects it and the conftest skips it, with its reason, on a
machine without CUDA. ``backend_for`` names the dl4py backend for a device, and ``tolerance``
says how closely two float32 runs on that device are expected to agree.
"""

from __future__ import annotations

import pytest
import torch

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
on_devices = pytest.mark.parametrize("device", DEVICES)

BACKENDS = {"cpu": "cpu", "cuda": "gpu"}


def gpu_per_rank(device: str, ranks: int) -> list[str] | None:
    """The GPUs ``ranks`` ranks of a sharded, tensor or hybrid plan run on: one each (NCCL),
    as dl4py requires (ranks sharing a GPU are refused: parallel/preflight.check_plan_transport).
    None on the CPU. A cuda case on a machine with fewer GPUs is skipped, saying so."""
    if device != "cuda":
        return None
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} ranks of a sharded, tensor or hybrid plan need {ranks} GPUs, one each: "
                    f"this machine has {torch.cuda.device_count()} (ranks sharing a GPU are refused)")
    return [f"cuda:{rank}" for rank in range(ranks)]


def backend_for(device: str) -> str:
    """dl4py's backend name for a torch device type."""
    return BACKENDS[device]


def tolerance(device: str, cpu: float = 0.0) -> dict:
    """``rtol``/``atol`` for comparing two float32 computations that should be the same.

    On the CPU the same operations in the same order give the same bits, so ``cpu`` (0 by
    default) is the test's own claim. On CUDA, cuDNN's convolutions run in TF32 by default and
    some of its backward kernels sum with atomics (no fixed order), so two runs of the same steps
    agree only to about 1e-3 after a few updates."""
    if device == "cuda":
        return {"rtol": 2e-3, "atol": 2e-3}
    return {"rtol": cpu, "atol": cpu}
