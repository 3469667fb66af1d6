"""Sharded data parallelism (``parallelism="sharded"``): ZeRO-3 on PyTorch's FSDP2.

Each rank holds 1/N of every parameter, of its gradient and of the updater's state
(``fully_shard``: ``Shard(0)`` DTensors on a 1-D mesh over the ranks). A layer's weights
are gathered for its forward and again for its backward, then dropped; its gradients are
reduced and scattered so that each rank keeps the mean gradient of its own shard, and
each rank's updater steps its shards. The ranks train their own batches, as in the
shared-gradients mode, and each update equals that mode's (and a single process's on the
union of the round's batches).

What is gathered at once is one *unit*. Units are the network's layers, and the rows of a
dense layer whose weight is more than 1/``UNIT_FRACTION`` of the network's parameters are
split into blocks, each a unit of its own: the seed's MLP 784-4000-4000-10 has 83% of its
weights in one layer, and gathering that whole layer (with its full gradient and the
reduce-scatter buffer beside it) would leave a rank of two holding 109% of the single
process's peak; in blocks it holds 56% (docs/model-parallel.md).

``shard_replica`` goes in torchtitan's order: the model's (master) module is split into
units and handed to ``fully_shard`` before the model has an optimizer, the optimizer is
made over the shards, and then a plain model's whole state is loaded by name with torch's
``set_model_state_dict``/``set_optimizer_state_dict`` (``distributed_state``), the split
layers' names and rows mapped by ``to_blocked``. The model file stays whole:
``ShardedReplica.gather`` collects the full parameters and updater state into a plain,
unsharded twin of the model (``to_plain`` joins the blocks back into their layer), which is
what is saved, scored and shown to listeners. Both directions only slice and join, so a
sharded -> single process -> sharded round trip is bit-exact.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from dl4py.parallel.distributed_state import load_state_by_name, parallelize_replica

UNIT_FRACTION = 16  # a dense layer over 1/16 of the parameters is gathered in row blocks
# ... unless it is small anyway: each unit costs its own collectives every step, which for
# small layers is time lost for memory nobody misses (4 MB in float32).
MIN_UNIT_ELEMENTS = 1 << 20


def row_blocks(weight_elements: int, total_parameters: int) -> int:
    """Blocks a dense layer's rows are split into: enough that none holds more than
    ``total_parameters / UNIT_FRACTION`` weights, nor less than MIN_UNIT_ELEMENTS (1: the
    layer is one unit)."""
    limit = max(total_parameters / UNIT_FRACTION, MIN_UNIT_ELEMENTS)
    return math.ceil(weight_elements / limit) if weight_elements > limit else 1


def row_pieces(tensor: torch.Tensor, blocks: int) -> tuple[torch.Tensor, ...]:
    """A split layer's tensor (a weight, a bias, or their updater state) cut into its blocks'
    rows: as ``torch.tensor_split`` cuts, the first ``rows % blocks`` blocks one row longer
    (40,000 rows in 3: 13,334, 13,333, 13,333). Parameters and updater state are cut here
    alike, so each row's state lands in the block that holds the row."""
    return torch.tensor_split(tensor, blocks, dim=0)


class RowBlocks(nn.Module):
    """A dense layer's ``nn.Linear`` as row blocks, each its own ``nn.Linear`` (and sharding
    unit); the output is the blocks' outputs side by side, as the whole layer's would be."""

    def __init__(self, linear: nn.Linear, blocks: int):
        super().__init__()
        weights = row_pieces(linear.weight.detach(), blocks)
        biases = row_pieces(linear.bias.detach(), blocks) if linear.bias is not None else [None] * blocks
        parts = []
        for weight, bias in zip(weights, biases):
            part = nn.Linear(linear.in_features, weight.shape[0], bias=bias is not None,
                             device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                part.weight.copy_(weight)
                if bias is not None:
                    part.bias.copy_(bias)
            parts.append(part)
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        return torch.cat([part(x) for part in self.parts], dim=-1)


def split_large_linears(module: nn.Module) -> dict[str, int]:
    """Replace, in place, each ``nn.Linear`` holding more than 1/UNIT_FRACTION of the
    parameters by ``RowBlocks``; returns {its name: blocks}."""
    total = sum(p.numel() for p in module.parameters())
    split = {}
    for name, child in list(module.named_modules()):
        if isinstance(child, nn.Linear):
            blocks = row_blocks(child.weight.numel(), total)
            if blocks > 1:
                parent_name, _, attr = name.rpartition(".")
                parent = module.get_submodule(parent_name) if parent_name else module
                setattr(parent, attr, RowBlocks(child, blocks))
                split[name] = blocks
    return split


def sharding_units(module: nn.Module) -> list[nn.Module]:
    """The modules gathered one at a time, innermost first: every row block, then each
    layer (a direct child of the root holding parameters; the vertices of a graph), the root
    last, which owns whatever is left."""
    blocks = [part for child in module.modules() if isinstance(child, RowBlocks) for part in child.parts]
    layers = []
    for child in module.children():
        members = child.children() if isinstance(child, (nn.ModuleDict, nn.ModuleList)) else [child]
        layers += [m for m in members if any(True for _ in m.parameters())]
    return blocks + layers


# -- names: the plain model's parameters <-> the sharded model's ---------------------------

def blocked_names(name: str, split: dict[str, int]) -> list[str] | None:
    """The sharded model's names for the plain parameter ``name`` when its layer is in row
    blocks (``1.op.weight`` -> ``1.op.parts.0.weight``, ...), else None."""
    layer, _, leaf = name.rpartition(".")
    if layer in split:
        return [f"{layer}.parts.{j}.{leaf}" for j in range(split[layer])]
    return None


def plain_name(name: str, split: dict[str, int]) -> str:
    """The plain model's name for a sharded model's parameter (``1.op.parts.3.weight`` ->
    ``1.op.weight``); other names are the same in both."""
    layer, _, rest = name.partition(".parts.")
    return f"{layer}.{rest.rpartition('.')[2]}" if rest and layer in split else name


def to_blocked(state: dict[str, torch.Tensor], split: dict[str, int]) -> dict[str, torch.Tensor]:
    """A plain model's state (by parameter name) under the sharded model's names: each split
    layer's tensors cut into its blocks' rows (``row_pieces``), the inverse of ``to_plain``."""
    out = {}
    for name, tensor in state.items():
        names = blocked_names(name, split)
        out.update({name: tensor} if names is None else zip(names, row_pieces(tensor, len(names))))
    return out


def to_blocked_optimizer(named: dict, split: dict[str, int]) -> dict:
    """A plain model's optimizer state by name (``optimizer_state_by_name``'s form) under the
    sharded model's names: its shaped state cut as ``to_blocked`` cuts the parameters, each
    scalar (Adam's step) copied into every block; each group names its layers' blocks."""
    state = {}
    for name, entries in named["state"].items():
        names = blocked_names(name, split)
        if names is None:
            state[name] = entries
            continue
        for key, value in entries.items():
            shaped = torch.is_tensor(value) and value.dim() > 0
            pieces = row_pieces(value, len(names)) if shaped else [_copy(value) for _ in names]
            for blocked, piece in zip(names, pieces):
                state.setdefault(blocked, {})[key] = piece
    groups = [{**group, "params": [n for name in group["params"] for n in (blocked_names(name, split) or [name])]}
              for group in named["param_groups"]]
    return {"state": state, "param_groups": groups}


def _copy(value):
    """A block's own copy of a scalar: each block's optimizer counts its own steps in place."""
    return value.clone() if torch.is_tensor(value) else value


def to_plain(state: dict[str, torch.Tensor], split: dict[str, int]) -> dict[str, torch.Tensor]:
    """A sharded model's state (by parameter name) under the plain names: each split
    layer's row blocks joined back into its tensor, the inverse of ``row_pieces``."""
    out = {}
    for name in state:
        plain = plain_name(name, split)
        if plain == name:
            out[name] = state[name]
        elif plain not in out:
            out[plain] = torch.cat([state[n] for n in blocked_names(plain, split)], dim=0)
    return out


def stepped_module(model) -> nn.Module:
    """The module whose parameters the updater steps: the float32 masters when kept."""
    return model.stepped_module


class ShardedReplica:
    """A model trained sharded: ``replica`` holds the FSDP2 module and an updater over its
    shards; ``twin`` (where kept) a plain copy that ``gather`` fills with the full state."""

    def __init__(self, replica, split: dict[str, int], mesh, twin=None):
        self.replica, self.split, self.mesh, self.twin = replica, split, mesh, twin
        self.last_batch = None  # (features, labels) this rank trained last: a round it sits out reuses them
        self.data_workers = dist.get_world_size()  # every rank trains batches of its own
        self._gathered_at = None  # the replica's counters at the last gather

    # -- the step ------------------------------------------------------------------
    def data_rank(self, rank: int) -> int:
        return rank

    def remember(self, features, labels) -> None:
        self.last_batch = (features, labels)

    def sit_out(self) -> None:
        """A round without a batch: a step with none (``gradient_hook`` does the collectives' part)."""
        self.replica.train_step(None, None)

    def gradient_hook(self, took_part: bool) -> None:
        """Between backward and update. FSDP reduced the gradients in backward as the mean
        over all ranks; a rank without a batch this round still has to take part in those
        collectives, so it runs a backward worth nothing here (its shards then receive the
        others' mean). The mean over the ranks that trained is then the mean over all
        times world / participants, as the shared-gradients mode averages."""
        if not took_part:
            self._backward_of_nothing()
        world = dist.get_world_size()
        count = torch.tensor([1.0 if took_part else 0.0], device=self.replica.backend.device)
        dist.all_reduce(count)
        participants = int(count.item())
        if 0 < participants < world:
            for p in self.replica.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(world / participants)

    def _backward_of_nothing(self) -> None:
        features, labels = self.last_batch
        module = self.replica.module
        was_training = module.training
        module.eval()  # no batch-norm statistics or dropout draws from a batch already trained
        try:
            with self.replica.precision_state.forward_context():
                outputs = module(features)
            (self.replica.loss(outputs.float(), labels) * 0.0).backward()
        finally:
            module.train(was_training)

    # -- the whole model -------------------------------------------------------------
    def gather(self):
        """Collect the full parameters, buffers and updater state into the twin (rank 0's;
        the others' is None). A collective: every rank calls it. Returns the twin, its
        counters those of the replica."""
        from torch.distributed.checkpoint.state_dict import (  # lazy: only distributed plans load it
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        moment = self.replica.training_state.moment
        if moment == self._gathered_at:  # nothing trained since: the same on every rank
            return self.twin
        self._gathered_at = moment
        # cpu_offload: the whole state lands on rank 0 only, on its host, a unit at a time.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        module = self.replica.module
        model_state = get_model_state_dict(module, options=options)
        optim_state = get_optimizer_state_dict(module, self.replica.optimizer, options=options)
        if self.twin is None:
            return None
        load_into_plain(self.twin, to_plain(model_state, self.split),
                        _joined_optimizer_state(optim_state["state"], self.split),
                        _plain_groups(optim_state["param_groups"], self.split))
        self.twin.training_state.copy_from(self.replica.training_state)
        if self.replica.precision_state.scales_loss:  # the loss scale goes with the state: a checkpoint carries it
            self.twin.precision_state.load_state_dict(self.replica.precision_state.state_dict())
        return self.twin


def _joined_optimizer_state(state: dict, split: dict[str, int]) -> dict:
    """Per-parameter updater state with each split layer's blocks joined (scalars, such as
    Adam's step, are the same in every block: the first is kept)."""
    by_key: dict[str, dict[str, torch.Tensor]] = {}
    for name, entries in state.items():
        for key, value in entries.items():
            by_key.setdefault(key, {})[name] = value
    joined: dict[str, dict] = {}
    for key, tensors in by_key.items():
        shaped = {n: t for n, t in tensors.items() if torch.is_tensor(t) and t.dim() > 0}
        scalars = {n: t for n, t in tensors.items() if n not in shaped}
        for name, value in to_plain(shaped, split).items():
            joined.setdefault(name, {})[key] = value
        for name, value in scalars.items():
            joined.setdefault(plain_name(name, split), {}).setdefault(key, value)
    return joined


def _plain_groups(groups: list[dict], split: dict[str, int]) -> list[dict]:
    """The updater's groups with each split layer's blocks named once, as the layer."""
    return [{**group, "params": list(dict.fromkeys(plain_name(n, split) for n in group["params"]))}
            for group in groups]


@torch.no_grad()
def load_into_plain(model, module_state: dict, optimizer_state: dict, groups: list[dict]) -> None:
    """Put full, plain-named state into an unsharded model: parameters (into the masters too
    where kept), buffers, and the updater's state and group settings."""
    stepped = stepped_module(model)
    for name, tensor in stepped.state_dict().items():
        tensor.copy_(module_state[name])
    if model.precision_state.keeps_masters:
        model.precision_state.after_sync()
        for name, buffer in model.module.named_buffers():
            buffer.copy_(module_state[name])
    names = {id(p): n for n, p in stepped.named_parameters()}
    order = [names[id(p)] for g in model.optimizer.param_groups for p in g["params"]]
    index = {name: i for i, name in enumerate(order)}
    model.optimizer.load_state_dict({
        "state": {index[name]: state for name, state in optimizer_state.items() if name in index},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
                         for g in groups],
    })


def _inputs_needing_gradients(module, args):
    """The batch, marked as needing a gradient while training. FSDP reduces a unit's
    gradients and frees its gathered weights when the gradient of its input is computed;
    without one (the first layer's input is data) that waits until the backward has ended,
    and the first layer's units all stay gathered, gradients and all, at the backward's
    peak. The price is one more product in the first layer's backward."""
    if not torch.is_grad_enabled():
        return None
    return tuple(a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() and not a.requires_grad
                 else a for a in args)


def shard_replica(replica, mesh, twin=None, state=None) -> ShardedReplica:
    """Shard ``replica`` over ``mesh`` in torchtitan's order (``shard_module``, then the
    optimizer made over the shards, then the whole state loaded by name). A model not built
    yet is built so, starting from ``state`` (``distributed_state.state_by_name``'s, of a
    plain model; None: as built); a built, plain one is converted in place, its optimizer
    made again with the state it had. ``twin``: the plain model ``gather`` fills (None on
    ranks that need none). Example, on every rank::

        sharded = shard_replica(MultiLayerNetwork(config), init_device_mesh("cpu", (2,)))
    """
    split = {}

    def parallelize(model) -> dict:
        split.update(shard_module(model, mesh))
        # The for-loop kernel: memory is why one shards (Model.make_optimizer).
        return {"loop": True, "plain_name": partial(plain_name, split=split)}

    state = parallelize_replica(replica, parallelize, state)
    if state is not None:
        module_state, optimizer_state = state
        load_state_by_name(replica, to_blocked(module_state, split), to_blocked_optimizer(optimizer_state, split))
    sharded = ShardedReplica(replica, split, mesh, twin)
    replica.lay_out(sharded)
    replica.share_gradients(sharded.gradient_hook)
    return sharded


def shard_module(model, mesh) -> dict[str, int]:
    """The sharded plan's conversion of a model's module, before the model has an optimizer:
    the (master) module split into units (``split_large_linears``: returns the layers cut in
    row blocks) and each handed to ``fully_shard``. The sharded masters are what runs from
    then on: FSDP casts each gathered unit itself (``PrecisionState.for_sharded``)."""
    from torch.distributed.fsdp import fully_shard  # lazy: only distributed plans load it

    stepped = model.stepped_module
    split = split_large_linears(stepped)
    policy = model.precision_state.fsdp_policy()
    for unit in sharding_units(stepped) + [stepped]:
        if policy is None:
            fully_shard(unit, mesh=mesh)
        else:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
    stepped.register_forward_pre_hook(_inputs_needing_gradients)
    model.convert(module=stepped, precision_state=model.precision_state.for_sharded(stepped))
    return split
