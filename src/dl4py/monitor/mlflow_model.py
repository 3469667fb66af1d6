"""A saved dl4py model as an MLflow Model, so that MLflow's registry and ``mlflow models serve`` use it.

    from dl4py import log_mlflow_model

    uri = log_mlflow_model("runs/lenet/model.dl4py", run_id, tracking_uri="sqlite:///mlflow.db")
    mlflow.pyfunc.load_model(uri).predict(rows)   # uri: runs:/<run_id>/model
    # mlflow models serve -m runs:/<run_id>/model --env-manager local

The ``python_function`` flavour: the model file travels inside the MLflow Model as its artifact
``model.dl4py``; ``Dl4pyPythonModel`` loads it with ``dl4py.load`` and answers ``predict`` with
``model.output`` (the output layer's activations as float32 numpy; a graph's several outputs side
by side). The signature is the network's: a float32 tensor ``(-1, *input_shape)`` in, and out the
shape one forward pass of the input example gives. MLflow refuses to unpickle a Python model by
default, so the model is given as code (MLflow's "models from code"): a three-line file naming
``Dl4pyPythonModel``, which needs dl4py where the model is loaded. ``pip_requirements`` are
written out (dl4py, torch, numpy at this machine's versions): MLflow resolves nothing over the
network. Needs MLflow 2.12.2 or later (models from code).

Everything goes through an explicit ``MlflowClient`` and the run's id, as ``MLflowStatsStorage``
does: MLflow's global "active run" and tracking URI are left alone.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from dl4py.errors import DataError, MissingDependencyError
from dl4py.nn.loading import load
from dl4py.nn.model_file import read_meta
from dl4py.version import __version__

try:
    import mlflow.pyfunc  # optional: mlflow (extra mlflow); Dl4pyPythonModel below subclasses its PythonModel
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model, ModelSignature
    from mlflow.tracking import MlflowClient
    from mlflow.types import Schema, TensorSpec
except ImportError:  # also when sys.modules["mlflow"] is None
    raise MissingDependencyError("an MLflow Model", "mlflow", "mlflow") from None

MODEL_NAME = "model"  # the MLflow Model's folder among the run's artifacts: runs:/<run_id>/model
MODEL_ARTIFACT = "model.dl4py"  # the model file's name among the MLflow Model's artifacts
_CODE_FILE = "dl4py_pyfunc.py"
# The model as MLflow loads it: this file is copied into the MLflow Model and run when it is loaded.
_CODE = '''"""The MLflow Model's Python model: a dl4py model file behind MLflow's pyfunc (written by dl4py)."""
import mlflow
from dl4py.monitor.mlflow_model import Dl4pyPythonModel
mlflow.models.set_model(Dl4pyPythonModel())
'''


class Dl4pyPythonModel(mlflow.pyfunc.PythonModel):
    """MLflow's pyfunc face of a dl4py model file: ``load_context`` reads the artifact
    ``model.dl4py`` with ``dl4py.load``; ``predict(rows)`` is ``model.output(rows)`` as float32 numpy."""

    model = None

    def load_context(self, context) -> None:
        self.model = load(context.artifacts[MODEL_ARTIFACT])

    # The np.ndarray hint tells MLflow to take the signature as logged (a tensor) and not to warn.
    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:
        return probabilities(self.model, model_input)


def probabilities(model, rows) -> np.ndarray:
    """``model.output(rows)`` as float32 numpy on the CPU; a graph's several outputs side by side.
    ``rows``: an array or a DataFrame, one example per row."""
    output = model.output(np.asarray(rows, dtype=np.float32))
    if isinstance(output, list):  # a graph with several outputs: one tensor each
        output = torch.cat([part.reshape(part.shape[0], -1) for part in output], dim=1)
    return output.detach().float().cpu().numpy()


def save_mlflow_model(model_file, path, mlflow_model=None) -> None:
    """Write the MLflow Model of ``model_file`` (a ``model.dl4py``) into the folder ``path``
    (which must not exist): ``mlflow.pyfunc.load_model(path)`` and ``mlflow models serve -m
    path`` use it. ``mlflow_model``: MLflow's ``Model`` record to fill (its run id)."""
    model_file = Path(model_file)
    kind = read_meta(model_file)["kind"]
    if kind == "torch_module":
        raise DataError(f"{model_file} holds a plain torch module's weights, which dl4py.load cannot rebuild "
                        "alone; an MLflow Model needs a MultiLayerNetwork or ComputationGraph file")
    model = load(model_file, backend="cpu")
    example = np.zeros((1, *_example_shape(model, model_file, 1)), dtype=np.float32)
    signature = ModelSignature(Schema([TensorSpec(np.dtype(np.float32), _shape(model.signature().input_shape))]),
                               Schema([TensorSpec(np.dtype(np.float32), _output_shape(model, model_file))]))
    with tempfile.TemporaryDirectory(prefix="dl4py-mlflow-") as folder:
        code = Path(folder) / _CODE_FILE
        code.write_text(_CODE)
        mlflow.pyfunc.save_model(str(path), python_model=str(code), artifacts={MODEL_ARTIFACT: str(model_file)},
                                 signature=signature, input_example=example, mlflow_model=mlflow_model,
                                 pip_requirements=pip_requirements())


def log_mlflow_model(model_file, run_id: str, tracking_uri: str | None = None, name: str = MODEL_NAME,
                     registered_model_name: str | None = None) -> str:
    """Add ``model_file`` as an MLflow Model to the run ``run_id``, in the folder ``name`` of its
    artifacts, and return its URI (``runs:/<run_id>/model``). ``registered_model_name``: also a
    new version of that registered model (created if missing). ``tracking_uri``: as
    ``MLflowStatsStorage``'s (None: MLflow's default)."""
    client = MlflowClient(tracking_uri)
    with tempfile.TemporaryDirectory(prefix="dl4py-mlflow-") as folder:
        local = Path(folder) / name
        save_mlflow_model(model_file, local, mlflow_model=Model(run_id=run_id, artifact_path=name))
        client.log_artifacts(run_id, str(local), name)
    if registered_model_name is not None:
        register(client, run_id, name, registered_model_name)
    return f"runs:/{run_id}/{name}"


def register(client, run_id: str, name: str, registered_model_name: str):
    """A new version of ``registered_model_name`` (created if missing) from the run's MLflow
    Model ``name``; returns MLflow's ModelVersion."""
    try:
        client.create_registered_model(registered_model_name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/{name}"  # where the files are, as MLflow 2 records it
    return client.create_model_version(registered_model_name, source, run_id=run_id)


def pip_requirements() -> list[str]:
    """What the MLflow Model needs, pinned to this machine's versions (torch without a local
    build tag such as ``+cpu``, which PyPI does not know)."""
    return [f"dl4py=={__version__}", f"torch=={torch.__version__.split('+')[0]}", f"numpy=={np.__version__}",
            f"mlflow=={mlflow.__version__}"]


def _example_shape(model, model_file, length: int) -> tuple[int, ...]:
    """One example's shape; a sequence of any length gets ``length`` steps."""
    shape = model.signature().input_shape
    if shape is None:
        raise DataError(f"{model_file}: the model declares no input shape, which an MLflow signature needs")
    return tuple(length if size is None else size for size in shape)


def _output_shape(model, model_file) -> tuple[int, ...]:
    """The output's shape, from forward passes of zeros: -1 for the rows, and for any size that
    follows a sequence's length (outputs for one step and for two differ there)."""
    one, two = (probabilities(model, np.zeros((1, *_example_shape(model, model_file, steps)), dtype=np.float32))
                for steps in (1, 2))
    if one.ndim != two.ndim:
        raise DataError(f"{model_file}: the output's rank changes with the sequence length")
    return (-1, *(a if a == b else -1 for a, b in zip(one.shape[1:], two.shape[1:])))


def _shape(sizes) -> tuple[int, ...]:
    """A signature's tensor shape: -1 for the rows, and for a sequence of any length."""
    return (-1, *(-1 if size is None else size for size in sizes))
