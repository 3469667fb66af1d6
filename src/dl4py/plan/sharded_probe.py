"""What one collective of a sharded (FSDP2) training step costs among this machine's ranks,
beyond its bytes (``profile.ShardedCollective``); run by ``plan.measure``'s rank program.

A link is timed back to back, the ranks made ready by a barrier before each call. A sharded
step reaches each unit's gathers and reduce-scatter after some compute instead, the ranks
arriving apart and each wake-up of a collective's threads waiting for a turn on a busy core;
on the benchmark's two-core CPU that made a small all-gather cost 1.2-1.5 ms inside a
two-rank sharded step against 0.24 ms back to back (``benchmarks/results/plan-cpu.md``).

The probe: ``UNITS`` small dense units (a ``WIDTH`` x ``WIDTH`` linear layer and a tanh), each
sharded by FSDP2, trained on ``BATCH`` examples by the for-loop SGD dl4py steps DTensors with;
a step gathers each unit for the forward and again for the backward and reduce-scatters its
gradients. Every rank times the probe's step sharded over all the ranks, and sharded over a
group of itself alone: the same hooks, copies and update, no peer to wait for. The ranks run
both at once, so they share the cores alike in each. The difference, per collective, is the
figure: the compute is microseconds a unit, so what is left is the collectives' own cost.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

UNITS, WIDTH, BATCH = 8, 64, 8
COLLECTIVES_PER_UNIT = 3  # the forward's gather, the backward's gather, the gradients' reduce-scatter
WARM_UP_STEPS = 3
ROUNDS = 2  # alone, all, alone, all: a drift of the machine's load reaches both alike


def sharded_collective_seconds(rank: int, world: int, target: torch.device, repeats: int) -> float:
    """Seconds one collective of a sharded step costs among ``world`` ranks, beyond its bytes:
    the mean of the ranks' figures (each rank's own waits differ; a step waits for them all)."""
    # every rank makes every group of one, in the same order, as new_group requires
    alone = [dist.new_group([member]) for member in range(world)][rank]
    meshes = {"alone": DeviceMesh.from_group(alone, target.type),
              "all": DeviceMesh.from_group(dist.group.WORLD, target.type)}
    peers = {"device_ids": [target.index]} if target.type == "cuda" else {}  # NCCL's barrier asks which GPU
    samples = {"alone": [], "all": []}
    try:
        for _ in range(ROUNDS):
            for name, mesh in meshes.items():
                dist.barrier(**peers)  # start together: the timed steps, not a late rank's start-up
                samples[name] += _step_seconds(mesh, target, repeats)
    finally:
        # FSDP2's modules hold their mesh's group in reference cycles: collect them while the
        # groups exist, then let go of the group of one (the measurement's rank program still
        # leaves by os._exit: freeing gloo's groups at the interpreter's exit can abort it)
        del meshes
        gc.collect()
        dist.destroy_process_group(alone)
    extra = (statistics.median(samples["all"]) - statistics.median(samples["alone"])) / (UNITS * COLLECTIVES_PER_UNIT)
    mean = torch.tensor([max(extra, 0.0)], dtype=torch.float64, device=target)
    dist.all_reduce(mean)
    return mean.item() / world


def _step_seconds(mesh: DeviceMesh, target: torch.device, repeats: int) -> list[float]:
    from torch.distributed.fsdp import fully_shard  # lazy: as parallel/sharding.py, only sharding loads FSDP2

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(UNITS))).to(target)
    for unit in model:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)  # the for-loop kernel DTensors take
    features = torch.randn(BATCH, WIDTH, device=target)
    sync = (lambda: torch.cuda.synchronize(target)) if target.type == "cuda" else (lambda: None)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(features).square().mean().backward()
        optimizer.step()
        sync()

    for _ in range(WARM_UP_STEPS):
        step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return samples
