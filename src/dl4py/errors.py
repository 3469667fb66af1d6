"""Errors dl4py raises on purpose. Each names what is wrong and where."""


class DL4PyError(Exception):
    """Base of every error dl4py raises deliberately."""


class ConfigError(DL4PyError, ValueError):
    """A configuration value is invalid. `where` is its path, e.g. ``network.layers[2].kernel_size``."""

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class DataError(DL4PyError):
    """A data file is missing, truncated or corrupt, or a batch does not fit the network."""


class BackendError(DL4PyError):
    """The requested backend, device or precision cannot be used here."""


class TrainingError(DL4PyError):
    """Training cannot go on (for example the loss became NaN)."""


class WorkerError(DL4PyError):
    """A parallel worker failed; names the worker, its device, and its traceback or exit signal."""

    def __init__(self, rank: int, device: str, detail: str):
        self.rank, self.device, self.detail = rank, device, detail
        super().__init__(f"worker {rank} (device {device}) failed: {detail}")
