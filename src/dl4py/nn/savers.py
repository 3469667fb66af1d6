"""Where early stopping keeps the best (and latest) model: memory, or files written atomically.

Here, beside the model files they write and read, and not in ``train/early_stopping`` (which
holds their contract, ``EarlyStoppingModelSaver``, and still names them, as DL4J's
earlystopping package does): the train floor sits below nn and imports nothing of it.
"""

from __future__ import annotations

from pathlib import Path

from dl4py.errors import DataError
from dl4py.nn.loading import load
from dl4py.nn.model_file import read_model_file
from dl4py.nn.serialization import _restore_masters, model_bytes  # the masters restored as a load restores them
from dl4py.train.early_stopping.savers import EarlyStoppingModelSaver


class InMemoryModelSaver(EarlyStoppingModelSaver):
    """Keeps the model files' bytes; ``get_best_model()`` rebuilds a model from them."""

    def __init__(self):
        self.best: bytes | None = None
        self.latest: bytes | None = None

    def save_best(self, model, score: float) -> None:
        self.best = model_bytes(model)

    def save_latest(self, model, score: float) -> None:
        self.latest = model_bytes(model)

    def get_best_model(self, into=None, backend=None):
        return None if self.best is None else load(self.best, into=into, backend=backend)

    def get_latest_model(self, into=None, backend=None):
        return None if self.latest is None else load(self.latest, into=into, backend=backend)

    def restore_best_weights(self, model) -> bool:
        """Put the best model's weights (parameters, buffers, float32 masters) back into
        ``model``, in place, as Keras' ``restore_best_weights`` does: its updater state,
        counters and normalizer stay as training left them. False when none was kept."""
        if self.best is None:
            return False
        saved = read_model_file(self.best)
        try:
            model.module.load_state_dict(saved.weights)
        except RuntimeError as exc:
            raise DataError(f"restore_best_weights: the kept weights do not fit the model: {exc}") from None
        _restore_masters(model, saved.masters)
        return True


class LocalFileModelSaver(EarlyStoppingModelSaver):
    """Writes ``bestModel.dl4py`` / ``latestModel.dl4py`` (with updater state) in ``directory``.
    Each write goes to a temporary file that is renamed into place: a crash mid-save
    leaves the previous best model readable."""

    BEST, LATEST = "bestModel.dl4py", "latestModel.dl4py"

    def __init__(self, directory):
        self.directory = Path(directory)

    def save_best(self, model, score: float) -> None:
        model.save(self.directory / self.BEST)

    def save_latest(self, model, score: float) -> None:
        model.save(self.directory / self.LATEST)

    def get_best_model(self, into=None, backend=None):
        return self._load(self.BEST, into, backend)

    def get_latest_model(self, into=None, backend=None):
        return self._load(self.LATEST, into, backend)

    def _load(self, name: str, into, backend):
        path = self.directory / name
        return load(path, into=into, backend=backend) if path.exists() else None
