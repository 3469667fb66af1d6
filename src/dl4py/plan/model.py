"""The cost model: each plan's time per step and memory per device, from a network's work
(``plan.work``) and a device's measured speeds (``plan.profile``).

A step's compute on one device is, layer by layer, its matrix products and convolutions at
the device's rate for calls of their size, its element-wise bytes at the device's memory
bandwidth, a dispatch for each kernel, and the update (the parameters, their gradients and the
updater state read and written once by a fused kernel, once per operator by the for-loop one the
distributed plans use); on a CPU, the page faults of the buffers too large for the allocator to
keep, made anew every step. Where ranks share a device (CPU ranks on one machine),
each has its share of it (``cpu_shares``: the most crowded core's, for the plans that
synchronize at every unit or pair). Communication is each plan's collectives, timed by the device's
fitted links (``Link.seconds``: latency plus bytes over bandwidth), plus the copies around
them (averaging's flat buffer, FSDP2's buffers), with no overlap: dl4py's
data-parallel modes exchange after the backward pass, and the sharded, tensor and hybrid plans
wait on their gathers.

The plans, for W ranks each given the config's batch B (DL4J's ParallelWrapper semantics: a
round trains one batch per worker):

- ``single``: one device.
- ``data-averaging``: every rank a whole model and its own batch; the parameters (and the
  updater state, ``average_updaters``) averaged every ``averaging_frequency`` rounds.
- ``data-shared``: the same, the gradients averaged every step.
- ``sharded``: FSDP2: each unit's parameters gathered for the forward and again for the
  backward, its gradients reduce-scattered; each of those collectives at its cost inside a
  sharded step where the profile measured it (``ShardedCollective``), else the link's latency.
- ``tensor``: every rank the same batch; consecutive hidden dense layers split in
  column/row pairs, each pair one all-reduce of its output forward and one of its input's
  gradient backward (Megatron's MLP).
- ``hybrid``: the layers before the first dense layer data-parallel on each rank's batch, the
  batch gathered there, the dense layers as in ``tensor`` on the gathered batch.
- ``experiments``: one independent run per device (a sweep): no exchange at all, but W
  separate trainings rather than one faster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dl4py.config.graph import GraphConfig
from dl4py.config.parallel import ParallelPlan
from dl4py.errors import ConfigError
from dl4py.memory.capacity import max_batch_size
from dl4py.memory.estimate import estimate
from dl4py.memory.sharded import sharding_layout
from dl4py.memory.step_sizes import network_of
from dl4py.memory.tensor import NO_PAIRS, NOTHING_APART, TOLERANCE as TENSOR_TOLERANCE, dense_pairs, first_dense_layer
from dl4py.plan.layer_times import LayerTimes
from dl4py.plan.profile import DeviceProfile
from dl4py.plan.work import LayerWork, StepWork, step_work

PLAN_NAMES = ("single", "data-averaging", "data-shared", "sharded", "tensor", "hybrid", "experiments")
DATA_SYNC = {"data-averaging": "averaging", "data-shared": "shared_gradients"}  # ParallelPlan's sync
# The profile's precision for a policy's arithmetic; "double" has no measured rate: float's, halved.
COMPUTE_PRECISION = {"float": "float", "double": "float", "half": "half", "mixed-fp16": "half",
                     "bfloat16": "bfloat16", "mixed-bf16": "bfloat16"}
# Times the parameter bytes an update reads and writes: parameter, gradient and state(s).
UPDATE_PASSES = {"sgd": 3, "nesterovs": 5, "adam": 7, "adamw": 7, "rmsprop": 5, "adagrad": 5, "adadelta": 7,
                 "adamax": 7, "nadam": 7, "amsgrad": 9, "noop": 0}
# The same for torch's for-loop kernel, which dl4py's distributed plans (sharded, tensor, hybrid)
# step with (nn/model.py ``_for_loop``: the fused and foreach kernels take no DTensors): one
# operator at a time, each a pass of its own, e.g. SGD's ``buf.mul_(m).add_(g)``: 2 + 3, and
# Nesterov's ``g.add(buf)``: a new tensor, 3. L2 (weight decay) adds ``g.add(p)``: 3 more.
FOR_LOOP_UPDATE_PASSES = {"sgd": 3, "nesterovs": 11, "adam": 18, "adamw": 20}
L2_PASSES = 3
STATE_COPIES = {"sgd": 0, "nesterovs": 1, "adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1, "adadelta": 2,
                "adamax": 2, "nadam": 2, "amsgrad": 3, "noop": 0}
FLOAT_BYTES = 4  # averaging and gradient exchange run in float32 (parallel/averaging.py)
SMALL_MESSAGE = 8  # the participant count each exchange agrees on first
# averaging.average's passes over its buffer, each a read and a write: the copy into one flat
# buffer (torch.cat), its weighting (mul_), the division by the participants (div_), the copy back.
PACKING_PASSES = 4
# On a CPU, glibc serves an allocation over its largest mmap threshold (32 MiB on 64-bit,
# DEFAULT_MMAP_THRESHOLD_MAX) from fresh pages and unmaps it when freed, so a buffer that big
# allocated every step is faulted in page by page every step: a gradient (the step's
# zero_grad(set_to_none=True) drops it), averaging's flat buffer. PyTorch's CUDA allocator caches.
FRESH_PAGES_FROM = 32 * 2**20
PAGE_BYTES = 4096
# The kernel's cost of one such page (the trap and the zeroing), per thread; faults of
# several threads run in parallel. Not in the profile yet (profile.py measures no fresh
# allocation): Linux's usual figure, which a 77 MB buffer on the benchmark machine met
# (1.4 us a page on one thread, 0.6 on two; benchmarks/results/plan-cpu.md).
PAGE_FAULT_S = 1.4e-6


@dataclass(frozen=True)
class Prediction:
    """One plan on ``workers`` devices: whether dl4py can train the network so, and if it can,
    its time per step (``step_s`` = compute + communication), throughput and memory per device."""

    plan: str
    workers: int
    admitted: bool
    why_not: str = ""  # why dl4py cannot train the network with this plan
    batch_per_rank: int = 0
    samples_per_step: int = 0  # examples one step (round) trains, all ranks together
    compute_s: float = 0.0
    communication_s: float = 0.0
    moved_bytes: int = 0  # bytes each rank passes into collectives per step
    peak_bytes: int | None = None  # per device; None: not estimated for this plan
    fits: bool | None = None  # within the device memory given; None: no memory given
    largest_batch: int | None = None  # the largest B whose step fits; None: not searched

    @property
    def step_s(self) -> float:
        return self.compute_s + self.communication_s

    @property
    def samples_per_second(self) -> float:
        return self.samples_per_step / self.step_s if self.admitted and self.step_s > 0 else 0.0


def predict(config, profile: DeviceProfile, workers: int, batch_size: int | None = None,
            precision: str | None = None, device_memory: int | None = None,
            averaging_frequency: int = 1, average_updaters: bool = True,
            layer_times: LayerTimes | None = None) -> list[Prediction]:
    """Every plan of ``PLAN_NAMES`` for ``config`` (a run config, network or graph config) on
    ``workers`` devices like ``profile``'s (on a CPU profile: ranks sharing that machine).
    ``layer_times``: the network's own layers and update timed on this machine at this batch
    (``plan.layer_times``), used in place of the curves for what they cover."""
    network, run_precision = network_of(config)
    training = getattr(config, "training", None)
    batch = batch_size if batch_size is not None else getattr(training, "batch_size", None)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ConfigError("batch_size", f"must be a whole number of examples of at least 1, got {batch!r} "
                                        "(give --batch-size where the config's is auto or missing)")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError("devices", f"must be a whole number of at least 1, got {workers!r}")
    precision = precision or run_precision or "float"
    if layer_times is not None and layer_times.batch_size != batch:
        raise ConfigError("layer_times", f"were timed at batch {layer_times.batch_size}, not {batch}")
    cost = _Cost(network, profile, precision, workers, layer_times)
    plans = [cost.single(batch)]
    if workers > 1:
        plans += [cost.data(batch, averaging_frequency, average_updaters), cost.data(batch, 1, False, shared=True),
                  cost.sharded(batch), cost.tensor(batch), cost.hybrid(batch), cost.experiments(batch)]
    return [_with_memory(p, network, precision, profile, device_memory) for p in plans]


class _Cost:
    """The time parts every plan is made of, for one network, profile and precision."""

    def __init__(self, network, profile: DeviceProfile, precision: str, workers: int,
                 layer_times: LayerTimes | None = None):
        self.network, self.profile, self.precision, self.workers = network, profile, precision, workers
        self.layer_times = layer_times
        self._works: dict[int, StepWork] = {}
        # The layout one device and a data worker train convolutions in where channels_last is
        # auto (nn/memory_format.py: float and double); the distributed plans keep NCHW.
        self.layout = "nhwc" if precision in ("float", "double") else "nchw"
        self.rate_precision = COMPUTE_PRECISION.get(precision, "float")
        if self.rate_precision not in profile.matmul:
            self.rate_precision = "float"  # a profile measured in float only (a quick CPU one)
        updater = type(network.updater).__name__.lower()
        self.update_passes = UPDATE_PASSES.get(updater, 5)
        # An updater whose for-loop kernel is not counted: the fused kernel's passes, a lower bound.
        self.for_loop_passes = FOR_LOOP_UPDATE_PASSES.get(updater, self.update_passes) + (
            L2_PASSES if getattr(network, "l2", 0) else 0)
        self.state_copies = STATE_COPIES.get(updater, 1)
        # Ranks on one CPU machine share its cores; GPUs are a device each. ``synced_share``: the
        # plans that synchronize within a step (at each unit or pair) go at their slowest rank's pace.
        self.share, self.synced_share = cpu_shares(workers, profile.threads) if profile.kind == "cpu" else (1.0, 1.0)

    def work(self, batch: int) -> StepWork:
        """The step's work at ``batch``, counted once for every plan that asks (each counts the
        network's FLOPs on the meta device)."""
        if batch not in self._works:
            self._works[batch] = step_work(self.network, batch, self.precision, device=self.profile.kind)
        return self._works[batch]

    def compute(self, layers, share: float | None = None, flop_scale: dict[int, float] | None = None,
                whole_gradients: bool = True, distributed: bool = False,
                held: dict[int, float] | None = None) -> float:
        """Seconds of ``layers``' forward, backward and update on this rank's share of a device;
        ``flop_scale``: layer index -> the fraction of its work this rank does (a split layer);
        ``held``: layer index -> the fraction of its parameters this rank holds and updates
        (default: ``flop_scale``'s; they differ where a rank's batch is not the config's);
        ``whole_gradients``: False where each gradient is made a unit at a time (FSDP2's);
        ``distributed``: the parameters are DTensors, stepped by the for-loop kernel."""
        update_passes = self.for_loop_passes if distributed else self.update_passes
        flop_scale = flop_scale or {}
        held = flop_scale if held is None else held
        if self.layer_times is not None:  # the network timed here: its step, not the curves
            return self._timed_step(self.layer_times, layers, "nchw" if distributed else self.layout,
                                    flop_scale, held, distributed) / (share if share is not None else self.share)
        seconds = 0.0
        for layer in layers:
            scale, part = flop_scale.get(layer.index, 1.0), held.get(layer.index, 1.0)
            seconds += scale * (self._flop_seconds(layer, layer.forward_flops) + self._flop_seconds(
                layer, layer.backward_flops, calls=2) + layer.bytes / self.profile.memory_bandwidth)
            seconds += layer.kernels * self.profile.overhead_s
            if not layer.frozen:
                seconds += part * update_passes * layer.parameter_bytes / self.profile.memory_bandwidth
                if whole_gradients:  # its gradient, made anew every step
                    seconds += self.fresh_pages_seconds(part * layer.parameter_bytes)
        return seconds / (share if share is not None else self.share)

    def _timed_step(self, timed: LayerTimes, layers, layout: str, flop_scale: dict, held: dict,
                    distributed: bool) -> float:
        """The whole network's measured step, less what this rank does not do of each layer
        (the share of a split layer it leaves to the others; more where it does several
        batches' work) and its update (the for-loop kernel's for the distributed plans; for the
        sharded plan the DTensor one is FSDP2's measured work, which the caller adds)."""
        trained = sum(layer.parameters for layer in layers if not layer.frozen) or 1
        fused, loop = timed.update.get("fused", 0.0), timed.update.get("loop", 0.0)
        seconds = timed.step[layout]
        for layer in layers:
            scale, part = flop_scale.get(layer.index, 1.0), held.get(layer.index, 1.0)
            measured = timed.of(layer.index, layout)
            if measured is not None:
                seconds -= (1 - scale) * sum(measured)
            if not layer.frozen:
                weight = layer.parameters / trained
                seconds -= (1 - part) * fused * weight
                if distributed:
                    seconds += part * (loop - fused) * weight
        return max(seconds, 0.0)

    def fresh_pages_seconds(self, nbytes: float) -> float:
        """Faulting in a CPU buffer of ``nbytes`` allocated anew each step (``FRESH_PAGES_FROM``),
        on the whole device (the caller divides by the rank's share, as for compute)."""
        if self.profile.kind != "cpu" or nbytes <= FRESH_PAGES_FROM:
            return 0.0
        return nbytes / PAGE_BYTES * PAGE_FAULT_S / (self.profile.threads or 1)

    def _flop_seconds(self, layer: LayerWork, flops: int, calls: int = 1) -> float:
        if flops == 0:
            return 0.0
        kind = "conv" if layer.kind == "conv" else "matmul"
        scale = 0.5 if self.precision == "double" else 1.0
        return flops / (scale * self.profile.rate(kind, self.rate_precision, flops / calls))

    def exchange(self, collective: str, nbytes: float, ranks: int | None = None,
                 latency_s: float | None = None) -> float:
        """The link's time for ``nbytes``; ``latency_s``: in place of the link's own (a
        collective's cost inside a sharded step, ``DeviceProfile.sharded_collective_s``)."""
        ranks = ranks or self.workers
        if ranks == 1 or nbytes <= 0:
            return 0.0
        link = self.profile.link(collective, ranks) or self.profile.link("all_reduce", ranks)
        if link is None:
            link = self._scaled_link(collective, ranks)
        return link.seconds(nbytes) + (0.0 if latency_s is None else latency_s - link.latency_s)

    def reduce_scatter(self, part: float, latency_s: float | None = None) -> float:
        """A reduce-scatter leaving each rank ``part`` bytes. Its input is the whole unit, W parts:
        gloo reduces all of it (torch's gloo reduce_scatter_tensor took twice an all-reduce of
        the same 77 MB on the benchmark machine), so on gloo it is at least an all-reduce of the
        unit; NCCL's ring moves one part per step, as an all-gather does."""
        link = self.profile.link("all_reduce", self.workers)
        if link is not None and link.backend == "gloo":
            return self.exchange("all_reduce", part * self.workers, latency_s=latency_s)
        return self.exchange("all_gather", part, latency_s=latency_s)

    def _scaled_link(self, collective: str, ranks: int):
        """A link for a rank count not measured: the nearest measured one of the collective,
        its time per byte scaled as a ring's, 2 (n - 1) / n (all-reduce) or (n - 1) (all-gather)."""
        links = [link for link in self.profile.links if link.collective in (collective, "all_reduce")]
        if not links:
            raise ConfigError("profile", f"{self.profile.name!r} has no measured collectives; measure it with "
                                         "`dl4py plan --profile` (its links time the ranks' exchanges)")
        nearest = min(links, key=lambda link: (link.collective != collective, abs(link.ranks - ranks)))
        factor = _ring_factor(nearest.collective, ranks) / _ring_factor(nearest.collective, nearest.ranks)
        return type(nearest)(nearest.collective, nearest.backend, ranks, nearest.latency_s,
                             nearest.bandwidth / factor, nearest.scope)

    # -- the plans ---------------------------------------------------------------------

    def single(self, batch: int) -> Prediction:
        work = self.work(batch)
        return Prediction("single", 1, True, batch_per_rank=batch, samples_per_step=batch,
                          compute_s=self.compute(work.layers, share=1.0))

    def data(self, batch: int, frequency: int, average_updaters: bool, shared: bool = False) -> Prediction:
        work = self.work(batch)
        trained = sum(layer.parameters for layer in work.layers if not layer.frozen)
        if shared:
            nbytes, every = trained * FLOAT_BYTES, 1
        else:
            copies = 1 + (self.state_copies if average_updaters else 0)
            nbytes, every = trained * copies * FLOAT_BYTES, max(frequency, 1)
        # averaging.average's passes over its flat buffer, which is allocated afresh every time.
        packing = (2 * PACKING_PASSES * nbytes / self.profile.memory_bandwidth
                   + self.fresh_pages_seconds(nbytes)) / self.share
        exchange = self.exchange("all_reduce", SMALL_MESSAGE) + self.exchange("all_reduce", nbytes) + packing
        name = "data-shared" if shared else "data-averaging"
        return Prediction(name, self.workers, True, batch_per_rank=batch, samples_per_step=batch * self.workers,
                          compute_s=self.compute(work.layers), communication_s=exchange / every,
                          moved_bytes=int(nbytes / every))

    def sharded(self, batch: int) -> Prediction:
        work = self.work(batch)
        seconds, moved = 0.0, 0
        copied = 0.0
        # what a collective costs inside a sharded step, where measured: the ranks reach each
        # unit's after compute, not ready and waiting as when a link is timed back to back
        within_step = self.profile.sharded_collective_s(self.workers)
        for part, trains in self._shards(work):
            # gathered for the forward, again for the backward; its gradient reduce-scattered
            seconds += 2 * self.exchange("all_gather", part, latency_s=within_step) + (
                self.reduce_scatter(part, latency_s=within_step) if trains else 0)
            moved += (3 if trains else 2) * part
            # FSDP2 copies around each collective, a read and a write each: a gather's shard
            # into its send buffer and the gathered unit out into the parameters; the unit's
            # gradients into the reduce-scatter's input (its chunk_cat).
            copied += 2 * 2 * (part + self.workers * part) + (2 * self.workers * part if trains else 0)
        seconds += copied / self.profile.memory_bandwidth / self.synced_share
        if self.layer_times is not None and self.layer_times.sharded_overhead_s is not None:
            # FSDP2's hooks, copies and DTensor update, measured (their Python runs on one thread a rank)
            seconds += self.layer_times.sharded_overhead_s
        return Prediction("sharded", self.workers, True, batch_per_rank=batch, samples_per_step=batch * self.workers,
                          compute_s=self.compute(work.layers, share=self.synced_share, whole_gradients=False,
                                                 distributed=True),
                          communication_s=seconds, moved_bytes=moved)

    def _shards(self, work: StepWork) -> list[tuple[int, bool]]:
        """(bytes of one rank's shard, whether it trains) for each unit FSDP2 gathers at once:
        the layout dl4py shards a network with, or for a graph each vertex with parameters."""
        if isinstance(self.network, GraphConfig):
            return [(-(-layer.parameter_bytes // self.workers), not layer.frozen)
                    for layer in work.layers if layer.parameters]
        element_bytes = _param_bytes(work)
        return [(unit.shard_elements(self.workers) * element_bytes, unit.trains)
                for unit in sharding_layout(self.network)]

    def tensor(self, batch: int) -> Prediction:
        work = self.work(batch)
        pairs = dense_pairs(self.network)
        if not pairs:
            return Prediction("tensor", self.workers, False, NO_PAIRS if not isinstance(
                self.network, GraphConfig) else "dl4py splits the dense layers of a MultiLayerNetwork; this is a graph")
        split = {index: 1.0 / self.workers for pair in pairs for index in pair}
        seconds, moved = self._pair_exchanges(work, pairs, rows=1)
        # Every rank trains the same batch: a step is one batch, on a share of the device each.
        return Prediction("tensor", self.workers, True, batch_per_rank=batch, samples_per_step=batch,
                          compute_s=self.compute(work.layers, share=self.synced_share, flop_scale=split,
                                                 distributed=True),
                          communication_s=seconds, moved_bytes=moved)

    def hybrid(self, batch: int) -> Prediction:
        if isinstance(self.network, GraphConfig):
            return Prediction("hybrid", self.workers, False, "dl4py's hybrid is for a MultiLayerNetwork; this is a graph")
        work = self.work(batch)
        pairs = dense_pairs(self.network)
        first_dense = first_dense_layer(self.network)
        if not pairs or not first_dense:
            return Prediction("hybrid", self.workers, False, NO_PAIRS if not pairs else NOTHING_APART)
        before = [layer for layer in work.layers if layer.index < first_dense]
        after = [layer for layer in work.layers if layer.index >= first_dense]
        split = {index: 1.0 / self.workers for pair in pairs for index in pair}
        # After the gather every rank holds W batches: the split pairs' share is one batch's work,
        # the replicated layers (the output layer) do all W.
        dense_scale = {layer.index: split.get(layer.index, 1.0) * self.workers for layer in after}
        gathered = before[-1].output_elements * _activation_bytes(self.precision)
        conv_bytes = sum(layer.parameters for layer in before if not layer.frozen) * FLOAT_BYTES
        pair_seconds, pair_bytes = self._pair_exchanges(work, pairs, rows=self.workers)
        seconds = (self.exchange("all_gather", gathered) * 2  # features forward, their gradient's rows back
                   + self.exchange("all_reduce", conv_bytes) + pair_seconds)
        return Prediction("hybrid", self.workers, True, batch_per_rank=batch, samples_per_step=batch * self.workers,
                          # the layers before the dense ones as they are; the update is of the
                          # parameters a rank holds, whatever its batch
                          compute_s=self.compute(work.layers, share=self.synced_share, flop_scale=dense_scale,
                                                 distributed=True, held=split),
                          communication_s=seconds, moved_bytes=int(2 * gathered + conv_bytes + pair_bytes))

    def experiments(self, batch: int) -> Prediction:
        work = self.work(batch)
        return Prediction("experiments", self.workers, True, batch_per_rank=batch,
                          samples_per_step=batch * self.workers, compute_s=self.compute(work.layers))

    def _pair_exchanges(self, work: StepWork, pairs, rows: int) -> tuple[float, int]:
        """Each pair's all-reduce of its output (forward) and of its input's gradient (backward)."""
        by_index = {layer.index: layer for layer in work.layers}
        seconds, moved = 0.0, 0
        for first, second in pairs:
            out_bytes = rows * by_index[second].output_elements * _activation_bytes(self.precision)
            in_bytes = rows * _input_elements(work, first) * _activation_bytes(self.precision)
            seconds += self.exchange("all_reduce", out_bytes) + self.exchange("all_reduce", in_bytes)
            moved += out_bytes + in_bytes
        return seconds, moved


def cpu_shares(workers: int, threads: int | None) -> tuple[float, float]:
    """(a rank's share of the CPU on average, the slowest rank's) for ``workers`` ranks on a CPU
    of ``threads``, each given its ``threads // workers`` threads where they go round (dl4py's
    ``worker_threads``; what is left over idles), else one each, several ranks to a core. Over a
    long stretch of compute the kernel moves ranks between cores and each gets 1 / workers; a
    plan that synchronizes at every unit goes at the pace of a rank sharing its core with the
    most others: 1 / (threads * ceil(workers / threads)). Three ranks on the benchmark's two
    cores: 1/3 and 1/4."""
    if not threads:
        return 1.0 / workers, 1.0 / workers
    if workers <= threads:
        each = (threads // workers) / threads
        return each, each
    return 1.0 / workers, 1.0 / (threads * -(-workers // threads))


def _input_elements(work: StepWork, index: int) -> int:
    earlier = [layer for layer in work.layers if layer.index < index]
    return earlier[-1].output_elements if earlier else 0


def _activation_bytes(precision: str) -> int:
    return {"double": 8, "half": 2, "bfloat16": 2, "mixed-fp16": 2, "mixed-bf16": 2}.get(precision, 4)


def _param_bytes(work: StepWork) -> int:
    parameters = work.parameters
    return round(sum(layer.parameter_bytes for layer in work.layers) / parameters) if parameters else FLOAT_BYTES


def _ring_factor(collective: str, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks if collective == "all_reduce" else ranks - 1


def _with_memory(prediction: Prediction, network, precision: str, profile: DeviceProfile,
                 device_memory: int | None) -> Prediction:
    """The plan's peak per device from the memory estimator, whether it fits, and the largest batch."""
    if not prediction.admitted:
        return prediction
    plan, device = prediction.plan, profile.kind
    options = _estimate_options(plan, prediction.workers)
    try:
        report = estimate(network, prediction.batch_per_rank, precision, device=device, **options)
    except ConfigError:  # a network or precision the estimator does not model for the plan
        return prediction
    kept = _kept_copy(plan, report, device)  # the same at any batch
    peak = math.ceil(report.needed_bytes(True) / (1 - _margin(plan))) + kept
    if device_memory is None:
        return replace(prediction, peak_bytes=peak)
    # the largest batch as ``dl4py memory`` finds it, less what the plan counts besides the estimate
    largest = max_batch_size(network, device_memory - kept, precision, device=device, margin=_margin(plan), **options)
    return replace(prediction, peak_bytes=peak, fits=peak <= device_memory, largest_batch=largest)


def _estimate_options(plan: str, workers: int) -> dict:
    """The memory estimator's options for one device of ``plan``, each with ``as_measured``: a
    gradient's parts where its tensor forks (a split layer's blocks, a graph's shared input)
    added out of place, which is what LiveTensorBytes sees and never less than autograd's
    in-place adding of a plain step (the sharded MLP at batch 2048: 286 MB against 262), so
    that a "fits" holds either way."""
    if plan in ("sharded", "tensor", "hybrid"):
        return {"parallelism": plan, "workers": workers, "as_measured": True}
    if plan in DATA_SYNC:  # a worker's replica and the flat buffer its exchange makes
        return {"parallelism": ParallelPlan("data", sync=DATA_SYNC[plan]), "workers": workers, "as_measured": True}
    return {"as_measured": True}


def _margin(plan: str) -> float:
    """The fraction of a device a plan's estimate leaves free: the tensor and hybrid estimates'
    tolerance (``memory.tensor``); the others are exact on a CPU."""
    return TENSOR_TOLERANCE if plan in ("tensor", "hybrid") else 0.0


def _kept_copy(plan: str, report, device: str) -> int:
    """A sharded CPU rank's reduce-scatter input, which gloo's thread now and then holds past
    the estimated peak (a race with the step; docs/memory.md): one gathered unit at most. A
    plan's "fits" counts it, so that it holds whichever way the race goes."""
    return report.gathered_unit_bytes if plan == "sharded" and device == "cpu" else 0


__all__ = ["PLAN_NAMES", "Prediction", "predict"]
