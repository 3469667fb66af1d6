"""Backend choice: ND4J's priority variables, explicit settings, clear errors."""

from __future__ import annotations

import pytest
import torch

import dl4py
from dl4py.backend import resolve_backend, resolve_precision
from dl4py.backend import selection
from dl4py.errors import BackendError


@pytest.fixture
def cuda_present(monkeypatch):
    """Pretend a usable CUDA device exists, so the rules are tested on any machine."""
    monkeypatch.setattr(selection, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(selection, "_first_permitted_gpu", lambda: torch.device("cuda", 0))


@pytest.fixture
def cuda_absent(monkeypatch):
    monkeypatch.setattr(selection, "cuda_unavailable_reason", lambda: "no CUDA device is visible")


def test_gpu_wins_by_default_when_available(cuda_present):
    backend = resolve_backend(env={})
    assert backend.name == "gpu" and backend.device == torch.device("cuda", 0)
    assert "BACKEND_PRIORITY_GPU=100, BACKEND_PRIORITY_CPU=0" in backend.reason


def test_cpu_wins_when_its_priority_is_higher(cuda_present):
    backend = resolve_backend(env={"BACKEND_PRIORITY_CPU": "200", "BACKEND_PRIORITY_GPU": "100"})
    assert backend.name == "cpu" and "cpu ranks higher" in backend.reason
    assert resolve_backend(env={"BACKEND_PRIORITY_GPU": "-5"}).name == "cpu"


def test_tie_goes_to_gpu_and_explicit_choice_beats_priorities(cuda_present):
    assert resolve_backend(env={"BACKEND_PRIORITY_CPU": "7", "BACKEND_PRIORITY_GPU": "7"}).name == "gpu"
    assert resolve_backend("cpu", env={"BACKEND_PRIORITY_GPU": "1000"}).name == "cpu"
    assert resolve_backend("gpu", env={"BACKEND_PRIORITY_CPU": "1000"}).name == "gpu"


def test_auto_falls_back_to_cpu_and_says_why(cuda_absent):
    backend = resolve_backend(env={})
    assert backend.name == "cpu"
    assert "no CUDA device is visible; fell back to cpu" in backend.reason


def test_explicit_gpu_without_cuda_is_a_clear_error(cuda_absent):
    with pytest.raises(BackendError, match="GPU backend was requested explicitly but cannot be used: no CUDA"):
        resolve_backend("gpu", env={})
    with pytest.raises(BackendError, match="set by dl4py.set_backend"):
        try:
            dl4py.set_backend("gpu")
            resolve_backend(env={})
        finally:
            dl4py.set_backend("auto")


@pytest.mark.parametrize("var, value", [
    ("BACKEND_PRIORITY_CPU", "high"), ("BACKEND_PRIORITY_GPU", "1.5"), ("BACKEND_PRIORITY_CPU", "0x10"),
])
def test_non_integer_priority_is_rejected(var, value):
    with pytest.raises(BackendError, match=f"{var} must be an integer priority, got '{value}'"):
        resolve_backend(env={var: value})


def test_bad_backend_names_are_rejected():
    with pytest.raises(BackendError, match="backend must be one of auto, cpu, gpu; got 'tpu'"):
        dl4py.set_backend("tpu")
    with pytest.raises(BackendError, match="got 'cuda'"):
        resolve_backend("cuda")


def test_real_cuda_reason_on_this_machine():
    reason = selection.cuda_unavailable_reason()
    assert (reason is None) == torch.cuda.is_available()


def test_precision_names_and_aliases():
    assert resolve_precision("fp16").name == "half"
    assert resolve_precision("bf16").param_dtype == torch.bfloat16
    assert resolve_precision("mixed-bf16").autocast_dtype == torch.bfloat16
    assert resolve_precision("mixed-bf16").param_dtype == torch.float32
    with pytest.raises(BackendError, match="unknown precision 'quarter'"):
        resolve_precision("quarter")
    dl4py.set_default_dtype("double")
    try:
        assert resolve_precision().name == "double"
    finally:
        dl4py.set_default_dtype("float")


def test_under_torchrun_each_local_rank_gets_its_own_gpu(monkeypatch):
    # Every process of a node choosing the first GPU would put all their models on it.
    from dl4py.backend.cuda_environment import Environment

    monkeypatch.setattr(Environment, "usable_cuda_devices", lambda self: [2, 5])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert selection._first_permitted_gpu() == torch.device("cuda", 2)
    for rank, index in [("0", 2), ("1", 5), ("2", 2)]:
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert selection._first_permitted_gpu() == torch.device("cuda", index)
