"""DL4J's ``updaterState.bin`` (one flat row of optimizer state) split per parameter, and joined back.

Two layouts, read from DL4J's sources:

- ``BLOCKS`` (DL4J 0.9.0 on, ``BaseMultiLayerUpdater``): the parameters are walked in the flat
  order of ``coefficients.bin`` (layers input to output, or a graph's topological order; each
  layer's ``paramTable`` order). Consecutive parameters whose updater configurations are equal
  (``IUpdater.equals``: the class and every hyperparameter and schedule) share one
  ``UpdaterBlock``; a layer without parameters does not break a block; a pretraining-only
  parameter (VAE, autoencoder visible bias) shares only with those of its own layer
  (``UpdaterUtils.updaterConfigurationsEquals``). A block's state is one contiguous piece of the
  row, ``k * N`` long for ``N`` parameter values and an updater keeping ``k`` values each, cut by
  the updater's ``setStateViewArray`` into its ``k`` states, each ``N`` long: Adam ``[m | v]``
  over the whole block, so a parameter's ``m`` and ``v`` lie ``N`` apart.
- ``PER_PARAMETER`` (DL4J 0.8 and before, ``LayerUpdater`` with one ``GradientUpdater`` per
  variable): each parameter has its own ``k * n`` piece, cut the same way: ``[m_W | v_W | m_b | v_b]``.
  The two agree for one-state updaters (Nesterovs, RmsProp, AdaGrad); a 0.8 file has the 0.8
  layer JSON (``"updater": "ADAM"``, no ``"iupdater"``).

Within a state, element ``i`` belongs to element ``i`` of the parameter's segment in
``coefficients.bin`` (DL4J reshapes both views alike), so the parameter layout turns the states
into tensors exactly as it turns the weights.

``TORCH_STATE`` says which torch optimizer state each DL4J state becomes, and whether training
goes on exactly as DL4J's would (``to_torch_state``, ``from_torch_state``), for DL4J's updater as
it runs from 1.0.0-beta3 on: on the minibatch's mean gradient. Older DL4J stepped it with the
summed gradient and divided after it, so its state is in other units (``optimizer_state``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import numpy as np

from dl4py.dl4j.ndarray import DL4JFileError

BLOCKS, PER_PARAMETER = "blocks", "per-parameter"

# Each updater's states, in the order setStateViewArray cuts them (field names of DL4J's
# GradientUpdater classes); Sgd and NoOp keep none.
STATE_NAMES = {
    "Sgd": (), "NoOp": (), "Nesterovs": ("v",), "RmsProp": ("lastGradient",), "AdaGrad": ("historicalGradient",),
    "Adam": ("m", "v"), "Nadam": ("m", "v"), "AdaMax": ("m", "u"), "AdaDelta": ("msg", "msdx"),
    "AMSGrad": ("m", "v", "vHat"), "AdaBelief": ("m", "s"),
}
# DL4J 0.x's Updater enum and class names, lower-cased, onto the names above.
_ALIASES = {name.lower(): name for name in STATE_NAMES} | {"none": "NoOp"}


@dataclass(frozen=True)
class UpdaterSlot:
    """One parameter in DL4J's flat order: where it is (for messages), how many values, and its
    updater: ``updater`` (``"Adam"``, ``"NESTEROVS"``, ``"org.nd4j.linalg.learning.config.Adam"``)
    and ``settings``, a hashable of its hyperparameters and schedules. Slots share a block only
    when both are equal, as DL4J's ``IUpdater.equals`` decides."""

    layer: int | str
    key: str
    count: int
    updater: str
    settings: Hashable = ()
    pretrain: bool = False  # a pretraining-only parameter (isPretrainParam)

    @property
    def kind(self) -> str:
        return updater_kind(self.updater, f"layer {self.layer!r} parameter {self.key!r}")


def updater_kind(name: str, where: str = "updater") -> str:
    """DL4J's updater class for ``name`` (an enum or class name, any case), or a DL4JFileError."""
    kind = _ALIASES.get(str(name).rsplit(".", 1)[-1].lower())
    if kind is None:
        raise DL4JFileError(where, f"updater {name!r} is not one dl4py reads (it reads {', '.join(STATE_NAMES)})")
    return kind


def state_size(slots) -> int:
    """How many values ``updaterState.bin`` holds for these parameters (the same in both layouts)."""
    return sum(len(STATE_NAMES[slot.kind]) * _count(slot) for slot in slots)


def split_state(state, slots, layout: str = BLOCKS, where: str = "updaterState.bin") -> list[dict[str, np.ndarray]]:
    """Per slot, ``{state name: flat values}`` (in the element order of the slot's segment of
    ``coefficients.bin``); ``{}`` for Sgd and NoOp. ``state`` is the array ``read_array`` gives
    (DL4J's ``[1, n]`` row). A length that disagrees with the slots is one DL4JFileError."""
    slots = list(slots)
    flat = _row(state, where)
    expected = state_size(slots)
    if flat.size != expected:
        raise DL4JFileError(where, f"holds {flat.size} values, but the updaters of the {len(slots)} parameters "
                                   f"need {expected} ({_summary(slots)})")
    result: list[dict[str, np.ndarray]] = [{} for _ in slots]
    for start, members in _pieces(slots, layout):
        names, total = STATE_NAMES[slots[members[0]].kind], sum(slots[i].count for i in members)
        offset = 0
        for i in members:
            n = slots[i].count
            result[i] = {name: flat[start + q * total + offset:start + q * total + offset + n].copy()
                         for q, name in enumerate(names)}
            offset += n
    return result


def join_state(states, slots, layout: str = BLOCKS, dtype=None) -> np.ndarray:
    """The inverse of ``split_state``: DL4J's ``[1, n]`` row, for ``write_array`` (DL4J 1.0 gives
    the row strides ``[1, 1]``, write_array ``[n, 1]``: the same values, not the same bytes; with
    ``n == 0`` DL4J writes no ``updaterState.bin``). ``dtype`` defaults to that of the first state
    given, else float32."""
    slots, states = list(slots), list(states)
    if len(states) != len(slots):
        raise ValueError(f"join_state: {len(states)} states for {len(slots)} parameters")
    if dtype is None:
        dtype = next((np.asarray(a).dtype for s in states for a in s.values()), np.float32)
    flat = np.zeros(state_size(slots), dtype=dtype)
    for start, members in _pieces(slots, layout):
        names, total = STATE_NAMES[slots[members[0]].kind], sum(slots[i].count for i in members)
        offset = 0
        for i in members:
            slot, given = slots[i], states[i]
            if set(given) != set(names):
                raise ValueError(f"join_state: layer {slot.layer!r} parameter {slot.key!r} ({slot.kind}) needs "
                                 f"states {list(names)}, got {sorted(given)}")
            for q, name in enumerate(names):
                values = np.asarray(given[name]).reshape(-1)
                if values.size != slot.count:
                    raise ValueError(f"join_state: layer {slot.layer!r} parameter {slot.key!r} state {name!r} has "
                                     f"{values.size} values, the parameter {slot.count}")
                flat[start + q * total + offset:start + q * total + offset + slot.count] = values
            offset += slot.count
    return flat.reshape(1, -1)


def _pieces(slots, layout: str):
    """``(start in the row, [slot indices])`` of each contiguous piece of state: DL4J's updater
    blocks, or one piece per parameter in the 0.8 layout."""
    if layout not in (BLOCKS, PER_PARAMETER):
        raise ValueError(f"layout must be {BLOCKS!r} or {PER_PARAMETER!r}, got {layout!r}")
    groups: list[list[int]] = []
    for i, slot in enumerate(slots):
        _count(slot)
        if groups and layout == BLOCKS and _same_block(slots[groups[-1][-1]], slot):
            groups[-1].append(i)
        else:
            groups.append([i])
    start = 0
    for members in groups:
        yield start, members
        start += len(STATE_NAMES[slots[members[0]].kind]) * sum(slots[i].count for i in members)


def _same_block(before: UpdaterSlot, slot: UpdaterSlot) -> bool:
    """``UpdaterUtils.updaterConfigurationsEquals`` for two consecutive parameters."""
    if (before.kind, before.settings) != (slot.kind, slot.settings):
        return False
    if before.pretrain or slot.pretrain:
        return before.layer == slot.layer and before.pretrain and slot.pretrain
    return True


def _count(slot: UpdaterSlot) -> int:
    if isinstance(slot.count, bool) or not isinstance(slot.count, (int, np.integer)) or slot.count < 0:
        raise ValueError(f"layer {slot.layer!r} parameter {slot.key!r}: count must be a whole number >= 0, "
                         f"got {slot.count!r}")
    return int(slot.count)


def _row(state, where: str) -> np.ndarray:
    array = np.asarray(state)
    if array.ndim > 2 or (array.ndim == 2 and 1 not in array.shape):
        raise DL4JFileError(where, f"is shaped {list(array.shape)}, not a row of updater state")
    return array.reshape(-1)


def _summary(slots) -> str:
    """``Adam 2 x 9965 values`` for each updater, in order of first use."""
    counts: dict[str, int] = {}
    for slot in slots:
        counts[slot.kind] = counts.get(slot.kind, 0) + _count(slot)
    return ", ".join(f"{kind} {len(STATE_NAMES[kind])} x {n} values" for kind, n in counts.items())


# ---- onto torch's optimizers --------------------------------------------------------------

@dataclass(frozen=True)
class TorchMapping:
    """Which ``torch.optim`` class continues a DL4J updater, its state names (torch name -> DL4J
    name), and whether training then goes on as DL4J's would: ``exact``, ``approximate`` or
    ``refused``, with why."""

    optimizer: str | None
    names: dict
    continuation: str
    why: str


TORCH_STATE = {
    "Sgd": TorchMapping("SGD", {}, "exact", "no state on either side"),
    "NoOp": TorchMapping(None, {}, "exact", "the parameters never change: keep them out of the optimizer"),
    "Nesterovs": TorchMapping(
        "SGD", {"momentum_buffer": "v"}, "exact",
        "SGD(momentum=mu, nesterov=True) with momentum_buffer = -v / lr: DL4J keeps v = mu*v - lr*g and "
        "steps by mu*v_prev - (1+mu)*v, torch keeps b = mu*b + g and steps by lr*(g + mu*b); equal while lr "
        "is constant (one rounding of the division); after a learning-rate change the carried momentum is "
        "scaled by the new rate in torch, by the old one in DL4J"),
    "RmsProp": TorchMapping(
        "RMSprop", {"square_avg": "lastGradient"}, "exact",
        "RMSprop(alpha=rmsDecay, eps, momentum=0, centered=False): both step by lr*g / (sqrt(G) + eps); "
        "'lastGradient' is DL4J's name for the running mean of g^2"),
    "AdaGrad": TorchMapping(
        "Adagrad", {"sum": "historicalGradient"}, "exact",
        "Adagrad(lr_decay=0, eps): both step by lr*g / (sqrt(H) + eps) with H the sum of g^2"),
    "AdaDelta": TorchMapping(
        "Adadelta", {"square_avg": "msg", "acc_delta": "msdx"}, "exact",
        "Adadelta(lr=1.0, rho, eps): DL4J's AdaDelta has no learning rate; the same two running means"),
    "Adam": TorchMapping(
        "Adam", {"exp_avg": "m", "exp_avg_sq": "v"}, "approximate",
        "step = DL4J's iteration count; DL4J divides by sqrt(v) + eps before its bias correction "
        "(alpha_t = lr*sqrt(1-b2^t)/(1-b1^t)), torch after it, so torch's eps acts as eps*sqrt(1-b2^t) "
        "in DL4J's terms: the steps differ by at most eps / (sqrt(v) + eps) relative"),
    "AMSGrad": TorchMapping(
        "Adam", {"exp_avg": "m", "exp_avg_sq": "v", "max_exp_avg_sq": "vHat"}, "approximate",
        "Adam(amsgrad=True); the same epsilon placement difference as Adam"),
    "AdaMax": TorchMapping(
        "Adamax", {"exp_avg": "m", "exp_inf": "u"}, "approximate",
        "step = DL4J's iteration count; torch takes max(b2*u, |g| + eps), DL4J max(b2*u, |g|) (+1e-32): "
        "the steps differ by at most eps / u relative"),
    "Nadam": TorchMapping(
        None, {}, "refused",
        "torch.optim.NAdam is another algorithm (a momentum-decay schedule mu_t with its product in the "
        "state, and a bias-corrected v); DL4J's Nadam has neither"),
    "AdaBelief": TorchMapping(None, {}, "refused", "torch has no AdaBelief optimizer"),
}
_STEPPED = ("Adam", "AMSGrad", "AdaMax", "RmsProp", "AdaGrad", "AdaDelta")  # torch keeps a "step" count


def to_torch_state(kind: str, state: dict, *, learning_rate: float | None = None, iteration: int = 0) -> dict:
    """One parameter's DL4J state as torch's optimizer keeps it (numpy arrays, and ``"step"``
    as a float where torch counts steps: set it to DL4J's iteration count, the updates applied).
    Nesterovs needs the ``learning_rate`` of the last update. A refused updater is a ValueError."""
    kind = updater_kind(kind)
    mapping = _mapping(kind)
    result = {torch_name: np.asarray(state[dl4j_name]) for torch_name, dl4j_name in mapping.names.items()}
    if kind == "Nesterovs":
        result["momentum_buffer"] = -result["momentum_buffer"] / _rate(learning_rate)
    if kind in _STEPPED:
        result["step"] = float(iteration)
    return result


def from_torch_state(kind: str, torch_state: dict, count: int, *, learning_rate: float | None = None) -> dict:
    """The inverse of ``to_torch_state`` for one parameter of ``count`` values. A state torch has
    not created yet (a parameter never stepped) is torch's starting value, zeros."""
    kind = updater_kind(kind)
    mapping = _mapping(kind)
    result = {}
    for torch_name, dl4j_name in mapping.names.items():
        value = torch_state.get(torch_name)
        result[dl4j_name] = np.zeros(count) if value is None else np.asarray(value).reshape(-1)
    if kind == "Nesterovs":
        result["v"] = -result["v"] * _rate(learning_rate)
    return result


def _mapping(kind: str) -> TorchMapping:
    mapping = TORCH_STATE[kind]
    if mapping.continuation == "refused":
        raise ValueError(f"DL4J's {kind} state cannot continue in torch: {mapping.why}")
    return mapping


def _rate(learning_rate) -> float:
    if learning_rate is None or not learning_rate > 0:
        raise ValueError(f"Nesterovs' state converts with the learning rate of the last update, got {learning_rate!r}")
    return float(learning_rate)
