"""Which evaluation fits a model: regression statistics for a regression loss, else classification."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dl4py.eval.evaluation import Evaluation
from dl4py.eval.regression import RegressionEvaluation
from dl4py.eval.roc import ROC, ROCMultiClass

__all__ = ["REGRESSION_LOSSES", "is_regression_loss", "new_evaluation", "new_roc"]

# DL4J's regression LossFunctions, by the names a config may spell them (case and
# underscores ignored), whether or not dl4py's output layer offers each one yet.
REGRESSION_LOSSES = frozenset({
    "mse", "l1", "l2", "squaredloss", "meanabsoluteerror", "mae", "meansquarederror",
    "meanabsolutepercentageerror", "mape", "meansquaredlogarithmicerror", "msle", "poisson",
    "huber", "smoothl1", "cosineproximity",
})
_TORCH_REGRESSION = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.PoissonNLLLoss)
_TORCH_REGRESSION_FNS = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.poisson_nll_loss)


def is_regression_loss(loss) -> bool:
    """True for a regression loss: a name (``"mse"``, ``"l1"``, ...) or a torch loss (``nn.MSELoss()``)."""
    if isinstance(loss, str):
        # "LossFunctions.LossFunction.MSE" (DL4J's enum spelling) names the same loss as "mse".
        return loss.rsplit(".", 1)[-1].lower().replace("_", "").replace("-", "") in REGRESSION_LOSSES
    return isinstance(loss, _TORCH_REGRESSION) or any(loss is fn for fn in _TORCH_REGRESSION_FNS)


def output_loss(model):
    """The loss of ``model``'s output: the output layer's name for a MultiLayerNetwork, the
    callable a TorchModel was given, or None when neither can be told."""
    config = getattr(model, "config", None)
    layers = getattr(config, "layers", None)
    if layers:
        return getattr(layers[-1], "loss", None)
    return getattr(model, "_loss_fn", None)


def new_evaluation(model, labels: torch.Tensor | None = None):
    """An empty ``RegressionEvaluation`` for a model trained with a regression loss, else an
    ``Evaluation``. Class-index ``labels`` (integers) mean classification whatever the loss:
    a classifier trained with MSE on one-hot rows is evaluated on its classes."""
    class_indices = labels is not None and not labels.is_floating_point()
    return RegressionEvaluation() if is_regression_loss(output_loss(model)) and not class_indices else Evaluation()


def new_roc(outputs: torch.Tensor, threshold_steps: int):
    """``ROC`` for one or two output columns, ``ROCMultiClass`` (one-vs-all) for more."""
    columns = 1 if outputs.dim() == 1 else outputs.shape[1]
    return ROC(threshold_steps) if columns <= 2 else ROCMultiClass(threshold_steps)
