"""Data-parallel training across worker processes and devices (DL4J's ParallelWrapper)."""

from dl4py.config.parallel import ParallelOptions, ParallelPlan
from dl4py.errors import WorkerError
from dl4py.parallel.early_stopping import EarlyStoppingParallelTrainer
from dl4py.parallel.launched import launched_by_torchrun
from dl4py.parallel.wrapper import ParallelWrapper

__all__ = ["EarlyStoppingParallelTrainer", "ParallelOptions", "ParallelPlan", "ParallelWrapper", "WorkerError", "launched_by_torchrun"]
