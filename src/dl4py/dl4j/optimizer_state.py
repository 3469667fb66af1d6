"""DL4J's updater state and training position as an imported model's, so ``fit`` goes on where
DL4J stopped: ``updaterState.bin`` into the torch optimizer's state, ``iterationCount`` and
``epochCount`` into the model's counters.

Three steps:

- ``plan_state``, from the configuration alone: each DL4J parameter's updater as DL4J applies
  it (``getUpdaterByParam``: the layer's ``iupdater``, its ``biasUpdater`` for biases where one
  is set, NoOp for a frozen layer and for batch normalization's running statistics; 0.8's
  ``updater`` enum and the layer's own fields, ``biasLearningRate`` for biases) as one
  ``UpdaterSlot`` per ``ParamSlot``; the file's layout (``BLOCKS`` for 0.9+ JSON, which has
  ``iupdater``; ``PER_PARAMETER`` for 0.7/0.8 JSON); and which parameters the model's one torch
  optimizer continues: those whose DL4J updater is the one dl4py made the network's (the first
  layer's that dl4py has, as the configuration mapping chooses it). The rest, and how exact the
  continuation is (``updater_state.TORCH_STATE``), become ``left_out`` lines.
- ``read_state``: the entry read within the size the slots need and split per parameter; a
  damaged or wrong-sized entry is a ``left_out`` line, not an error (the parameters are whole).
- ``load_state``: ``torch_states`` converts each state to torch's (``to_torch_state``: Nesterovs'
  ``-v / lr`` at the rate of the model's next update) and lays it out by the parameter's own
  ``ParamSlot.to_torch`` (a state value belongs to the weight value at its position, so the
  transpose or gate reorder the weights take is the state's); the result goes through the
  optimizer's ``load_state_dict`` onto the stepped parameters (float32 masters under half), in
  their dtype. Parameters DL4J's state does not continue get torch's fresh state (zeros, step 0):
  every parameter has a state, as torch's fused SGD needs (it takes a group's buffers all or none).

Which DL4J wrote the file matters: from 1.0.0-beta3 on, DL4J divides the gradient by the
minibatch size before its updater (``BaseMultiLayerUpdater.divideByMinibatch``) and adds L2
before it too, so its state is that of the mean gradient, as dl4py's. Up to 1.0.0-beta2 (0.8's
``LayerUpdater.postApply``, 0.9's blocks) the updater ran on the minibatch's *summed* gradient and
the update was divided by the minibatch size after it: the state is in other units by a factor
the file does not hold (Nesterovs' ``v``: B times; RmsProp's: B squared) and the adaptive rules
themselves differ. A configuration with a ``dataType`` or 1.0's ``regularization`` lists
(1.0.0-beta4 on) is of the first kind; an older one's state is left out, with a line (a
1.0.0-beta3 file, which has neither, is treated as older).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from dl4py.config.updaters import Updater
from dl4py.dl4j.config_json import DL4JConfiguration, LayerFields, number, typed, wrapped_layer
from dl4py.dl4j.json_dialects import inner_layer
from dl4py.dl4j.model_zip import UPDATER_STATE, ModelZip
from dl4py.dl4j.ndarray import DL4JFileError, read_array
from dl4py.dl4j.param_layout import ParamSlot
from dl4py.dl4j.updater_state import (BLOCKS, PER_PARAMETER, STATE_NAMES, TORCH_STATE, UpdaterSlot, split_state,
                                      state_size, to_torch_state)

# The updaters dl4py has (config/updaters.py), by DL4J's class names.
DL4PY_UPDATERS = ("Sgd", "Nesterovs", "Adam", "RmsProp")
_ARRAY_HEADER_BYTES = 1024  # an ND4J row vector's header (see importer)
_FROZEN = ("FrozenLayer", "FrozenLayerWithBackprop")  # getUpdaterByParam: NoOp for every parameter
_RUNNING_STATISTICS = ("mean", "var", "log10stdev")  # batch normalization's: NoOp in DL4J
_BIAS_KEYS = ("b", "bF", "bB")  # the initializers' isBiasParam
# 0.7/0.8: the fields beside the ``updater`` enum that its update rule reads (IUpdater.equals in 0.9+).
_OLD_UPDATER_FIELDS = ("learningRate", "momentum", "momentumSchedule", "rmsDecay", "epsilon", "adamMeanDecay",
                       "adamVarDecay", "rho", "learningRateSchedule")
_OLD_SCHEDULE_FIELDS = ("learningRatePolicy", "lrPolicyDecayRate", "lrPolicySteps", "lrPolicyPower")
_SUMMED_GRADIENTS = (f"{UPDATER_STATE} (a file from before DL4J 1.0.0-beta4: up to 1.0.0-beta2 DL4J stepped its "
                     "updater with the minibatch's summed gradients and divided by the minibatch size after it, so "
                     "the state's units differ from dl4py's by that size, which the file does not hold): left out, "
                     "fit starts a fresh updater")
# Why an approximate continuation is one, in a few words (TORCH_STATE says it at length).
_APPROXIMATE = {
    "Adam": "epsilon placement: torch adds it after the bias correction, DL4J before, so the steps differ "
            "by at most eps / (sqrt(v) + eps) relative",
    "Nesterovs": "a learning-rate schedule: torch scales the carried momentum by the new rate, DL4J by the old",
}


@dataclass(frozen=True)
class StatePlan:
    """What the import does with ``updaterState.bin``: the ``UpdaterSlot`` of each parameter (in
    coefficients.bin's order; empty where the file's updaters cannot be laid out), the file's
    ``layout``, whether each parameter's state goes into the optimizer (``carried``), the DL4J
    updater ``kind`` the optimizer continues, a line for each thing it cannot carry, and DL4J's
    ``(epochs, iterations)`` (``dl4j_position``)."""

    present: bool
    slots: tuple[UpdaterSlot, ...]
    layout: str
    carried: tuple[bool, ...]
    kind: str | None
    left_out: tuple[str, ...]
    position: tuple[int, int] = (0, 0)


def plan_state(conf: DL4JConfiguration, param_slots: list[ParamSlot], network_updater: Updater,
               present: bool) -> StatePlan:
    """The ``StatePlan`` for a configuration, its parameter slots and the updater dl4py made of
    it (``MappedNetwork.config.updater``); ``present``: the zip holds ``updaterState.bin``."""
    layout, position = state_layout(conf), dl4j_position(conf)
    try:
        slots = tuple(updater_slots(conf, param_slots))
        kinds = [slot.kind for slot in slots]  # an updater dl4py does not read: DL4JFileError here
    except DL4JFileError as exc:
        line = f"{UPDATER_STATE} ({exc}: its layout is unknown): left out, fit starts a fresh updater"
        return StatePlan(present, (), layout, (), None, (line,) if present else (), position)
    kind = type(network_updater).__name__
    if not mean_gradient_state(conf):
        return StatePlan(present, slots, layout, (False,) * len(slots), kind,
                         (_SUMMED_GRADIENTS,) if present else (), position)
    reference = _reference(slots, kind)
    carried = tuple(reference is not None and (k, s.settings) == reference for k, s in zip(kinds, slots))
    lines = _lines(slots, kinds, carried, kind, network_updater) if present else []
    return StatePlan(present, slots, layout, carried, kind, tuple(lines), position)


def state_layout(conf: DL4JConfiguration) -> str:
    """``BLOCKS`` where the layers' JSON has 0.9+'s ``iupdater``, else 0.7/0.8's ``PER_PARAMETER``."""
    for layer in conf.layers:
        fields = _updater_layer(LayerFields(layer, conf.where))
        if "iupdater" in fields.raw or "iUpdater" in fields.raw:
            return BLOCKS
    return PER_PARAMETER


def mean_gradient_state(conf: DL4JConfiguration) -> bool:
    """Whether DL4J's updater state is that of the minibatch's mean gradient, as dl4py's (see the
    module docstring): a 1.0.0-beta4+ configuration, told by its ``dataType`` or its layers'
    ``regularization`` lists."""
    return conf.data_type is not None or any(
        "regularization" in _updater_layer(LayerFields(layer, conf.where)).raw for layer in conf.layers)


def updater_slots(conf: DL4JConfiguration, param_slots: list[ParamSlot]) -> list[UpdaterSlot]:
    """One ``UpdaterSlot`` per parameter slot: its DL4J updater and hyperparameters as DL4J's
    ``getUpdaterByParam`` gives them (see the module docstring)."""
    out = []
    for slot in param_slots:
        fields = LayerFields(conf.layers[slot.layer], conf.where)
        if fields.layer.kind in _FROZEN or (fields.layer.kind == "BatchNormalization"
                                            and slot.key in _RUNNING_STATISTICS):
            out.append(UpdaterSlot(slot.layer, slot.key, slot.count, "NoOp"))
            continue
        inner = _updater_layer(fields)
        name, params = updater_fields(inner, bias=_is_bias(fields, slot.key))
        out.append(UpdaterSlot(slot.layer, slot.key, slot.count, name, _settings(inner, params)))
    return out


def updater_fields(fields: LayerFields, bias: bool = False) -> tuple[str, dict]:
    """DL4J's updater of a layer's weights (``bias``: of its biases) as the file writes it, not
    mapped: ``(name, hyperparameters)``. 0.9+: ``iupdater``'s class and fields (``biasUpdater``'s
    for biases where it is set); 0.7/0.8: the ``updater`` enum (SGD where absent) and the layer's
    own fields, with ``biasLearningRate`` as the biases' ``learningRate``."""
    name, params = typed(fields.raw.get("iupdater") or fields.raw.get("iUpdater"))
    if name is not None:
        bias_name, bias_params = typed(fields.raw.get("biasUpdater")) if bias else (None, {})
        return (bias_name, bias_params) if bias_name is not None else (name, params)
    params = dict(fields.raw)
    if bias and number(params.get("biasLearningRate")) is not None:
        params["learningRate"] = params["biasLearningRate"]
    return str(fields.raw.get("updater") or "SGD"), params


def _updater_layer(fields: LayerFields) -> LayerFields:
    """The layer object whose fields hold the updater: a LastTimeStep's or FrozenLayer's wrapped
    layer, a Bidirectional's forward copy (its ``getUpdaterByParam`` asks that one)."""
    if fields.layer.kind == "Bidirectional":
        return inner_layer(fields, "fwd") or fields
    return wrapped_layer(fields)


def _is_bias(fields: LayerFields, key: str) -> bool:
    if fields.layer.kind == "Bidirectional":  # fb, bb: the forward and backward copies' b
        key = key[1:]
    return key in _BIAS_KEYS


def _settings(fields: LayerFields, params: dict) -> str:
    """A hashable of what the update rule reads: 0.9+'s whole updater object (``IUpdater.equals``
    compares every field), 0.7/0.8's updater fields and the network's learning-rate policy."""
    if "iupdater" not in fields.raw and "iUpdater" not in fields.raw:
        params = {key: params.get(key) for key in _OLD_UPDATER_FIELDS} | {
            key: fields.layer.conf.get(key) for key in _OLD_SCHEDULE_FIELDS}
    return json.dumps(params, sort_keys=True, default=str)


def _reference(slots, kind: str):
    """``(kind, settings)`` of the DL4J updater dl4py made the network's: the first weight's
    whose updater dl4py has (the configuration mapping's choice), if it is of the network's kind."""
    for slot in slots:
        if slot.kind in DL4PY_UPDATERS and slot.key not in _BIAS_KEYS:
            return (slot.kind, slot.settings) if slot.kind == kind else None
    return None


def _lines(slots, kinds, carried, kind: str, network_updater: Updater) -> list[str]:
    lines = []
    if any(carried) and kind in _APPROXIMATE and (kind != "Nesterovs" or network_updater.schedule is not None):
        lines.append(f"{UPDATER_STATE}: {kind} state imported, approximate ({_APPROXIMATE[kind]})")
    by_reason: dict[str, list] = {}
    for slot, slot_kind, is_carried in zip(slots, kinds, carried):
        if not is_carried and STATE_NAMES[slot_kind]:  # Sgd and NoOp have nothing to carry
            by_reason.setdefault(_why_not(slot_kind, kind), []).append(slot)
    for why, left in by_reason.items():
        lines.append(f"{UPDATER_STATE}: the state of {_parameters(left)} ({why}): left out, those parameters "
                     "start with a fresh updater")
    return lines


def _why_not(slot_kind: str, kind: str) -> str:
    mapping = TORCH_STATE[slot_kind]
    if mapping.continuation == "refused":
        return f"DL4J's {slot_kind}: {mapping.why.split(';')[0].split(' (')[0]}"
    if slot_kind not in DL4PY_UPDATERS:
        return f"DL4J's {slot_kind}: dl4py has no such updater"
    if slot_kind == kind:
        return f"their own {kind} settings, not the network's that dl4py steps them with"
    return f"their {slot_kind}, not the network's {kind} that dl4py steps them with"


def _parameters(slots) -> str:
    """``layer 0 (W, b), layer 1 (b)``."""
    keys: dict = {}
    for slot in slots:
        keys.setdefault(slot.layer, []).append(slot.key)
    return ", ".join(f"layer {layer} ({', '.join(names)})" for layer, names in keys.items())


# ---- reading, converting, loading ---------------------------------------------------------------

def read_state(archive: ModelZip, plan: StatePlan) -> tuple[list[dict] | None, list[str]]:
    """``(states, lines)``: per parameter ``{DL4J state name: values}`` (None where nothing is to
    be loaded), and a line where the entry cannot be used (read no further than the slots need)."""
    if not plan.present or not any(plan.carried):
        return None, []
    where = f"{archive.name}:{UPDATER_STATE}"
    try:
        need = state_size(plan.slots)
        # Eight bytes a value (DOUBLE, the widest DL4J writes) and a header: no more is read.
        array = read_array(archive.read(UPDATER_STATE, max_bytes=need * 8 + _ARRAY_HEADER_BYTES), where)
        if array.dtype.kind != "f":
            raise DL4JFileError(where, f"holds {array.dtype} values; DL4J's updater state is FLOAT, DOUBLE or HALF")
        return split_state(array, plan.slots, plan.layout, where), []
    except DL4JFileError as exc:
        return None, [f"{exc} (not imported: fit starts a fresh updater)"]


def torch_states(param_slots: list[ParamSlot], states: list[dict], kind: str, *, learning_rate: float | None = None,
                 iteration: int = 0, carried=None) -> dict[str, dict]:
    """Per torch parameter name (``ParamSlot.torch_names``), the state torch's optimizer for DL4J's
    ``kind`` keeps: float64 arrays in the parameter's torch shape, and ``"step"`` where torch
    counts steps. ``states``: per parameter slot, DL4J's ``{state name: flat values}``
    (``split_state``); where ``carried[i]`` is false, torch's fresh state instead. Nesterovs
    needs the ``learning_rate`` of the next update; ``iteration``: DL4J's iteration count."""
    out = {}
    for i, (slot, state) in enumerate(zip(param_slots, states)):
        keep = carried is None or carried[i]
        if not keep:  # DL4J's zeros at iteration 0 convert to torch's fresh state
            state = {name: np.zeros(slot.count) for name in STATE_NAMES[kind]}
        # Converted in float64, then rounded once to the parameter's dtype (a double model's
        # state from a FLOAT file keeps -v / lr exact).
        wide = {name: np.asarray(values, dtype=np.float64) for name, values in state.items()}
        converted = to_torch_state(kind, wide, learning_rate=learning_rate, iteration=iteration if keep else 0)
        laid_out = {name: slot.to_torch(values) for name, values in converted.items() if name != "step"}
        for j, torch_name in enumerate(slot.torch_names):
            out[torch_name] = {name: arrays[j] for name, arrays in laid_out.items()}
            if "step" in converted:
                out[torch_name]["step"] = converted["step"]
    return out


def dl4j_position(conf: DL4JConfiguration) -> tuple[int, int]:
    """``(epochs, iterations)`` DL4J had trained when it saved: the configuration's ``epochCount``
    and ``iterationCount`` (a layer's where the network has none; 0.8 keeps no epochs: 0)."""
    first = conf.layers[0].conf if conf.layers else {}
    counts = []
    for key in ("epochCount", "iterationCount"):
        value = number(conf.raw.get(key), number(first.get(key), 0.0))
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise DL4JFileError(conf.where, f"{key} is {conf.raw.get(key, first.get(key))!r}, not a count")
        counts.append(int(value))
    return counts[0], counts[1]


def set_position(model, plan: StatePlan) -> None:
    """The model's counters where DL4J's stood (``plan.position``): its epochs and iterations;
    each DL4J iteration applied one update, so dl4py's update count (which its schedules read)
    is the same."""
    epochs, iterations = plan.position
    model.training_state.load_counters({"epoch_count": epochs, "iteration_count": iterations,
                                        "update_count": iterations, "batch_in_epoch": 0})


@torch.no_grad()
def load_state(model, param_slots: list[ParamSlot], plan: StatePlan, states: list[dict]) -> None:
    """DL4J's per-parameter ``states`` (``read_state``) into ``model``'s optimizer, after
    ``set_position`` (Adam's step and Nesterovs' learning rate come from the counters)."""
    optimizer = model.optimizer
    if not TORCH_STATE[plan.kind].names or _plain_sgd(optimizer):
        return  # Sgd, or Nesterovs with momentum 0 (plain SGD in torch): no state
    position = model.training_state
    rate = model.config.updater.learning_rate_at(position.updates, position.epoch)
    by_name = torch_states(param_slots, states, plan.kind, learning_rate=rate, iteration=position.updates,
                           carried=plan.carried)
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): name for name, p in model.precision_state.stepped_module.named_parameters()}
    loaded = {}
    for index, param in enumerate(ordered):
        name = names.get(id(param))
        if name not in by_name:  # param_layout fills every parameter: a miss is a layout fault
            raise DL4JFileError(UPDATER_STATE, f"no DL4J parameter holds the state of dl4py's {name}")
        loaded[index] = {key: torch.tensor(value, dtype=torch.float32) if key == "step" else _like(param, value)
                         for key, value in by_name[name].items()}
    optimizer.load_state_dict({"state": loaded, "param_groups": optimizer.state_dict()["param_groups"]})


def _plain_sgd(optimizer) -> bool:
    return isinstance(optimizer, torch.optim.SGD) and all(group["momentum"] == 0 for group in optimizer.param_groups)


def _like(param: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """``values`` as a tensor of the parameter's shape, dtype, device and strides (torch's fused
    kernels assume a state lies as its parameter does: channels-last convolution weights)."""
    if tuple(values.shape) != tuple(param.shape):
        raise DL4JFileError(UPDATER_STATE, f"a state shaped {list(values.shape)} for a parameter shaped "
                                           f"{list(param.shape)}")
    return torch.empty_like(param).copy_(torch.from_numpy(np.ascontiguousarray(values)))
