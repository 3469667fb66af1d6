"""What the two steps with worker processes share (parallel, model-parallel): worker 0's
readings relayed to the step, a part that keeps a failed worker's traceback, toy data."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from dl4py.errors import WorkerError
from dl4py.train.listeners import TrainingListener
from gpu_steps._check import Check

# Two ranks on one device: NCCL refuses that, so dl4py must pick gloo (preflight.process_group_backend).
EXPECTED_BACKEND = "gloo"


class WorkerProbe(TrainingListener):
    """Worker 0's readings at each epoch's end (``rows``), taken in worker 0 itself: the
    ParallelWrapper gives worker 0 the part a listener hands out (``worker_part``, as for
    StatsListener's collector) and relays what it makes back here (``receive``)."""

    def __init__(self):
        self.rows: list[dict] = []

    def worker_part(self, workers: int) -> "ProbePart":
        return ProbePart()

    def receive(self, records: list[dict]) -> None:
        self.rows.extend(records)


class ProbePart(TrainingListener):
    """Runs in worker 0. The device's peak counts from the fit's start (the replica is built
    by then); ``steps_peak_mib`` as of its last step, before the epoch's end (where a
    sharded or tensor-parallel replica is gathered whole)."""

    def __init__(self):
        self.pending: list[dict] = []
        self.steps_peak = None

    def on_fit_start(self, model):
        if torch.cuda.is_initialized():  # the worker's device is its current one
            torch.cuda.reset_peak_memory_stats()

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if torch.cuda.is_initialized():
            self.steps_peak = torch.cuda.max_memory_allocated()  # the allocator's count: no wait for the device

    def on_epoch_end(self, model, summary):
        cuda = torch.cuda.is_initialized()
        self.pending.append({
            "epoch": summary.epoch, "last_of_fit": False,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "allocated_mib": mib(torch.cuda.memory_allocated()) if cuda else None,
            "reserved_mib": mib(torch.cuda.memory_reserved()) if cuda else None,
            "peak_mib": mib(torch.cuda.max_memory_allocated()) if cuda else None,
            "steps_peak_mib": mib(self.steps_peak) if self.steps_peak is not None else None,
            "rss_mib": rss_mib(os.getpid()),
        })

    def drain(self) -> list[dict]:
        rows, self.pending = self.pending, []
        return rows


@contextmanager
def part(check: Check, name: str):
    """``check.part``, keeping the end of a failed worker's traceback as a figure: a
    WorkerError's first line, all the part records, only says which worker failed."""
    with check.part(name):
        try:
            yield
        except WorkerError as exc:
            check.figure(f"{name}_worker_error", str(exc).strip().splitlines()[-4:])
            raise


def rss_mib(pid: int) -> float | None:
    """A process's resident memory (Linux /proc); None once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return mib(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return None


def mib(n: int) -> float:
    return round(n / 2**20, 2)


def toy_examples(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of 5 features and 3 classes a small network learns in a few steps."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=generator)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
