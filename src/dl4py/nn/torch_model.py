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
    module is moved to its device and precision, and after a distributed plan converted
    it) or an optimizer already built on them. Such an instance has no factory: where a
    distributed plan replaced the parameters (``training_mode="sharded"``), the optimizer is
    made again from its class, defaults and groups, each group's parameters matched by name.
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
        self._optimizer_names = None  # an instance's groups by parameter name, as of the build
        self._output_activation = output_activation

    def _build_module(self, device: torch.device, dtype: torch.dtype):
        if environment().fused_optimizer == "on":
            raise BackendError(
                "environment setting fused_optimizer=on applies to the optimizers dl4py builds from "
                "an updater; a TorchModel's optimizer is yours: pass fused=True to it "
                "(torch.optim.SGD, Adam, AdamW) and set fused_optimizer to auto"
            )
        if isinstance(self._optimizer_in, torch.optim.Optimizer):  # named before a plan can replace them
            names = {id(p): name for name, p in self._module_in.named_parameters()}
            self._optimizer_names = [[names.get(id(p)) for p in group["params"]]
                                     for group in self._optimizer_in.param_groups]
        # Module.to() swaps parameter data in place, so an optimizer built on these
        # parameters before the move still refers to them.
        return self._module_in.to(device=device, dtype=dtype)

    def _make_optimizer(self, module, plain_name):
        given = self._optimizer_in
        if not isinstance(given, torch.optim.Optimizer):
            optimizer = given(module.parameters())
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError("TorchModel: the optimizer factory must return a torch.optim.Optimizer")
            return optimizer
        current = {id(p) for p in module.parameters()}
        replaced = any(name is not None and id(p) not in current
                       for group, names in zip(given.param_groups, self._optimizer_names)
                       for p, name in zip(group["params"], names))
        return _made_again(given, self._optimizer_names, module, plain_name) if replaced else given

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


def _made_again(optimizer: torch.optim.Optimizer, names: list[list[str | None]], module: nn.Module,
                plain_name) -> torch.optim.Optimizer:
    """``optimizer``, given for a module a distributed plan has since converted, made again over
    the converted parameters from its class, defaults and groups: each group takes the
    parameters that now stand for its own (``names``: its parameters' names at the build;
    ``plain_name``: a converted parameter's name in the plain module)."""
    standing_for: dict[str, list] = {}
    for name, param in module.named_parameters():
        standing_for.setdefault(plain_name(name), []).append(param)
    groups = []
    for group, group_names in zip(optimizer.param_groups, names):
        if None in group_names:
            raise RuntimeError("TorchModel: the optimizer given steps parameters that are not its module's, so it "
                               "cannot be made again over a distributed plan's parameters; pass a factory instead")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [param for name in group_names for param in standing_for[name]]})
    return type(optimizer)(groups, **optimizer.defaults)
