"""Collectives of the parallel trainer: parameter averaging and gradient sharing.

Both weight each worker by whether it took part (trained a batch since the last average,
or in this step), so an uneven last round averages across the workers that trained and
no worker's stale values dilute the result. Tensors travel in one flat buffer per device
and dtype, in float32 (float64 for double), one all-reduce each, plus one for the
participant count. The buffers live on the model's device: torch keeps some optimizer
state on the CPU beside CUDA parameters (the ``step`` counts of RMSprop, and of Adam
unless fused), and NCCL only moves CUDA tensors.
"""

from __future__ import annotations

import torch

from dl4py.parallel import collectives


def stepped_parameters(model) -> list[torch.Tensor]:
    """The tensors the updater steps: float32 masters when the precision keeps them."""
    return list(model.stepped_module.parameters())


def replica_state(model, include_updater: bool) -> list[torch.Tensor]:
    """Everything that must agree across replicas after averaging, in a fixed order."""
    tensors = stepped_parameters(model)
    tensors += [b for b in model.module.buffers() if b.is_floating_point()]
    if include_updater:
        for group in model.optimizer.param_groups:
            for param in group["params"]:
                state = model.optimizer.state.get(param, {})
                tensors += [state[k] for k in sorted(state) if torch.is_tensor(state[k]) and state[k].is_floating_point()]
    return tensors


def agree_on_loss_scaling(model, device: torch.device) -> None:
    """Give every worker the same loss scaling after an average: the smallest scale (with the
    smallest growth count among the workers at it) and the largest count of updates applied.
    Between averages each worker's scaler follows its own batches' overflows, and skips its
    own steps; afterwards the replicas are one model again, so the state a checkpoint keeps
    (worker 0's) is every worker's, and a resumed run goes on as the uninterrupted one."""
    precision = model.precision_state
    if not precision.scales_loss or collectives.world_size() == 1:
        return
    state = precision.state_dict()  # reads the scale from the device: averaging waits for it anyway
    mine = torch.tensor([state["scale"], state["_growth_tracker"], model.update_count], dtype=torch.float64,
                        device=device)
    every = collectives.all_gather(mine)
    scale, tracker = min((float(t[0]), int(t[1])) for t in every)
    model.training_state.agree_on_updates(max(int(t[2]) for t in every))
    precision.load_state_dict({**state, "scale": scale, "_growth_tracker": tracker})


def _participant_count(took_part: bool, device: torch.device) -> float:
    count = torch.tensor([1.0 if took_part else 0.0], device=device)
    return float(collectives.all_reduce(count).item())


@torch.no_grad()
def average(tensors: list[torch.Tensor], took_part: bool) -> float:
    """Replace each tensor by its mean over the workers that took part; returns their number."""
    if not tensors:
        return 0.0
    if collectives.world_size() == 1:  # the mean of one is itself
        return 1.0
    count = _participant_count(took_part, tensors[0].device)
    if count == 0:  # nobody trained since the last average: nothing to do, on every worker alike
        return 0.0
    weight = 1.0 if took_part else 0.0
    device = tensors[0].device  # the parameters come first: the model's device
    for bucket in _buckets(tensors):
        wide = torch.float64 if bucket[0].dtype == torch.float64 else torch.float32
        flat = torch.cat([t.reshape(-1).to(device=device, dtype=wide) for t in bucket]).mul_(weight)
        collectives.all_reduce(flat)
        flat = flat.div_(count).to(bucket[0].device)
        torch._foreach_copy_(bucket, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in bucket]), bucket)])
    return count


@torch.no_grad()
def broadcast(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Give every worker worker ``src``'s values, passing through the model's device."""
    device = tensors[0].device if tensors else None
    for tensor in tensors:
        moved = tensor.to(device)  # the tensor itself when it is already there
        collectives.broadcast(moved, src=src)
        if moved is not tensor:
            tensor.copy_(moved)


@torch.no_grad()
def share_gradients(params: list[torch.Tensor], took_part: bool) -> None:
    """All-reduce gradients to their mean over the workers that trained a batch this step
    (DDP's semantics; a worker without a batch receives the mean and steps with it)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    average([p.grad for p in params], took_part)


def mean_over_participants(value: torch.Tensor | None, took_part: bool, device: torch.device) -> float:
    """Mean of a scalar (e.g. the last minibatch loss) over the workers that took part."""
    pair = torch.tensor([float(value) if took_part and value is not None else 0.0, 1.0 if took_part else 0.0],
                        device=device, dtype=torch.float64)
    collectives.all_reduce(pair)
    return float(pair[0] / pair[1]) if pair[1] > 0 else float("nan")


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by (device, dtype), so each group copies back with one foreach call."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())
