"""Save and load models: one zip file, no pickles (DL4J's ModelSerializer).

Entries: ``meta.json`` (format, kind, counters, precision, versions), ``config.json``
(MultiLayerNetwork and ComputationGraph: the network is rebuilt by its constructor), ``weights.safetensors``
(parameters and buffers, in the model's precision), ``master.safetensors`` (the float32
master weights of ``half``/``bfloat16`` models), and when asked ``updater.json`` +
``updater.safetensors`` (the optimizer's state; the loss scaler's state is in meta.json), and
for a model with a normalizer ``normalizer.json`` + ``normalizer.safetensors`` (its kind,
settings and float64 statistics: a loaded model normalizes as the saved one). No
generator state: training seeds its generators for each batch from its position
(``train/randomness.py``), so a run resumed part-way through an epoch draws what it would
have drawn. The file is written to a
temporary name and renamed, so a crash mid-save leaves the previous file intact. Reading is
``model_file.read_model_file``: every entry checked, every defect one error naming the file.
"""

from __future__ import annotations

import io
import json
import zipfile

import torch
from safetensors.torch import save as st_save

from dl4py.errors import DataError
from dl4py.io import atomic_write_bytes
from dl4py.nn.model_file import FORMAT, FORMAT_VERSION, ModelFile, read_model_file
from dl4py.version import __version__
KERNEL_KEYS = ("foreach", "fused")  # torch.optim's implementation flags: the environment's, not the model's


def save_model(model, path, save_updater: bool = True) -> None:
    atomic_write_bytes(path, model_bytes(model, save_updater))


def model_bytes(model, save_updater: bool = True) -> bytes:
    """The model file's content, in memory (what ``save`` writes)."""

    model.init()
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": model.kind,
        "dl4py_version": __version__,
        "torch_version": torch.__version__,
        "precision": model.precision.name,
        **model.training_state.counters(),
        "scaler": model.precision_state.state_dict(),
        "score": None if model.last_score is None else float(model.last_score),
        "module_class": f"{type(model.module).__module__}.{type(model.module).__qualname__}",
        "has_updater": save_updater,
        "has_normalizer": model.normalizer is not None,
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("meta.json", json.dumps(meta, indent=2))
        if model.kind in ("multilayer", "graph"):
            zf.writestr("config.json", model.config.to_json())
        zf.writestr("weights.safetensors", st_save(_cpu_tensors(model.module.state_dict())))
        if model.precision_state.keeps_masters:
            zf.writestr("master.safetensors", st_save(_cpu_tensors(model.precision_state.named_master_parameters())))
        if save_updater:
            state_json, state_tensors = _split_optimizer_state(model.optimizer.state_dict())
            zf.writestr("updater.json", json.dumps(state_json))
            zf.writestr("updater.safetensors", st_save(state_tensors))
        if model.normalizer is not None:
            settings, stats = model.normalizer.state()
            zf.writestr("normalizer.json", json.dumps(settings))
            zf.writestr("normalizer.safetensors", st_save(_cpu_tensors(stats)))
    return buffer.getvalue()


def restore_state(model, path) -> None:
    """Load a saved model's weights, updater state and counters into ``model`` (same architecture)."""
    saved = read_model_file(path)
    model.init()
    restore_saved(model, saved)


def restore_saved(model, saved: ModelFile) -> None:
    # The file is well formed (read_model_file checked it); what can still fail is its fit
    # to this model: names, shapes and optimizer groups.
    path = saved.path
    try:
        model.module.load_state_dict(saved.weights)
    except RuntimeError as exc:
        raise DataError(f"{path}: the saved weights do not fit the model: {exc}") from None
    try:
        _restore_masters(model, saved.masters)
    except (KeyError, RuntimeError, AttributeError) as exc:
        raise DataError(f"{path}: the saved float32 master weights do not fit the model: {exc!r}") from None
    if saved.updater is not None:
        state = saved.updater
        # Which kernel steps the parameters is the environment's choice, not the file's; torch
        # casts the loaded state (step counters) for the kernel named in the groups it is given.
        for group, current in zip(state["param_groups"], model.optimizer.param_groups):
            group.update({key: current[key] for key in KERNEL_KEYS if key in current})
        try:
            model.optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
            raise DataError(f"{path}: the saved updater state does not fit the model's optimizer: {exc!r}") from None
        _match_parameter_layouts(model.optimizer)
    restore_meta(model, saved)


def restore_meta(model, saved: ModelFile) -> None:
    """What a model file holds beside the tensors: the normalizer, the counters, the loss
    scaler's state and the last score (a distributed replica loads its tensors by name)."""
    meta, path = saved.meta, saved.path
    if saved.normalizer is not None:
        model.normalizer = saved.normalizer
    model.training_state.load_counters(meta)
    if model.precision_state.scales_loss and meta.get("scaler"):
        try:
            model.precision_state.load_state_dict(meta["scaler"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise DataError(f"{path}: the saved loss scaler state is not usable: {exc!r}") from None
    if meta.get("score") is not None:
        model.set_score(meta["score"])


@torch.no_grad()
def _restore_masters(model, masters: dict[str, torch.Tensor] | None) -> None:
    """Float32 masters are the exact weights: prefer them over the 16-bit copies when present."""
    if model.precision_state.keeps_masters:
        for name, param in model.precision_state.named_master_parameters().items():
            param.copy_(masters[name] if masters is not None else model.module.get_parameter(name))
        model.precision_state.after_sync()
    elif masters is not None:
        for name, value in masters.items():
            model.module.get_parameter(name).copy_(value)


def _cpu_tensors(tensors: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}


def _split_optimizer_state(state_dict: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Optimizer state -> (JSON part, tensors keyed ``param_id/name``). The kernel flags are
    left out: they belong to the environment that trains the model, not to the model."""
    tensors, scalars = {}, {}
    for pid, entries in state_dict["state"].items():
        for name, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{pid}/{name}"] = value.detach().to("cpu").contiguous().clone()
            else:
                scalars.setdefault(str(pid), {})[name] = value
    groups = [{k: v for k, v in group.items() if k not in KERNEL_KEYS} for group in state_dict["param_groups"]]
    return {"param_groups": groups, "scalars": scalars}, tensors


@torch.no_grad()
def _match_parameter_layouts(optimizer) -> None:
    """Give loaded state tensors their parameter's strides (channels_last convolution weights).

    Files hold contiguous tensors; torch's fused kernels assume a parameter, its gradient and
    its state share one layout, and on a CPU compute wrong values, silently, when they differ.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for name, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                    state[name] = torch.empty_like(param, dtype=value.dtype).copy_(value)
