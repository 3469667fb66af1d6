"""Errors dl4py raises on purpose. Each names what is wrong and where."""

import errno


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


class StorageError(DL4PyError):
    """The operating system refused a file operation (disk full, no permission, not a
    directory, read-only file system); names the path and the cause."""

    def __init__(self, action: str, path, cause: OSError):
        self.path, self.cause = path, cause
        reason = cause.strerror or type(cause).__name__
        super().__init__(f"cannot {action} {path}: {reason}")


class ModelFileError(DataError):
    """A model or checkpoint file cannot be read: ``FILE is not a valid dl4py model: WHAT``."""

    def __init__(self, path, what: str):
        self.path, self.what = str(path), what
        super().__init__(f"{path} is not a valid dl4py model: {what}")

    def __reduce__(self):  # the default would call __init__ with the message alone
        return type(self), (self.path, self.what)


class DataSizeError(DataError, ValueError):
    """A limit asks for more examples than the data set holds. Also a ValueError, as it
    was before it had its own class; ``limit`` and ``available`` let a caller name its key."""

    def __init__(self, limit: int, available: int, source: str = ""):
        self.limit, self.available, self.source = limit, available, source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}limit={limit} exceeds the {available} examples available")

    def __reduce__(self):
        return type(self), (self.limit, self.available, self.source)


class LabelError(DataError, ValueError):
    """A label or prediction cannot be scored (a class index out of range, a NaN). Also a
    ValueError, as it was before it had its own class."""


class MissingDependencyError(DL4PyError, ImportError):
    """An optional package that a feature needs is not installed; says what to ``pip install``.
    Also an ImportError, which is what a caller catching a missing package expects."""

    def __init__(self, what: str, package: str, extra: str):
        self.what, self.package, self.extra = what, package, extra
        super().__init__(f"{what} needs the '{package}' package: pip install \"dl4py[{extra}]\"")

    def __reduce__(self):
        return type(self), (self.what, self.package, self.extra)


class InferenceError(DL4PyError):
    """ParallelInference cannot take or answer a request: its queue stayed full for longer
    than its ``queue_timeout``, or it was closed."""


def bind_error(exc: OSError, host: str, port: int, busy_hint: str = "") -> "ConfigError | None":
    """The ConfigError for a server's socket that could not bind (``--port`` taken, ``--host``
    not an address of this machine), or None for any other failure."""
    if exc.errno == errno.EADDRINUSE:
        return ConfigError("--port", f"port {port} on {host} is already in use{busy_hint}; choose another with "
                                     "--port, or --port 0 for any free one")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError("--host", f"{host} is not an address of this machine")
    return None
