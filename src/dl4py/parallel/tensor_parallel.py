"""Tensor (model) parallel dense layers, and Krizhevsky's hybrid, on PyTorch's DTensor.

Tensor mode (``"tensor"``): every rank trains the same batch; the weights of pairs of
hidden dense layers are split across the ranks, the first of a pair by output columns
(``ColwiseParallel``), the second by input rows (``RowwiseParallel``). The activation between
them works on each rank's own columns, so a pair costs one all-reduce forward (the second
layer's partial sums) and one backward (the gradient entering the first): Megatron's MLP.
Every other parameter is replicated, and since all ranks compute it from the same all-reduced
values, its gradient is identical everywhere without communication.

Hybrid mode (``"hybrid"``; "One weird trick for parallelizing convolutional neural networks",
Krizhevsky 2014): the layers before the first dense layer (convolutions: few weights, much
arithmetic) are data-parallel, each rank on its own batch. At the first dense layer the ranks'
activations are gathered along the batch, the dense layers run as in tensor mode on the whole
gathered batch, and the loss is the mean over it (the labels are gathered too), so it is the
single-process loss of the concatenated batch. Backward, each rank keeps its own rows' share
of the gradient entering the gather; the convolutions' gradients are then summed across ranks
(``TensorParallelPlan.gradient_hook``), since each rank's convolutions saw only its rows.

Which layers split (``tensor_parallel_plan``): consecutive hidden dense layers pair up from
the first; a hidden dense layer left over without a partner, and the output layer, stay
replicated. Split alone, column-parallel would have to gather its output for the next layer
(or the loss) and row-parallel would need its input scattered: a collective either way for a
single layer, and the output layer is small (n_out classes) while the loss needs all of its
columns on every rank. Sizes need not divide by the number of ranks: DTensor shards unevenly
(``torch.chunk``'s split: 63 columns over 2 ranks are 32 + 31), and the pair's two halves are
split alike, so the arithmetic is the single-process arithmetic (the tests check it on a
63-unit layer). Only the order of the partial sums' addition differs (rounding).

The ranks' batches in hybrid mode may differ in size, down to none (an epoch's last round):
the gather exchanges the sizes first. But every rank must step in every round, with an
empty batch where it has no data, since the gather is a collective. Layers the hybrid cannot
train as one process would are refused (``gather_point``): batch normalization before the
gather (each rank's statistics apart), dropout after it (each rank's own masks on the
replicated batch).

A 2-D mesh (``("data", "tensor")``, the plan's ``tensor_size`` T of W ranks): rank r is in
data group r // T at tensor position r % T. The dense pairs split over the ranks of one
tensor group (the "tensor" sub-mesh) and the hybrid gathers within it; the W / T groups are
data-parallel: after each backward every gradient (a split weight's local shard, a whole
parameter) is averaged over the "data" sub-mesh, over the groups that had rows. So a step is
one update on the round's batches together, the mean of the groups' mean gradients.

Accumulation (``accumulate_batches`` k): the hook runs once per window, on the summed
gradients, so tensor mode's data groups average their window's gradients as shared-gradients
workers do. The hybrid refuses it (``options.check_mode_fits_model``): each rank weighs its
batch by its own rows, but the loss is its tensor group's over the gathered rows.

The conversion goes in torchtitan's order (``apply_tensor_parallel``): the module's dense
pairs are split (``split_dense_pairs``) before the model has an optimizer, the optimizer is
made over the result, and a plain model's whole state is then loaded by name
(``distributed_state.load_full_state``: torch's ``set_model_state_dict`` and
``set_optimizer_state_dict``), each tensor distributed like its parameter.

Not yet: precisions with float32 master weights or loss scaling (``bfloat16``, ``half``,
``mixed-fp16``; ``distributed_state``); ``float``, ``double`` and ``mixed-bf16`` work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dl4py.errors import ConfigError
from dl4py.parallel.distributed_state import check_precision, load_full_state, parallelize_replica

MODES = ("tensor", "hybrid")


def tensor_parallel_plan(module: nn.Sequential) -> dict:
    """``{"3.op": ColwiseParallel(), "4.op": RowwiseParallel(), ...}`` for a MultiLayerNetwork's
    module: consecutive hidden dense layers (an ``nn.Linear`` op, not the last layer) in
    column/row pairs. Empty when the network has fewer than two hidden dense layers in a row."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # lazy: only distributed plans load it

    plan, waiting = {}, None  # waiting: a dense layer still looking for its partner
    last = len(module) - 1
    for index, layer in enumerate(module):
        dense = index < last and isinstance(_op(layer), nn.Linear)
        if not dense:
            waiting = None  # a pair is two dense layers in a row: nothing else between them
        elif waiting is None:
            waiting = index
        else:
            # The column shard stays a DTensor through the activation: it knows its global
            # width, which a plain local tensor of an uneven shard (32 of 63) could not tell
            # the row-parallel layer.
            plan[f"{waiting}.op"] = ColwiseParallel(use_local_output=False)
            plan[f"{index}.op"] = RowwiseParallel()
            waiting = None
    return plan


def gather_point(module: nn.Sequential) -> int:
    """Index of the first dense layer (its op an ``nn.Linear``), where the hybrid gathers the
    batch; a ConfigError for a network the hybrid cannot train like a single process."""
    dense = [index for index, layer in enumerate(module) if isinstance(_op(layer), nn.Linear)]
    if not dense:
        raise ConfigError("network.layers", "hybrid parallelism gathers the batch at the first dense layer "
                          "(DenseLayer or OutputLayer), and this network has none")
    for index, layer in enumerate(module):
        if index < dense[0] and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in layer.modules()):
            raise ConfigError(f"network.layers[{index}]", "batch normalization before the first dense layer would "
                              "normalize each rank's rows apart under hybrid parallelism (not supported yet); "
                              "use tensor parallelism or data parallelism for this network")
        if index >= dense[0] and any(isinstance(m, nn.Dropout) for m in layer.modules()):
            raise ConfigError(f"network.layers[{index}]", "dropout on the gathered batch would draw a different "
                              "mask on each rank under hybrid parallelism (not supported yet); move it before "
                              "the first dense layer or use tensor parallelism")
    return dense[0]


@dataclass
class TensorParallelPlan:
    """What the rank program needs to run a converted replica (``apply_tensor_parallel``)."""

    mode: str  # "tensor" or "hybrid"
    world: int
    layers: dict  # parallelize_module's plan: module name -> ParallelStyle
    # Hybrid: the names of the data-parallel parameters, whose gradients the hook sums.
    data_parallel: list[str] = field(default_factory=list)
    gradient_hook: object = None  # hook(took_part) for Model.share_gradients; None: nothing to share
    data_groups: int = 1  # a 2-D mesh's data-parallel groups (its "data" size); 1: a 1-D mesh

    @property
    def data_workers(self) -> int:
        """How many workers the data plan deals batches to: tensor mode trains one stream of
        batches per data group (on each of its ranks), the hybrid one stream per rank."""
        return self.data_groups if self.mode == "tensor" else self.world

    def data_rank(self, rank: int) -> int:
        """Which of the ``data_workers`` streams ``rank`` reads: its data group's in tensor
        mode (the ranks of a tensor group train the same batches), its own in the hybrid."""
        return rank // (self.world // self.data_groups) if self.mode == "tensor" else rank

    def batch_index(self, round_index: int, rank: int) -> int:
        """The batch ``rank`` trains in round ``round_index``: the usual rounds over the
        ``data_workers`` streams (tensor mode on a 1-D mesh: batch r on every rank). In
        hybrid mode every rank must step in every round, with an empty batch (no rows)
        where the data has run out: the gather is a collective."""
        return round_index * self.data_workers + self.data_rank(rank)


def apply_tensor_parallel(replica, mesh, hybrid: bool = False, state=None) -> TensorParallelPlan:
    """Convert a MultiLayerNetwork ``replica`` on every rank of ``mesh``: 1-D
    (``init_device_mesh(device_type, (world,))``), or 2-D with dimensions named
    ``("data", "tensor")`` (data-parallel groups of tensor-parallel ranks). In torchtitan's
    order: its dense pairs split over the tensor ranks (``split_dense_pairs``), then its
    optimizer made over the result, then the whole state loaded by name; with ``hybrid`` the
    layers before the first dense layer stay data-parallel. A model not built yet is built
    so, starting from ``state`` (``distributed_state.state_by_name``'s; None: as built); a
    built one is converted in place, its optimizer made again with the state it had. Install
    the returned plan's ``gradient_hook`` with ``replica.share_gradients`` (before the first
    ``train_step``). Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
        plan = apply_tensor_parallel(replica, mesh, hybrid=True)
        replica.share_gradients(plan.gradient_hook)
    """
    if mesh.ndim == 1:
        tensor_mesh, data_group = mesh, None
    elif mesh.ndim == 2 and mesh.mesh_dim_names == ("data", "tensor"):
        tensor_mesh, data_group = mesh["tensor"], mesh["data"].get_group()
    else:
        raise ValueError(f"tensor parallelism runs on a 1-D device mesh or a 2-D one named ('data', 'tensor'); "
                         f"got {mesh.ndim} dimensions named {mesh.mesh_dim_names}")
    if getattr(replica, "kind", None) != "multilayer":
        raise TypeError(f"tensor parallelism needs a MultiLayerNetwork, got {type(replica).__name__}")
    plan = TensorParallelPlan("hybrid" if hybrid else "tensor", mesh.size(), {},
                              data_groups=1 if data_group is None else mesh.size(0))
    state = parallelize_replica(replica, lambda model: split_dense_pairs(model, plan, tensor_mesh, data_group), state)
    if state is not None:
        load_full_state(replica, *state)
    return plan


def split_dense_pairs(model, plan: TensorParallelPlan, tensor_mesh, data_group=None) -> dict:
    """The tensor and hybrid plans' conversion of a model's module, before the model has an
    optimizer: its dense pairs split over ``tensor_mesh`` (``plan.layers``), the hybrid's
    gather and gathered loss installed, and ``plan.gradient_hook`` made. Returns
    ``make_optimizer``'s keywords: torch's for-loop kernel where some parameters are now
    DTensors beside plain ones (the fused and foreach kernels take one kind per call)."""
    from torch.distributed.tensor import DTensor  # lazy: only distributed plans load it
    from torch.distributed.tensor.parallel import parallelize_module  # lazy: only distributed plans load it

    module = model.module
    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise RuntimeError("apply_tensor_parallel: this replica is already distributed; convert a fresh copy")
    plan.layers = tensor_parallel_plan(module)
    gather_at = gather_point(module) if plan.mode == "hybrid" else None  # checked before anything changes
    check_precision(model)
    if plan.layers:
        parallelize_module(module, tensor_mesh, plan.layers)
    if plan.mode == "hybrid":
        plan.gradient_hook = _hybrid_hook(model, plan, tensor_mesh.get_group(), data_group, gather_at)
    elif data_group is not None:
        stepped = [p for p in module.parameters() if p.requires_grad]

        def share(took_part):  # a data group without a batch (an epoch's short last round) counts for nothing
            average_gradients(stepped, data_group, took_part)

        plan.gradient_hook = share
    return {"loop": bool(plan.layers)}


def _hybrid_hook(model, plan: TensorParallelPlan, group, data_group, gather_at: int):
    """The hybrid's gather of the batch at the first dense layer and its gathered loss, put
    on ``model``; returns the gradient hook: the data-parallel layers' gradients summed over
    the tensor ``group``, and on a 2-D mesh every gradient averaged over the data groups."""
    module = model.module
    stepped = [p for p in module.parameters() if p.requires_grad]
    module[gather_at].register_forward_pre_hook(lambda _layer, args: (gather_rows(args[0], group),) + args[1:])
    loss = _GatheredLoss(model.loss, group)  # labels join their gathered rows
    model.convert(loss=loss)
    plan.data_parallel = [name for name, p in module[:gather_at].named_parameters() if p.requires_grad]
    params = [p for p in module[:gather_at].parameters() if p.requires_grad]

    def share(took_part):
        if not took_part:  # the others wait in the gather for this rank's rows: stop loudly
            raise RuntimeError(
                f"hybrid parallelism: rank {dist.get_rank()} stepped without a batch; every rank "
                "must step in every round, with an empty batch (no rows) where its data ran out"
            )
        if params:
            sum_gradients(params, group)
        if data_group is not None:  # a tensor group whose ranks all had no rows counts for nothing
            had_rows, loss.rows = loss.rows > 0, 0
            average_gradients(stepped, data_group, had_rows)

    return share


class _GatherRows(torch.autograd.Function):
    """All ranks' rows, concatenated in rank order; backward, this rank's rows of the gradient.
    The gradient arriving is whole on every rank (the dense layers make it so: replicated, or
    all-reduced at the column-parallel layer's input), so taking one's rows needs no message."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=group)
        counts = [int(c) for c in counts]  # batches may differ (an epoch's last, an empty one)
        most = max(counts)
        padded = rows.new_zeros((most, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        ctx.start = sum(counts[:rank])
        ctx.stop = ctx.start + counts[rank]
        return torch.cat([g[:n] for g, n in zip(gathered, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start:ctx.stop], None


def gather_rows(rows: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``rows`` concatenated along dimension 0 in rank order (a collective);
    differentiable: each rank's gradient is its own rows' part of the whole one."""
    return _GatherRows.apply(rows, group)


class _GatheredLoss:
    """The model's loss on the gathered batch: labels gathered as the features were."""

    def __init__(self, loss, group):
        self.loss, self.group = loss, group
        self.rows = 0  # rows gathered since the gradient hook last asked (an accumulation window's)

    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            labels = gather_rows(labels, self.group)
        self.rows += labels.shape[0]
        if not labels.shape[0]:
            # A tensor group of a 2-D mesh whose ranks all ran out of data in this round: a
            # mean over no rows is NaN; zero keeps the backward's collectives and adds nothing.
            return outputs.sum() * 0.0
        return self.loss(outputs, labels)


@torch.no_grad()
def sum_gradients(params: list[torch.Tensor], group=None) -> None:
    """All-reduce the gradients of ``params`` to their sum over the ranks, in one flat buffer
    (the hybrid's loss is already the mean over the whole gathered batch: a sum, not a mean)."""
    for p in params:
        if p.grad is None:  # a layer this rank's (empty) batch did not reach
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    for p, value in zip(params, flat.split([p.numel() for p in params])):
        # Copied in, not replaced: a channels_last weight's gradient keeps its layout, which
        # torch's fused optimizers assume (nn/serialization.py).
        p.grad.copy_(value.view(p.shape))


@torch.no_grad()
def average_gradients(params: list[torch.Tensor], group, took_part: bool) -> None:
    """Replace the gradients of ``params`` by their mean over the ranks of ``group`` that
    ``took_part`` (a 2-D mesh's data groups), in one flat all-reduce that carries the count
    of participants too. A split parameter's gradient is averaged by its local shard: the
    group's ranks hold the same shard of it."""
    for p in params:
        if p.grad is None:  # a step without a batch
            p.grad = torch.zeros_like(p)
    grads = [_local(p.grad) for p in params]
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    flat = torch.cat([*(g.reshape(-1).to(wide) for g in grads), torch.ones(1, dtype=wide, device=grads[0].device)])
    if not took_part:
        flat.zero_()
    dist.all_reduce(flat, group=group)
    flat = flat[:-1] / flat[-1].clamp(min=1)  # the rounds always have a batch somewhere: the clamp is a guard
    for g, value in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(value.view(g.shape))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself outside autograd: writes reach the DTensor)."""
    from torch.distributed.tensor import DTensor  # lazy: only distributed plans load it

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _op(layer: nn.Module) -> nn.Module | None:
    return layer.op if isinstance(layer, nn.Sequential) and "op" in layer._modules else None
