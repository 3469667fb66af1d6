"""The part of ``StatsListener`` that reads the live model: the "stats" records.

Every ``frequency`` iterations it records the score, the learning rate, samples/s since
its last record, the process's and the device's memory, and per layer the mean absolute
parameter, gradient, update and activation, and the update:parameter ratio.

Cheap by construction: on a step it does not record it only counts. On the step before a
recorded one it copies the parameters on the device (the update is the difference after
the recorded step) and hooks the layers' forward; on the recorded step it computes every
number on the device and reads them all with one ``tolist()``, then unhooks. The
gradients are those the step left in ``.grad`` (the next step clears them first).

Under ``torch.compile`` (environment settings ``compile``, ``cuda_graphs``) forward hooks
would be left out of the compiled graph or force a recompile at each recorded step, so a
compiled model's records have no activations (null); everything else is recorded.

In one process the listener runs it on the model; in a spawned parallel fit worker 0 runs
it on its replica and relays the records (``StatsListener.worker_part``). It is picklable
until a fit starts with it.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from dl4py.monitor.layers import model_layers
from dl4py.train.history import current_learning_rate
from dl4py.train.listeners import TrainingListener, _Count, _passes
from dl4py.train.step import forward_function


class StatsCollector(TrainingListener):
    def __init__(self, frequency: int):
        self.frequency = frequency
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
        return {"frequency": self.frequency}  # it travels before its fit: the state is made there

    def __setstate__(self, state):
        self.frequency = state["frequency"]
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
            self.pending.append(self._record(model, iteration, epoch, loss))
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
    def _record(self, model, iteration: int, epoch: int, loss) -> dict:
        values: list[torch.Tensor] = []  # every number, read at once at the end

        def slot(tensor) -> int:
            values.append(tensor.reshape(()).to(torch.float32))
            return len(values) - 1

        loss_at = slot(torch.as_tensor(loss, device=model.backend.device).detach())
        before = iter(self._before) if self._before is not None and len(self._before) == len(self._parameters) else None
        slots = {}
        for layer in self._layers:
            sums = {"parameters": [], "gradients": [], "updates": []}
            for p in layer.parameters:
                sums["parameters"].append(slot(_abs_sum(p)))
                if p.grad is not None:
                    sums["gradients"].append(slot(_abs_sum(p.grad)))
                if before is not None:
                    sums["updates"].append(slot(_abs_sum(p - next(before))))
            activation = self._activations.get(layer.name)
            slots[layer.name] = (sums, None if activation is None else slot(activation), layer.size)
        numbers = torch.stack(values).tolist() if values else []  # the one read from the device
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
        self._release()
        self._samples, self._since = 0, now
        return record


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
