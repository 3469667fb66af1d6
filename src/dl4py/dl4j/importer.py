"""``import_dl4j``: a DL4J ModelSerializer zip as a working dl4py MultiLayerNetwork.

The steps, each in its own module: open the zip with every size checked (``model_zip``), read
configuration.json in its dialect and map it onto a NetworkConfig (``config_json``), lay
coefficients.bin out onto the built modules' tensors (``param_layout``). The parameters land
exactly: every value of the file in the torch entry and position DL4J's layout gives it, in
the file's precision (float, double or half, as DL4J's ``dataType`` or the array says).

What is not imported is said in one line (a warning on the ``dl4py.dl4j`` logger; ``plan_import``
lists it without building anything): the Java-serialized entries (never opened), the updater
state (imported by a later piece: ``fit`` starts a fresh updater), and training settings dl4py
lacks. ``strict=True`` refuses the file instead.

Data goes in as dl4py takes it: sequences ``[batch, time, size]`` (DL4J's default is ``[batch,
size, time]``), images ``[batch, channels, height, width]`` as DL4J's, or flat rows where DL4J's
first layer had a ``FeedForwardToCnnPreProcessor`` (``InputType.convolutional_flat``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from dl4py.config.input_type import InputType
from dl4py.dl4j.config_json import DL4JConfiguration, MappedNetwork, map_network, read_configuration
from dl4py.dl4j.model_zip import COEFFICIENTS, CONFIGURATION, UPDATER_STATE, ModelZip, open_model_zip
from dl4py.dl4j.ndarray import DL4JFileError, read_array
from dl4py.dl4j.param_layout import ParamSlot, check_count, param_slots, split_parameters
from dl4py.nn.network import MultiLayerNetwork

log = logging.getLogger("dl4py.dl4j")

_PRECISION_OF_ARRAY = {np.dtype(np.float32): "float", np.dtype(np.float64): "double", np.dtype(np.float16): "half"}
# An ND4J row vector's header: two UTF strings, lengths and a rank-2 shape buffer.
_ARRAY_HEADER_BYTES = 1024
# Torch entries no DL4J parameter fills: batch norm's update counter (DL4J keeps none).
_NOT_FROM_DL4J = ("num_batches_tracked",)


def import_dl4j(path, *, input_type: InputType | None = None, precision: str | None = None,
                strict: bool = False) -> MultiLayerNetwork:
    """The MultiLayerNetwork DL4J saved at ``path`` (``ModelSerializer.writeModel``), built and
    holding DL4J's parameters exactly, ready for ``output``, ``evaluate`` and ``fit``.

    ``input_type``: where the file does not hold the input's shape (a network that starts with
    a convolution and has no input preprocessor). ``precision``: instead of the file's.
    ``strict``: refuse the file when anything is left out (see the module docstring).

    >>> net = dl4py.import_dl4j("lenet.zip")                             # doctest: +SKIP
    >>> net.output(features)                                             # doctest: +SKIP
    """
    plan = plan_import(path, input_type)
    if strict and plan.left_out:
        raise DL4JFileError(plan.archive.name, "strict import, but it would leave out: " + "; ".join(plan.left_out))
    flat = _coefficients(plan.archive, plan.slots)
    model = MultiLayerNetwork(plan.mapped.config, precision=precision or plan.mapped.precision or _array_precision(flat))
    model.init()
    load_parameters(model, plan.slots, flat, f"{plan.archive.name}:{COEFFICIENTS}")
    if plan.left_out:
        log.warning("%s: imported; left out: %s", plan.archive.name, "; ".join(plan.left_out))
    return model


@dataclass(frozen=True)
class ImportPlan:
    """What ``import_dl4j`` would do with a zip, worked out without reading its parameters:
    the configuration as read and as mapped, the parameter slots, and what would be left out."""

    archive: ModelZip
    conf: DL4JConfiguration
    mapped: MappedNetwork
    slots: list[ParamSlot]
    left_out: tuple[str, ...]


def plan_import(path, input_type: InputType | None = None) -> ImportPlan:
    """The ``ImportPlan`` of the zip at ``path``; the same errors as ``import_dl4j``."""
    archive = open_model_zip(path)
    conf = read_configuration(archive.read_configuration(), f"{archive.name}:{CONFIGURATION}")
    if conf.is_graph:
        raise DL4JFileError(archive.name, "holds a ComputationGraph: importing graphs comes later "
                                          "(dl4py imports DL4J MultiLayerNetworks now)")
    mapped = map_network(conf, input_type)
    slots = param_slots(conf, mapped.prefixes)
    return ImportPlan(archive, conf, mapped, slots, tuple(_left_out(archive, mapped)))


def _coefficients(archive: ModelZip, slots: list[ParamSlot]) -> np.ndarray:
    need = slots[-1].offset + slots[-1].count if slots else 0
    where = f"{archive.name}:{COEFFICIENTS}"
    if need == 0:
        return np.zeros(0, dtype=np.float32)
    # Eight bytes a value (DOUBLE, the widest DL4J writes) and a header: no more is read.
    data = archive.read(COEFFICIENTS, max_bytes=need * 8 + _ARRAY_HEADER_BYTES)
    flat = read_array(data, where)
    if flat.dtype not in _PRECISION_OF_ARRAY:
        raise DL4JFileError(where, f"holds {flat.dtype} values; DL4J's parameters are FLOAT, DOUBLE or HALF")
    check_count(slots, flat.size, where)  # before the network is built: the file's values bound its size
    return flat.reshape(-1)


def _array_precision(flat: np.ndarray) -> str:
    return _PRECISION_OF_ARRAY[flat.dtype]


def _left_out(archive: ModelZip, mapped: MappedNetwork) -> list[str]:
    lines = archive.left_out()
    if archive.has(UPDATER_STATE):
        lines.append(f"{UPDATER_STATE} (the updater's state: not imported yet, fit starts a fresh updater)")
    return lines + list(mapped.left_out)


@torch.no_grad()
def load_parameters(model: MultiLayerNetwork, slots: list[ParamSlot], flat: np.ndarray, where: str) -> None:
    """DL4J's flat parameters into a built model's tensors, by ``slots``; every parameter and
    buffer of the model must be filled (what none fills would keep a random start)."""
    values = split_parameters(slots, flat, where)
    stepped = model.precision_state.stepped_module  # float32 masters under half: exact for half values
    modules = [stepped] if model.module is stepped else [stepped, model.module]
    for module in modules:
        state = module.state_dict(keep_vars=True)
        unfilled = [name for name in state if name not in values and not name.endswith(_NOT_FROM_DL4J)]
        if unfilled:
            raise DL4JFileError(where, f"no DL4J parameter fills {', '.join(unfilled)} of the dl4py network "
                                       "(a layer whose layout dl4py maps wrongly)")
        for name, value in values.items():
            target = state.get(name)
            if target is None:
                raise DL4JFileError(where, f"the dl4py network has no {name} for DL4J's parameter there")
            if tuple(target.shape) != value.shape:
                raise DL4JFileError(where, f"{name}: DL4J's values have shape {list(value.shape)}, the dl4py "
                                           f"tensor {list(target.shape)}")
            target.copy_(torch.from_numpy(np.ascontiguousarray(value)).to(target.dtype))
    model.precision_state.after_sync()


def read_dl4j_configuration(path) -> DL4JConfiguration:
    """The configuration of the zip at ``path`` as read, not mapped: what a network dl4py
    cannot build still has its ``param_slots``."""
    archive = open_model_zip(path)
    return read_configuration(archive.read_configuration(), f"{archive.name}:{CONFIGURATION}")
