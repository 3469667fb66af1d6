"""The part of ``StatsListener`` that reads the live model: the "stats" records.

Every ``frequency`` iterations it records the score, the learning rate, samples/s since
its last record, the process's and the device's memory, and per layer the mean absolute
parameter, gradient, update and activation, and the update:parameter ratio. Every
``histogram_every``-th record (the iterations passing multiples of ``frequency *
histogram_every``) also carries ``histograms``: per layer, the histogram of its parameters,
gradients and updates in ``HISTOGRAM_BINS`` equal bins between their smallest and largest
value (DL4J's StatsListener collects the same; a layer holding a NaN or infinity has none).

Cheap by construction: on a step it does not record it only counts. On the step before a
recorded one it copies the parameters on the device (the update is the difference after
the recorded step) and hooks the layers' forward; on the recorded step it computes every
number on the device and reads them all with one ``tolist()``, then unhooks. The
gradients are those the step left in ``.grad`` (the next step clears them first). The
histograms are binned on the device too, by ``index_put_(accumulate=True)`` rather than
``torch.histc``, whose range must be Python numbers (a read of the device per tensor), and
in pieces of ``_CHUNK`` elements, so a large layer costs a few tens of MB of temporaries.

Under ``torch.compile`` (environment settings ``compile``, ``cuda_graphs``) forward hooks
would be left out of the compiled graph or force a recompile at each recorded step, so a
compiled model's records have no activations (null); everything else is recorded.

In one process the listener runs it on the model; in a spawned parallel fit worker 0 runs
it on its replica and relays the records (``StatsListener.worker_part``). It is picklable
until a fit starts with it.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

from dl4py.monitor.layers import model_layers
from dl4py.train.history import current_learning_rate
from dl4py.train.listeners import TrainingListener, _Count, _passes
from dl4py.train.step import forward_function


HISTOGRAM_BINS = 20  # as DL4J's StatsListener
_CHUNK = 1 << 22  # elements binned at a time


class StatsCollector(TrainingListener):
    def __init__(self, frequency: int, histogram_every: int = 0):
        self.frequency = frequency
        self.histogram_every = histogram_every
        self._reset()

    def _reset(self) -> None:
        self.pending: list[dict] = []  # records made and not yet taken (``drain``)
        self._count = _Count()
        self._layers = []
        self._parameters: list[torch.Tensor] = []  # every layer's, in order
        self._hookable = False
        self._before: list[torch.Tensor] | None = None  # the parameters before the step to record
        self._hooks: list = []
        self._activations: dict[str, torch.Tensor] = {}
        self._jump = 1  # iterations per call: 1, or the workers of a parallel fit
        self._samples, self._since = 0, time.perf_counter()

    def __getstate__(self):
        # it travels before its fit: the state is made there
        return {"frequency": self.frequency, "histogram_every": self.histogram_every}

    def __setstate__(self, state):
        self.frequency, self.histogram_every = state["frequency"], state["histogram_every"]
        self._reset()

    def drain(self) -> list[dict]:
        """The records made since the last call."""
        records, self.pending = self.pending, []
        return records

    # ---- listener events ---------------------------------------------------------------
    def on_fit_start(self, model):
        self._release()
        self._layers = model_layers(model)
        self._parameters = [p for layer in self._layers for p in layer.parameters]
        self._hookable = not _compiled(model)

    def on_epoch_start(self, model, epoch):
        self._count.start(model)
        self._samples, self._since = 0, time.perf_counter()
        if self.frequency and _passes(model.iteration_count, model.iteration_count + self._jump, self.frequency):
            self._prepare()  # the epoch's first step is recorded

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if not self.frequency:
            return
        last = self._count.advance(iteration)
        self._jump = iteration - last
        self._samples += batch_size
        if _passes(last, iteration, self.frequency):
            histograms = bool(self.histogram_every) and _passes(last, iteration, self.frequency * self.histogram_every)
            self.pending.append(self._record(model, iteration, epoch, loss, histograms))
        if _passes(iteration, iteration + self._jump, self.frequency):
            self._prepare()  # the next step is recorded: its update needs the parameters now

    def on_fit_end(self, model, interrupted):
        self._release()

    # ---- the work ----------------------------------------------------------------------
    def _prepare(self) -> None:
        with torch.no_grad():
            self._before = [p.detach().clone() for p in self._parameters]
        if self._hookable and not self._hooks:
            self._hooks = [layer.module.register_forward_hook(self._hook(layer.name)) for layer in self._layers]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if not (module.training and torch.is_grad_enabled()):
                return  # validation, evaluation: not the training step's activations
            tensor = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
                self._activations[name] = _abs_sum(tensor.detach()) / tensor.numel()
        return hook

    def _release(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._before, self._activations = [], None, {}

    @torch.no_grad()
    def _record(self, model, iteration: int, epoch: int, loss, histograms: bool = False) -> dict:
        reads = _Reads()
        loss_at = reads.add(torch.as_tensor(loss, device=model.backend.device).detach())
        before = iter(self._before) if self._before is not None and len(self._before) == len(self._parameters) else None
        slots, binned = {}, {}
        for layer in self._layers:
            sums = {"parameters": [], "gradients": [], "updates": []}
            tensors = {"parameters": layer.parameters, "gradients": [], "updates": []}  # for the histograms
            for p in layer.parameters:
                sums["parameters"].append(reads.add(_abs_sum(p)))
                if p.grad is not None:
                    sums["gradients"].append(reads.add(_abs_sum(p.grad)))
                    tensors["gradients"].append(p.grad)
                if before is not None:
                    update = p - next(before)
                    sums["updates"].append(reads.add(_abs_sum(update)))
                    if histograms:
                        tensors["updates"].append(update)
            if histograms:
                tensors["gradients"] = tensors["gradients"] if len(tensors["gradients"]) == len(layer.parameters) else []
                # binned layer by layer: the updates of one layer at a time stay in memory
                binned[layer.name] = {kind: reads.add(histogram) for kind, kept in tensors.items()
                                      if (histogram := _histogram(kept)) is not None}
            activation = self._activations.get(layer.name)
            slots[layer.name] = (sums, None if activation is None else reads.add(activation), layer.size)
        numbers = reads.read()  # the one read from the device
        now = time.perf_counter()
        layers = {}
        for name, (sums, activation, size) in slots.items():
            means = {key: (sum(numbers[i] for i in at) / size if at and size else None) for key, at in sums.items()}
            if means["gradients"] is not None and len(sums["gradients"]) < len(sums["parameters"]):
                means["gradients"] = None  # some parameters had no gradient: no layer mean to give
            ratio = (means["updates"] / means["parameters"]
                     if means["updates"] is not None and means["parameters"] else None)
            layers[name] = {**means, "update_ratio": ratio,
                            "activations": None if activation is None else numbers[activation]}
        elapsed = now - self._since
        record = {
            "kind": "stats", "iteration": iteration, "epoch": epoch, "score": numbers[loss_at],
            "learning_rate": current_learning_rate(model),
            "samples_per_second": self._samples / elapsed if elapsed > 0 and self._samples else None,
            "memory": memory_record(model.backend.device),
            "layers": layers,
        }
        if histograms:
            record["histograms"] = {name: kinds for name, at in binned.items() if (kinds := {
                kind: histogram for kind, i in at.items() if (histogram := histogram_record(numbers, i)) is not None})}
        self._release()
        self._samples, self._since = 0, now
        return record


class _Reads:
    """Numbers made on the device, read back together with one ``tolist()``. In float64, so a
    histogram bin counts exactly up to 2**53 (float32 stops at 2**24 elements)."""

    def __init__(self):
        self._parts: list[torch.Tensor] = []
        self._size = 0

    def add(self, tensor: torch.Tensor) -> int:
        """Where ``tensor``'s numbers (flattened) will start in ``read()``'s list."""
        part = tensor.reshape(-1).to(torch.float64)
        self._parts.append(part)
        self._size += part.numel()
        return self._size - part.numel()

    def read(self) -> list[float]:
        return torch.cat(self._parts).tolist() if self._parts else []


def _histogram(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``[min, max, sum, sum of squares, count of each of HISTOGRAM_BINS bins]`` of ``tensors``
    together, on their device (None: no elements). Equal bins from the smallest to the largest
    value; a bin holds its left edge, the last one both edges; all values equal: every one in
    the first bin. A NaN or infinity makes min or max non-finite: ``histogram_record`` then
    leaves the histogram out, and the counts are never read."""
    chunks = [x for t in tensors if t.numel() for x in t.detach().reshape(-1).split(_CHUNK)]
    if not chunks:
        return None
    dtype = torch.promote_types(chunks[0].dtype, torch.float32)  # 16-bit values binned and summed wider
    lows, highs, sums, squares = [], [], [], []
    for x in chunks:
        low, high = torch.aminmax(x)
        lows.append(low)
        highs.append(high)
        sums.append(x.sum(dtype=dtype))
        squares.append(torch.linalg.vector_norm(x, 2, dtype=dtype).square())
    low, high = torch.stack(lows).amin().to(dtype), torch.stack(highs).amax().to(dtype)
    width = high - low
    scale = torch.where(width > 0, HISTOGRAM_BINS / width, 0)  # stays on the device: no branch on its value
    counts = torch.zeros(HISTOGRAM_BINS, dtype=dtype, device=chunks[0].device)
    one = torch.ones((), dtype=dtype, device=chunks[0].device)
    for x in chunks:
        bins = ((x.to(dtype) - low) * scale).long().clamp_(0, HISTOGRAM_BINS - 1)
        counts.index_put_((bins,), one, accumulate=True)
    return torch.cat([torch.stack([low, high, torch.stack(sums).sum(), torch.stack(squares).sum()]), counts])


def histogram_record(numbers: list[float], at: int) -> dict | None:
    """The JSON form of a ``_histogram`` read back at ``numbers[at:]``: ``min``, ``max``,
    ``counts`` (whole numbers, one per bin, summing to the number of elements), ``sum`` and
    ``sum_squares``. None when some element was not finite (a diverged layer: its NaN shows
    in the scalars)."""
    low, high, total, squares = numbers[at:at + 4]
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    counts = [int(count) for count in numbers[at + 4:at + 4 + HISTOGRAM_BINS]]
    return {"min": low, "max": high, "counts": counts, "sum": total, "sum_squares": squares}


def _abs_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of absolute values, accumulated in float32 or wider: 16-bit tensors are widened so
    the sum does not overflow or round away, and a float64 one (``double``) stays float64
    because ``vector_norm`` refuses to narrow its input to the accumulation dtype."""
    return torch.linalg.vector_norm(tensor, 1, dtype=torch.promote_types(tensor.dtype, torch.float32))


def _compiled(model) -> bool:
    try:
        return forward_function(model) is not model.module
    except Exception:  # a setting the step itself refuses (cuda_graphs on a CPU): it says why
        return True


def memory_record(device: torch.device) -> dict:
    allocated = reserved = None
    if device.type == "cuda":
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    return {"process_rss_bytes": process_rss_bytes(), "device_allocated_bytes": allocated,
            "device_reserved_bytes": reserved}


def process_rss_bytes() -> int | None:
    """This process's resident memory now: psutil where installed, else /proc (Linux), else
    the peak resident size the OS reports (``resource``)."""
    try:
        import psutil  # optional: psutil (in no extra: /proc or resource answer without it)
    except ImportError:
        pass
    else:
        return psutil.Process().memory_info().rss
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource  # optional: resource (POSIX only)
    except ImportError:  # Windows without psutil
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
