"""The CUDA environment: DL4J's ``CudaEnvironment.getInstance().getConfiguration()``.

One mutable ``Environment`` per process holds the settings (docs/environment.md); it is
plain data (``to_dict``/``from_dict``), so a parallel worker can rebuild and apply it.
Sources, lowest first: defaults, PyTorch's and CUDA's own variables
(``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_NO_CUDA_MEMORY_CACHING``, ``CUDA_LAUNCH_BLOCKING``),
``ND4J_CUDA_FORCE_SINGLE_GPU`` / ``ND4J_DEBUG``, ``DL4PY_*`` variables, then code and
config sections (the later of those two wins). Nothing happens at import time.

Allocator settings, ``debug`` and ``deterministic``'s cuBLAS workspace are environment
variables that CUDA reads once, when it starts; changing them after that is an error, not
a silent no-op. The process-wide instance applies every change at once, like DL4J's.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any, Mapping, Optional

import torch

from dl4py.errors import BackendError, ConfigError

log = logging.getLogger("dl4py")

DEFAULTS: dict[str, Any] = {
    "allow_multi_gpu": True, "devices": None, "max_device_cache": None,
    "max_cacheable_chunk": None, "gc_threshold": None, "expandable_segments": False,
    "caching": True, "pinned_memory": True, "tf32": None, "cudnn_benchmark": False,
    "deterministic": False, "debug": False, "compile": "off", "cuda_graphs": False,
}
COMPILE_MODES = ("off", "default", "max-autotune")
_FLAGS = ("allow_multi_gpu", "expandable_segments", "caching", "pinned_memory", "tf32",
          "cudnn_benchmark", "deterministic", "debug", "cuda_graphs")
_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_MIN_CHUNK_MIB = 20  # PyTorch requires max_split_size_mb > 20 (its large-block size)

ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # newer torch reads either
_ALLOC_KEYS = {"max_cacheable_chunk": "max_split_size_mb", "gc_threshold": "garbage_collection_threshold",
               "expandable_segments": "expandable_segments"}
# (setting, variable, the setting's value that needs the variable, the variable's value)
_SIMPLE_VARS = (("caching", "PYTORCH_NO_CUDA_MEMORY_CACHING", False, "1"),
                ("debug", "CUDA_LAUNCH_BLOCKING", True, "1"),
                ("deterministic", "CUBLAS_WORKSPACE_CONFIG", True, ":4096:8"))
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
VARIABLES = ALLOC_VARS + tuple(var for _, var, _, _ in _SIMPLE_VARS)


# -- values --------------------------------------------------------------------------

def parse_size(value: Any, where: str) -> int:
    """Bytes from an int or a string such as ``"6GB"`` / ``"512MiB"`` (KB = 1000, KiB = 1024)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(where, f"must be a size in bytes or a string such as '512MiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.match(value)
        unit = (m.group(2) or "b").lower() if m else ""
        if m is None or unit not in _UNITS:
            raise ConfigError(where, f"is not a size: {value!r}; write bytes, or a number with a unit "
                                     "B, KB, MB, GB, KiB, MiB, GiB (KB = 1000 bytes, KiB = 1024)")
        size = round(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigError(where, f"must be a positive size, got {value!r}")
    return size


def device_cache_limit(value: Any, where: str = "max_device_cache") -> tuple[str, float]:
    """``("fraction", f)`` for a number up to 1, else ``("bytes", n)``."""
    if isinstance(value, str):
        try:
            value = float(value) if "." in value else int(value)
        except ValueError:
            return "bytes", parse_size(value, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(where, f"must be a fraction in (0, 1] or a size such as '6GB', got {value!r}")
    if 0 < value <= 1:
        return "fraction", float(value)
    if value <= 0 or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(where, f"must be a fraction in (0, 1] or a whole number of bytes, got {value!r}")
    return "bytes", int(value)


def chunk_mib(value: Any, where: str = "max_cacheable_chunk") -> int:
    """``max_split_size_mb`` for a size; PyTorch's "mb" are MiB, rounded down."""
    mib = parse_size(value, where) // 2**20
    if mib <= _MIN_CHUNK_MIB:
        raise ConfigError(where, f"must be more than {_MIN_CHUNK_MIB} MiB (PyTorch's smallest "
                                 f"max_split_size_mb is {_MIN_CHUNK_MIB + 1}), got {value!r}")
    return mib


def check_setting(name: str, value: Any, where: str | None = None) -> Any:
    """Validate one setting; return its canonical value or raise ConfigError naming ``where``."""
    where = where or name
    if name not in DEFAULTS:
        raise ConfigError(where, f"unknown environment setting; valid settings: {', '.join(DEFAULTS)}")
    if value is None:
        if DEFAULTS[name] is None:
            return None
        raise ConfigError(where, f"must not be null (default: {DEFAULTS[name]!r})")
    if name in _FLAGS:
        if not isinstance(value, bool):
            raise ConfigError(where, f"must be true or false, got {value!r}")
        return value
    if name == "devices":
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
            if len(set(value)) != len(value):
                raise ConfigError(where, f"lists a device twice: {list(value)}")
            return tuple(value)
        raise ConfigError(where, f"must be a non-empty list of CUDA device indices, got {value!r}")
    if name == "max_device_cache":
        device_cache_limit(value, where)
        return value.strip() if isinstance(value, str) else value
    if name == "max_cacheable_chunk":
        chunk_mib(value, where)
        return value.strip() if isinstance(value, str) else value
    if name == "gc_threshold":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise ConfigError(where, f"must be a fraction strictly between 0 and 1, got {value!r}")
        return float(value)
    # compile; YAML reads a bare `off` as false
    mode = {False: "off", True: "default"}.get(value, value) if isinstance(value, bool) else value
    if isinstance(mode, str) and mode.lower() in COMPILE_MODES:
        return mode.lower()
    raise ConfigError(where, f"must be one of {', '.join(COMPILE_MODES)}; got {value!r}")


def _parse_variable(name: str, raw: str, var: str) -> Any:
    if name in _FLAGS:
        if raw.lower() not in _BOOLS:
            raise ConfigError(var, f"must be one of 1/0, true/false, yes/no, on/off; got {raw!r}")
        return _BOOLS[raw.lower()]
    if name == "devices":
        try:
            return [int(part) for part in raw.split(",")]
        except ValueError:
            raise ConfigError(var, f"must be indices separated by commas (0,1), got {raw!r}") from None
    if name == "gc_threshold":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(var, f"must be a fraction strictly between 0 and 1, got {raw!r}") from None
    if name in ("max_device_cache", "max_cacheable_chunk") and raw.isdigit():
        return int(raw)
    if name == "max_device_cache" and re.fullmatch(r"\d*\.\d+|\d+\.", raw):
        return float(raw)
    return raw


def _variable_items(environ: Mapping[str, str]) -> list[tuple[str, Any, str, str]]:
    """(setting, value, source, where) from the variables, lowest precedence first."""
    items = []
    conf_var = next((v for v in ALLOC_VARS if environ.get(v)), None)
    names = {key: name for name, key in _ALLOC_KEYS.items()}
    for key, raw in _parse_conf(environ[conf_var] if conf_var else "").items():
        if key in names and raw is not None:
            try:  # a value PyTorch itself rejects is PyTorch's to report
                if key == "max_split_size_mb":
                    value: Any = f"{raw}MiB"
                else:
                    value = raw.lower() == "true" if key == "expandable_segments" else float(raw)
                items.append((names[key], check_setting(names[key], value), conf_var, conf_var))
            except (ConfigError, ValueError):
                pass
    if _truthy(environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")):
        items.append(("caching", False) + ("PYTORCH_NO_CUDA_MEMORY_CACHING",) * 2)
    if _truthy(environ.get("CUDA_LAUNCH_BLOCKING")):
        items.append(("debug", True) + ("CUDA_LAUNCH_BLOCKING",) * 2)
    for var, name, invert in (("ND4J_CUDA_FORCE_SINGLE_GPU", "allow_multi_gpu", True),
                              ("ND4J_DEBUG", "debug", False)):
        raw = (environ.get(var) or "").strip()
        if raw:
            items.append((name, _parse_variable(name, raw, var) != invert, var, var))
    for name in DEFAULTS:
        var = f"DL4PY_{name.upper()}"
        raw = (environ.get(var) or "").strip()
        if raw:
            items.append((name, _parse_variable(name, raw, var), var, var))
    return items


def _parse_conf(text: str) -> dict[str, str | None]:
    """``key:value`` pairs; commas inside brackets (roundup_power2_divisions:[64:8,>:1]) stay."""
    pairs: dict[str, str | None] = {}
    for token in filter(None, (t.strip() for t in re.split(r",(?![^\[]*\])", text))):
        key, sep, value = token.partition(":")
        pairs[key.strip()] = value.strip() if sep else None
    return pairs


def _format_conf(pairs: dict[str, str | None]) -> str:
    return ",".join(key if value is None else f"{key}:{value}" for key, value in pairs.items())


def _alloc_value(name: str, value: Any) -> str | None:
    """The allocator key's value for a setting, or None for PyTorch's default."""
    if value is None or value is False:
        return None
    if name == "max_cacheable_chunk":
        return str(chunk_mib(value))
    return "True" if value is True else repr(float(value))


def _normalise(key: str, raw: str | None) -> str | None:
    """A user's allocator value in the form `_alloc_value` writes, to compare the two."""
    try:
        if key == "expandable_segments":
            return "True" if str(raw).lower() in ("true", "1") else None
        return str(int(raw)) if key == "max_split_size_mb" else repr(float(raw))
    except (TypeError, ValueError):
        return raw


def _truthy(raw: str | None) -> bool:
    return raw is not None and raw.strip().lower() in ("1", "true", "yes", "on")


# -- process state: what dl4py itself wrote, so it can take it back before CUDA starts --

_lock = threading.RLock()
_process: Optional["Environment"] = None
_owned_keys: dict[str, dict[str, str]] = {}  # allocator variable -> keys dl4py added
_created: set[str] = set()  # variables that did not exist before dl4py wrote them
_owned_vars: dict[str, str] = {}  # simple variable -> value dl4py set
_fractions: dict[int, float] = {}  # device -> memory fraction dl4py set


def _reset_environment_for_tests() -> None:
    """Forget the process instance and what dl4py wrote (tests restore the variables)."""
    global _process
    with _lock:
        _process = None
        _owned_keys.clear()
        _created.clear()
        _owned_vars.clear()
        _fractions.clear()


def _explicit(name: str, sources: dict[str, str], var: str) -> bool:
    """Set by dl4py's own means (not absent, not read from ``var`` itself)."""
    return name in sources and sources[name] not in (var, *ALLOC_VARS)


def _plan(values: dict, sources: dict, environ: Mapping[str, str], late: bool):
    """Variables to change ({var: value or None to delete}), the settings behind them, owned keys.
    A setting that contradicts a variable is a ConfigError, or too late once CUDA has started."""
    changes: dict[str, str | None] = {}
    culprits: list[str] = []
    owned: dict[str, dict[str, str]] = {}
    for var in [v for v in ALLOC_VARS if v in environ] or [ALLOC_VARS[0]]:
        current = environ.get(var)
        pairs = _parse_conf(current or "")
        mine = _owned_keys.get(var, {})
        new = {k: v for k, v in pairs.items() if not (k in mine and mine[k] == v)}
        owned[var] = {}
        for name, key in _ALLOC_KEYS.items():
            if not _explicit(name, sources, var):
                continue
            want, have = _alloc_value(name, values[name]), new.get(key)
            if key in new and _normalise(key, have) != want:
                if late:
                    raise _too_late([name], values, sources)
                raise ConfigError(name, f"{var} already sets {key}:{have}, but {name}={values[name]!r} "
                                        f"({sources[name]}) asks for {key}:{want or 'default'}; "
                                        "remove one of them")
            if want is not None and key not in new:
                new[key] = owned[var][key] = want
            if pairs.get(key) != new.get(key):
                culprits.append(name)
        text = _format_conf(new)
        value = None if not text and (current is None or var in _created) else text
        if new != pairs or (value is None) != (current is None):
            changes[var] = value
    for name, var, needs, on_value in _SIMPLE_VARS:
        if not _explicit(name, sources, var):
            continue
        current = environ.get(var) or None
        theirs = None if current == _owned_vars.get(var) else current
        wanted = values[name] == needs
        want = on_value if wanted else None
        if theirs is not None:
            ok = theirs in _CUBLAS_DETERMINISTIC if name == "deterministic" else _truthy(theirs)
            if ok != wanted and (wanted or name != "deterministic"):
                if late:
                    raise _too_late([name], values, sources)
                raise ConfigError(name, f"{var}={theirs} is set in the environment, but "
                                        f"{name}={values[name]!r} ({sources[name]}) needs "
                                        f"{var}={want or '(unset)'}; remove one of them")
            want = current
        if want != current:
            changes[var] = want
            culprits.append(name)
    return changes, culprits, owned


def _too_late(culprits: list[str], values: dict, sources: dict) -> BackendError:
    name = culprits[0] if culprits else "expandable_segments"
    value, source = values[name], sources.get(name, "code")
    shown = str(value).lower() if isinstance(value, bool) else str(value)
    if source.startswith(("DL4PY_", "ND4J_")):
        how = (f"it came from {source}, but dl4py was not asked to apply it before CUDA started: "
               f"call dl4py.environment().apply() before any CUDA work")
    else:
        how = (f"set it before any CUDA work (first thing in the script, before a network is put on "
               f"the GPU), or start the process with DL4PY_{name.upper()}={shown}")
    return BackendError(f"{name}={value!r} cannot take effect: CUDA is already initialised in this "
                        f"process, and CUDA reads this setting only when it starts; {how}.")


def _apply_process(values: dict, sources: dict) -> None:
    late = torch.cuda.is_initialized()
    changes, culprits, owned = _plan(values, sources, os.environ, late)
    if changes and late:
        raise _too_late(culprits, values, sources)
    for var, value in changes.items():
        if value is None:
            os.environ.pop(var, None)
            _created.discard(var)
        else:
            if var not in os.environ:
                _created.add(var)
            os.environ[var] = value
    _owned_keys.update(owned)
    for name, var, needs, on_value in _SIMPLE_VARS:
        if var in changes:
            if changes[var] == on_value:
                _owned_vars[var] = on_value
            else:
                _owned_vars.pop(var, None)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None and torch.version.cuda and any(v in changes for v in ALLOC_VARS):
        # In case PyTorch parsed its allocator config before we wrote the variable.
        conf = next((os.environ[v] for v in ALLOC_VARS if v in os.environ), "")
        try:
            setter(conf)
        except RuntimeError as exc:  # the variable, read when CUDA starts, still holds
            log.debug("dl4py: allocator settings not pushed to PyTorch early: %s", exc)
    if sources.get("tf32") and values["tf32"] is not None:
        torch.backends.cuda.matmul.allow_tf32 = values["tf32"]
        torch.backends.cudnn.allow_tf32 = values["tf32"]
    if "cudnn_benchmark" in sources:
        torch.backends.cudnn.benchmark = values["cudnn_benchmark"]
    if "deterministic" in sources:
        if torch.are_deterministic_algorithms_enabled() != values["deterministic"]:
            torch.use_deterministic_algorithms(values["deterministic"])  # imports Inductor: 1 s
        torch.backends.cudnn.deterministic = values["deterministic"]


def _check_combination(values: dict, sources: dict, prefix: str = "") -> None:
    """Settings that cannot act together. PyTorch's own variables are PyTorch's business."""
    where = (lambda name: f"{prefix}.{name}" if prefix else name)
    ours = (lambda name: name in sources and sources[name] not in VARIABLES)
    if not values["caching"]:
        for name in ("max_device_cache", "max_cacheable_chunk", "gc_threshold", "expandable_segments"):
            if values[name] not in (None, False) and (ours(name) or ours("caching")):
                raise ConfigError(where(name), "has no effect with caching off: every allocation then goes "
                                               "straight to cudaMalloc, past the caching allocator")
    if values["gc_threshold"] is not None and values["max_device_cache"] is None and ours("gc_threshold"):
        raise ConfigError(where("gc_threshold"), "acts only under a memory cap (PyTorch collects cached "
                                                 "blocks only when a per-process memory fraction is set); "
                                                 "set max_device_cache too")
    if values["deterministic"] and values["cudnn_benchmark"]:
        raise ConfigError(where("cudnn_benchmark"), "contradicts deterministic: benchmarking may pick a "
                                                    "different cuDNN algorithm on every run")


# -- the environment -------------------------------------------------------------------

class Environment:
    """CUDA environment settings; assignment validates. ``environment()`` is the process's one."""

    allow_multi_gpu: bool
    devices: Optional[tuple]
    max_device_cache: Any
    max_cacheable_chunk: Any
    gc_threshold: Optional[float]
    expandable_segments: bool
    caching: bool
    pinned_memory: bool
    tf32: Optional[bool]
    cudnn_benchmark: bool
    deterministic: bool
    debug: bool
    compile: str
    cuda_graphs: bool

    def __init__(self, **settings: Any):
        object.__setattr__(self, "_values", dict(DEFAULTS))
        object.__setattr__(self, "_sources", {})
        object.__setattr__(self, "_live", False)
        self.update(**settings)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values")
        if values is not None and name in values:
            return values[name]
        raise AttributeError(f"Environment has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        self._set([(name, value, "code", name)])

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self._values.items() if v != DEFAULTS[k])
        return f"Environment({changed})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Environment) and self.to_dict() == other.to_dict()

    def __reduce__(self):
        return Environment.from_dict, (self.to_dict(),)

    def _set(self, items: list[tuple[str, Any, str, str]], prefix: str = "", check: bool = False) -> None:
        with _lock:
            values, sources = dict(self._values), dict(self._sources)
            for name, value, source, where in items:
                values[name] = check_setting(name, value, where)
                sources[name] = source
            if check:
                _check_combination(values, sources, prefix)
            if self._live:
                _apply_process(values, sources)
            object.__setattr__(self, "_values", values)
            object.__setattr__(self, "_sources", sources)

    def update(self, **settings: Any) -> "Environment":
        """Set several settings at once (all validated before any is applied)."""
        self._set([(name, value, "code", name) for name, value in settings.items()])
        return self

    def update_from_config(self, config: Any, where: str = "environment") -> "Environment":
        """Merge a config's ``environment`` section: its non-null fields override, nulls leave alone."""
        data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        items = [(k, v, "config", f"{where}.{k}") for k, v in data.items() if v is not None]
        self._set(items, prefix=where, check=True)
        return self

    def set_by(self) -> dict[str, str]:
        """Where each setting that was set came from: ``code``, ``config``, ``dict`` or a variable."""
        return dict(self._sources)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._values.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> "Environment":
        if not isinstance(data, Mapping):
            raise ConfigError(where, f"must be a mapping of environment settings, got {data!r}")
        # A value equal to what PyTorch's own variable says (a worker inherits those) stays
        # attributed to that variable, as it is in the parent.
        inherited = [item for item in _variable_items(os.environ) if item[2] in VARIABLES]
        env = cls()
        env._set(inherited)
        path = (lambda k: f"{where}.{k}" if where else k)
        items = [(k, v, "dict", path(k)) for k, v in data.items()
                 if not (k in env._sources and env._values[k] == check_setting(k, v, path(k)))]
        env._set(items, where, check=True)
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Environment":
        """Settings from PyTorch's, ND4J's and dl4py's variables (``DL4PY_`` wins)."""
        env = cls()
        env._set(_variable_items(os.environ if environ is None else environ))
        return env

    def check(self, where: str = "") -> None:
        """Raise ConfigError for settings that contradict each other or cannot act together."""
        _check_combination(self._values, self._sources, where)

    def usable_cuda_devices(self) -> list[int]:
        """Visible CUDA devices dl4py may use: ``devices`` (all when None), only the first
        without ``allow_multi_gpu``. Indices count after ``CUDA_VISIBLE_DEVICES``."""
        count = torch.cuda.device_count()
        if count == 0:
            return []
        chosen = list(range(count)) if self.devices is None else list(self.devices)
        missing = [d for d in chosen if d >= count]
        if missing:
            raise BackendError(f"devices lists {missing}, but only {count} CUDA device(s) are visible "
                               f"(indices 0-{count - 1}, counted after CUDA_VISIBLE_DEVICES)")
        return chosen if self.allow_multi_gpu else chosen[:1]

    def apply(self, device: torch.device | str | None = None) -> None:
        """Put the settings in force and make this the process's environment.

        Process-wide: environment variables for CUDA and the allocator, torch flags. With a
        CUDA ``device``: the memory cap on that device, after checking it may be used.
        Idempotent; a change CUDA can no longer take is a BackendError.
        """
        global _process
        with _lock:
            if device is not None:
                device = torch.device(device)
                self.check()
            _apply_process(self._values, self._sources)
            if _process is not None and _process is not self:
                object.__setattr__(_process, "_live", False)
            object.__setattr__(self, "_live", True)
            _process = self
            if device is not None and device.type == "cuda":
                self._apply_device(device)

    def _apply_device(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        usable = self.usable_cuda_devices()
        if index not in usable:
            raise BackendError(f"cuda:{index} is not among the devices this environment permits {usable} "
                               f"(devices={self.devices}, allow_multi_gpu={self.allow_multi_gpu})")
        if self.max_device_cache is None:
            if _fractions.pop(index, None) is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, index)
            return
        kind, amount = device_cache_limit(self.max_device_cache)
        if kind == "bytes":
            amount = min(1.0, amount / torch.cuda.get_device_properties(index).total_memory)
        torch.cuda.set_per_process_memory_fraction(float(amount), index)
        _fractions[index] = float(amount)


def environment() -> Environment:
    """The process's environment, read from the ``DL4PY_*`` (and ND4J, PyTorch) variables on
    first call. Changes to it take effect at once; ``apply(device)`` adds the per-device cap.
    For example ``dl4py.environment().update(max_device_cache="6GB", tf32=True)``.
    """
    global _process
    with _lock:
        if _process is None:
            env = Environment.from_environ()
            object.__setattr__(env, "_live", True)
            _process = env
        return _process
