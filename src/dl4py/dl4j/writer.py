"""``save_dl4j``: a dl4py MultiLayerNetwork as a DL4J ModelSerializer zip, ``import_dl4j``'s inverse.

The zip holds what ``ModelSerializer.writeModel`` writes, in its order: ``configuration.json``
(``config_writer``: DL4J 1.0's dialect), ``coefficients.bin`` (the flat ``[1, N]`` row in DL4J's
parameter order), ``updaterState.bin`` (the optimizer's state in DL4J 1.0's block layout) and
``normalizer.bin`` where the model has a normalizer DL4J has.

The parameters are laid out by the same ``ParamSlot`` list the import uses, read from the
configuration just written (so writer and reader cannot disagree on a layout): each slot's
``from_torch`` turns the torch tensors back into DL4J's segment (an LSTM's two torch biases
become DL4J's one, their sum: an import puts it in ``bias_ih``, zeros in ``bias_hh``, the same
network but not the same two tensors once dl4py has trained them). They are written in the model's
precision, the values the running network holds: under ``half``, the half values (what DL4J's
HALF network holds; the float32 masters' extra bits are not written, and an import puts the half
values back into them).

The updater state: each parameter's torch state converted to DL4J's (``from_torch_state``:
Nesterovs' ``v = -lr * momentum_buffer``, RmsProp's and Adam's state as they are, which is Adam's
documented approximation on continuation) and laid out by the slot's ``from_torch``, joined into
blocks (``join_state``). State DL4J cannot take in its terms (an updater DL4J's state would not
continue, the second bias of torch's LSTM) is left out with one warning line on ``dl4py.dl4j``.
DL4J's ``iterationCount`` and ``epochCount`` are the model's counters.

Nothing is written unless all of it can be: a layer without a DL4J counterpart is one
DL4JFileError before any file is touched; the zip is written atomically (``dl4py.io``).
"""

from __future__ import annotations

import io
import logging
import struct
import zipfile

import numpy as np
import torch

from dl4py.dl4j.config_json import map_network, read_configuration
from dl4py.dl4j.config_writer import configuration_json
from dl4py.dl4j.model_zip import COEFFICIENTS, CONFIGURATION, NORMALIZER, UPDATER_STATE
from dl4py.dl4j.ndarray import DL4JFileError, write_array
from dl4py.dl4j.normalizer_file import normalizer_to_dl4j, write_normalizer
from dl4py.dl4j.optimizer_state import plan_state
from dl4py.dl4j.param_layout import ParamSlot, join_parameters, param_slots
from dl4py.dl4j.updater_state import STATE_NAMES, from_torch_state, join_state
from dl4py.io import atomic_write_bytes
from dl4py.nn.network import MultiLayerNetwork

log = logging.getLogger("dl4py.dl4j")

_DTYPES = {"float": np.float32, "double": np.float64, "half": np.float16}
_HEADER_BYTES = 128  # where write_array's shape information lies
_NOT_TO_DL4J = ("num_batches_tracked",)  # batch norm's counter: DL4J keeps none


def save_dl4j(model, path) -> None:
    """Write ``model`` (a built dl4py MultiLayerNetwork) to ``path`` as a DL4J ModelSerializer
    zip that DL4J 1.0.0-beta4+ (and ``dl4py.import_dl4j``) loads as the same network, with its
    parameters, updater state, training counters and normalizer (see the module docstring)."""
    archive = dl4j_archive(model, str(path))
    atomic_write_bytes(path, archive)


def dl4j_archive(model, where: str = "save_dl4j") -> bytes:
    """The zip's bytes ``save_dl4j`` writes; every error raised before anything is written."""
    if not isinstance(model, MultiLayerNetwork):
        raise DL4JFileError(where, f"a {type(model).__name__}: DL4J's ModelSerializer zips hold "
                                   "MultiLayerNetworks (graphs and torch models are not written)")
    if model.module is None:
        model.init()
    precision = model.precision.name
    if precision not in _DTYPES:
        raise DL4JFileError(where, f"precision {precision}: DL4J networks are FLOAT, DOUBLE or HALF")
    position = model.training_state
    text = configuration_json(model.config, precision, (position.epoch, position.iteration), where)
    conf = read_configuration(text, f"{where}:{CONFIGURATION}")
    mapped = map_network(conf, model.config.input_type)
    _check_same_layers(model.config, mapped.config, where)
    slots = param_slots(conf, mapped.prefixes)
    dtype = _DTYPES[precision]
    entries = {CONFIGURATION: text.encode("utf-8"),
               COEFFICIENTS: dl4j_row(coefficients(model, slots, dtype, where))}
    state, lines = updater_state(model, conf, slots, mapped.config.updater, dtype)
    if state is not None:
        entries[UPDATER_STATE] = dl4j_row(state)
    if model.normalizer is not None:
        try:
            entries[NORMALIZER] = write_normalizer(normalizer_to_dl4j(model.normalizer))
        except (TypeError, ValueError) as exc:
            raise DL4JFileError(where, f"normalizer: {exc}; nothing was written") from None
    if lines:
        log.warning("%s: written; left out: %s", where, "; ".join(lines))
    return _zip(entries)


def _check_same_layers(config, mapped, where: str) -> None:
    """The written configuration, read back, must build the same layer types (a writer fault
    otherwise: the parameters would go to other places)."""
    written = [type(layer).__name__ for layer in mapped.layers]
    ours = [type(layer).__name__ for layer in config.layers]
    if written != ours:
        raise DL4JFileError(where, f"the written configuration reads back as layers {written}, not {ours}")


@torch.no_grad()
def coefficients(model, slots: list[ParamSlot], dtype, where: str = "save_dl4j") -> np.ndarray:
    """DL4J's ``[1, N]`` parameter row of ``model`` by ``slots``, from the running module's
    tensors (the half values under half), in ``dtype``."""
    tensors = {name: tensor.detach().cpu().numpy() for name, tensor in model.module.state_dict().items()
               if not name.endswith(_NOT_TO_DL4J)}
    named = {name for slot in slots for name in slot.torch_names}
    missing = sorted(set(tensors) - named)
    if missing:
        raise DL4JFileError(where, f"no DL4J parameter holds dl4py's {', '.join(missing)}")
    wide = {name: value.astype(np.float64) for name, value in tensors.items()}
    flat = join_parameters(slots, wide)
    return flat.astype(dtype).reshape(1, -1)


@torch.no_grad()
def updater_state(model, conf, slots: list[ParamSlot], network_updater, dtype) -> tuple[np.ndarray | None, list]:
    """``(row, lines)``: DL4J's updaterState.bin row of the model's optimizer (None where DL4J
    keeps none: Sgd, or no parameters), and a line for each thing left out."""
    plan = plan_state(conf, slots, network_updater, True)
    kinds = [slot.kind for slot in plan.slots]
    if not any(STATE_NAMES[kind] for kind in kinds):
        return None, []
    optimizer_state = _optimizer_state_by_name(model)
    if not optimizer_state:  # a fresh updater (never stepped, or its state left out on import): DL4J's
        return None, []      # zeros would read back as a state at iterationCount, not a fresh one
    # The rate import_dl4j divides Nesterovs' v by: that of the next update, so the two invert.
    rate = model.config.updater.learning_rate_at(model.training_state.updates, model.training_state.epoch)
    shapes = {name: tuple(value.shape) for name, value in model.module.state_dict().items()}
    states, lines = [], []
    for slot, updater_slot in zip(slots, plan.slots):
        kind = updater_slot.kind
        names = STATE_NAMES[kind]
        if not names:
            states.append({})
            continue
        per_name = []
        for i, torch_name in enumerate(slot.torch_names):
            torch_state = optimizer_state.get(torch_name, {})
            if i > 0 and torch_name.split(".")[-1].startswith("bias_hh"):
                if any(np.any(np.asarray(v) != 0) for k, v in torch_state.items() if k != "step"):
                    lines.append(f"{UPDATER_STATE}: the state of torch's second LSTM bias {torch_name} (DL4J has "
                                 "one bias, written with bias_ih's state, which equals bias_hh's while both train "
                                 "alike; an import gives bias_hh a fresh state)")
                torch_state = {}
            count = int(np.prod(shapes[torch_name]))
            dl4j = from_torch_state(kind, torch_state, count, learning_rate=rate)
            per_name.append({key: np.asarray(value, dtype=np.float64).reshape(shapes[torch_name])
                             for key, value in dl4j.items()})
        states.append({key: slot.from_torch(tuple(part[key] for part in per_name)) for key in names})
    return join_state(states, plan.slots, plan.layout, dtype=dtype), lines


def _optimizer_state_by_name(model) -> dict[str, dict]:
    """The optimizer's state per ``state_dict`` name of the stepped module (float32 masters
    under half), as float64 numpy arrays."""
    names = {id(p): name for name, p in model.precision_state.stepped_module.named_parameters()}
    out = {}
    for param, state in model.optimizer.state.items():
        name = names.get(id(param))
        if name is not None:
            out[name] = {key: value.detach().cpu().double().numpy() if torch.is_tensor(value) else value
                         for key, value in state.items()}
    return out


def dl4j_row(row: np.ndarray) -> bytes:
    """A ``[1, N]`` row as DL4J 1.0 writes it: ``write_array``'s bytes with the row's strides
    ``[1, 1]`` where write_array writes C order's ``[N, 1]`` (DL4J's ``Nd4j.create(1, N)`` view;
    seen in the real 1.0 files), so an untouched file's entries come back byte for byte."""
    data = write_array(row)
    n = row.shape[1]
    written, dl4j = struct.pack(">5q", 2, 1, n, n, 1), struct.pack(">5q", 2, 1, n, 1, 1)
    at = data.find(written)
    if n > 1 and 0 <= at < _HEADER_BYTES:
        data = data[:at] + dl4j + data[at + len(written):]
    return data


def _zip(entries: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return out.getvalue()
