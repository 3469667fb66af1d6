"""TorchModel: a plain ``torch.nn.Module`` with a loss and optimizer, trained like any dl4py model."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dl4py.backend import Backend, Precision
from dl4py.backend.cuda_environment import environment
from dl4py.errors import BackendError
from dl4py.nn.model import Model
from dl4py.nn.signature import Signature, torch_signature


class TorchModel(Model):
    """Bring your own PyTorch module::

        model = TorchModel(MyNet(), loss=torch.nn.CrossEntropyLoss(),
                           optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
        model.fit(iterator, epochs=2)

    ``optimizer`` is a factory taking the parameters (preferred: it is called after the
    module is moved to its device and precision) or an optimizer already built on them.
    ``output_activation`` turns module outputs into predictions in ``output()`` (e.g.
    ``torch.softmax``); ``evaluate`` takes the argmax of the raw outputs either way.
    """

    kind = "torch_module"

    def __init__(
        self,
        module: nn.Module,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: Callable[..., torch.optim.Optimizer] | torch.optim.Optimizer,
        output_activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
        backend: str | Backend | None = None,
        precision: str | Precision | None = None,
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"TorchModel needs a torch.nn.Module, got {type(module).__name__}")
        if not callable(loss):
            raise TypeError("TorchModel: loss must be callable as loss(outputs, labels)")
        super().__init__(backend, precision)
        self._module_in = module
        self._loss_fn = loss
        self._optimizer_in = optimizer
        self._output_activation = output_activation

    def _build(self, device: torch.device, dtype: torch.dtype):
        if environment().fused_optimizer == "on":
            raise BackendError(
                "environment setting fused_optimizer=on applies to the optimizers dl4py builds from "
                "an updater; a TorchModel's optimizer is yours: pass fused=True to it "
                "(torch.optim.SGD, Adam, AdamW) and set fused_optimizer to auto"
            )
        # Module.to() swaps parameter data in place, so an optimizer built on these
        # parameters before the move still refers to them.
        module = self._module_in.to(device=device, dtype=dtype)
        if isinstance(self._optimizer_in, torch.optim.Optimizer):
            optimizer = self._optimizer_in
        else:
            optimizer = self._optimizer_in(module.parameters())
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError("TorchModel: the optimizer factory must return a torch.optim.Optimizer")
        return module, optimizer

    def loss(self, outputs, labels):
        return self._loss_fn(outputs, labels)

    def activate(self, outputs):
        return outputs if self._output_activation is None else self._output_activation(outputs)

    def signature(self) -> Signature:
        """No declared input shape (serve takes ``input_shape=``) nor output width; a classifier
        unless ``loss`` is a regression loss (``nn.MSELoss``, ``F.l1_loss``, ...)."""
        return torch_signature(self._loss_fn)

    def summary(self) -> str:
        """The module as torch prints it (a TorchModel has no layer table)."""
        self.init()
        return str(self.module)
