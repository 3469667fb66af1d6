"""What a sweep runs: grid expansion, random sampling, experiment names.

A value is kept as the text a ``--set key=value`` override takes (read as YAML by
``RunConfig.with_overrides``), so an experiment's process sees exactly what the user
wrote, and ``sweep.json`` stores nothing that needs a Python type to read back.
"""

from __future__ import annotations

import copy
import itertools
import math
import random as random_module
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from dl4py.config.run import RunConfig, _assign
from dl4py.errors import ConfigError

# training.backend is decided by --devices; environment.devices would fight the slot pinning.
SLOT_KEYS = ("training.backend", "environment.devices")


@dataclass(frozen=True)
class Range:
    """A numeric interval sampled uniformly, or log-uniformly (``log``); ints stay ints."""

    low: float
    high: float
    log: bool = False
    integer: bool = False

    def sample(self, rng: random_module.Random) -> str:
        if self.log:
            value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            value = rng.uniform(self.low, self.high)
        if self.integer:
            return str(min(max(round(value), int(self.low)), int(self.high)))
        return yaml_float(value, digits=4)


@dataclass(frozen=True)
class Experiment:
    name: str  # also its run directory's name inside the sweep folder
    overrides: dict  # key -> value text, applied as --set key=value

    def label(self, short: Mapping[str, str] | None = None) -> str:
        """``learning_rate=0.05,batch_size=64``: the varied values, short key names."""
        short = short or short_keys(self.overrides)
        return ",".join(f"{short[k]}={v}" for k, v in self.overrides.items())


def yaml_float(value: float, digits: int | None = None) -> str:
    """``value`` (to ``digits`` significant digits) as YAML reads a float: ``1.0e-05``, not
    ``1e-05``, which PyYAML takes for a string."""
    if not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    text = repr(float(value)) if digits is None else f"{value:.{digits}g}"
    mantissa, e, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return mantissa + e + exponent


def value_text(value: Any) -> str:
    """Override text for a Python value: a string is taken as written (YAML, like --set)."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, float):
        return yaml_float(value)
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text[:-3].strip() if text.endswith("...") else text  # scalars end with a document marker


def parse_grid(spec: str) -> tuple[str, list[str]]:
    """``key=v1,v2,...`` -> (key, [value texts])."""
    key, sep, raw = spec.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise ConfigError(f"--grid {spec}", "must look like key=v1,v2,..., e.g. training.batch_size=32,64")
    return key, _values(f"--grid {spec}", split_top_level(raw))


def split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets: ``[5, 5],[[3, 3], [1, 1]],{a: 1, b: 2}`` is three values."""
    values, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    values.append(text[start:].strip())
    return values


def parse_range(spec: str) -> tuple[str, Range]:
    """``key=lo:hi`` or ``key=lo:hi:log`` -> (key, Range)."""
    key, sep, raw = spec.partition("=")
    parts = [p.strip() for p in raw.split(":")]
    where = f"--range {spec}"
    if not sep or not key.strip() or len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "log"):
        raise ConfigError(where, "must look like key=low:high or key=low:high:log, e.g. "
                                 "network.updater.learning_rate=0.001:0.1:log")
    return key.strip(), make_range(where, parts[0], parts[1], len(parts) == 3)


def make_range(where: str, low: Any, high: Any, log: bool) -> Range:
    numbers = []
    for text in (low, high):
        value = yaml.safe_load(text) if isinstance(text, str) else text
        if isinstance(value, str):  # PyYAML reads 1e-3 as text; Python reads it as a number
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(where, f"bounds must be numbers, got {text!r}")
        numbers.append(value)
    lo, hi = numbers
    if not lo < hi:
        raise ConfigError(where, f"low must be below high, got {lo} and {hi}")
    if log and lo <= 0:
        raise ConfigError(where, f"a log range needs a positive low bound, got {lo}")
    integer = all(isinstance(v, int) for v in numbers)
    return Range(float(lo), float(hi), log, integer)


def _values(where: str, values: list[str]) -> list[str]:
    if not values or any(not v for v in values):
        raise ConfigError(where, "has an empty value; separate values with single commas")
    seen = set()
    for value in values:
        if value in seen:
            raise ConfigError(where, f"lists {value} twice")
        seen.add(value)
    return values


def normalise_grid(grid: Mapping[str, Any] | list[str] | None) -> dict[str, list[str]]:
    """A grid from Python (``{key: [values]}``) or the command line (``["key=v1,v2"]``)."""
    if not grid:
        return {}
    if isinstance(grid, Mapping):
        out = {}
        for key, values in grid.items():
            if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
                raise ConfigError(f"grid {key}", f"must be a list of values, got {values!r}")
            out[str(key).strip()] = _values(f"grid {key}", [value_text(v) for v in values])
        return out
    return _one_per_key(grid, parse_grid, "--grid", "is given by another --grid too; list all its values in one")


def normalise_ranges(ranges: Mapping[str, Any] | list[str] | None) -> dict[str, Range]:
    """Ranges from Python (``{key: (lo, hi)}`` or ``(lo, hi, "log")``) or the command line."""
    if not ranges:
        return {}
    if isinstance(ranges, Mapping):
        out = {}
        for key, spec in ranges.items():
            where = f"ranges {key}"
            if isinstance(spec, Range):
                out[key] = spec
                continue
            if isinstance(spec, str):
                out[key] = parse_range(f"{key}={spec}")[1]
                continue
            spec = tuple(spec)
            if len(spec) not in (2, 3) or (len(spec) == 3 and spec[2] != "log"):
                raise ConfigError(where, f"must be (low, high) or (low, high, 'log'), got {spec!r}")
            out[key] = make_range(where, spec[0], spec[1], len(spec) == 3)
        return out
    return _one_per_key(ranges, parse_range, "--range", "has another --range too")


def _one_per_key(specs: list[str], parse, flag: str, clash: str) -> dict:
    """Command-line specs parsed into {key: value}; a key given twice is an error."""
    out = {}
    for spec in specs:
        key, value = parse(spec)
        if key in out:
            raise ConfigError(f"{flag} {spec}", f"{key} {clash}")
        out[key] = value
    return out


def check_keys(config: RunConfig, keys: list[str], where: str = "--grid") -> None:
    """Fail up front on a key the config lacks: every experiment would fail on it.

    Values are left to each experiment's own process, which reports a bad one as that
    experiment's failure while the others go on.
    """
    data = config.to_dict()
    for key in keys:
        if key in SLOT_KEYS:
            raise ConfigError(f"{where} {key}", "is set by the sweep for each device slot (--devices); "
                                                "run separate sweeps to compare backends or device lists")
        try:
            _assign(copy.deepcopy(data), key, None)  # the same path rules as --set, no value check
        except ConfigError as exc:
            raise ConfigError(f"{where} {key}", str(exc).split(": ", 1)[-1]) from None


def expand(grid: dict[str, list[str]], ranges: dict[str, Range], random: int | None = None,
           seed: int = 0) -> list[Experiment]:
    """Every grid point, or ``random`` points drawn with ``seed`` (ranges sampled, grid
    values picked uniformly); each named ``NNN-key=value,...``."""
    both = set(grid) & set(ranges)
    if both:
        raise ConfigError(f"--range {min(both)}", "is also given by --grid; give a key one or the other")
    if random is None:
        if ranges:
            raise ConfigError(f"--range {next(iter(ranges))}", "needs --random N: the number of points to draw")
        if not grid:
            raise ConfigError("--grid", "a sweep needs at least one --grid key=v1,v2 (or --random N with --range)")
        keys = list(grid)
        points = [dict(zip(keys, values)) for values in itertools.product(*grid.values())]
    else:
        if random < 1:
            raise ConfigError("--random", f"must be a positive number of points, got {random}")
        if not grid and not ranges:
            raise ConfigError("--random", "needs --range key=low:high (or --grid values to pick from)")
        rng = random_module.Random(seed)
        keys = list(grid) + list(ranges)
        points = [{**{k: rng.choice(v) for k, v in grid.items()},
                   **{k: r.sample(rng) for k, r in ranges.items()}} for _ in range(random)]
    short = short_keys(keys)
    width = max(3, len(str(len(points))))
    return [Experiment(experiment_name(i, point, short, width), point) for i, point in enumerate(points, 1)]


def experiment_name(number: int, point: Mapping[str, str], short: Mapping[str, str], width: int = 3) -> str:
    """``003-learning_rate=0.1,batch_size=64``: the number and the values, fit for a folder name."""
    label = ",".join(f"{short[k]}={_safe(v)}" for k, v in point.items())[:80]
    return f"{number:0{width}d}-{label}"


def short_keys(keys) -> dict[str, str]:
    """The last part of each key (``learning_rate``), the whole key where two would clash."""
    last = {k: re.sub(r"\[\d+\]$", "", k.rsplit(".", 1)[-1]) for k in keys}
    clashing = {v for v in last.values() if list(last.values()).count(v) > 1}
    return {k: (k if s in clashing else s) for k, s in last.items()}


def _safe(value: str) -> str:
    # Part of a folder name on any file system: no slashes, spaces, brackets or commas.
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", value).strip("_") or "_"


@dataclass(frozen=True)
class Plan:
    """Everything needed to run or resume a sweep; stored as ``sweep.json``."""

    config: dict  # the base run config, --set overrides applied
    config_name: str
    experiments: tuple[Experiment, ...]
    grid: dict
    ranges: dict
    random: int | None = None
    seed: int = 0
    metric: str = "test_accuracy"
    # An Optuna search (dl4py.sweep.optuna_search): experiments are added as its trials are
    # asked, up to ``search["trials"]``; None for a grid or random plan, fixed up front.
    search: dict | None = None

    @property
    def keys(self) -> list[str]:
        if self.search is not None:  # known before the first trial is asked
            return list(self.grid) + list(self.ranges)
        return list(self.experiments[0].overrides) if self.experiments else []

    def to_dict(self) -> dict:
        data = {
            "version": 1, "config_name": self.config_name, "metric": self.metric,
            "grid": self.grid, "random": self.random, "seed": self.seed,
            "ranges": {k: [r.low, r.high, r.log, r.integer] for k, r in self.ranges.items()},
            "experiments": [{"name": e.name, "overrides": e.overrides} for e in self.experiments],
            "config": self.config,
        }
        if self.search is not None:
            data["search"] = self.search
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        search = data.get("search")
        return cls(
            config=data["config"], config_name=data["config_name"], metric=data["metric"],
            experiments=tuple(Experiment(e["name"], dict(e["overrides"])) for e in data["experiments"]),
            grid={k: list(v) for k, v in data["grid"].items()}, random=data["random"], seed=data["seed"],
            ranges={k: Range(*v) for k, v in data["ranges"].items()},
            search=dict(search) if search is not None else None,
        )

    def same_experiments(self, other: Plan) -> bool:
        """Whether ``other`` runs the same experiments on the same base config (the metric may differ);
        for a search, the same search space and sampler (its number of trials may differ)."""
        if self.search is not None or other.search is not None:
            mine, theirs = ({k: v for k, v in (p.search or {}).items() if k != "trials"} for p in (self, other))
            return (self.config == other.config and self.grid == other.grid and self.ranges == other.ranges
                    and self.seed == other.seed and mine == theirs)
        return self.config == other.config and self.experiments == other.experiments
