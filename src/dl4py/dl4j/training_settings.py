"""DL4J's training settings as dl4py's: weight init, L2 (and what other regularization is left
out), dropout, the updater with its hyperparameters and learning-rate schedule, per layer, and
the one updater and L2 of the network that dl4py keeps.

They change how the network trains, not what it computes: what dl4py lacks (L1, bias
regularization, weight decay, a weight-init distribution, an updater or schedule without a
dl4py counterpart, per-layer updaters that differ) goes into a ``left_out`` list, one line each
naming the layer and what stands in for it, never an error. ``dropout_rate`` is the exception
in kind: DL4J's plain dropout becomes a dl4py DropoutLayer (``layer_mapping``).
"""

from __future__ import annotations

from collections import Counter

from dl4py.config.frozen import unfrozen
from dl4py.config.schedules import ExponentialSchedule, PolySchedule, StepSchedule
from dl4py.config.updaters import Adam, Nesterovs, RmsProp, Sgd
from dl4py.dl4j.json_dialects import LayerFields, inner_layer, number, typed
from dl4py.errors import ConfigError

_WEIGHT_INITS = {"xavier": "xavier", "relu": "relu", "normal": "normal", "uniform": "uniform", "zero": "zero"}


def weight_init(fields: LayerFields, left_out: list) -> str | None:
    """The layer's weight init as dl4py names it; None (listed in ``left_out``) for one dl4py
    lacks, or where the file names none."""
    name = fields.get("weightInit")
    if name is None:
        name, _ = typed(fields.raw.get("weightInitFn"))
        name = (name or "").removeprefix("WeightInit")
    if not name:
        return None
    dl4py_name = _WEIGHT_INITS.get(str(name).lower())
    if dl4py_name is None:
        left_out.append(f"layer {fields.index}: weight init {name} (it only shapes fresh parameters; dl4py's "
                        "xavier stands in)")
    return dl4py_name


def weight_l2(fields: LayerFields, left_out: list) -> float:
    """L2 on the weights; L1, bias L2 and weight decay go to ``left_out``."""
    if fields.layer.conf.get("useRegularization") is False:  # 0.7/0.8: l1/l2 set but switched off
        return 0.0
    if "regularization" in fields.raw or "regularizationBias" in fields.raw:
        l2 = 0.0
        for item in fields.raw.get("regularization") or []:
            name, params = typed(item)
            value = _schedule_value(params.get("l2"))
            if name == "L2Regularization" and value is not None:
                l2 = value
            else:
                left_out.append(f"layer {fields.index}: {name} {params} (dl4py regularizes with L2 only)")
        if fields.raw.get("regularizationBias"):
            left_out.append(f"layer {fields.index}: regularization of biases (dl4py leaves biases unregularized)")
        return l2
    for key, what in (("l1", "L1"), ("l1Bias", "bias L1"), ("l2Bias", "bias L2")):
        if number(fields.raw.get(key), 0.0):
            left_out.append(f"layer {fields.index}: {what} {fields.raw[key]} (dl4py regularizes weights with L2 only)")
    return number(fields.raw.get("l2"), 0.0)


def _schedule_value(value) -> float | None:
    name, params = typed(value)
    if isinstance(value, (int, float)):
        return float(value)
    return number(params.get("value")) if name == "FixedSchedule" else None


def layer_updater(fields: LayerFields, left_out: list):
    """The layer's updater as dl4py's (None: dl4py has none like it, noted in ``left_out``)."""
    wrapped = inner_layer(fields, "fwd") if fields.layer.kind == "Bidirectional" else None
    if wrapped is not None:  # a Bidirectional keeps no updater of its own: its layer's is it
        fields = wrapped
    name, params = typed(fields.raw.get("iupdater") or fields.raw.get("iUpdater"))
    if name is None and isinstance(fields.raw.get("updater"), dict):  # 1.0 SameDiff layers: the object in "updater"
        name, params = typed(fields.raw["updater"])
    if name is None:  # 0.7/0.8: an enum and the hyperparameters beside it
        name, params = str(fields.raw.get("updater") or "SGD"), fields.raw
        schedule = _old_schedule(fields, left_out)
    else:
        schedule = _schedule(fields, params.get("learningRateSchedule"), left_out)
    key = name.lower()
    lr = number(params.get("learningRate"))
    if lr is None:  # DL4J writes NaN beside a schedule: the schedule's first rate
        lr = _initial_rate(params.get("learningRateSchedule"))
    extra = {"schedule": schedule} if schedule is not None else {}
    if lr is not None:
        extra["learning_rate"] = lr
    if key == "sgd":
        return Sgd(**extra)
    if key == "nesterovs":
        return Nesterovs(momentum=number(params.get("momentum"), 0.9), **extra)
    if key == "adam":
        return Adam(beta1=number(params.get("beta1", params.get("adamMeanDecay")), 0.9),
                    beta2=number(params.get("beta2", params.get("adamVarDecay")), 0.999),
                    epsilon=number(params.get("epsilon"), 1e-8), **extra)
    if key == "rmsprop":
        return RmsProp(rms_decay=number(params.get("rmsDecay"), 0.95), epsilon=number(params.get("epsilon"), 1e-8),
                       **extra)
    left_out.append(f"layer {fields.index}: updater {name} (dl4py has Sgd, Nesterovs, Adam, RmsProp; "
                    "the network's other updater, or Sgd, stands in)")
    return None


def _schedule(fields: LayerFields, value, left_out: list):
    name, params = typed(value)
    if name is None:
        return None
    unit = "epoch" if str(params.get("scheduleType", "ITERATION")).upper() == "EPOCH" else "iteration"
    try:
        if name == "ExponentialSchedule":
            return ExponentialSchedule(gamma=params["gamma"], unit=unit)
        if name == "StepSchedule":
            return StepSchedule(decay_rate=params["decayRate"], step=int(params["step"]), unit=unit)
        if name == "PolySchedule":
            return PolySchedule(power=params["power"], max_steps=int(params["maxIter"]), unit=unit)
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise fields.error(f"learning-rate schedule {name} {params}: {exc}") from None
    left_out.append(f"layer {fields.index}: learning-rate schedule {name} (dl4py schedules: exponential, step, "
                    "poly; the fixed initial rate stands in)")
    return None


def _initial_rate(value) -> float | None:
    _, params = typed(value)
    if "initialValue" in params:
        return number(params["initialValue"])
    values = params.get("values")  # MapSchedule: {iteration: rate}
    if isinstance(values, dict) and values:
        return number(values[min(values, key=int)])
    return None


def _old_schedule(fields: LayerFields, left_out: list):
    """0.7/0.8's network-wide ``learningRatePolicy``."""
    conf = fields.layer.conf
    policy = str(conf.get("learningRatePolicy") or "None")
    if policy == "None":
        return None
    if policy == "Exponential":
        return ExponentialSchedule(gamma=number(conf.get("lrPolicyDecayRate")))
    if policy == "Step":
        return StepSchedule(decay_rate=number(conf.get("lrPolicyDecayRate")),
                            step=int(number(conf.get("lrPolicySteps"))))
    left_out.append(f"layer {fields.index}: learning-rate policy {policy} (dl4py schedules: exponential, step, poly; "
                    "the fixed rate stands in)")
    return None


def dropout_rate(fields: LayerFields, left_out: list) -> float:
    """The rate of the dropout DL4J applies to the layer's input (DL4J stores the probability to
    keep); 0 for none, and for a dropout kind dl4py lacks (listed in ``left_out``)."""
    old = number(fields.raw.get("dropOut"), 0.0)  # 0.7/0.8: the probability to keep
    if old:
        return 1.0 - old
    name, params = typed(fields.raw.get("idropout"))
    if name is None:
        return 0.0
    if name != "Dropout" or params.get("pSchedule") is not None:
        left_out.append(f"layer {fields.index}: dropout {name} {params} (dl4py has plain dropout with a fixed rate)")
        return 0.0
    keep = number(params.get("p"), 1.0)
    return 0.0 if keep >= 1.0 else 1.0 - keep



def network_updater(updaters: dict, left_out: list):
    """The one updater dl4py's network takes from DL4J's per-layer ``updaters`` (layer index ->
    updater, None where dl4py has none like it): the first layer's; layers with another are
    listed in ``left_out``."""
    chosen = [u for u in updaters.values() if u is not None]
    updater = chosen[0] if chosen else Sgd()
    differing = sorted(i for i, u in updaters.items() if u is not None and u != updater)
    if differing:
        left_out.append(f"layers {differing}: their own updaters (dl4py has one per network: "
                        f"layer {min(updaters)}'s {type(updater).__name__} is used)")
    return updater


def network_l2(layers, l2_elsewhere: dict, left_out: list) -> float:
    """The L2 most layers have; the layers that take the network's (``l2_elsewhere``: DL4J
    layer index -> its L2) and have another are listed in ``left_out``."""
    values = [getattr(unfrozen(layer), "l2", None) for layer in layers]
    counts = Counter([v for v in values if v is not None] + list(l2_elsewhere.values()))
    l2 = counts.most_common(1)[0][0] if counts else 0.0
    for index, value in l2_elsewhere.items():
        if value != l2:
            left_out.append(f"layer {index}: L2 {value} (dl4py's layer of this kind takes the network's "
                            f"L2, {l2})")
    return l2
