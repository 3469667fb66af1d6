"""Read a model file and check every part of it before any of it reaches a model.

A model file comes from outside (a disk, a copy, a download), so nothing in it is trusted:
each defect is one ``ModelFileError`` -- ``FILE is not a valid dl4py model: WHAT`` --
never a JSON, zip or safetensors traceback. Only the entries dl4py writes are read, each
bounded by the size its zip header declares (JSON entries also by ``JSON_LIMIT``), so a
small file cannot inflate a foreign or lying entry into gigabytes of memory.
"""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from dl4py.backend.precision import NAMES, resolve_precision
from dl4py.config.graph import GraphConfig
from dl4py.config.network import NetworkConfig
from dl4py.data.normalizers import normalizer_from_state
from dl4py.errors import BackendError, ConfigError, DataError, ModelFileError

FORMAT = "dl4py-model"
FORMAT_VERSION = 1
KINDS = ("multilayer", "graph", "torch_module")
JSON_LIMIT = 16 * 2**20  # far above any real meta/config/updater JSON; far below a bomb
_JSON_ENTRIES = ("meta.json", "config.json", "updater.json", "normalizer.json")
_TENSOR_ENTRIES = ("weights.safetensors", "master.safetensors", "updater.safetensors", "normalizer.safetensors",
                   "randomness.safetensors")
_COUNTERS = ("epoch_count", "iteration_count", "batch_in_epoch", "update_count")
# safetensors' parser does not document which errors it raises for a bad header or dtype.
_TENSOR_ERRORS = (SafetensorError, ValueError, TypeError, KeyError, RuntimeError, OverflowError)


@dataclass
class ModelFile:
    """The checked content of a model file. ``updater`` is the optimizer state dict ready for
    ``load_state_dict`` (None when the file has none, or the caller skips it); ``normalizer``
    the model's fitted Normalizer (None when it has none); ``randomness`` the generators' state
    that files of earlier dl4py versions kept for a model saved part-way through an epoch
    (checked, and not used: training now seeds its generators per batch), else None."""

    path: str  # for messages: the file's path, or "<model bytes>"
    meta: dict[str, Any]
    config: Any  # a NetworkConfig (MultiLayerNetwork) or GraphConfig (ComputationGraph); None for a TorchModel
    weights: dict[str, torch.Tensor]
    masters: dict[str, torch.Tensor] | None
    updater: dict | None
    normalizer: Any = None
    randomness: dict | None = None


def read_model_file(source) -> ModelFile:
    """Parse and check a model file: a path, or the bytes of one (``model_bytes``)."""
    label = "<model bytes>" if isinstance(source, (bytes, bytearray)) else str(source)
    entries = _read_entries(source, label)

    def fail(what: str) -> ModelFileError:
        return ModelFileError(label, what)

    meta = _check_meta(_json(entries, "meta.json", fail), label, fail)
    config = None
    if meta["kind"] in ("multilayer", "graph"):
        config = _network_config(_json(entries, "config.json", fail), fail, meta["kind"])
    weights = _tensors(entries, "weights.safetensors", fail)
    masters = _tensors(entries, "master.safetensors", fail) if "master.safetensors" in entries else None
    updater = None
    if meta["has_updater"]:
        updater = _optimizer_state(
            _json(entries, "updater.json", fail), _tensors(entries, "updater.safetensors", fail), fail
        )
    normalizer = _normalizer(entries, meta["has_normalizer"], fail)
    randomness = _randomness(entries, meta.get("randomness"), fail)
    return ModelFile(label, meta, config, weights, masters, updater, normalizer, randomness)


def read_meta(source) -> dict[str, Any]:
    """meta.json of a model file, checked: what the file holds (counters, precision, whether
    it has updater and loss scaler state), without reading its tensors."""
    label = "<model bytes>" if isinstance(source, (bytes, bytearray)) else str(source)
    entries = _read_entries(source, label, names=("meta.json",))

    def fail(what: str) -> ModelFileError:
        return ModelFileError(label, what)

    return _check_meta(_json(entries, "meta.json", fail), label, fail)


# ---- the zip ------------------------------------------------------------------------------
def _read_entries(source, label: str, names=_JSON_ENTRIES + _TENSOR_ENTRIES) -> dict[str, bytes]:
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    else:
        source = Path(source)
        if source.is_dir():
            hint = f"; the run's model is {source / 'model.dl4py'}" if (source / "model.dl4py").is_file() else ""
            raise ModelFileError(label, f"it is a directory, not a file{hint}")
        if not source.exists():
            raise DataError(f"{label}: no such model file")
    try:
        archive = zipfile.ZipFile(source)
    except zipfile.BadZipFile as exc:
        raise ModelFileError(label, f"not a zip archive ({exc}); it may be truncated") from None
    except OSError as exc:
        raise DataError(f"{label}: cannot read model file: {exc.strerror or exc}") from None
    entries: dict[str, bytes] = {}
    with archive:
        for info in archive.infolist():
            name = info.filename
            if name not in names:
                continue  # never opened (a foreign entry can be a zip bomb), or not asked for
            if name in entries:
                raise ModelFileError(label, f"entry {name} appears twice")
            try:
                entries[name] = _read_entry(archive, info, label)
            except (zipfile.BadZipFile, EOFError, OSError, zlib.error, NotImplementedError, RuntimeError) as exc:
                # a bad CRC, a truncated stream, an unsupported compression or encryption
                raise ModelFileError(label, f"entry {name} cannot be read ({exc})") from None
    return entries


def _read_entry(archive: zipfile.ZipFile, info: zipfile.ZipInfo, label: str) -> bytes:
    name, declared = info.filename, info.file_size
    if name in _JSON_ENTRIES and declared > JSON_LIMIT:
        raise ModelFileError(label, f"{name} declares {declared} bytes; a dl4py model's {name} is at most {JSON_LIMIT}")
    with archive.open(info) as stream:
        # One byte more than declared: a stream longer than its header says shows as too long
        # instead of being read on; zipfile itself also stops at the declared size.
        data = stream.read(declared + 1)
    if len(data) != declared:
        raise ModelFileError(label, f"{name} holds {len(data)}+ bytes but its zip header declares {declared}")
    return data


# ---- the entries ----------------------------------------------------------------------------
def _json(entries: dict[str, bytes], name: str, fail) -> Any:
    if name not in entries:
        raise fail(f"entry {name} is missing")
    try:
        return json.loads(entries[name].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise fail(f"{name} is not valid JSON ({exc})") from None


def _check_meta(meta: Any, label: str, fail) -> dict:
    if not isinstance(meta, dict):
        raise fail(f"meta.json must hold a JSON object, got {_kind_of(meta)}")
    if meta.get("format") != FORMAT:
        raise fail(f"meta.json names format {meta.get('format')!r}, not {FORMAT!r}")
    version = meta.get("format_version")
    if not _is_int(version) or version < 1:
        raise fail(f"meta.json: format_version must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:  # a valid file this dl4py is too old for, not a broken one
        raise DataError(f"{label}: saved by a newer dl4py (format {version}); upgrade dl4py to read it")
    if meta.get("kind") not in KINDS:
        raise fail(f"meta.json: kind must be one of {', '.join(KINDS)}; got {meta.get('kind')!r}")
    _check_precision(meta.get("precision"), fail)
    for name in _COUNTERS:
        value = meta.get(name, 0 if name in ("batch_in_epoch", "update_count") else None)
        if not _is_int(value) or value < 0:
            raise fail(f"meta.json: {name} must be an integer >= 0, got {value!r}")
    meta.setdefault("batch_in_epoch", 0)
    meta.setdefault("update_count", meta["iteration_count"])
    meta.setdefault("has_updater", False)
    meta.setdefault("has_normalizer", False)  # files from before normalizers have none
    checks = {"has_updater": (bool,), "has_normalizer": (bool,), "scaler": (dict, type(None)),
              "score": (int, float, type(None)), "module_class": (str,)}
    for name, types in checks.items():
        value = meta.get(name)
        if name in meta and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise fail(f"meta.json: {name} has the wrong type ({_kind_of(value)})")
    if meta["kind"] == "torch_module" and "module_class" not in meta:
        raise fail("meta.json: a torch module's file must name its module_class")
    return meta


def _check_precision(name: Any, fail) -> None:

    if name is None:
        raise fail(f"meta.json names no precision (one of {', '.join(NAMES)})")
    unknown = fail(f"meta.json: unknown precision {name!r}; one of {', '.join(NAMES)}")
    if not isinstance(name, str):
        raise unknown
    try:
        resolve_precision(name)
    except BackendError:
        raise unknown from None


def _network_config(data: Any, fail, kind: str = "multilayer"):

    try:
        return (GraphConfig if kind == "graph" else NetworkConfig).from_dict(data)
    except (ConfigError, TypeError, ValueError) as exc:  # untrusted data: constructors may object too
        raise fail(f"config.json: {exc}") from None


def _tensors(entries: dict[str, bytes], name: str, fail) -> dict[str, torch.Tensor]:
    if name not in entries:
        raise fail(f"entry {name} is missing")
    try:
        return st_load(entries[name])
    except _TENSOR_ERRORS as exc:
        raise fail(f"{name} is not a safetensors file ({exc})") from None


def _normalizer(entries: dict[str, bytes], wanted: bool, fail):
    """normalizer.json (kind, settings) + normalizer.safetensors (float64 statistics) -> the
    model's Normalizer, every value checked; None when meta.json says the model has none."""
    present = [name for name in ("normalizer.json", "normalizer.safetensors") if name in entries]
    if not wanted:
        if present:  # a normalizer the model would silently not apply
            raise fail(f"entry {present[0]} is present but meta.json says has_normalizer is false")
        return None

    settings = _json(entries, "normalizer.json", fail)
    stats = _tensors(entries, "normalizer.safetensors", fail)
    try:
        return normalizer_from_state(settings, stats)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise fail(f"normalizer.json/normalizer.safetensors: {exc}") from None


def _randomness(entries: dict[str, bytes], position: Any, fail) -> dict | None:
    """meta.json's ``randomness`` ([epoch, batch, stream]) + randomness.safetensors (byte
    tensors of torch's generator states; written by earlier dl4py versions) -> a dict, or None."""
    if position is None:
        if "randomness.safetensors" in entries:
            raise fail("entry randomness.safetensors is present but meta.json names no randomness position")
        return None
    if not (isinstance(position, list) and len(position) == 3 and all(_is_int(v) and v >= 0 for v in position)):
        raise fail(f"meta.json: randomness must be [epoch, batch, stream] of integers >= 0, got {position!r}")
    generators = _tensors(entries, "randomness.safetensors", fail)
    if "cpu" not in generators or set(generators) - {"cpu", "cuda"}:
        raise fail(f"randomness.safetensors must hold 'cpu' (and 'cuda'), got {sorted(generators)}")
    if any(t.dtype != torch.uint8 or t.dim() != 1 for t in generators.values()):
        raise fail("randomness.safetensors: generator states must be 1-D uint8 tensors")
    try:
        torch.Generator().set_state(generators["cpu"])
    except RuntimeError as exc:
        raise fail(f"randomness.safetensors: 'cpu' is not a generator state ({exc})") from None
    return {"position": tuple(position), **generators}


def _optimizer_state(state_json: Any, tensors: dict[str, torch.Tensor], fail) -> dict:
    """updater.json (groups, scalars) + updater.safetensors (``param_id/name``) -> a torch
    optimizer state dict; every key and type checked, since torch's own errors name neither."""
    if (not isinstance(state_json, dict) or not isinstance(state_json.get("param_groups"), list)
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in state_json["param_groups"])
            or not isinstance(state_json.get("scalars", {}), dict)):
        raise fail("updater.json must be an object with param_groups (a list of groups with params) and scalars")
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        pid, sep, name = key.partition("/")
        if not sep or not pid.isdigit() or not name:
            raise fail(f"updater.safetensors: tensor name {key!r} is not PARAM_ID/NAME")
        state.setdefault(int(pid), {})[name] = value
    for pid, scalars in state_json.get("scalars", {}).items():
        if not pid.isdigit() or not isinstance(scalars, dict):
            raise fail(f"updater.json: scalars[{pid!r}] must be an object keyed by a parameter id")
        state.setdefault(int(pid), {}).update(scalars)
    groups = state_json["param_groups"]
    for group in groups:
        if isinstance(group.get("betas"), list):  # JSON has no tuples; torch compares betas as one
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind_of(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")
