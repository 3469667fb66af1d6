"""A precision policy's mechanics for one module and its optimizer: ``Precision.bind``.

The policy (``precision.py``) is a name and the dtypes it implies; the state made here
for a built module holds what the policy needs while training and nothing else does:

- the float32 master weights of ``half`` and ``bfloat16``: the module that runs forward
  and backward holds 16-bit parameters, the optimizer steps a float32 copy of each, and
  after an update the copies are rounded back into the module, so that an update smaller
  than half the 16-bit spacing of a weight accumulates in the master instead of vanishing
  (4 extra bytes per parameter);
- the loss scaler of ``half`` and ``mixed-fp16`` (torch's ``GradScaler``), and the count of
  the updates it skipped because a gradient overflowed.

Trainers call ``backward``, ``unscale`` (before anything reads true gradient values),
``step`` (True when the update was applied), and ``after_sync`` when the stepped
parameters were overwritten from outside (averaged, broadcast, loaded). Lightning
Fabric's ``Precision.backward`` / ``optimizer_step`` has the same shape.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from dl4py.errors import TrainingError

_LOW = (torch.float16, torch.bfloat16)

# Steps in a row whose update the scaler skipped before training stops: each skip halves the
# scale, so 50 take it from 2**16 to 2**-34, where no finite gradient overflows any more; a
# run still skipping there has a loss or gradient that is infinite whatever the scale.
DEFAULT_MAX_SKIPPED_STEPS = 50


class MasterWeights:
    """A 16-bit running copy of a float32 module whose parameters the optimizer steps."""

    def __init__(self, master_module: nn.Module, dtype: torch.dtype):
        self.master_module = master_module  # float32; the optimizer holds its parameters
        self.module = copy.deepcopy(master_module).to(dtype)
        self._low = list(self.module.parameters())
        self._high = list(master_module.parameters())

    def grads_to_master(self) -> None:
        """Move the 16-bit gradients of a backward into the float32 masters, adding them to
        what the masters hold: an accumulation window (``train/accumulate.py``) sums its
        batches in float32, not in 16 bits. The step clears the masters' gradients when an
        update's window begins, so one backward per update copies them."""
        for low, high in zip(self._low, self._high):
            if low.grad is None:
                continue
            if high.grad is None:
                high.grad = low.grad.to(torch.float32)
            else:
                high.grad.add_(low.grad)  # promoted to float32 as it is added
            low.grad = None

    @torch.no_grad()
    def master_to_module(self) -> None:
        torch._foreach_copy_(self._low, self._high)


class PrecisionState:
    """Masters and loss scaler of one model (see the module's docstring). ``module`` is what
    runs forward and backward, ``stepped_module`` what the optimizer steps (the same module
    unless masters are kept)."""

    def __init__(self, policy, module: nn.Module, device: torch.device,
                 max_skipped_steps: int = DEFAULT_MAX_SKIPPED_STEPS, masters: bool | None = None):
        self.policy, self.device = policy, device
        masters = policy.master_weights if masters is None else masters  # False: FSDP keeps them (for_sharded)
        self._masters = MasterWeights(module, policy.param_dtype) if masters else None
        self.module = module if self._masters is None else self._masters.module
        self.stepped_module = module
        self._scaler = torch.amp.GradScaler(device.type) if policy.uses_loss_scaling else None
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps = 0  # updates the scaler skipped, in all
        self.skipped_in_a_row = 0
        self._stepped = False
        self._hooked = weakref.WeakSet()  # optimizers whose steps _on_optimizer_step sees

    @property
    def keeps_masters(self) -> bool:
        return self._masters is not None

    @property
    def scales_loss(self) -> bool:
        return self._scaler is not None

    @property
    def plain(self) -> bool:
        """Nothing to add to a plain step: no masters, no scaling, no autocast."""
        return self._masters is None and self._scaler is None and self.policy.autocast_dtype is None

    # ---- the step ----------------------------------------------------------------------
    def forward_context(self):
        return self.policy.forward_context(self.device)

    @staticmethod
    def for_loss(outputs: torch.Tensor) -> torch.Tensor:
        """Outputs as the loss takes them: its reduction in float32, not in 16 bits."""
        return outputs.float() if outputs.dtype in _LOW else outputs

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled where the policy scales), its gradients added to the
        stepped parameters' ``.grad``."""
        (loss if self._scaler is None else self._scaler.scale(loss)).backward()
        if self._masters is not None:
            self._masters.grads_to_master()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """True gradient values in ``.grad`` before an update (gradient normalization's
        thresholds are for them); ``step`` then skips its own unscale."""
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer``'s update; False when the scaler skipped it for an overflow. Training
        stops with a TrainingError after ``max_skipped_steps`` skips in a row."""
        if self._scaler is None:
            optimizer.step()
            self.after_sync()
            return True
        # Without a fused kernel GradScaler calls optimizer.step() only when no gradient
        # overflowed (it has waited for the device to know that): a hook on the step counts
        # the applied updates without another read. A fused kernel is always called and
        # skips inside; there the scale tells (halved after a skip).
        fused = any(group.get("fused") for group in optimizer.param_groups)
        if not fused and optimizer not in self._hooked:
            optimizer.register_step_post_hook(self._on_optimizer_step)
            self._hooked.add(optimizer)
        scale_before = self._scaler.get_scale() if fused else None
        self._stepped = False
        self._scaler.step(optimizer)
        self._scaler.update()
        applied = self._stepped if scale_before is None else self._scaler.get_scale() >= scale_before
        if not applied:
            self._skipped()
            return False  # the masters are as they were: the module needs no copy
        self.skipped_in_a_row = 0
        self.after_sync()
        return True

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._stepped = True

    def _skipped(self) -> None:
        self.skipped_steps += 1
        self.skipped_in_a_row += 1
        if self.max_skipped_steps and self.skipped_in_a_row >= self.max_skipped_steps:
            raise TrainingError(
                f"{self.skipped_in_a_row} updates in a row were skipped because the gradients overflowed "
                f"{self.policy.name}'s 16 bits even at loss scale {self._scaler.get_scale():g} (precision "
                f"'{self.policy}'): the loss or a gradient is infinite; lower the learning rate, check the "
                "data for huge values, or use 'mixed-bf16' or 'float'"
            )

    @torch.no_grad()
    def after_sync(self) -> None:
        """The stepped parameters changed (an update, an average, a load): the 16-bit running
        copy takes them. Nothing to do without masters."""
        if self._masters is not None:
            self._masters.master_to_module()

    # ---- for distributed plans ---------------------------------------------------------------
    def fsdp_policy(self):
        """FSDP2's mixed precision for this policy: units gathered in 16 bits from float32
        master shards, gradients reduced in float32; None where parameters keep their dtype."""
        if self._masters is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy  # optional: torch.distributed may be absent

        return MixedPrecisionPolicy(param_dtype=self.policy.param_dtype, reduce_dtype=torch.float32)

    def for_sharded(self, module: nn.Module) -> "PrecisionState":
        """The state of the same model once FSDP runs ``module`` (the masters, sharded): FSDP
        casts each gathered unit itself, so no master copy is kept; the loss scale goes on."""
        state = PrecisionState(self.policy, module, self.device, self.max_skipped_steps, masters=False)
        if self._scaler is not None:
            state._scaler.load_state_dict(self._scaler.state_dict())
        state.skipped_steps, state.skipped_in_a_row = self.skipped_steps, self.skipped_in_a_row
        return state

    # ---- the loss scale ----------------------------------------------------------------
    @property
    def loss_scale(self) -> float | None:
        """The scaler's current scale (a read of the device); None without loss scaling."""
        return None if self._scaler is None else self._scaler.get_scale()

    def set_loss_scale(self, scale: float, growth_tracker: int = 0, **settings) -> None:
        """Start the scaler at ``scale`` (and ``growth_interval=...`` etc. where given)."""
        state = {**self._scaler.state_dict(), "scale": float(scale), "_growth_tracker": int(growth_tracker)}
        self._scaler.load_state_dict({**state, **settings})

    def state_dict(self) -> dict | None:
        """The loss scaler's state (what a model file keeps); None without loss scaling."""
        return None if self._scaler is None else self._scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._scaler is not None:
            self._scaler.load_state_dict(state)

    def named_master_parameters(self) -> dict[str, torch.Tensor]:
        return {} if self._masters is None else dict(self.stepped_module.named_parameters())

