"""``import_dl4j``: a DL4J ModelSerializer zip as a working dl4py MultiLayerNetwork (or, for a
ComputationGraphConfiguration, a ComputationGraph: ``graph_mapping``).

The steps, each in its own module: open the zip with every size checked (``model_zip``), read
configuration.json in its dialect and map it onto a NetworkConfig (``config_json``), lay
coefficients.bin out onto the built modules' tensors (``param_layout``), updaterState.bin into
the optimizer's state and DL4J's iteration and epoch counts into the model's counters
(``optimizer_state``), normalizer.bin into the model's normalizer (``normalizer_file``). The
parameters land exactly: every value of the file in the torch entry and position DL4J's layout
gives it, in the file's precision (float, double or half, as DL4J's ``dataType`` or the array
says); the updater state in the same positions, on the parameters the optimizer steps. So
``fit`` goes on where DL4J stopped, and ``output`` takes the raw features DL4J's normalizer took.

What is not imported is said in one line (a warning on the ``dl4py.dl4j`` logger; ``plan_import``
lists what the configuration alone shows, without building anything): the Java-serialized
entries (never opened), training settings dl4py lacks, updater state torch cannot continue as
DL4J would (or continues only approximately, as Adam's), and an updater state or normalizer
that cannot be used. ``strict=True`` refuses the file instead.

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
from dl4py.data.normalizers import Normalizer
from dl4py.dl4j.config_json import DL4JConfiguration, MappedNetwork, map_network, read_configuration
from dl4py.dl4j.graph_mapping import DL4JGraph, MappedGraph, map_graph, read_graph
from dl4py.dl4j.model_zip import COEFFICIENTS, CONFIGURATION, NORMALIZER, UPDATER_STATE, ModelZip, open_model_zip
from dl4py.dl4j.ndarray import DL4JFileError, read_array
from dl4py.dl4j.normalizer_file import load_normalizer
from dl4py.dl4j.optimizer_state import StatePlan, load_state, plan_state, read_state, set_position
from dl4py.dl4j.param_layout import ParamSlot, check_count, param_slots, split_parameters
from dl4py.nn.graph import ComputationGraph
from dl4py.nn.network import MultiLayerNetwork

log = logging.getLogger("dl4py.dl4j")

_PRECISION_OF_ARRAY = {np.dtype(np.float32): "float", np.dtype(np.float64): "double", np.dtype(np.float16): "half"}
# An ND4J row vector's header: two UTF strings, lengths and a rank-2 shape buffer.
_ARRAY_HEADER_BYTES = 1024
# Torch entries no DL4J parameter fills: batch norm's update counter (DL4J keeps none).
_NOT_FROM_DL4J = ("num_batches_tracked",)
# normalizer.bin: a header, a few doubles and at most four statistics arrays of the input's size.
_NORMALIZER_ARRAYS = 4


def import_dl4j(path, *, input_type: InputType | dict[str, InputType] | None = None, precision: str | None = None,
                strict: bool = False) -> MultiLayerNetwork | ComputationGraph:
    """The MultiLayerNetwork DL4J saved at ``path`` (``ModelSerializer.writeModel``), built and
    holding DL4J's parameters exactly, its updater state, training counters and normalizer,
    ready for ``output``, ``evaluate`` and ``fit`` (which continues DL4J's training).

    A ComputationGraphConfiguration becomes a ComputationGraph (``graph_mapping``).

    ``input_type``: where the file does not hold the input's shape (a network that starts with
    a convolution and has no input preprocessor); for a graph, one per network input name
    (a dict), or one InputType for a graph with one input. ``precision``: instead of the file's.
    ``strict``: refuse the file when anything is left out (see the module docstring).

    >>> net = dl4py.import_dl4j("lenet.zip")                             # doctest: +SKIP
    >>> net.output(features)                                             # doctest: +SKIP
    """
    plan = plan_import(path, input_type)
    _refuse_if_strict(strict, plan.archive, plan.left_out)
    flat = _coefficients(plan.archive, plan.slots)
    states, lines = read_state(plan.archive, plan.state)  # read and checked before anything is built
    left_out = plan.left_out + tuple(lines)
    _refuse_if_strict(strict, plan.archive, left_out)
    model_class = MultiLayerNetwork if plan.graph is None else ComputationGraph
    model = model_class(plan.mapped.config, precision=precision or plan.mapped.precision or _array_precision(flat))
    model.init()
    load_parameters(model, plan.slots, flat, f"{plan.archive.name}:{COEFFICIENTS}")
    set_position(model, plan.state)
    if states is not None:
        load_state(model, plan.slots, plan.state, states)
    if plan.normalizer is not None:
        model.set_normalizer(plan.normalizer)
    if left_out:
        log.warning("%s: imported; left out: %s", plan.archive.name, "; ".join(left_out))
    return model


def _refuse_if_strict(strict: bool, archive: ModelZip, left_out) -> None:
    if strict and left_out:
        raise DL4JFileError(archive.name, "strict import, but it would leave out: " + "; ".join(left_out))


@dataclass(frozen=True)
class ImportPlan:
    """What ``import_dl4j`` would do with a zip, worked out without reading its parameters or
    updater state: the configuration as read and as mapped, the parameter slots, what becomes
    of the updater state (``state``), the normalizer (None where the zip has none, or one dl4py
    cannot use), and what would be left out (a wrong-sized updater state shows at import only).
    For a graph, ``graph`` is the graph as read, ``mapped`` a MappedGraph, and the slots' layer
    indices are those of ``graph.layers`` (the layer vertices in DL4J's topological order)."""

    archive: ModelZip
    conf: DL4JConfiguration
    mapped: MappedNetwork | MappedGraph
    slots: list[ParamSlot]
    state: StatePlan
    normalizer: Normalizer | None
    left_out: tuple[str, ...]
    graph: DL4JGraph | None = None


def plan_import(path, input_type: InputType | dict[str, InputType] | None = None) -> ImportPlan:
    """The ``ImportPlan`` of the zip at ``path``; the same errors as ``import_dl4j``."""
    archive = open_model_zip(path)
    conf = read_configuration(archive.read_configuration(), f"{archive.name}:{CONFIGURATION}")
    graph = None
    if conf.is_graph:
        graph = read_graph(conf)
        if input_type is not None and not isinstance(input_type, dict):
            input_type = {name: input_type for name in graph.inputs}
        mapped = map_graph(graph, input_type)
        layers = graph.layers  # the layer vertices in DL4J's topological order: its flat parameters' order
    else:
        mapped = map_network(conf, input_type)
        layers = conf
    slots = param_slots(layers, mapped.prefixes)
    state = plan_state(layers, slots, mapped.config.updater, archive.has(UPDATER_STATE))
    normalizer, normalizer_lines = _normalizer(archive, mapped)
    left_out = _archive_left_out(archive) + list(mapped.left_out) + list(state.left_out) + normalizer_lines
    return ImportPlan(archive, conf, mapped, slots, state, normalizer, tuple(left_out), graph)


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


def _archive_left_out(archive: ModelZip) -> list[str]:
    """The zip's entries left out: the Java-serialized ones."""
    return archive.left_out()


def _normalizer(archive: ModelZip, mapped: MappedNetwork | MappedGraph) -> tuple[Normalizer | None, list[str]]:
    """DL4J's normalizer as dl4py's, or a line saying why not (a type dl4py lacks, labels
    normalized too, a damaged entry): the network itself is whole without it."""
    if not archive.has(NORMALIZER):
        return None, []
    where = f"{archive.name}:{NORMALIZER}"
    if mapped.config.input_type is None:  # a graph with several inputs: DL4J's normalizer is a MultiDataSet one
        return None, [f"{where}: not imported (a graph with several inputs): normalize the inputs as DL4J did"]
    values = int(np.prod([size or 1 for size in mapped.config.input_type.example_shape()]))
    try:
        data = archive.read(NORMALIZER, max_bytes=_NORMALIZER_ARRAYS * (values * 8 + _ARRAY_HEADER_BYTES) + 1024)
        return load_normalizer(data, where), []
    except DL4JFileError as exc:
        return None, [f"{exc} (not imported: normalize the inputs as DL4J did)"]


@torch.no_grad()
def load_parameters(model: MultiLayerNetwork | ComputationGraph, slots: list[ParamSlot], flat: np.ndarray,
                    where: str) -> None:
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
