"""Device slots: where each experiment's process runs, and the environment that pins it.

A GPU slot hides every other GPU (``CUDA_VISIBLE_DEVICES``), so an experiment cannot
touch, or leave a CUDA context on, a device it was not given. ``--per-device K`` puts
K slots on each device: small networks leave a GPU mostly idle, and several of them
share it well. Every slot gets an equal share of the CPU cores as its thread count
(``OMP_NUM_THREADS``, which torch reads at start): without it each process would start
one thread per core and they would fight over the cores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dl4py.backend.cuda_environment import environment
from dl4py.errors import ConfigError
from dl4py.parallel.threads import usable_cores

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class Slot:
    device: int | None  # CUDA index as this process sees it; None for the CPU
    index: int  # which of the device's slots
    threads: int
    visible: str = ""  # the CUDA_VISIBLE_DEVICES entry naming the device
    share: int = 1  # experiments sharing the device at once (--per-device)

    @property
    def name(self) -> str:
        return f"{'cpu' if self.device is None else f'gpu{self.device}'}#{self.index}"

    @property
    def backend(self) -> str:
        return "cpu" if self.device is None else "gpu"

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        env["CUDA_VISIBLE_DEVICES"] = self.visible  # "" hides every GPU from a CPU slot
        # The slot is the device list; a DL4PY_DEVICES meant for the sweep's view of the
        # GPUs would name indices that no longer exist inside the experiment.
        env.pop("DL4PY_DEVICES", None)
        if self.device is not None and self.share > 1 and "DL4PY_MAX_DEVICE_CACHE" not in env:
            # Each of the K experiments on a GPU may take 1/K of it: one cannot starve the
            # others, and batch_size auto sizes for its share (a config's own cap wins).
            env["DL4PY_MAX_DEVICE_CACHE"] = f"{1 / self.share:.4f}"
        for var in THREAD_VARS:
            env[var] = str(self.threads)
        env["PYTHONUNBUFFERED"] = "1"  # the log shows the last line even after a kill
        return env


def parse_devices(devices: str | Sequence[int] | None) -> list[int] | None:
    """``"all"`` (the GPUs dl4py may use, else the CPU), ``"cpu"``, ``"0,1"`` or ``[0, 1]``;
    returns CUDA indices, or None for the CPU."""
    if devices is None or (isinstance(devices, str) and devices.strip().lower() == "all"):
        return _all_gpus() or None
    if isinstance(devices, str):
        text = devices.strip().lower()
        if text == "cpu":
            return None
        try:
            devices = [int(part) for part in text.split(",")]
        except ValueError:
            raise ConfigError("--devices", f"must be all, cpu, or GPU indices such as 0,1; got {text!r}") from None
    indices = list(devices)
    if not indices or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in indices):
        raise ConfigError("--devices", f"must be all, cpu, or GPU indices such as 0,1; got {devices!r}")
    if len(set(indices)) != len(indices):
        raise ConfigError("--devices", f"lists a device twice: {indices}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [d for d in indices if d >= count]
    if missing:
        raise ConfigError("--devices", f"names GPU {missing[0]}, but {count} CUDA device(s) are visible"
                                       + ("; use --devices cpu" if count == 0 else ""))
    return indices


def _all_gpus() -> list[int]:
    if not torch.cuda.is_available():
        return []
    return environment().usable_cuda_devices()  # honours DL4PY_DEVICES and allow_multi_gpu


def make_slots(devices: list[int] | None, per_device: int, cpus: int | None = None,
               environ: Mapping[str, str] | None = None) -> list[Slot]:
    """``per_device`` slots on each device, ordered so the first experiments spread over all devices."""
    if isinstance(per_device, bool) or not isinstance(per_device, int) or per_device < 1:
        raise ConfigError("--per-device", f"must be a positive number of experiments per device, got {per_device!r}")
    gpus = devices or [None]
    threads = max(1, (cpus or usable_cores()) // (per_device * len(gpus)))
    # Indices are the sweep's view; the experiment needs the entry CUDA itself reads.
    visible = (environ if environ is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else None
    slots = []
    for k in range(per_device):
        for device in gpus:
            name = "" if device is None else (entries[device] if entries else str(device))
            slots.append(Slot(device, k, threads, name, per_device))
    return slots
