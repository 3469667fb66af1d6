"""Device profiles, measured not assumed: how fast a device multiplies matrices, convolves,
moves memory and exchanges with its peers, for the planner's time per step.

Who does what: ``DeviceProfile`` (here) holds the figures and reads and writes them as JSON;
``plan.measure.measure_profile`` times them on this machine (collectives in ranks of their
own, bounded by the doctor's ``run_bounded``); ``builtin_profiles`` has published figures of
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

A ``ShardedCollective`` is what one collective of a sharded (FSDP2) training step costs among
``ranks`` processes beyond its bytes: a link is timed back to back, every rank ready, where a
training step reaches each unit's gather and reduce-scatter after compute, its ranks' arrivals
apart and each wake-up a thread's turn on a busy core. On the benchmark's two-core CPU a
small all-gather took 0.24 ms back to back and 1.2-1.5 ms a collective inside a sharded step
of two ranks (5-6 ms for four ranks sharing the two cores).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from dl4py.errors import BackendError, ConfigError
from dl4py.io import atomic_write_json

KINDS = ("matmul", "conv")
PRECISIONS = {"float": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16}
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")
LOCAL, NETWORK = "local", "network"  # a link between processes of one machine, or between machines
MEASURED, BUILTIN, CALIBRATED = "measured", "builtin", "calibrated"
FORMAT = 1  # the JSON layout's version



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
class ShardedCollective:
    """One collective of a sharded training step among ``ranks`` processes over ``backend``:
    ``seconds`` in place of the link's latency (the bytes still move at the link's bandwidth),
    measured as the step time of a probe of small FSDP2 units on the ranks less the same
    probe's on groups of one rank, per collective (``plan.sharded_probe``)."""

    backend: str
    ranks: int
    seconds: float
    scope: str = LOCAL


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
    sharded: tuple[ShardedCollective, ...] = ()

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

    def sharded_collective_s(self, ranks: int, scope: str = LOCAL) -> float | None:
        """Seconds of one collective of a sharded step among ``ranks``, beyond its bytes; None
        where not measured (a built-in profile, or another count of ranks)."""
        return next((item.seconds for item in self.sharded if (item.ranks, item.scope) == (ranks, scope)), None)

    def to_dict(self) -> dict:
        data = asdict(self)
        for kind in KINDS:
            data[kind] = {precision: [list(point) for point in curve.points]
                          for precision, curve in getattr(self, kind).items()}
        data["links"] = [{**asdict(link), "samples": [list(s) for s in link.samples]} for link in self.links]
        data["sharded"] = [asdict(item) for item in self.sharded]
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
            links=tuple(reader.link(item, f"links[{i}]") for i, item in enumerate(reader.items(data, "links"))),
            sharded=tuple(reader.sharded(item, f"sharded[{i}]") for i, item in enumerate(reader.items(data, "sharded"))))


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

    def sharded(self, item, path) -> ShardedCollective:
        item = self.mapping(item, path, {f.name for f in fields(ShardedCollective)})
        return ShardedCollective(self.text(item, f"{path}.backend"), self.whole(item, f"{path}.ranks"),
                                 self.number(item, f"{path}.seconds"),
                                 self.choice(item, f"{path}.scope", (LOCAL, NETWORK)))

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
