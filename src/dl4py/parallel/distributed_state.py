"""A model whose parameters are distributed (DTensor: tensor parallel, FSDP2 sharded): how it is
made, in torchtitan's order, and its state gathered whole or loaded whole.

``parallelize_replica`` converts a model's module for a plan (``parallelize_module``,
``fully_shard``) before the model has an optimizer, has the model make its optimizer over
the converted parameters (``Model.make_optimizer``), and returns the whole state to load into
the result by name: a plain model's (``state_by_name``). ``load_state_by_name`` loads it with
torch's ``torch.distributed.checkpoint.state_dict`` (``set_model_state_dict``,
``set_optimizer_state_dict``, ``full_state_dict=True``), each tensor distributed like its
parameter; a plan that renamed parameters maps the names first (``sharding.to_blocked``).
``full_state``/``load_full_state`` go between a tensor-parallel model and the whole tensors
a single process holds, so a distributed run's model file loads in one process and back.
Example, on every rank::

    state = parallelize_replica(replica, plan)  # plan(model) converts replica.module
    load_state_by_name(replica, *state)
    model_bytes(plain_twin(replica))  # a file a single process loads

All of these but ``state_by_name`` are collectives: every rank calls them, in the same order.
"""

from __future__ import annotations

import pickle

import torch

from dl4py.nn.serialization import KERNEL_KEYS


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
    """The optimizer's ``state_dict`` with parameters named (``names``: ``{id(p): name}``):
    ``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}``, the form
    ``set_optimizer_state_dict`` reads."""
    state = {names[id(p)]: dict(values) for p, values in optimizer.state.items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def state_by_name(model) -> tuple[dict[str, torch.Tensor], dict]:
    """A plain model's whole state by parameter name, as ``load_state_by_name`` takes it: its
    stepped module's parameters and buffers (the float32 masters where kept), and its
    optimizer's state and groups. The model's own tensors, detached: copy them where the
    model trains on."""
    stepped = model.stepped_module
    names = {id(p): name for name, p in stepped.named_parameters()}
    return dict(stepped.state_dict()), optimizer_state_by_name(model.optimizer, names)


def parallelize_replica(replica, parallelize, state: tuple | None = None) -> tuple | None:
    """Convert ``replica`` for a distributed plan in torchtitan's order: ``parallelize(model)``
    converts its module (through ``Model.convert``) while it has no optimizer, and the
    optimizer is then made over the result (``Model.init(parallelize=...)``). Returns the
    whole state to load into it by name: ``state`` for a model not built yet (None: it starts
    as built); a built model's module is converted in place, its optimizer made again, and
    its own state (taken before anything changed) is returned, unless ``state`` is given."""
    if replica.module is None:
        replica.init(parallelize=parallelize)
        return state
    replica.use_contiguous_layout()
    if state is None:
        # The last step's gradients are stale, and torch's loader takes a gradient for "state made".
        replica.stepped_module.zero_grad(set_to_none=True)
        state = state_by_name(replica)
    replica.convert(optimizer=replica.make_optimizer(**(parallelize(replica) or {})))
    return state


def full_state(replica) -> tuple[dict[str, torch.Tensor], dict]:
    """``(model_state_by_name, optimizer_state_by_name)``: whole tensors, as a single-process
    model of the same network holds them (every rank receives them)."""
    check_precision(replica)
    from torch.distributed.checkpoint import state_dict as dcp  # lazy: only distributed plans load it

    whole = dcp.StateDictOptions(full_state_dict=True)
    model_state = dcp.get_model_state_dict(replica.module, options=whole)
    optimizer_state = dcp.get_optimizer_state_dict(replica.module, replica.optimizer, options=whole)
    return model_state, optimizer_state


def load_full_state(replica, model_state: dict[str, torch.Tensor], optimizer_state: dict | None = None) -> None:
    """Load whole tensors (``full_state``'s, or a single-process model's) into a tensor-parallel
    ``replica``, each distributed like its parameter."""
    check_precision(replica)
    load_state_by_name(replica, model_state, optimizer_state)


def load_state_by_name(model, module_state: dict[str, torch.Tensor], optimizer_state: dict | None = None) -> None:
    """Load a whole state by parameter name (``state_by_name``'s, under the model's own names)
    into ``model``'s stepped module and optimizer, each tensor distributed like its parameter."""
    from torch.distributed.checkpoint import state_dict as dcp  # lazy: only distributed plans load it

    stepped = model.stepped_module
    dcp.set_model_state_dict(stepped, module_state, options=dcp.StateDictOptions(full_state_dict=True))
    if optimizer_state is not None:
        # The groups loaded carry their source's kernel flags; this optimizer keeps its own.
        kernels = [{key: group[key] for key in KERNEL_KEYS if key in group} for group in model.optimizer.param_groups]
        _load_optimizer_state(stepped, model.optimizer, optimizer_state)
        for group, kept in zip(model.optimizer.param_groups, kernels):
            group.update(kept)


def plain_twin(replica):
    """A single-process copy of ``replica`` (same config, counters, normalizer), its
    parameters and updater state the gathered whole ones: what ``model_bytes`` saves as the
    run's model file."""
    model_state, optimizer_state = full_state(replica)
    # The model's recipe (Model.__getstate__: no module), less what a distributed mode put on
    # the instance in place of a method (the hybrid's gathered loss): that is the run's, not the model's.
    recipe = {name: value for name, value in replica.__getstate__().items()
              if not callable(getattr(type(replica), name, None))}
    twin = object.__new__(type(replica))
    twin.__dict__.update(pickle.loads(pickle.dumps(recipe)))
    twin.place(replica.backend, replica.precision)
    twin.init()
    load_full_state(twin, model_state, optimizer_state)
    twin.set_score(replica.last_score)
    return twin


def _load_optimizer_state(module, optimizer, named: dict) -> None:
    """Load a by-name, whole optimizer state, each tensor distributed like its parameter."""
    if any(torch.is_tensor(v) and v.dim() > 0 for values in named["state"].values() for v in values.values()):
        from torch.distributed.checkpoint import state_dict as dcp  # lazy: only distributed plans load it

        dcp.set_optimizer_state_dict(module, optimizer, named, options=dcp.StateDictOptions(full_state_dict=True))
        return
    # Nothing to distribute (no state yet, or plain SGD's none), which torch's loader does
    # not take: the hyperparameters by group, any scalars by name.
    params = dict(module.named_parameters())
    for group, saved in zip(optimizer.param_groups, named["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for name, values in named["state"].items():
        optimizer.state[params[name]] = dict(values)


def check_precision(replica) -> None:
    """NotImplementedError for a precision with float32 masters or loss scaling: tensor
    parallelism's DTensors do not support them yet (the sharded plan's FSDP2 does)."""
    precision = replica.precision_state
    if precision.keeps_masters or precision.scales_loss:
        what = "keeps float32 master weights" if precision.keeps_masters else "scales the loss"
        raise NotImplementedError(
            f"precision '{replica.precision}' {what}, which distributed parameters do not "
            "support yet; use 'float', 'double' or 'mixed-bf16'"
        )
