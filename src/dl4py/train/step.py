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

import logging
import weakref
from typing import Callable

import torch

from dl4py.backend.cuda_environment import environment
from dl4py.errors import BackendError
from dl4py.nn.cpu_precision import slow_dtype
from dl4py.train.accumulate import AccumulatingStep
from dl4py.train.gradient_normalization import gradient_normalizer

log = logging.getLogger("dl4py")

# (compile, cuda_graphs) -> torch.compile mode. CUDA graphs come from Inductor's
# cudagraph trees, which its "reduce-overhead" and "max-autotune" modes switch on.
_COMPILE_MODES = {
    ("default", False): "default",
    ("default", True): "reduce-overhead",
    ("off", True): "reduce-overhead",
    ("max-autotune", False): "max-autotune-no-cudagraphs",
    ("max-autotune", True): "max-autotune",
}


_said_eager: set = set()  # (mode, precision) pairs already told they run eager

# model -> (settings, its torch.compile'd module): compiled once per model and settings.
_compiled: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def forward_function(model):
    """The module, or its torch.compile'd form when the environment asks for kernel fusion
    (``compile``; under ``auto``, where the fit chose it: ``compile_choice.py``) or CUDA graphs
    (``cuda_graphs``)."""
    env = environment()
    key = (_compile_mode(env.compile, model), bool(env.cuda_graphs))
    if key == ("off", False) or _eager_for_precision(key[0], model):
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


def _eager_for_precision(mode: str, model) -> bool:
    """Whether a compile asked for runs eager instead: a 16-bit policy on a CPU without native
    kernels for it. Compiled, its convolutions lose dl4py's float32 path (nn/convolution.py
    keeps PyTorch's own kernel in a traced graph), the generic 16-bit one that is 5-15x slower:
    mixed-bf16 compiled was measured at 0.16x float there. Said once per process."""
    slow = None if mode == "off" else slow_dtype(model.precision, model.backend.device)
    if slow is not None and (mode, str(model.precision)) not in _said_eager:
        _said_eager.add((mode, str(model.precision)))
        log.warning("dl4py: compile: %s runs eager for precision '%s': this CPU has no native %s kernels, "
                    "and compiled it ran slower still; use precision 'float' to compile", mode,
                    model.precision, str(slow).removeprefix("torch."))
    return slow is not None


def _compile_mode(setting: str, model) -> str:
    """``auto`` resolved by the model's last fit (eager where none chose: a parallel rank,
    a step made outside fit); the other settings as they are."""
    if setting != "auto":
        return setting
    choice = model.compile_choice
    return "default" if choice is not None and choice.on and choice.setting == "auto" else "off"


def make_train_step(model, gradient_hook=None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Return ``step(features, labels) -> loss`` (detached) for an initialised model.

    ``gradient_hook(took_part)`` runs between backward and the update (the parallel trainer
    shares gradients there); ``step(None, None)`` is then a step without a batch of this
    worker's, which applies the shared update. The step is an ``AccumulatingStep``: it
    updates on every ``model.accumulate_batches``-th call (every call by default).
    ``step(features, labels, observe)`` also hands the batch's outputs (as the module gave
    them, computed before the update) and labels to ``observe``: training metrics come from
    the forward pass the step ran anyway (``train/training_accuracy.py``).
    """
    module, optimizer, loss_fn, precision = forward_function(model), model.optimizer, model.loss, model.precision_state
    scheduled = model.learning_rate_at(0, 0) is not None
    normalizer = gradient_normalizer(model)
    if precision.plain and normalizer is None and not scheduled and gradient_hook is None \
            and model.accumulate_batches == 1:
        return _plain_step(model, module, optimizer, loss_fn)

    def backward(features, labels, weight=None, observe=None):
        with precision.forward_context():
            outputs = module(features)
        loss = loss_fn(precision.for_loss(outputs), labels)  # outside autocast, as the policy's own
        if observe is not None:
            observe(outputs, labels)
        del outputs  # as in _plain_step: held through backward, the outputs would raise its peak
        precision.backward(loss if weight is None else loss * weight)
        return loss.detach()

    def update(took_part):
        if gradient_hook is not None:
            gradient_hook(took_part)  # shared first: the norms are those of the averaged gradient
        if normalizer is not None:
            precision.unscale(optimizer)  # thresholds are for true gradients
            normalizer.normalize()
        if scheduled:  # from the updates applied: a skipped one does not advance the schedule
            for group in optimizer.param_groups:
                group["lr"] = model.learning_rate_at(model.update_count, model.epoch_count)
        if precision.step(optimizer):
            model.training_state.count_update()

    return AccumulatingStep(model.accumulate_batches, backward, update, lambda: optimizer.zero_grad(set_to_none=True),
                            lambda: [p.grad for group in optimizer.param_groups for p in group["params"]])


def _plain_step(model, module, optimizer, loss_fn):
    """The common case, with no call it does not need: no precision extras, no hook, no
    schedule, no accumulation."""

    def step(features, labels, observe=None):
        optimizer.zero_grad(set_to_none=True)
        outputs = module(features)
        loss = loss_fn(outputs, labels)
        if observe is not None:
            observe(outputs, labels)
        # The graph keeps what backward needs; a name here would hold the outputs through
        # backward, where the step's memory peaks (what memory/ estimates, to the byte on a CPU).
        del outputs
        loss.backward()
        optimizer.step()
        model.training_state.count_update()
        return loss.detach()

    return step
