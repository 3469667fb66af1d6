"""What a run trained on: versions, backend, device, precision, the CUDA environment settings.

Written to a run directory's ``environment.json`` and into the "static" record of its
``metrics.jsonl``, so that any number a run reports can be traced to the machine it ran on.
"""

from __future__ import annotations

import platform

import torch

from dl4py.backend.cuda_environment import environment


def environment_record(model) -> dict:
    """The environment of an initialised ``model``: dl4py, torch, Python, platform, CPU
    threads, backend (and why it was chosen), device, precision, CUDA version, the
    environment settings, and the GPU's name on a GPU."""
    device = model.backend.device
    record = {
        "dl4py": __import__("dl4py").__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "backend": model.backend.name,
        "backend_reason": model.backend.reason,
        "device": str(device),
        "precision": model.precision.name,
        "cuda": torch.version.cuda,
        "environment": environment().to_dict(),
    }
    if device.type == "cuda":
        record["device_name"] = torch.cuda.get_device_name(device)
    return record


def with_worker_threads(record: dict, workers: int, threads: dict[int, int]) -> dict:
    """``record`` with what a parallel fit's workers trained with: ``workers``, and
    ``worker_threads``, the intra-op threads each worker reported by rank (under torchrun,
    only this rank's is known here). ``cpu_threads`` stays this process's own."""
    return {**record, "workers": workers, "worker_threads": {str(rank): threads[rank] for rank in sorted(threads)}}
