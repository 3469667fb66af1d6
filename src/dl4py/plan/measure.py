"""Measuring a device profile (``plan.profile``'s figures) on this machine: ``dl4py plan --profile``.

Compute: matrix products and convolutions of a few sizes per precision, up to the plateau,
an element-wise add for bandwidth, a tiny operator for dispatch; each size warmed up, then
the median of timed samples. Collectives: each count of ranks in processes of its own, over
gloo (CPU) or NCCL (CUDA), bounded by the doctor's ``run_bounded`` and killed at the deadline;
each rank times each collective at a few message sizes, and a latency and a bandwidth are
fitted to them (``fit_latency_bandwidth``); then what a collective costs inside a sharded
training step (``sharded_probe``).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dl4py.doctor.children import DEADLINE, run_bounded
from dl4py.doctor.rank import run_in_group
from dl4py.doctor.result import last_report, report_stage
from dl4py.errors import BackendError, ConfigError
from dl4py.parallel.threads import worker_threads
from dl4py.plan.profile import (COLLECTIVES, KINDS, LOCAL, MEASURED, PRECISIONS, Curve, DeviceProfile, Link,
                                ShardedCollective, Source)
from dl4py.plan.sharded_probe import sharded_collective_seconds

# Sizes timed: square matrix products (n), 3x3 convolutions (batch, in, out, height = width),
# element-wise buffers (bytes), collective messages (bytes). CPU sizes stop where a call
# would take seconds on a laptop; GPU ones reach where an H100 plateaus.
MATMUL_N = {"cpu": (32, 128, 512, 1024, 2048), "cuda": (256, 1024, 4096, 8192)}
CONV_SHAPES = {"cpu": ((8, 8, 16, 16), (32, 32, 32, 28), (64, 64, 64, 28), (64, 128, 128, 28)),
               "cuda": ((32, 64, 64, 56), (128, 128, 128, 56), (256, 256, 256, 56))}
ELEMENTWISE_BYTES = {"cpu": 64 * 2**20, "cuda": 512 * 2**20}  # each of a + b -> out: past every cache
MESSAGE_BYTES = (4 * 2**10, 64 * 2**10, 2**20, 16 * 2**20)
QUICK_MESSAGE_BYTES = (4 * 2**10, 256 * 2**10, 4 * 2**20)
REPEATS, QUICK_REPEATS = 15, 4
MIN_SAMPLES = 3
MIN_SAMPLE_S = 2e-3  # a sample repeats a short call until it lasts this long: the clock's resolution
MAX_CALLS = 1000
WARM_UP_S = 0.4  # per size: long enough for oneDNN's first calls of a shape, which are 1000x slower
PAST_PLATEAU = 0.5  # a size whose rate falls below this much of the best so far ends the curve (noise
# on a shared CPU moves a point by a third; CPU half precision falls by half and more)
COMPUTE_SHARE = 0.5  # of budget_s, for compute; collectives get the rest


def measure_profile(device: str = "cpu", ranks: tuple[int, ...] | None = None, backend: str | None = None,
                    budget_s: float = 60.0, threads: int | None = None, quick: bool = False) -> DeviceProfile:
    """Time this machine: matrix products and convolutions per precision (a few sizes each,
    up to the plateau), an element-wise add, a tiny operator, and each collective among each
    count of ``ranks`` local processes over ``backend`` (default gloo on CPU, nccl on CUDA;
    default ranks: 2 on CPU, every visible GPU on CUDA when there are two or more).

    Bounded by ``budget_s`` (about half for compute); a collective that fails or is still
    running at the end is a BackendError, and no rank process outlives this call. ``quick``
    (for tests): float only, fewer sizes and repeats. ``threads``: CPU intra-op threads to
    measure with (default: PyTorch's current setting), restored afterwards. Rates are those
    of this process's settings: on CUDA, ``float`` matrix products are FP32 unless TF32 was
    turned on (``environment.tf32``), and convolutions TF32 unless it was turned off.
    """
    target = torch.device(device)
    if target.type not in ("cpu", "cuda"):
        raise ConfigError("device", f"must be cpu or cuda[:N], got {device!r}")
    if target.type == "cuda" and not torch.cuda.is_available():
        raise BackendError(f"device {device} was named but CUDA is not available here")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or budget_s <= 0:
        raise ConfigError("budget_s", f"must be a positive number of seconds, got {budget_s!r}")
    if threads is not None and (target.type != "cpu" or isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ConfigError("threads", f"is for the CPU and must be a positive whole number, got {threads!r}")
    backend = backend or ("nccl" if target.type == "cuda" else "gloo")
    ranks = _rank_counts(target, backend, ranks)
    deadline = time.monotonic() + budget_s
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used_threads = torch.get_num_threads() if target.type == "cpu" else None
        compute = _measure_compute(target, budget_s * COMPUTE_SHARE, quick)
    finally:
        torch.set_num_threads(threads_before)
    links, sharded = [], []
    for index, world in enumerate(ranks):
        share = (deadline - time.monotonic()) / (len(ranks) - index)  # what is left, split evenly
        measured_links, collective_s = _measure_links(backend, world, time.monotonic() + share, quick)
        links += measured_links
        sharded.append(ShardedCollective(backend, world, collective_s))
    hardware = torch.cuda.get_device_name(target) if target.type == "cuda" else _cpu_name()
    source = Source(MEASURED, hardware, datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    torch.__version__)
    return DeviceProfile(hardware, target.type, _memory_bytes(target), source=source, threads=used_threads,
                         links=tuple(links), sharded=tuple(sharded), **compute)


def _rank_counts(target: torch.device, backend: str, ranks) -> tuple[int, ...]:
    if backend not in ("gloo", "nccl") or (backend == "nccl" and target.type != "cuda"):
        raise ConfigError("backend", f"must be gloo, or nccl on CUDA, got {backend!r}")
    gpus = torch.cuda.device_count() if target.type == "cuda" else 0
    if ranks is None:
        return (gpus,) if gpus >= 2 else () if target.type == "cuda" else (2,)
    if not isinstance(ranks, (tuple, list)) or any(isinstance(r, bool) or not isinstance(r, int) or r < 2
                                                   for r in ranks):
        raise ConfigError("ranks", f"must be counts of processes, each 2 or more, got {ranks!r}")
    if backend == "nccl" and any(r > gpus for r in ranks):
        raise ConfigError("ranks", f"nccl takes one GPU per rank and {gpus} are visible, got {tuple(ranks)}")
    return tuple(ranks)


def _measure_compute(target: torch.device, budget_s: float, quick: bool) -> dict:
    # bfloat16 arithmetic is Ampere's (compute capability 8.0), as the model's own check says
    has_bf16 = target.type == "cpu" or torch.cuda.get_device_capability(target) >= (8, 0)
    precisions = ["float"] if quick else [p for p in PRECISIONS if p != "bfloat16" or has_bf16]
    repeats = QUICK_REPEATS if quick else REPEATS
    share = budget_s / (len(KINDS) * len(precisions) + 2)  # + bandwidth and overhead
    matmul_n = MATMUL_N[target.type][:3:2] if quick else MATMUL_N[target.type]
    conv_shapes = CONV_SHAPES[target.type][:2] if quick else CONV_SHAPES[target.type]
    timer = _Timer(target, repeats)
    matmul = {p: timer.curve([_matmul(n, PRECISIONS[p], target) for n in matmul_n], share) for p in precisions}
    conv = {p: timer.curve([_conv(shape, PRECISIONS[p], target) for shape in conv_shapes], share)
            for p in precisions}
    nbytes = ELEMENTWISE_BYTES[target.type] // (4 if quick else 1)
    bandwidth = 3 * nbytes / timer.seconds(_add(nbytes // 4, target), time.monotonic() + share)  # 2 reads, 1 write
    overhead = timer.seconds(_add(1, target), time.monotonic() + share)
    return {"matmul": matmul, "conv": conv, "memory_bandwidth": bandwidth, "overhead_s": overhead}


def _add(elements: int, target: torch.device):
    a, b, out = (torch.ones(elements, device=target) for _ in range(3))
    return lambda: torch.add(a, b, out=out)


def _matmul(n: int, dtype: torch.dtype, target: torch.device):
    def make():
        a, b, out = (torch.randn(n, n, device=target).to(dtype) for _ in range(3))
        return lambda: torch.matmul(a, b, out=out)
    return 2 * n**3, make


def _conv(shape: tuple[int, int, int, int], dtype: torch.dtype, target: torch.device):
    batch, channels_in, channels_out, side = shape
    def make():
        x = torch.randn(batch, channels_in, side, side, device=target).to(dtype)
        w = torch.randn(channels_out, channels_in, 3, 3, device=target).to(dtype)
        return lambda: F.conv2d(x, w, padding=1)
    return 2 * batch * channels_out * side * side * channels_in * 9, make


class _Timer:
    """Median seconds per call, the device synchronized around each sample."""

    def __init__(self, target: torch.device, repeats: int):
        self.repeats = repeats
        self.sync = (lambda: torch.cuda.synchronize(target)) if target.type == "cuda" else (lambda: None)

    def seconds(self, run, until: float) -> float:
        warm_until, fastest, calls = min(time.monotonic() + WARM_UP_S, until), math.inf, 0
        while calls < 2 or (time.monotonic() < warm_until and calls < MAX_CALLS):
            start = time.perf_counter()
            run()  # the first calls pay for allocation and set-up: on a CPU, a dozen 20 ms calls
            self.sync()
            fastest, calls = min(fastest, time.perf_counter() - start), calls + 1
        # the fastest call sizes the samples: a slow one was set-up, or another process's turn on a core
        calls = min(MAX_CALLS, max(1, int(MIN_SAMPLE_S / max(fastest, 1e-9))))
        samples = []
        while len(samples) < self.repeats and (len(samples) < MIN_SAMPLES or time.monotonic() < until):
            start = time.perf_counter()
            for _ in range(calls):
                run()
            self.sync()
            samples.append((time.perf_counter() - start) / calls)
        return statistics.median(samples)

    def curve(self, cases: list, share_s: float) -> Curve:
        """Sizes in order until the rate falls past its plateau (CPU half precision does) or
        the next size would not fit in ``share_s``; at least the first two while time is left:
        on a loaded machine a first size's calls can all wait on the thread pool (a 32x32
        product at 4 MFLOP/s), and a budget projected from that one point would end the curve there."""
        until, points = time.monotonic() + share_s, []
        for index, (flops, make) in enumerate(cases):
            seconds = self.seconds(make(), until)
            points.append((flops, flops / seconds))
            best = max(rate for _, rate in points)
            if points[-1][1] < PAST_PLATEAU * best or index + 1 == len(cases):
                break
            # as if the rate went on falling as much as it fell from the best: CPU half does
            next_call_s = seconds * cases[index + 1][0] / flops * best / points[-1][1]
            out_of_time = time.monotonic() + (MIN_SAMPLES + 2) * next_call_s > until
            if time.monotonic() > until or (index >= 1 and out_of_time):
                break
        return Curve(tuple(points))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _memory_bytes(target: torch.device) -> int:
    if target.type == "cuda":
        return torch.cuda.get_device_properties(target).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# -- collectives -------------------------------------------------------------------------

# The rank leaves by os._exit once its report is out: after FSDP2 has run in a process that timed
# collectives, freeing gloo's groups at the interpreter's exit aborted a rank now and then
# ("terminate called without an active exception", about one measurement in six among 4 ranks),
# failing a measurement whose figures were all in.
RANK_PROGRAM = ("import os, sys; from dl4py.plan.measure import link_rank_main; code = link_rank_main(sys.argv[1:]); "
                "sys.stdout.flush(); sys.stderr.flush(); os._exit(code)")


def _measure_links(backend: str, world: int, deadline: float, quick: bool) -> tuple[list[Link], float]:
    """The collectives' links among ``world`` ranks, and the seconds of one collective in a
    sharded step (``sharded_probe``)."""
    sizes = QUICK_MESSAGE_BYTES if quick else MESSAGE_BYTES
    repeats = QUICK_REPEATS if quick else REPEATS // 2
    with socket.socket() as probe:  # a free loopback port; rank 0 listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    wall_deadline = time.time() + (deadline - time.monotonic())
    commands = [[sys.executable, "-c", RANK_PROGRAM, str(rank), str(world), backend, f"tcp://127.0.0.1:{port}",
                 repr(wall_deadline), ",".join(map(str, sizes)), str(repeats)] for rank in range(world)]
    exits = run_bounded(commands, deadline)
    reports = [last_report(e.stdout) for e in exits]
    what = f"timing {backend} collectives among {world} ranks"
    for rank, (end, report) in enumerate(zip(exits, reports)):
        if end.killed == DEADLINE:
            raise BackendError(f"{what}: rank {rank} was still in {report.get('stage', 'start-up')} at the "
                               "budget's end and was killed; give a larger budget_s on a busy machine")
        if end.killed is None and (end.returncode != 0 or "error" in report):
            detail = report.get("error") or (end.stderr.strip().splitlines() or [f"exit {end.returncode}"])[-1]
            raise BackendError(f"{what}: rank {rank} failed in {report.get('stage', 'start-up')}: {detail}")
    timings = reports[0].get("timings", {})
    return [Link(name, backend, world, *fit_latency_bandwidth(samples), LOCAL,
                 tuple((int(n), float(t)) for n, t in samples)) for name, samples in timings.items()], \
        float(reports[0]["sharded_s"])


def fit_latency_bandwidth(samples) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of ``seconds = latency + bytes / bandwidth`` through
    (bytes, seconds) samples: least squares of the relative error, so that small messages
    set the latency and large ones the bandwidth; the latency is kept at 0 or more."""
    weights = [1 / t**2 for _, t in samples]
    sw = sum(weights)
    sx = sum(w * n for w, (n, _) in zip(weights, samples))
    sy = sum(w * t for w, (_, t) in zip(weights, samples))
    sxx = sum(w * n * n for w, (n, _) in zip(weights, samples))
    sxy = sum(w * n * t for w, (n, t) in zip(weights, samples))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    latency = (sy - slope * sx) / sw
    if slope <= 0:  # no growth with size (noise, or sizes too alike): the largest message's rate
        return min(t for _, t in samples), max(n / t for n, t in samples)
    if latency < 0:  # through the origin instead
        latency, slope = 0.0, sxy / sxx
    return latency, 1 / slope


def link_rank_main(argv: list[str]) -> int:
    """One rank timing collectives: ``RANK WORLD BACKEND INIT_METHOD DEADLINE SIZES REPEATS``.
    Prints a JSON line as it enters each stage and one at the end (``timings``: collective ->
    [[bytes, median seconds], ...]; ``sharded_s``: one collective of a sharded step; or
    ``error``): the doctor's rank program (``run_in_group``). On a CPU each rank takes the
    threads dl4py gives each of ``WORLD`` workers (``worker_threads``), as a plan's ranks would."""
    rank, world, backend, init_method = int(argv[0]), int(argv[1]), argv[2], argv[3]
    deadline, sizes, repeats = float(argv[4]), [int(s) for s in argv[5].split(",")], int(argv[6])

    def timings(report: dict, target: torch.device, rank: int, world: int) -> None:
        if target.type == "cpu":
            torch.set_num_threads(worker_threads(world))
        report["timings"] = {name: [[n, _time_collective(name, n, world, target, repeats)] for n in sizes]
                             for name in COLLECTIVES if report_stage(report, name) is None}
        report_stage(report, "sharded")
        report["sharded_s"] = sharded_collective_seconds(rank, world, target, repeats)

    return run_in_group(rank, world, backend, init_method, deadline, timings)


def _time_collective(name: str, nbytes: int, world: int, target: torch.device, repeats: int) -> float:
    tensor = torch.ones(nbytes // 4, device=target)
    gathered = torch.empty(world * tensor.numel(), device=target)
    run = {"all_reduce": lambda: dist.all_reduce(tensor),
           "all_gather": lambda: dist.all_gather_into_tensor(gathered, tensor),
           "broadcast": lambda: dist.broadcast(tensor, 0)}[name]
    sync = (lambda: torch.cuda.synchronize(target)) if target.type == "cuda" else (lambda: None)
    peers = {"device_ids": [target.index]} if target.type == "cuda" else {}  # NCCL's barrier asks which GPU
    samples = []
    for index in range(repeats + 2):  # two warm-ups: the first call sets up the connections' buffers
        dist.barrier(**peers)  # start together, so a rank's wait for a late peer is not timed
        start = time.perf_counter()
        run()
        sync()
        if index >= 2:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)
