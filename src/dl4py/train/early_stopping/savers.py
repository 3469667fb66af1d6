"""Where the best (and latest) model goes: memory, or files written atomically."""

from __future__ import annotations

from pathlib import Path


class InMemoryModelSaver:
    """Keeps the model files' bytes; ``get_best_model()`` rebuilds a model from them."""

    def __init__(self):
        self.best: bytes | None = None
        self.latest: bytes | None = None

    def save_best(self, model, score: float) -> None:
        from dl4py.nn.serialization import model_bytes

        self.best = model_bytes(model)

    def save_latest(self, model, score: float) -> None:
        from dl4py.nn.serialization import model_bytes

        self.latest = model_bytes(model)

    def get_best_model(self, into=None, backend=None):
        return None if self.best is None else _load(self.best, into, backend)

    def get_latest_model(self, into=None, backend=None):
        return None if self.latest is None else _load(self.latest, into, backend)


class LocalFileModelSaver:
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
        path = self.directory / self.BEST
        return _load(path, into, backend) if path.exists() else None

    def get_latest_model(self, into=None, backend=None):
        path = self.directory / self.LATEST
        return _load(path, into, backend) if path.exists() else None


def _load(source, into, backend):
    from dl4py.nn.loading import load

    return load(source, into=into, backend=backend)
