"""Watching training: statistics (``StatsListener``), where they go (``StatsStorage``), and the
pages that show them (``UIServer``: ``dl4py ui``; ``write_report``: ``dl4py report``)."""

from dl4py.monitor.stats import StatsListener
from dl4py.monitor.mlflow import MLflowStatsStorage
from dl4py.monitor.report import write_report
from dl4py.monitor.server import UIServer
from dl4py.monitor.storage import FileStatsStorage, InMemoryStatsStorage, StatsStorage
from dl4py.monitor.tensorboard import TensorBoardStatsStorage
from dl4py.monitor.wandb_storage import WandbStatsStorage

__all__ = ["FileStatsStorage", "InMemoryStatsStorage", "MLflowStatsStorage", "StatsListener", "StatsStorage",
           "TensorBoardStatsStorage", "UIServer", "WandbStatsStorage", "write_report"]
