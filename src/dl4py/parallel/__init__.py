"""Data-parallel training across worker processes and devices (DL4J's ParallelWrapper)."""

from dl4py.errors import WorkerError
from dl4py.parallel.early_stopping import EarlyStoppingParallelTrainer
from dl4py.parallel.wrapper import ParallelWrapper, launched_by_torchrun

__all__ = ["EarlyStoppingParallelTrainer", "ParallelWrapper", "WorkerError", "launched_by_torchrun"]
