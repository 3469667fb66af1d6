"""The doctor's in-process checks: backend, CUDA devices, collectives, allocator, /dev/shm.

Each takes nothing and returns a ``Result``; the runner bounds its time and turns an
exception into a failed verdict. The GPU ones run only where a GPU is usable (the runner
skips them otherwise), so here they may assume CUDA works enough to be asked.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from dl4py.backend.cuda_environment import ALLOC_VARS, environment
from dl4py.backend.selection import resolve_backend
from dl4py.doctor.result import FAILED, PASSED, SKIPPED, WARNING, Result
from dl4py.errors import DL4PyError

GIB = 2**30
SHM_WARN_BYTES = 1 * GIB  # below this, worker processes sharing batches run out of room
SHM = "/dev/shm"
_MATMUL_N = 256  # ones @ ones is exactly N in every float format, TF32 included


def backend() -> Result:
    try:
        chosen = resolve_backend()
    except DL4PyError as exc:
        return Result(FAILED, str(exc), "correct or unset the variable or setting it names "
                                        "(BACKEND_PRIORITY_CPU/GPU, DL4PY_DEVICES), or train with --backend cpu")
    return Result(PASSED, f"{chosen}: {chosen.reason}")


def cuda_devices() -> Result:
    seen, broken = [], []
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        try:
            ones = torch.ones(_MATMUL_N, _MATMUL_N, device=device)
            right = bool(((ones @ ones) == _MATMUL_N).all())  # .all() -> bool waits for the kernel
            free, total = torch.cuda.mem_get_info(index)
        except RuntimeError as exc:
            broken.append(f"cuda:{index}: {str(exc).strip().splitlines()[0]}")
            continue
        name = torch.cuda.get_device_properties(index).name
        seen.append(f"cuda:{index} {name} {total / GIB:.1f} GiB ({free / GIB:.1f} free)")
        if not right:
            broken.append(f"cuda:{index}: a matrix product came out wrong")
    if broken:
        return Result(FAILED, "; ".join(broken), "nvidia-smi shows the devices and what holds them; a device in "
                                                 "exclusive mode held by another process, or a driver fault, "
                                                 "is unusable: leave it out with CUDA_VISIBLE_DEVICES")
    return Result(PASSED, f"{len(seen)} usable: " + "; ".join(seen))


def gloo() -> Result:
    if not dist.is_available():
        return Result(FAILED, f"this PyTorch build ({torch.__version__}) has no torch.distributed",
                      "install a PyTorch build with distributed support (the official wheels have it)")
    if not dist.is_gloo_available():
        return Result(FAILED, f"this PyTorch build ({torch.__version__}) has no gloo backend",
                      "install a PyTorch build with gloo (the official wheels have it); CPU ranks need it")
    return Result(PASSED, "available: CPU ranks exchange through gloo")


def nccl() -> Result:
    if not (dist.is_available() and dist.is_nccl_available()):
        return Result(FAILED, f"this PyTorch build ({torch.__version__}) has no NCCL backend",
                      "install a CUDA build of PyTorch from the official wheels, which bundle NCCL")
    version = ".".join(map(str, torch.cuda.nccl.version()))
    count = torch.cuda.device_count()
    if count < 2:
        return Result(PASSED, f"NCCL {version} available; one GPU, so no NCCL all-reduce here "
                              "(NCCL takes one rank per GPU)")
    return Result(PASSED, f"NCCL {version} available for {count} GPUs")


def allocator() -> Result:
    try:
        env = environment()
        env.check()
    except DL4PyError as exc:
        return Result(FAILED, str(exc), "correct or unset the variable it names (docs/environment.md)")
    sources = env.set_by()
    conf = [f"{var}={os.environ[var]}" for var in ALLOC_VARS if os.environ.get(var)]
    settings = [f"{name}={getattr(env, name)} ({sources[name]})" for name in
                ("caching", "max_device_cache", "max_cacheable_chunk", "gc_threshold", "expandable_segments")
                if name in sources]
    detail = ("; ".join(conf + settings)
              or "defaults: caching allocator on, no memory cap, PYTORCH_CUDA_ALLOC_CONF unset")
    for name, healthy, why in (("caching", True, "every allocation goes straight to cudaMalloc"),
                               ("debug", False, "every kernel launch waits for the kernel")):
        if name in sources and getattr(env, name) != healthy:
            return Result(WARNING, f"{detail}; {name}={getattr(env, name)} from {sources[name]}: {why}, which is "
                                   "slow", f"unset {sources[name]} unless you are debugging")
    return Result(PASSED, detail)


def dev_shm() -> Result:
    if not os.path.isdir(SHM):
        return Result(SKIPPED, f"no {SHM} on this system (not Linux): worker processes share memory another way")
    stats = os.statvfs(SHM)
    total, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    detail = f"{total / GIB:.2f} GiB, {free / GIB:.2f} GiB free"
    try:
        with tempfile.NamedTemporaryFile(dir=SHM, prefix="dl4py-doctor-"):
            pass
    except OSError as exc:
        return Result(FAILED, f"{detail}, but not writable: {exc.strerror or exc}",
                      f"worker processes share tensors in {SHM}: make it writable (mode 1777)")
    if total < SHM_WARN_BYTES or free < SHM_WARN_BYTES:
        return Result(WARNING, f"{detail}: worker processes share their batches and tensors there",
                      "give it more: docker run --shm-size=8g (or --ipc=host); on Kubernetes, an emptyDir "
                      "with medium: Memory mounted at /dev/shm")
    return Result(PASSED, detail)
