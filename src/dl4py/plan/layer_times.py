"""The network's own layers timed on this machine: ``dl4py plan --measure-layers``.

A profile's curves give a layer's time from its FLOPs and its kind, which is what a planner
for a device one does not have can know. On the device at hand the network's own layers can
simply be run: a convolution's rate depends on its shape as much as on its FLOPs (on the
benchmark CPU, LeNet's one-channel first convolution's backward ran at 36 GFLOP/s where the
profile's 3x3 convolutions of as many FLOPs ran at 90-450), and on the layout dl4py trains it
in. ``measure_layers`` times, at the batch of the plan and in both layouts (channels-last,
as one device or a data-parallel worker trains a convolutional network where channels_last is
auto; contiguous, as the sharded, tensor and hybrid plans do): the plain network's whole
training step (its layers, the glue between them, the loss, the fused update), each layer's
module alone (forward, and forward and backward), the optimizer's step as dl4py makes it and
its for-loop kernel (the distributed plans'), and FSDP2's own work a step (a sharded step on a
group of one less the plain step, at one thread). ``predict(..., layer_times=...)`` then starts
each plan from the whole step and takes off or adds what the plan changes (the share of a split
layer another rank does, the update's kernel, FSDP2's work); the shares of a CPU, the exchanges
and the copies stay the model's.

Times are this process's, at its thread count.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dl4py.config.graph import GraphConfig, example_shape
from dl4py.memory.step_sizes import network_of
from dl4py.nn.loading import network_model
from dl4py.parallel.sharding import shard_replica
from dl4py.plan.work import layer_parts

REPEATS = 7
WARM_UP_S = 0.3  # oneDNN's first calls of a shape are far slower than the rest (plan/measure.py)
MIN_WARM_UP_CALLS = 3


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of each layer's forward and backward by layout ("nhwc", "nchw"; a layer without
    2-D convolutions has the same in both), and of the update ("fused" or foreach as dl4py
    steps one device or a data worker, "loop" as the distributed plans step)."""

    batch_size: int
    threads: int
    forward: dict[str, dict[int, float]] = field(default_factory=dict)
    backward: dict[str, dict[int, float]] = field(default_factory=dict)
    update: dict[str, float] = field(default_factory=dict)
    # FSDP2's own work a step on one rank (its hooks and copies, the DTensor update), measured at
    # one thread on a group of one; None where not measured (a process group exists already).
    sharded_overhead_s: float | None = None
    # The whole training step of the plain network by layout: its layers, the glue between them
    # (a graph's vertices, the loss) and the fused update.
    step: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        missing = {"nhwc", "nchw"} - set(self.step)
        if missing:
            raise ValueError(f"LayerTimes needs the whole step timed in both layouts; missing {sorted(missing)}")

    def of(self, index: int, layout: str) -> tuple[float, float] | None:
        """(forward, backward) seconds of layer ``index`` in ``layout``; None if not timed."""
        if index not in self.forward.get(layout, {}):
            return None
        return self.forward[layout][index], self.backward[layout][index]


def measure_layers(config, batch_size: int, precision: str | None = None, device: str = "cpu") -> LayerTimes:
    """Time ``config`` (a run config, network or graph config) on ``device`` (the CPU, or
    ``cuda[:N]``) at ``batch_size``: each figure the median of REPEATS calls after a warm-up
    of WARM_UP_S, the device synchronized around each call."""
    network, run_precision = network_of(config)
    precision = precision or run_precision or "float"
    target = torch.device(device)
    forward, backward = {}, {}
    for layout in ("nhwc", "nchw"):
        forward[layout], backward[layout] = {}, {}
        for part in layer_parts(network):
            if part.module is None:
                continue
            module = _on_device(part.module, layout, target)
            features = _batch(part, batch_size, network, layout, target)
            forward_s, both_s = _time_part(module, features, target)
            forward[layout][part.index] = forward_s
            backward[layout][part.index] = max(both_s - forward_s, 0.0)
    return LayerTimes(batch_size, torch.get_num_threads(), forward, backward,
                      _update_times(network, precision, target),
                      _sharded_overhead(network, precision, batch_size, target),
                      _step_times(network, precision, batch_size, target))


def _model(network, precision: str, target: torch.device, contiguous: bool):
    model = network_model(network, backend="gpu" if target.type == "cuda" else "cpu", precision=precision).init()
    if contiguous:
        model.use_contiguous_layout()
    return model


def _step_batch(network, batch_size: int, target: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.rand(batch_size, *example_shape(network), device=target),
            torch.zeros(batch_size, dtype=torch.long, device=target))


def _step_times(network, precision: str, batch_size: int, target: torch.device) -> dict[str, float]:
    features, labels = _step_batch(network, batch_size, target)
    times = {}
    for layout in ("nhwc", "nchw"):
        model = _model(network, precision, target, contiguous=layout == "nchw")
        times[layout] = _median_seconds(lambda: model.train_step(features, labels), target)
    return times


def _on_device(meta_module: torch.nn.Module, layout: str, target: torch.device) -> torch.nn.Module:
    """The part's module with real (random) weights on ``target``, its 4-D ones in ``layout``."""
    module = meta_module.to_empty(device=target)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.05)
        for buffer in module.buffers():  # running statistics: finite, as a trained network's
            buffer.fill_(1) if buffer.is_floating_point() else buffer.zero_()
    if layout == "nhwc":
        module = module.to(memory_format=torch.channels_last)
    return module.train()


def _batch(part, batch_size: int, network, layout: str, target: torch.device) -> torch.Tensor:
    dims = tuple(1 if d is None else d for d in part.input.dims)  # a sequence of unknown length: 1 step
    features = torch.randn(batch_size, *dims, device=target)
    if layout == "nhwc" and features.dim() == 4:
        features = features.contiguous(memory_format=torch.channels_last)
    reads_gradient = part.reads != ("input",) and not (isinstance(network, GraphConfig)
                                                       and all(r in network.inputs for r in part.reads))
    return features.requires_grad_(reads_gradient)


def _time_part(module: torch.nn.Module, features: torch.Tensor, target: torch.device) -> tuple[float, float]:
    """Median seconds of the forward, and of the forward and backward together."""
    trained = [p for p in module.parameters() if p.requires_grad]
    wanted = trained + ([features] if features.requires_grad else [])

    def forward():
        return module(features)

    def both():
        result = module(features)
        if wanted and result.requires_grad:
            torch.autograd.grad(result, wanted, torch.ones_like(result))

    return _median_seconds(forward, target), _median_seconds(both, target)


def _update_times(network, precision: str, target: torch.device) -> dict[str, float]:
    """The optimizer step over the whole network as dl4py makes it, and its for-loop kernel,
    after one step on two examples (the gradients and the updater's state exist)."""
    model = _model(network, precision, target, contiguous=False)
    model.train_step(*_step_batch(network, 2, target))
    times = {"fused": _median_seconds(model.optimizer.step, target)}
    loop = model.make_optimizer(loop=True)
    loop.load_state_dict(model.optimizer.state_dict())
    times["loop"] = _median_seconds(loop.step, target)
    return times


def _sharded_overhead(network, precision: str, batch_size: int, target: torch.device) -> float | None:
    """A sharded replica's step on a group of one rank less the same network's plain step in
    the contiguous layout, both at one CPU thread (a rank's Python): what FSDP2 adds to each
    rank's step besides its collectives (which a group of one does not wait on)."""
    if dist.is_initialized():  # inside a job of its own: the planner does not join it
        return None
    threads = torch.get_num_threads()
    features, labels = _step_batch(network, batch_size, target)
    backend = "nccl" if target.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.set_num_threads(1)
        plain = _model(network, precision, target, contiguous=True)
        sharded = _model(network, precision, target, contiguous=True)
        shard_replica(sharded, init_device_mesh(target.type, (1,)))
        times = {name: _median_seconds(lambda model=model: model.train_step(features, labels), target)
                 for name, model in (("plain", plain), ("sharded", sharded))}
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()
    return max(times["sharded"] - times["plain"], 0.0)


def _median_seconds(run, target: torch.device) -> float:
    def sync():
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    warm_until, calls = time.monotonic() + WARM_UP_S, 0
    while calls < MIN_WARM_UP_CALLS or time.monotonic() < warm_until:
        run()
        calls += 1
    samples = []
    for _ in range(REPEATS):
        sync()
        start = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
