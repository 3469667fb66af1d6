"""A model whose parameters are distributed (DTensor: tensor parallel, FSDP2 sharded): its
optimizer rebuilt over the converted parameters, and its state gathered whole or loaded whole.

Converting a module in place (``parallelize_module``, ``fully_shard``) replaces its
parameters, so the optimizer built at ``init`` steps tensors the module no longer uses.
``rebuild_optimizer`` makes the same optimizer (class, defaults, param groups) over the new
parameters, matched by name, and moves its state (momentum, Adam's moments and step) over,
each tensor distributed like its parameter. ``full_state``/``load_full_state`` go between a
distributed model and the whole tensors a single process holds, keyed by parameter name
(torch's ``torch.distributed.checkpoint.state_dict``), so a distributed run's model file
loads in one process and back. Example, on every rank::

    names = parameter_names(replica)
    parallelize_module(replica.module, mesh, plan)
    rebuild_optimizer(replica, names)
    model_bytes(plain_twin(replica))  # a file a single process loads

All of these but ``parameter_names`` are collectives: every rank calls them, in the same order.
"""

from __future__ import annotations

import pickle

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_WHOLE = StateDictOptions(full_state_dict=True)
_KERNEL_KEYS = ("foreach", "fused")  # torch.optim's implementation flags


def parameter_names(replica) -> dict[int, str]:
    """``{id(parameter): name}`` of the module as it is now: record it before converting."""
    _check_precision(replica)
    return {id(p): name for name, p in replica.module.named_parameters()}


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
    """The optimizer's ``state_dict`` with parameters named (``names``: ``{id(p): name}``):
    ``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}``, the form
    ``set_optimizer_state_dict`` reads."""
    state = {names[id(p)]: dict(values) for p, values in optimizer.state.items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def rebuild_optimizer(replica, names_before: dict[int, str]) -> torch.optim.Optimizer:
    """Replace ``replica.optimizer`` by the same optimizer over ``replica.module``'s current
    parameters, its groups and state carried over by parameter name (``names_before``: what
    ``parameter_names`` said before the module was converted). Returns the new optimizer."""
    old = replica.optimizer
    # The last step's gradients are stale, and torch's loader takes a gradient for "state made".
    old.zero_grad(set_to_none=True)
    whole = optimizer_state_by_name(old, names_before)
    params = dict(replica.module.named_parameters())
    groups = []
    for group in whole["param_groups"]:
        missing = [name for name in group["params"] if name not in params]
        if missing:
            raise RuntimeError(f"rebuild_optimizer: the converted module has no parameters {missing}")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [params[name] for name in group["params"]]})
    defaults = dict(old.defaults)
    if len({isinstance(p, DTensor) for p in params.values()}) > 1:
        # torch's fused and foreach kernels take DTensors or plain tensors, not both in one
        # call: a module only partly distributed (replicated layers) steps parameter by
        # parameter. Equal within rounding (nn/optimizers.py); the kernel is not the model's.
        for settings in [defaults, *groups, *whole["param_groups"]]:
            settings.update({key: False for key in _KERNEL_KEYS if key in settings})
    new = type(old)(groups, **defaults)
    replica.convert(optimizer=new)
    _load_optimizer_state(replica.module, new, whole)
    return new


def full_state(replica) -> tuple[dict[str, torch.Tensor], dict]:
    """``(model_state_by_name, optimizer_state_by_name)``: whole tensors, as a single-process
    model of the same network holds them (every rank receives them)."""
    _check_precision(replica)
    model_state = get_model_state_dict(replica.module, options=_WHOLE)
    optimizer_state = get_optimizer_state_dict(replica.module, replica.optimizer, options=_WHOLE)
    return model_state, optimizer_state


def load_full_state(replica, model_state: dict[str, torch.Tensor], optimizer_state: dict | None = None) -> None:
    """Load whole tensors (``full_state``'s, or a single-process model's) into ``replica``,
    each distributed like its parameter."""
    _check_precision(replica)
    set_model_state_dict(replica.module, model_state, options=_WHOLE)
    if optimizer_state is not None:
        # The groups loaded carry their source's kernel flags; this optimizer keeps its own.
        kernels = [{key: group[key] for key in _KERNEL_KEYS if key in group} for group in replica.optimizer.param_groups]
        _load_optimizer_state(replica.module, replica.optimizer, optimizer_state)
        for group, kept in zip(replica.optimizer.param_groups, kernels):
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
        set_optimizer_state_dict(module, optimizer, named, options=_WHOLE)
        return
    # Nothing to distribute (no state yet, or plain SGD's none), which torch's loader does
    # not take: the hyperparameters by group, any scalars by name.
    params = dict(module.named_parameters())
    for group, saved in zip(optimizer.param_groups, named["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for name, values in named["state"].items():
        optimizer.state[params[name]] = dict(values)


def _check_precision(replica) -> None:
    precision = replica.precision_state
    if precision.keeps_masters or precision.scales_loss:
        what = "keeps float32 master weights" if precision.keeps_masters else "scales the loss"
        raise NotImplementedError(
            f"precision '{replica.precision}' {what}, which distributed parameters do not "
            "support yet; use 'float', 'double' or 'mixed-bf16'"
        )
