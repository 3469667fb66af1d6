"""Device profiles, measured not assumed: how fast a device multiplies matrices, convolves,
moves memory and exchanges with its peers, for the planner's time per step.

Who does what: ``DeviceProfile`` holds the figures and reads and writes them as JSON;
``measure_profile`` times them on this machine (collectives in ranks of their own,
bounded by the doctor's ``run_bounded``); ``builtin_profiles`` has published figures of
common GPUs, ``calibrate`` and ``cluster_profile``.

Units: FLOP/s, bytes/s, seconds, bytes. A compute rate depends on the size of the work:
a 32x32 matrix product runs at a small fraction of a 2048x2048 one, whose rate is the
plateau. So each (kind, precision) keeps a ``Curve`` of 2-5 measured points, FLOPs of one
call against FLOP/s, and ``rate(flops)`` interpolates between them. A measured point times
whole calls, dispatch included: the time of a matrix product is ``flops / rate(flops)``,
with no ``overhead_s`` on top. ``overhead_s`` is for the many small element-wise operators
(one tiny ``add``: a kernel launch on a GPU, PyTorch's dispatch on a CPU); ``memory_bandwidth`` is
what an element-wise operator moves per second, reads and writes counted.

A ``Link`` is one collective over one backend among ``ranks`` processes, fitted to
``seconds(bytes) = latency_s + bytes / bandwidth`` from timings at a few message sizes.
``bytes`` is the tensor each rank passes in: the buffer for all_reduce and broadcast, each
rank's own part for all_gather (it receives ``ranks`` times as much).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dl4py.doctor.children import DEADLINE, run_bounded
from dl4py.doctor.result import first_line
from dl4py.errors import BackendError, ConfigError
from dl4py.io import atomic_write_json

KINDS = ("matmul", "conv")
PRECISIONS = {"float": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16}
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")
LOCAL, NETWORK = "local", "network"  # a link between processes of one machine, or between machines
MEASURED, BUILTIN, CALIBRATED = "measured", "builtin", "calibrated"
FORMAT = 1  # the JSON layout's version

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
RANK_MARGIN_S = 1.0  # torch.distributed's own timeout fires this long before the kill


@dataclass(frozen=True)
class Curve:
    """Throughput against the size of one call: ``points`` are (FLOPs, FLOP/s), FLOPs ascending."""

    points: tuple[tuple[float, float], ...]

    @property
    def peak(self) -> float:
        return max(rate for _, rate in self.points)

    def rate(self, flops: float) -> float:
        """FLOP/s for a call of ``flops``: log-log interpolation between the points; below
        the smallest, that call's time (work too small to go faster: dispatch); above the
        largest, its rate (the plateau)."""
        (low, low_rate), (high, high_rate) = self.points[0], self.points[-1]
        if flops <= low:
            return low_rate * flops / low
        if flops >= high:
            return high_rate
        for (x0, r0), (x1, r1) in zip(self.points, self.points[1:]):
            if flops <= x1:
                t = math.log(flops / x0) / math.log(x1 / x0)
                return math.exp(math.log(r0) + t * math.log(r1 / r0))
        return high_rate

    def scaled(self, factor: float) -> "Curve":
        return Curve(tuple((flops, rate * factor) for flops, rate in self.points))


@dataclass(frozen=True)
class Link:
    """One collective among ``ranks`` processes over ``backend``: ``seconds(bytes)``."""

    collective: str
    backend: str
    ranks: int
    latency_s: float
    bandwidth: float  # bytes/s, of the tensor each rank passes in (see the module's docstring)
    scope: str = LOCAL
    samples: tuple[tuple[int, float], ...] = ()  # (bytes, median seconds) it was fitted to; none if derived

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Source:
    """Where the figures come from: ``measured`` here (date, torch, hardware), ``builtin``
    (published peaks times ``efficiency``), or ``calibrated`` (published, replaced by a
    measured run; ``efficiency`` then says what fraction of the published peaks it reached)."""

    kind: str
    hardware: str = ""
    date: str = ""
    torch: str = ""
    efficiency: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceProfile:
    """One device's speeds. ``matmul``/``conv``: precision name (``float``, ``bfloat16``,
    ``half``) -> ``Curve``; the rest as the module's docstring says."""

    name: str
    kind: str  # cpu or cuda
    memory_bytes: int
    matmul: dict[str, Curve]
    conv: dict[str, Curve]
    memory_bandwidth: float
    overhead_s: float
    source: Source
    threads: int | None = None  # CPU: the intra-op threads it was measured with
    links: tuple[Link, ...] = ()

    def rate(self, kind: str, precision: str, flops: float) -> float:
        """FLOP/s of one ``kind`` (matmul, conv) call of ``flops`` in ``precision``."""
        curves = getattr(self, kind) if kind in KINDS else None
        if curves is None or precision not in curves:
            have = ", ".join(f"{k} {p}" for k in KINDS for p in getattr(self, k)) or "none"
            raise BackendError(f"profile {self.name!r} has no {kind} rate in {precision} (it has: {have})")
        return curves[precision].rate(flops)

    def link(self, collective: str, ranks: int, scope: str = LOCAL) -> Link | None:
        return next((link for link in self.links
                     if (link.collective, link.ranks, link.scope) == (collective, ranks, scope)), None)

    def to_dict(self) -> dict:
        data = asdict(self)
        for kind in KINDS:
            data[kind] = {precision: [list(point) for point in curve.points]
                          for precision, curve in getattr(self, kind).items()}
        data["links"] = [{**asdict(link), "samples": [list(s) for s in link.samples]} for link in self.links]
        return {"format": FORMAT, **data}

    @classmethod
    def from_dict(cls, data, where: str = "profile") -> "DeviceProfile":
        """The profile ``to_dict`` wrote; a ConfigError naming ``where`` and the key otherwise."""
        reader = _Reader(where)
        data = reader.mapping(data, "", {"format"} | {f.name for f in fields(cls)})
        if data.get("format") != FORMAT:
            raise ConfigError(f"{where}: format", f"must be {FORMAT}, got {data.get('format')!r}")
        kind = reader.choice(data, "kind", ("cpu", "cuda"))
        source = reader.mapping(data.get("source"), "source", {f.name for f in fields(Source)})
        return cls(
            name=reader.text(data, "name"), kind=kind, memory_bytes=reader.whole(data, "memory_bytes"),
            matmul=reader.curves(data, "matmul"), conv=reader.curves(data, "conv"),
            memory_bandwidth=reader.positive(data, "memory_bandwidth"), overhead_s=reader.positive(data, "overhead_s"),
            source=Source(reader.choice(source, "source.kind", (MEASURED, BUILTIN, CALIBRATED), "kind"),
                          *(reader.text(source, f"source.{k}", k, "") for k in ("hardware", "date", "torch")),
                          reader.efficiency(source)),
            threads=None if data.get("threads") is None else reader.whole(data, "threads"),
            links=tuple(reader.link(item, f"links[{i}]") for i, item in enumerate(reader.items(data, "links"))))


class _Reader:
    """Checks one JSON profile, naming ``where`` (the file) and the key path in each error."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, message: str):
        raise ConfigError(f"{self.where}: {key}" if key else self.where, message)

    def mapping(self, value, key: str, allowed: set[str]) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - allowed)
        if unknown:
            self.fail(f"{key}.{unknown[0]}" if key else unknown[0],
                      f"unknown key; valid keys: {', '.join(sorted(allowed))}")
        return value

    def get(self, data: dict, path: str, key: str | None = None, default=...):
        key = key or path.rsplit(".", 1)[-1]
        if key not in data:
            if default is not ...:
                return default
            self.fail(path, "missing")
        return data[key]

    def text(self, data, path, key=None, default=...) -> str:
        value = self.get(data, path, key, default)
        if not isinstance(value, str):
            self.fail(path, f"must be a string, got {value!r}")
        return value

    def choice(self, data, path, choices, key=None) -> str:
        value = self.get(data, path, key)
        if value not in choices:
            self.fail(path, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def positive(self, data, path, key=None, value=...) -> float:
        value = self.get(data, path, key) if value is ... else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            self.fail(path, f"must be a positive number, got {value!r}")
        return value

    def whole(self, data, path) -> int:
        value = self.get(data, path)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(path, f"must be a positive whole number, got {value!r}")
        return value

    def items(self, data, path) -> list:
        value = self.get(data, path, default=[])
        if not isinstance(value, list):
            self.fail(path, f"must be a list, got {type(value).__name__}")
        return value

    def pairs(self, value, path) -> tuple[tuple[float, float], ...]:
        if not isinstance(value, list) or not value:
            self.fail(path, "must be a non-empty list of [size, value] pairs")
        for i, pair in enumerate(value):
            if not isinstance(pair, list) or len(pair) != 2:
                self.fail(f"{path}[{i}]", f"must be a [size, value] pair, got {pair!r}")
            for number in pair:
                self.positive(None, f"{path}[{i}]", value=number)
        return tuple(tuple(pair) for pair in value)

    def curves(self, data, path) -> dict[str, Curve]:
        value = self.mapping(self.get(data, path), path, set(PRECISIONS))
        curves = {}
        for precision, points in value.items():
            points = self.pairs(points, f"{path}.{precision}")
            if any(a[0] >= b[0] for a, b in zip(points, points[1:])):
                self.fail(f"{path}.{precision}", "sizes must ascend")
            curves[precision] = Curve(points)
        return curves

    def efficiency(self, source: dict) -> dict[str, float]:
        value = self.get(source, "source.efficiency", "efficiency", {})
        if not isinstance(value, dict):
            self.fail("source.efficiency", "must be a JSON object")
        return {k: self.positive(value, f"source.efficiency.{k}", k) for k in value}

    def link(self, item, path) -> Link:
        item = self.mapping(item, path, {f.name for f in fields(Link)})
        samples = item.get("samples") or []
        return Link(self.choice(item, f"{path}.collective", COLLECTIVES), self.text(item, f"{path}.backend"),
                    self.whole(item, f"{path}.ranks"), self.number(item, f"{path}.latency_s"),
                    self.positive(item, f"{path}.bandwidth"), self.choice(item, f"{path}.scope", (LOCAL, NETWORK)),
                    tuple((int(n), t) for n, t in self.pairs(samples, f"{path}.samples")) if samples else ())

    def number(self, data, path) -> float:  # zero allowed: a latency too small to fit
        value = self.get(data, path)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            self.fail(path, f"must be a number >= 0, got {value!r}")
        return value


# -- files -------------------------------------------------------------------------------

def save_profile(profile: DeviceProfile, path: str | Path) -> Path:
    atomic_write_json(path, profile.to_dict())
    return Path(path)


def load_profile(path: str | Path) -> DeviceProfile:
    """The profile in ``path``; a one-line ConfigError naming the file (and the key) if it
    is missing, not JSON, or not a profile."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read the profile: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(str(path), f"is not valid JSON ({exc}); measure the profile again") from None
    return DeviceProfile.from_dict(data, str(path))


def default_profile_path(device: str = "cpu") -> Path:
    """``plan-profile-<host>-<device>.json`` in dl4py's cache folder, ``$XDG_CACHE_HOME/dl4py``
    (default ``~/.cache/dl4py``), where MNIST is kept too: a profile can always be measured again."""
    base = os.environ.get("XDG_CACHE_HOME", "")  # XDG: a relative (or empty) value is ignored
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    host = re.sub(r"[^A-Za-z0-9._-]+", "_", socket.gethostname()) or "host"
    return root / "dl4py" / f"plan-profile-{host}-{str(device).replace(':', '')}.json"


# -- measuring ---------------------------------------------------------------------------

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
    links = []
    for index, world in enumerate(ranks):
        share = (deadline - time.monotonic()) / (len(ranks) - index)  # what is left, split evenly
        links += _measure_links(backend, world, time.monotonic() + share, quick)
    hardware = torch.cuda.get_device_name(target) if target.type == "cuda" else _cpu_name()
    source = Source(MEASURED, hardware, datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    torch.__version__)
    return DeviceProfile(hardware, target.type, _memory_bytes(target), source=source, threads=used_threads,
                         links=tuple(links), **compute)


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
        the next size would not fit in ``share_s``; at least the first."""
        until, points = time.monotonic() + share_s, []
        for index, (flops, make) in enumerate(cases):
            seconds = self.seconds(make(), until)
            points.append((flops, flops / seconds))
            best = max(rate for _, rate in points)
            if points[-1][1] < PAST_PLATEAU * best or index + 1 == len(cases):
                break
            # as if the rate went on falling as much as it fell from the best: CPU half does
            next_call_s = seconds * cases[index + 1][0] / flops * best / points[-1][1]
            if time.monotonic() + (MIN_SAMPLES + 2) * next_call_s > until:
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

RANK_PROGRAM = "import sys; from dl4py.plan.profile import link_rank_main; sys.exit(link_rank_main(sys.argv[1:]))"


def _measure_links(backend: str, world: int, deadline: float, quick: bool) -> list[Link]:
    sizes = QUICK_MESSAGE_BYTES if quick else MESSAGE_BYTES
    repeats = QUICK_REPEATS if quick else REPEATS // 2
    with socket.socket() as probe:  # a free loopback port; rank 0 listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    wall_deadline = time.time() + (deadline - time.monotonic())
    commands = [[sys.executable, "-c", RANK_PROGRAM, str(rank), str(world), backend, f"tcp://127.0.0.1:{port}",
                 repr(wall_deadline), ",".join(map(str, sizes)), str(repeats)] for rank in range(world)]
    exits = run_bounded(commands, deadline)
    reports = [_last_json(e.stdout) for e in exits]
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
                 tuple((int(n), float(t)) for n, t in samples)) for name, samples in timings.items()]


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
    [[bytes, median seconds], ...], or ``error``), like the doctor's ranks."""
    rank, world, backend, init_method = int(argv[0]), int(argv[1]), argv[2], argv[3]
    deadline, sizes, repeats = float(argv[4]), [int(s) for s in argv[5].split(",")], int(argv[6])
    report: dict = {"rank": rank}
    try:
        target = torch.device("cpu")
        if backend == "nccl":
            target = torch.device("cuda", rank)
            torch.cuda.set_device(target)
        _stage(report, "rendezvous")
        timeout = timedelta(seconds=max(1.0, deadline - time.time() - RANK_MARGIN_S))
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        try:
            report["timings"] = {name: [[n, _time_collective(name, n, world, target, repeats)] for n in sizes]
                                 for name in COLLECTIVES if _stage(report, name) is None}
        finally:
            dist.destroy_process_group()
        report["stage"] = "done"
    except Exception as exc:
        report["error"] = first_line(exc)
    print(json.dumps(report), flush=True)
    return 1 if "error" in report else 0


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


def _stage(report: dict, stage: str) -> None:
    report["stage"] = stage
    print(json.dumps(report), flush=True)


def _last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict):
            return report
    return {}
