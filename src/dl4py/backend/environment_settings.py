"""Environment settings as values: defaults, validation, sizes, and the variables they map to.

The rules every source of a setting goes through (code, a config's ``environment``
section, ``DL4PY_*`` variables, PyTorch's and CUDA's own variables), kept apart from the
process state in ``cuda_environment`` so that config validation and the memory estimator
can use them without it.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from dl4py.errors import ConfigError

DEFAULTS: dict[str, Any] = {
    "allow_multi_gpu": True, "devices": None, "max_device_cache": None,
    "max_cacheable_chunk": None, "gc_threshold": None, "expandable_segments": False,
    "caching": True, "pinned_memory": True, "tf32": None, "cudnn_benchmark": False,
    "deterministic": False, "debug": False, "compile": "auto", "cuda_graphs": False,
    "device_data": "auto", "fused_optimizer": "auto", "channels_last": "auto",
}
# auto: compiled where the fit's planned steps pay for compiling (train/compile_choice.py)
COMPILE_MODES = ("auto", "off", "default", "max-autotune")
# Speed switches of the training path (docs/performance.md): auto lets dl4py decide per
# device and network; on insists (an error where it cannot apply); off never.
SWITCHES = ("device_data", "fused_optimizer", "channels_last")
SWITCH_VALUES = ("auto", "on", "off")
_FLAGS = ("allow_multi_gpu", "expandable_segments", "caching", "pinned_memory", "tf32",
          "cudnn_benchmark", "deterministic", "debug", "cuda_graphs")
_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_MIN_CHUNK_MIB = 20  # PyTorch requires max_split_size_mb >= 20 (kLargeBuffer, its large-block size)

ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # newer torch reads either
ALLOC_KEYS = {"max_cacheable_chunk": "max_split_size_mb", "gc_threshold": "garbage_collection_threshold",
               "expandable_segments": "expandable_segments"}
# (setting, variable, the setting's value that needs the variable, the variable's value)
SIMPLE_VARS = (("caching", "PYTORCH_NO_CUDA_MEMORY_CACHING", False, "1"),
                ("debug", "CUDA_LAUNCH_BLOCKING", True, "1"),
                ("deterministic", "CUBLAS_WORKSPACE_CONFIG", True, ":4096:8"))
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
VARIABLES = ALLOC_VARS + tuple(var for _, var, _, _ in SIMPLE_VARS)


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
    if mib < _MIN_CHUNK_MIB:
        raise ConfigError(where, f"must be at least {_MIN_CHUNK_MIB} MiB (PyTorch's smallest "
                                 f"max_split_size_mb is {_MIN_CHUNK_MIB}), got {value!r}")
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
    if name in SWITCHES:
        # YAML reads a bare on/off as a boolean, a variable may say 1/0
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str) and value.strip().lower() in (*SWITCH_VALUES, *_BOOLS):
            text = value.strip().lower()
            return text if text in SWITCH_VALUES else ("on" if _BOOLS[text] else "off")
        raise ConfigError(where, f"must be one of {', '.join(SWITCH_VALUES)}; got {value!r}")
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


def variable_items(environ: Mapping[str, str]) -> list[tuple[str, Any, str, str]]:
    """(setting, value, source, where) from the variables, lowest precedence first."""
    items = []
    conf_var = next((v for v in ALLOC_VARS if environ.get(v)), None)
    names = {key: name for name, key in ALLOC_KEYS.items()}
    for key, raw in parse_conf(environ[conf_var] if conf_var else "").items():
        if key in names and raw is not None:
            try:  # a value PyTorch itself rejects is PyTorch's to report
                if key == "max_split_size_mb":
                    value: Any = f"{raw}MiB"
                else:
                    value = raw.lower() == "true" if key == "expandable_segments" else float(raw)
                items.append((names[key], check_setting(names[key], value), conf_var, conf_var))
            except (ConfigError, ValueError):
                pass
    if truthy(environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")):
        items.append(("caching", False) + ("PYTORCH_NO_CUDA_MEMORY_CACHING",) * 2)
    if truthy(environ.get("CUDA_LAUNCH_BLOCKING")):
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


def parse_conf(text: str) -> dict[str, str | None]:
    """``key:value`` pairs; commas inside brackets (roundup_power2_divisions:[64:8,>:1]) stay."""
    pairs: dict[str, str | None] = {}
    for token in filter(None, (t.strip() for t in re.split(r",(?![^\[]*\])", text))):
        key, sep, value = token.partition(":")
        pairs[key.strip()] = value.strip() if sep else None
    return pairs


def format_conf(pairs: dict[str, str | None]) -> str:
    return ",".join(key if value is None else f"{key}:{value}" for key, value in pairs.items())


def alloc_value(name: str, value: Any) -> str | None:
    """The allocator key's value for a setting, or None for PyTorch's default."""
    if value is None or value is False:
        return None
    if name == "max_cacheable_chunk":
        return str(chunk_mib(value))
    return "True" if value is True else repr(float(value))


def normalise_alloc_value(key: str, raw: str | None) -> str | None:
    """A user's allocator value in the form `alloc_value` writes, to compare the two."""
    try:
        if key == "expandable_segments":
            return "True" if str(raw).lower() in ("true", "1") else None
        return str(int(raw)) if key == "max_split_size_mb" else repr(float(raw))
    except (TypeError, ValueError):
        return raw


def truthy(raw: str | None) -> bool:
    return raw is not None and raw.strip().lower() in ("1", "true", "yes", "on")
