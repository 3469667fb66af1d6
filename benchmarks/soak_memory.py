"""What the soak scenarios measure, and the rule that judges it.

``MemoryProbe`` reads the resident memory (RSS) of a set of processes (the one that
trains or serves, and the workers it started) and, with CUDA, this process's device
memory. A scenario records one ``Sample`` per iteration (a fit, an epoch, a run) or per
few seconds of load into a ``Trace``; ``judge`` compares memory after the warm-up with
memory at the end against an explicit bound.

The bound: growth after warm-up <= max(``floor_mb``, ``percent`` of the warm RSS). Memory
that creeps by a fixed amount per iteration fails it once the iterations add up; an
allocator settling in (a few hundred kB here and there, decelerating) does not. The
figures come from measurement: see ``soak.py``'s BOUNDS and benchmarks/results/soak-*.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import statistics
import sys
from dataclasses import asdict, dataclass, field

import psutil
import torch

MB = 2**20


@dataclass(frozen=True)
class Sample:
    label: str  # "fit 3", "epoch 2", "run 7", "t=30s"
    rss: int  # bytes, summed over the processes probed
    device_used: int | None = None  # bytes in use on the CUDA devices, every process's (workers' too)
    device_allocated: int | None = None  # bytes of CUDA memory this process's tensors hold
    device_reserved: int | None = None  # bytes its caching allocator holds


@dataclass(frozen=True)
class Bound:
    """Allowed growth after warm-up: max(``floor_mb``, ``percent`` % of the warm figure)."""

    floor_mb: float
    percent: float

    def allowed(self, warm: int) -> int:
        return int(max(self.floor_mb * MB, warm * self.percent / 100))

    def __str__(self) -> str:
        return f"max({self.floor_mb:g} MB, {self.percent:g}% of warm)"


@dataclass
class Trace:
    """A scenario's samples. ``warmup``: how many samples are the warm-up; ``window``: how
    many samples each end's figure is the median of (1 for samples taken after a whole
    iteration; more for samples taken under load, where requests in flight come and go)."""

    scenario: str
    warmup: int
    window: int = 1
    samples: list[Sample] = field(default_factory=list)
    notes: dict = field(default_factory=dict)  # what ran: counts, requests answered, failures

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)


@dataclass(frozen=True)
class Verdict:
    scenario: str
    warm_label: str
    end_label: str
    warm_rss: int
    end_rss: int
    allowed: int
    bound: str
    device_growth: int | None  # device memory in use, end - warm (CUDA only)
    device_allowed: int | None
    passed: bool
    reason: str  # why it failed; "" when it passed

    @property
    def growth(self) -> int:
        return self.end_rss - self.warm_rss

    def line(self) -> str:
        """One line: the scenario, the figures and pass/fail."""
        text = (f"{self.scenario}: RSS {self.warm_rss / MB:.1f} MB after warm-up ({self.warm_label}) -> "
                f"{self.end_rss / MB:.1f} MB at the end ({self.end_label}), growth {self.growth / MB:+.1f} MB, "
                f"allowed {self.allowed / MB:.1f} MB [{self.bound}]")
        if self.device_growth is not None:
            text += f"; device memory {self.device_growth / MB:+.1f} MB (allowed {self.device_allowed / MB:.1f} MB)"
        return text + (": pass" if self.passed else f": FAIL ({self.reason})")

    def to_dict(self) -> dict:
        return {**asdict(self), "growth": self.growth}


def judge(trace: Trace, bound: Bound) -> Verdict:
    """Memory after the warm-up against memory at the end; fails when it grew past ``bound``
    or when the scenario noted failures of its own (``notes["failures"]``)."""
    samples, k = trace.samples, trace.window
    if len(samples) < trace.warmup + k:
        raise ValueError(f"{trace.scenario}: {len(samples)} samples, too few for a warm-up of {trace.warmup} "
                         f"and an end window of {k}: run it longer")
    warm_part = samples[max(0, trace.warmup - k):trace.warmup] or samples[:1]
    end_part = samples[-k:]
    warm, end = _median(s.rss for s in warm_part), _median(s.rss for s in end_part)
    allowed = bound.allowed(warm)
    reasons = []
    if end - warm > allowed:
        reasons.append(f"RSS grew {(end - warm) / MB:.1f} MB > {allowed / MB:.1f} MB")
    device_growth = device_allowed = None
    if all(s.device_used is not None for s in (*warm_part, *end_part)):
        device_warm = _median(s.device_used for s in warm_part)
        device_growth = _median(s.device_used for s in end_part) - device_warm
        device_allowed = bound.allowed(device_warm)
        if device_growth > device_allowed:
            reasons.append(f"device memory grew {device_growth / MB:.1f} MB > {device_allowed / MB:.1f} MB")
    if trace.notes.get("failures"):
        reasons.append(f"{trace.notes['failures']} failed requests or runs")
    return Verdict(trace.scenario, warm_part[-1].label, end_part[-1].label, warm, end, allowed, str(bound),
                   device_growth, device_allowed, not reasons, "; ".join(reasons))


class MemoryProbe:
    """RSS of ``pids()`` (called at each sample: a pool's workers may be started later), and
    with CUDA the device memory in use. ``collect``: first run the garbage collector and hand
    this process's free heap pages back to the system (glibc's ``malloc_trim``), so that what
    is counted is what is still held, not cycles waiting for the next collection or blocks the
    allocator keeps for reuse (which made this process's RSS swing by several MB from one
    sample to the next). Other processes (workers, a server) are read as they are."""

    def __init__(self, pids, collect: bool = True):
        self.pids, self.collect = pids, collect

    def sample(self, label: str) -> Sample:
        if self.collect:
            gc.collect()
            _trim_heap()
        rss = sum(_rss(pid) for pid in self.pids())
        if not torch.cuda.is_available():
            return Sample(label, rss)
        # Device-wide (cudaMemGetInfo), so that worker processes' memory counts too; the
        # allocator's figures are this process's alone.
        used = 0
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            used += total - free
        return Sample(label, rss, used, torch.cuda.memory_allocated(), torch.cuda.memory_reserved())


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it (a server's own children, should it start any)."""
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _trim_heap() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    """glibc, which has ``malloc_trim``; None elsewhere (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess:  # ended between listing and reading: it holds nothing now
        return 0


def _median(values) -> int:
    return int(statistics.median(list(values)))
