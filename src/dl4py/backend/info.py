"""What ``dl4py info`` reports: the backend chosen and why, devices, versions, settings."""

from __future__ import annotations

import os
import platform

import torch

from dl4py.backend.cuda_environment import VARIABLES, environment
from dl4py.backend.precision import get_default_dtype
from dl4py.backend.selection import cuda_unavailable_reason, get_backend_choice, resolve_backend
from dl4py.errors import BackendError
from dl4py.version import __version__


def collect_info() -> dict:
    env = environment()  # reads the DL4PY_* variables; reporting applies nothing
    backend, backend_error = _backend_or_error()
    devices = []
    if cuda_unavailable_reason() is None:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            devices.append({
                "index": index,
                "name": props.name,
                "total_memory_bytes": total,
                "free_memory_bytes": free,
                "compute_capability": f"{props.major}.{props.minor}",
                "bf16_supported": props.major >= 8,
                "fp16_supported": props.major >= 6 or (props.major, props.minor) >= (5, 3),
                "multiprocessors": props.multi_processor_count,
            })
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "backend": backend.name if backend else None,
        "device": str(backend.device) if backend else None,
        "backend_reason": backend.reason if backend else backend_error,
        "backend_setting": get_backend_choice(),
        "priorities": {
            "BACKEND_PRIORITY_CPU": os.environ.get("BACKEND_PRIORITY_CPU", "0 (default)"),
            "BACKEND_PRIORITY_GPU": os.environ.get("BACKEND_PRIORITY_GPU", "100 (default)"),
        },
        "cuda_unavailable_reason": cuda_unavailable_reason(),
        "devices": devices,
        "versions": {
            "dl4py": __version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": cudnn,
            "python": platform.python_version(),
        },
        "cpu": {"threads": torch.get_num_threads(), "logical_cores": os.cpu_count()},
        "default_dtype": get_default_dtype(),
        "environment": env.to_dict(),
        "environment_detail": {
            "set_by": env.set_by(),
            "usable_cuda_devices": _usable(env),
            "variables": {var: os.environ[var] for var in VARIABLES if var in os.environ},
        },
    }


def _backend_or_error():
    """(backend, None), or (None, why) when the settings allow none: reporting that is what
    ``dl4py info`` is for, e.g. ``DL4PY_DEVICES=0,1`` on a one-GPU machine."""
    try:
        return resolve_backend(quiet=True), None  # the report says the reason: no second line
    except BackendError as exc:
        return None, f"no backend: {exc}"


def _usable(env) -> list[int] | str:
    try:
        return env.usable_cuda_devices()
    except BackendError as exc:
        return str(exc)


def format_info(info: dict) -> str:
    lines = [
        f"backend        {info['backend']} ({info['device']})" if info["backend"] else "backend        none",
        f"  why          {info['backend_reason']}",
        "versions       " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
        f"cpu threads    {info['cpu']['threads']} of {info['cpu']['logical_cores']} logical cores",
        f"default dtype  {info['default_dtype']}",
    ]
    if info["devices"]:
        for d in info["devices"]:
            lines.append(
                f"cuda:{d['index']}         {d['name']}, {d['total_memory_bytes'] / 2**30:.1f} GiB "
                f"({d['free_memory_bytes'] / 2**30:.1f} free), compute {d['compute_capability']}, "
                f"bf16 {'yes' if d['bf16_supported'] else 'no'}"
            )
    else:
        lines.append(f"cuda           unavailable: {info['cuda_unavailable_reason']}")
    set_by = info["environment_detail"]["set_by"]
    settings = [f"{k} {_show(info['environment'][k])} ({src})" for k, src in set_by.items()]
    lines.append("environment    " + (", ".join(settings) if settings else "defaults (nothing set)"))
    for var, value in info["environment_detail"]["variables"].items():
        lines.append(f"  {var}={value}")
    return "\n".join(lines)


def _show(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)
