"""One rank of the doctor's rendezvous check: meet the others, all-reduce, report.

    python -m dl4py.doctor.rank RANK WORLD BACKEND INIT_METHOD DEADLINE

It prints one JSON line as it enters each stage and one when it ends (``error`` set when a
stage failed), so whoever kills it still knows where it was. ``rendezvous.py`` kills it at
DEADLINE (seconds since the epoch) whatever it is doing: torch.distributed's own timeout is
set a second before that, for its message, but it does not bound everything (a client
connected to a port that accepts and never answers waits past it).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dl4py.doctor.result import first_line, report_stage

MARGIN_S = 1.0  # torch's timeout fires this long before the kill


def main(argv: list[str]) -> int:
    rank, world, backend, init_method, deadline = int(argv[0]), int(argv[1]), argv[2], argv[3], float(argv[4])
    return run_in_group(rank, world, backend, init_method, deadline, _all_reduce)


def _all_reduce(report: dict, device: torch.device, rank: int, world: int) -> None:
    report_stage(report, "all_reduce")
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    report["value"] = value.item()  # waits for the collective to finish


def run_in_group(rank: int, world: int, backend: str, init_method: str, deadline: float, work) -> int:
    """One rank's life in a process group, reported as it goes: its device (a GPU of its own
    under NCCL), the rendezvous (torch's timeout MARGIN_S before ``deadline``, seconds since the
    epoch), ``work(report, device, rank, world)``, the group destroyed; the last JSON line is the
    report, ``error`` set when a stage failed. The exit status: 0, or 1 on error. Also the rank
    program of ``plan/measure.py``'s collectives."""
    report = {"rank": rank}
    try:
        device = torch.device("cpu")
        if backend == "nccl":  # one GPU per rank: NCCL refuses two ranks on one device
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        report_stage(report, "rendezvous")
        timeout = timedelta(seconds=max(1.0, deadline - time.time() - MARGIN_S))
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        try:
            work(report, device, rank, world)
        finally:
            dist.destroy_process_group()
        report["stage"] = "done"
    except Exception as exc:
        report["error"] = first_line(exc)
    print(json.dumps(report), flush=True)
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
