"""The training step: one minibatch forward, backward and update.

Every trainer runs this same function (the single-device loop now, each parallel worker
later), so a model trains identically whichever runs it. The precision policy decides
the extras: autocast, loss scaling, float32 master weights; gradient normalization (DL4J's
GradientNormalization, on unscaled gradients); a scheduled learning rate is
set from the count of applied updates, which an update skipped for an fp16 overflow does
not advance. With ``model.accumulate_batches`` > 1 the batches' gradients are summed and
the update runs once per window of that many batches (``train/accumulate.py``).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from dl4py.train.accumulate import AccumulatingStep
from dl4py.train.gradient_normalization import gradient_normalizer

_LOW = (torch.float16, torch.bfloat16)

# (compile, cuda_graphs) -> torch.compile mode. CUDA graphs come from Inductor's
# cudagraph trees, which its "reduce-overhead" and "max-autotune" modes switch on.
_COMPILE_MODES = {
    ("default", False): "default",
    ("default", True): "reduce-overhead",
    ("off", True): "reduce-overhead",
    ("max-autotune", False): "max-autotune-no-cudagraphs",
    ("max-autotune", True): "max-autotune",
}


# model -> (settings, its torch.compile'd module): compiled once per model and settings.
_compiled: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def forward_function(model):
    """The module, or its torch.compile'd form when the environment asks for kernel fusion
    (``compile``) or CUDA graphs (``cuda_graphs``)."""
    from dl4py.backend.cuda_environment import environment
    from dl4py.errors import BackendError

    env = environment()
    key = (env.compile, bool(env.cuda_graphs))
    if key == ("off", False):
        return model.module
    if key[1] and model.backend.device.type != "cuda":
        raise BackendError(
            f"environment setting cuda_graphs needs the GPU backend, but this model runs on "
            f"{model.backend.device}; turn cuda_graphs off"
        )
    kept = _compiled.get(model)
    if kept is None or kept[0] != key or kept[2] is not model.module:
        kept = _compiled[model] = (key, torch.compile(model.module, mode=_COMPILE_MODES[key]), model.module)
    return kept[1]


def make_train_step(model, gradient_hook=None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Return ``step(features, labels) -> loss`` (detached) for an initialised model.

    ``gradient_hook(took_part)`` runs between backward and the update (the parallel
    trainer shares gradients there). With a hook, ``step(None, None)`` is a step without
    a batch: this worker contributes nothing but applies the shared update, so replicas
    stay identical when the last round has fewer batches than workers. With
    ``model.accumulate_batches`` = k > 1 the step is an ``AccumulatingStep``: it updates
    on every k-th call, and ``flush()`` applies a window cut short.
    """
    module, optimizer, loss_fn = forward_function(model), model.optimizer, model.loss
    precision, device = model.precision, model.backend.device
    master, scaler = model.master, model.scaler
    scheduled = model.learning_rate_at(0, 0) is not None
    normalizer = gradient_normalizer(model)
    batches = getattr(model, "accumulate_batches", 1)  # absent from models pickled before it existed
    plain = master is None and scaler is None and precision.autocast_dtype is None and normalizer is None

    if plain and not scheduled and gradient_hook is None and batches == 1:

        def step(features, labels):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(module(features), labels)
            loss.backward()
            optimizer.step()
            model.update_count += 1
            return loss.detach()

        return step

    def backward(features, labels, weight=None):
        """Forward and backward of one batch; its gradient (times ``weight``, a share of an
        accumulation window) is added to the stepped parameters' ``.grad``."""
        with precision.forward_context(device):
            outputs = module(features)
        if outputs.dtype in _LOW:  # the loss and its reduction in float32
            outputs = outputs.float()
        loss = loss_fn(outputs, labels)
        weighted = loss if weight is None else loss * weight
        (weighted if scaler is None else scaler.scale(weighted)).backward()
        if master is not None:
            master.grads_to_master()
        return loss.detach()

    def update(took_part):
        """The update from the gradients held: shared, unscaled, normalized, stepped."""
        if gradient_hook is not None:
            gradient_hook(took_part)  # shared first: the norms are those of the averaged gradient
        if normalizer is not None:
            if scaler is not None:  # thresholds are for true gradients; step() then skips its own unscale
                scaler.unscale_(optimizer)
            normalizer.normalize()
        if scheduled:
            lr = model.learning_rate_at(model.update_count, model.epoch_count)
            for group in optimizer.param_groups:
                group["lr"] = lr
        if scaler is None:
            optimizer.step()
            _applied(model, master)
        else:
            # GradScaler skips the update when a gradient overflowed and then lowers
            # its scale; a lower scale afterwards is how we know the step was skipped.
            # Compared on the device: get_scale() would wait for the GPU, twice a step.
            scale_before = scaler._get_scale_async().clone()
            scaler.step(optimizer)
            scaler.update()
            applied = scaler._get_scale_async() >= scale_before
            if scheduled:  # the next step's learning rate needs the count now: one wait
                if bool(applied):
                    _applied(model, master)
            else:
                if master is not None:  # a skipped step left the masters as they were: a no-op copy
                    master.master_to_module()
                model.count_updates_later(applied)

    def clear():
        optimizer.zero_grad(set_to_none=True)

    if batches > 1:
        def gradients():
            return [p.grad for group in optimizer.param_groups for p in group["params"]]

        return AccumulatingStep(batches, backward, update, clear, gradients)

    def full_step(features, labels):
        clear()
        took_part = features is not None
        loss = backward(features, labels) if took_part else None
        update(took_part)
        return loss

    return full_step


def _applied(model, master) -> None:
    if master is not None:
        master.master_to_module()
    model.update_count += 1
