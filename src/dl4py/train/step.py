"""The training step: one minibatch forward, backward and update.

Every trainer runs this same function (the single-device loop now, each parallel worker
later), so a model trains identically whichever runs it.
"""

from __future__ import annotations

from typing import Callable

import torch


def make_train_step(model) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Return ``step(features, labels) -> loss`` (detached) for an initialised model."""
    module, optimizer, loss_fn = model.module, model.optimizer, model.loss
    precision, device = model.precision, model.backend.device
    scaler = precision.make_scaler(device)

    if scaler is None and precision.autocast_dtype is None:

        def step(features, labels):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(module(features), labels)
            loss.backward()
            optimizer.step()
            return loss.detach()

        return step

    def mixed_step(features, labels):
        optimizer.zero_grad(set_to_none=True)
        with precision.forward_context(device):
            loss = loss_fn(module(features), labels)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    mixed_step.scaler = scaler
    return mixed_step
