"""A step's peak memory measured on the model's own device, and the estimate checked against it.

On a CPU the peak is ``LiveTensorBytes``' (``measure_training_step``): the live tensor bytes
docs/memory.md's 1% claims are about. On a GPU it is ``torch.cuda.max_memory_allocated``
during the step less what the allocator held at its start for anything but the model, its
updater state and the batch (cuBLAS' workspaces), as ``benchmarks/memory.py --device gpu``
measures it; the estimate for ``device="cuda"`` counts each tensor in the allocator's
512-byte granules, so the two are on the same terms.

docs/memory.md makes no GPU claim yet ("read the 1% above as a CPU figure": cuDNN's
workspaces and RNN reserve and the allocator's blocks over 1 MiB are not modelled).
``check_estimate`` asserts the CPU claim on both devices; on a GPU a miss is an expected
failure (xfail) whose reason gives both numbers, until those terms are modelled.
"""

from __future__ import annotations

import gc

import pytest
import torch

from dl4py.memory import LiveTensorBytes, measure_training_step
from dl4py.memory.measure import cuda_allocated_besides, resident_tensors
from dl4py.train.step import make_train_step


def release_cuda() -> None:
    """Let go of what earlier tests left: a first optimizer's reference cycle keeps its network
    until gc runs; cuBLAS keeps a workspace per handle and stream until told."""
    gc.collect()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private: absent is fine
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


def step_peak(model, features: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> int:
    """The peak bytes of one training step of ``model`` (after one warm-up step on two
    examples, so the updater's state exists), on the device it was built for."""
    if model.device.type != "cuda":
        return measure_training_step(model, features, labels, mask=mask).peak_bytes
    release_cuda()
    model.init()
    step = make_train_step(model)
    features = model.precision.convert_input(features.to(model.device))
    labels = labels.to(model.device)
    mask = None if mask is None else mask.to(model.device)
    try:
        if mask is not None:
            model.set_mask(mask[:2])
        step(features[:2], labels[:2])
        if mask is not None:
            model.set_mask(mask)
        outside = _reset_peak(model, [features, labels] + ([] if mask is None else [mask]))
        step(features, labels)
        torch.cuda.synchronize(model.device)
        return torch.cuda.max_memory_allocated(model.device) - outside
    finally:
        if mask is not None:
            model.set_mask(None)


def inference_peak(model, features: torch.Tensor) -> int:
    """The peak bytes of ``model``'s forward pass without gradients, on the device it was
    built for (on a CPU the live tensor bytes, its parameters, buffers and the batch counted)."""
    if model.device.type != "cuda":
        module = model.init().module.eval()
        tracker = LiveTensorBytes()
        tracker.track(list(module.parameters()) + list(module.buffers()) + [features])
        with torch.no_grad(), tracker:
            module(features)
        return tracker.peak
    release_cuda()
    module = model.init().module.eval()
    features = model.precision.convert_input(features.to(model.device))
    outside = _reset_peak(model, [features])
    with torch.no_grad():
        module(features)
    torch.cuda.synchronize(model.device)
    return torch.cuda.max_memory_allocated(model.device) - outside


def _reset_peak(model, batch: list[torch.Tensor]) -> int:
    """Start the peak statistics now; return the bytes allocated for anything but the model's
    resident tensors and ``batch``."""
    torch.cuda.synchronize(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    return cuda_allocated_besides(resident_tensors(model) + batch, model.device)


def check_estimate(estimated: int, measured: int, tolerance: float, device: str, what) -> None:
    """``estimated`` within ``tolerance`` of ``measured``: the documented claim on a CPU; on a
    GPU an expected failure when it misses (docs/memory.md claims nothing there yet)."""
    error = estimated / measured - 1
    if device == "cuda" and abs(error) > tolerance:
        pytest.xfail(f"{what}: estimated {estimated} B, measured {measured} B on the GPU ({error:+.2%}); "
                     f"docs/memory.md claims {tolerance:.0%} on a CPU only, until the GPU's terms are modelled")
    assert abs(error) <= tolerance, (what, estimated, measured, f"{error:+.3%}")
