"""The collectives the rank program meets through, at any number of ranks.

A rank alone (world size 1) needs no process group: every collective's answer for one rank is
its own value (a sum, a maximum or a gather of one; a broadcast from itself), so each function
here returns it without calling ``torch.distributed``, which would insist on a group. That
makes a single process the degenerate case of the rank program: ``run_rank(0, 1, ...)`` trains
as ``Model.fit`` does, with no ``init_process_group``. With more ranks they are
``torch.distributed``'s own, on the default group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    """The ranks of the default process group; 1 where there is none."""
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``tensor`` reduced in place over all ranks (returned, for chaining)."""
    if world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in rank order (all of one shape)."""
    if world_size() == 1:
        return [tensor]
    every = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(every, tensor)
    return every


def all_gather_object(value) -> list:
    """Every rank's ``value`` (anything that pickles), in rank order."""
    if world_size() == 1:
        return [value]
    every = [None] * world_size()
    dist.all_gather_object(every, value)
    return every


def broadcast(tensor: torch.Tensor, src: int = 0) -> None:
    """Rank ``src``'s values into ``tensor`` on every rank."""
    if world_size() > 1:
        dist.broadcast(tensor, src=src)
