"""The CUDA environment: DL4J's ``CudaEnvironment.getInstance().getConfiguration()``.

One mutable ``Environment`` per process holds the settings (docs/environment.md); it is
plain data (``to_dict``/``from_dict``), so a parallel worker can rebuild and apply it.
Sources, lowest first: defaults, PyTorch's and CUDA's own variables
(``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_NO_CUDA_MEMORY_CACHING``, ``CUDA_LAUNCH_BLOCKING``),
``ND4J_CUDA_FORCE_SINGLE_GPU`` / ``ND4J_DEBUG``, ``DL4PY_*`` variables, then code and
config sections (the later of those two wins). Nothing happens at import time.

The allocator settings (``max_split_size_mb``, ``garbage_collection_threshold``,
``expandable_segments``) are written to ``PYTORCH_CUDA_ALLOC_CONF`` and pushed to PyTorch's
allocator, which reads them on every allocation, so they can change at any time. ``caching``,
``debug`` and ``deterministic``'s cuBLAS workspace are variables read once, when CUDA starts;
changing them after that is an error, not a silent no-op. The process-wide instance applies
every change at once, like DL4J's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Mapping, Optional

import torch

from dl4py.backend.allocator_settings import push_allocator_settings
from dl4py.backend.environment_settings import (  # noqa: F401  (re-exported: the settings' rules)
    ALLOC_KEYS,
    ALLOC_VARS,
    COMPILE_MODES,
    CUBLAS_DETERMINISTIC,
    DEFAULTS,
    SIMPLE_VARS,
    VARIABLES,
    alloc_value,
    check_setting,
    chunk_mib,
    device_cache_limit,
    format_conf,
    normalise_alloc_value,
    parse_conf,
    parse_size,
    truthy,
    variable_items,
)
from dl4py.errors import BackendError, ConfigError

log = logging.getLogger("dl4py")


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


def _plan_allocator(values: dict, sources: dict, environ: Mapping[str, str]):
    """Allocator variables to change ({var: text, or None to delete}) and the keys dl4py owns
    in them. A setting that contradicts the user's own key is a ConfigError, before or after
    CUDA starts: the variable is theirs, and neither value is more right."""
    changes: dict[str, str | None] = {}
    owned: dict[str, dict[str, str]] = {}
    for var in [v for v in ALLOC_VARS if v in environ] or [ALLOC_VARS[0]]:
        current = environ.get(var)
        pairs = parse_conf(current or "")
        mine = _owned_keys.get(var, {})
        new = {k: v for k, v in pairs.items() if not (k in mine and mine[k] == v)}
        owned[var] = {}
        for name, key in ALLOC_KEYS.items():
            if not _explicit(name, sources, var):
                continue
            want, have = alloc_value(name, values[name]), new.get(key)
            if key in new and normalise_alloc_value(key, have) != want:
                raise ConfigError(name, f"{var} already sets {key}:{have}, but {name}={values[name]!r} "
                                        f"({sources[name]}) asks for {key}:{want or 'default'}; "
                                        "remove one of them")
            if want is not None and key not in new:
                new[key] = owned[var][key] = want
        text = format_conf(new)
        value = None if not text and (current is None or var in _created) else text
        if new != pairs or (value is None) != (current is None):
            changes[var] = value
    return changes, owned


def _plan_start_only(values: dict, sources: dict, environ: Mapping[str, str], late: bool):
    """Variables CUDA reads only when it starts ({var: value or None}) and the settings behind
    them. A contradiction with the user's variable is a ConfigError, or too late once CUDA runs."""
    changes: dict[str, str | None] = {}
    culprits: list[str] = []
    for name, var, needs, on_value in SIMPLE_VARS:
        if not _explicit(name, sources, var):
            continue
        current = environ.get(var) or None
        theirs = None if current == _owned_vars.get(var) else current
        wanted = values[name] == needs
        want = on_value if wanted else None
        if theirs is not None:
            ok = theirs in CUBLAS_DETERMINISTIC if name == "deterministic" else truthy(theirs)
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
    return changes, culprits


def _too_late(culprits: list[str], values: dict, sources: dict) -> BackendError:
    name = culprits[0]
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


def _write_variables(changes: Mapping[str, str | None]) -> None:
    for var, value in changes.items():
        if value is None:
            os.environ.pop(var, None)
            _created.discard(var)
        else:
            if var not in os.environ:
                _created.add(var)
            os.environ[var] = value
    for name, var, needs, on_value in SIMPLE_VARS:
        if var in changes:
            if changes[var] == on_value:
                _owned_vars[var] = on_value
            else:
                _owned_vars.pop(var, None)


def _apply_process(values: dict, sources: dict) -> None:
    late = torch.cuda.is_initialized()
    alloc_changes, owned = _plan_allocator(values, sources, os.environ)
    start_changes, culprits = _plan_start_only(values, sources, os.environ, late)
    if culprits and late:
        raise _too_late(culprits, values, sources)
    if alloc_changes and late:
        # Pushed before the variables are written, so a refusal leaves everything as it was.
        after = {var: value for var, value in {**os.environ, **alloc_changes}.items() if value is not None}
        push_allocator_settings(after, live=True)
    _write_variables({**alloc_changes, **start_changes})
    _owned_keys.update(owned)
    if alloc_changes and not late:
        push_allocator_settings(os.environ, live=False)
    _apply_torch_flags(values, sources)


def _apply_torch_flags(values: dict, sources: dict) -> None:
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
    device_data: str
    fused_optimizer: str
    channels_last: str

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

    @contextlib.contextmanager
    def temporarily(self, **settings: Any):
        """These settings for a ``with`` block, then the previous values again. Models built
        inside keep what they read::

            with dl4py.environment().temporarily(fused_optimizer="off"):
                net = MultiLayerNetwork(conf).init()
        """
        before = {name: (self._values[name], self._sources.get(name)) for name in settings if name in self._values}
        self.update(**settings)
        try:
            yield self
        finally:
            self._restore(before)

    def _restore(self, before: Mapping[str, tuple[Any, Optional[str]]]) -> None:
        """Put back values and where they came from, so ``set_by()`` is as it was before the block."""
        with _lock:
            values, sources = dict(self._values), dict(self._sources)
            for name, (value, source) in before.items():
                values[name] = value
                if source is None:
                    sources.pop(name, None)
                else:
                    sources[name] = source
            if self._live:
                # Applied as set in code: a setting with no source is left alone by the
                # planner, which would leave the variables the block wrote in place.
                unset = {name: "code" for name, (_, source) in before.items() if source is None}
                _apply_process(values, {**sources, **unset})
            object.__setattr__(self, "_values", values)
            object.__setattr__(self, "_sources", sources)

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
        inherited = [item for item in variable_items(os.environ) if item[2] in VARIABLES]
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
        env._set(variable_items(os.environ if environ is None else environ))
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
