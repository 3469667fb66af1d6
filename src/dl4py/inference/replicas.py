"""Copies of a model's network that answer requests, each on its own device.

A replica is a deep copy of the initialised module, in eval mode for good, in the model's
precision and memory format (the copy keeps both), moved to its device. It runs exactly
what ``Model.output`` runs: ``prepare_input`` (the model's normalizer, the precision's
input dtype), the module under the precision's forward context, ``activate``. Copies, not
the model's own module: ``fit`` may switch that to train mode or step it meanwhile.
"""

from __future__ import annotations

import copy
import threading

import torch

from dl4py.errors import ConfigError

# As Model.output: at most this many examples in one forward pass.
CHUNK = 4096


class Replica:
    """One copy of ``model``'s module on ``device``; ``lock`` makes it one forward at a time."""

    def __init__(self, model, module: torch.nn.Module, device: torch.device, index: int):
        self.model, self.module, self.device, self.index = model, module, device, index
        self.lock = threading.Lock()

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """Predictions for ``features`` ``[n, ...]``, on the model's device (where ``output``
        puts them), once this replica is free."""
        with self.lock:
            return self.run(features)

    def try_predict(self, features: torch.Tensor) -> torch.Tensor | None:
        """``predict``, if this replica is free at once; None when it is busy."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            return self.run(features)
        finally:
            self.lock.release()

    def run(self, features: torch.Tensor) -> torch.Tensor:
        """The forward pass itself (the caller holds ``lock``). No grad rather than inference
        mode: inference tensors cannot be changed in place later, which ``output``'s results can."""
        model, out_device = self.model, self.model.backend.device
        outputs = []
        with torch.no_grad():
            for start in range(0, features.shape[0], CHUNK):
                chunk = model.prepare_input(features[start:start + CHUNK].to(self.device))
                with model.precision.forward_context(self.device):
                    outputs.append(model.activate(self.module(chunk)).to(out_device))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def __repr__(self) -> str:
        return f"Replica({self.index}, {self.device})"


def replica_devices(model, workers, devices) -> list[torch.device]:
    """The device of each of ``workers`` replicas: ``devices`` in turn (several replicas per
    device when workers outnumber them); default the model's device."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError("workers", f"must be a whole number >= 1, got {workers!r}")
    if devices is None:
        chosen = [model.device]
    else:
        if isinstance(devices, (str, int, torch.device)):
            devices = [devices]
        chosen = []
        for device in devices:
            try:
                chosen.append(torch.device(f"cuda:{device}" if isinstance(device, int) else device))
            except (RuntimeError, TypeError) as error:
                raise ConfigError("devices", f"{device!r} is not a device ('cpu', 'cuda:0', ...): {error}") from None
        if not chosen:
            raise ConfigError("devices", "is empty: name at least one device, or leave it out for the model's")
    if workers < len(chosen):
        raise ConfigError("workers", f"{workers} is fewer than the {len(chosen)} devices given; each device "
                                     "needs at least one worker")
    return [chosen[i % len(chosen)] for i in range(workers)]


def make_replicas(model, placed: list[torch.device]) -> list[Replica]:
    """A replica of ``model`` (initialised first) on each device of ``placed`` (``replica_devices``)."""
    model.init()
    model.set_mask(None)  # the copies take the mask holder along: it must hold no batch's mask
    source = model.module
    was_training = source.training
    try:
        source.eval()
        replicas = []
        for index, device in enumerate(placed):
            module = copy.deepcopy(source).to(device=device)
            module.requires_grad_(False)
            replicas.append(Replica(model, module.eval(), device, index))
    finally:
        source.train(was_training)
    return replicas
