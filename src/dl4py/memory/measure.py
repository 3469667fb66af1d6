"""Measure the bytes of tensors alive during a training step, on any device.

``torch.cuda.max_memory_allocated`` answers this on a GPU only. ``LiveTensorBytes`` is a
``TorchDispatchMode`` that sees every tensor an operator returns (forward, backward and
the optimizer's update alike) and follows each storage until it is freed, so the same
peak can be read on a CPU. A storage's Python object lives exactly as long as the storage
itself (PyTorch keeps the two together), so a weak reference to it reports the free.
Tensors that exist before the mode starts (parameters, optimizer state, the batch) are
registered with ``track``.

Sharded training (FSDP2) needs two more things, which ``measure_training_step`` switches
on when the model's parameters are DTensors: a DTensor counts by its local shard (what
the rank holds), and storages are re-read after each operator (``follow_resizes``),
because FSDP2 gathers a unit's parameters into storages it grows and frees with
``UntypedStorage.resize_``, which no operator reports.

On a GPU, ``cuda_allocated_besides`` tells the step's own tensors from what the allocator
also holds (cuBLAS' workspaces), so ``torch.cuda.max_memory_allocated`` can be compared
with the estimate on the same terms.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dl4py.train.step import make_train_step



def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a rank's shard of a distributed parameter). One can
    exist only once ``torch.distributed.tensor`` is loaded, which costs about a second: it is
    asked only then, so a single-device run never loads it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


class LiveTensorBytes(TorchDispatchMode):
    """Counts live storage bytes; ``peak`` is the most seen at once, ``peak_op`` where."""

    def __init__(self, follow_resizes: bool = False):
        super().__init__()
        self._live: dict[int, int] = {}  # id(storage) -> bytes
        self._storages: dict[int, weakref.ref] = {}  # id(storage) -> the storage, when following resizes
        self.follow_resizes = follow_resizes
        self.current = 0
        self.peak = 0
        self.peak_op = "start"

    def track(self, *tensors) -> None:
        for tensor in tree_flatten(tensors)[0]:
            if isinstance(tensor, torch.Tensor):
                self._see(tensor)
        self._update_peak("start")

    def _see(self, tensor: torch.Tensor) -> None:
        if is_dtensor(tensor):  # a rank holds its shard, not the whole
            tensor = tensor._local_tensor
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key, size = id(storage), storage.nbytes()
        if key not in self._live:
            weakref.finalize(storage, self._free, key)
            self._live[key] = 0
            if self.follow_resizes:
                self._storages[key] = weakref.ref(storage)
        # A storage can grow in place (resize_ for an out= result): count its size now.
        self.current += size - self._live[key]
        self._live[key] = size

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)
        self._storages.pop(key, None)

    def _resync(self) -> None:
        """Read again the size of each live storage: one resized outside any operator
        (FSDP2's ``alloc_storage``/``free_storage``) counts at its size now."""
        for key, ref in list(self._storages.items()):
            storage = ref()
            if storage is not None and key in self._live:
                size = storage.nbytes()
                self.current += size - self._live[key]
                self._live[key] = size

    def _update_peak(self, where: str) -> None:
        if self.follow_resizes:
            self._resync()
        if self.current > self.peak:
            self.peak, self.peak_op = self.current, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._see(tensor)
        self._update_peak(str(func))
        return out


@dataclass(frozen=True)
class MeasuredStep:
    peak_bytes: int  # tensors alive at the step's peak
    peak_op: str  # the operator after which the peak was reached
    resident_bytes: int  # alive before the step: parameters, optimizer state, batch, gradients


def measure_training_step(model, features: torch.Tensor, labels: torch.Tensor, warmup: int = 1,
                          mask: torch.Tensor | None = None) -> MeasuredStep:
    """Peak live tensor bytes of one training step of an initialised dl4py model.

    ``warmup`` steps run first, so the updater's state exists as it does in steady
    training (its first step creates it); two examples are enough for that. ``mask``
    (``[batch, time]``) is a padded sequence batch's, as SequenceDataSetIterator gives it;
    it counts with the batch.

    Inside a rank of sharded training (a model ``shard_replica`` converted) it measures
    that rank: its shards, its batch and what it gathers (``follow_resizes``). Every rank
    must call it, as every rank takes part in each step's collectives.
    """
    model.init()
    model.module.train()  # a training step's tensors (dropout masks), whatever mode output() left it in
    step = make_train_step(model)
    features = model.precision.convert_input(features.to(model.device))
    labels = labels.to(model.device)
    if mask is not None:
        mask = mask.to(model.device)
    for _ in range(warmup):
        if mask is not None:
            model.set_mask(mask[:2])
        step(features[:2], labels[:2])
    if mask is not None:
        model.set_mask(mask)
    sharded = any(is_dtensor(p) for p in model.module.parameters())
    tracker = LiveTensorBytes(follow_resizes=sharded)
    resident = resident_tensors(model) + [features, labels] + ([] if mask is None else [mask])
    tracker.track(resident)
    resident_bytes = tracker.current
    del resident
    try:
        with tracker:
            step(features, labels)
    finally:
        if mask is not None:
            model.set_mask(None)
    return MeasuredStep(tracker.peak, tracker.peak_op, resident_bytes)


def resident_tensors(model) -> list[torch.Tensor]:
    """What a model keeps between steps: parameters, buffers, gradients, masters, updater state."""
    tensors = list(model.module.parameters()) + list(model.module.buffers())
    tensors += [p.grad for p in model.module.parameters() if p.grad is not None]
    if model.precision_state.keeps_masters:
        tensors += list(model.stepped_module.parameters())
        tensors += [p.grad for p in model.stepped_module.parameters() if p.grad is not None]
    for state in model.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def cuda_allocated_besides(tensors, device: torch.device | str | None = None) -> int:
    """Bytes the CUDA caching allocator holds on ``device`` for anything but ``tensors``'
    storages: cuBLAS' cached workspaces, for one. It is memory_allocated less the blocks
    that hold ``tensors``, found by address in the allocator's snapshot: a block can be
    larger than its tensor (docs/memory.md), so subtracting tensor sizes would not do."""
    index = torch.device(device or "cuda").index
    index = torch.cuda.current_device() if index is None else index
    starts = {tensor.untyped_storage().data_ptr() for tensor in tensors}
    segments = [s for s in torch.cuda.memory_snapshot() if s.get("device", index) == index]
    held = sum(block["size"] for segment in segments for block in segment["blocks"]
               if block["state"] == "active_allocated" and block["address"] in starts)
    return torch.cuda.memory_allocated(index) - held
