"""DL4J's names for training on Spark, as thin shells over ``SparkTrainer``:

    tm = ParameterAveragingTrainingMaster(batch_size_per_worker=32, averaging_frequency=5,
                                          worker_prefetch_num_batches=2)
    spark_net = SparkDl4jMultiLayer(spark, conf, tm)      # a NetworkConfig or a model
    spark_net.fit(df, label="y", epochs=2)
    model = spark_net.get_network()

Only the options that mean something here exist; docs/spark.md says what became of the
others (storage levels, RDD training approach, threshold encoding, ...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dl4py.config import GraphConfig, NetworkConfig
from dl4py.config.parallel import ParallelOptions, ParallelPlan
from dl4py.nn.loading import network_model
from dl4py.spark.data import is_spark_dataframe
from dl4py.spark.trainer import SparkTrainer


@dataclass(frozen=True)
class ParameterAveragingTrainingMaster:
    """Averaging mode. ``workers``: Spark tasks (default: the cluster's default parallelism,
    one per executor core, as DL4J); ``batch_size_per_worker`` batches a DataFrame or a
    directory; ``save_updater``: average the updater state too; ``export_directory``:
    where a DataFrame is staged."""

    batch_size_per_worker: int | None = None
    averaging_frequency: int | None = None
    worker_prefetch_num_batches: int = 16
    save_updater: bool = True
    workers: int | None = None
    export_directory: str | None = None

    def parallel_options(self, workers: int) -> ParallelOptions:
        """What this master asks of ``workers`` Spark tasks, validated (SparkTrainer's ``options``)."""
        return ParallelOptions(workers=workers, parallelism=ParallelPlan("data"),
                               averaging_frequency=self.averaging_frequency, average_updaters=self.save_updater,
                               prefetch_buffer=self.worker_prefetch_num_batches).validate()


@dataclass(frozen=True)
class SharedTrainingMaster:
    """Shared-gradients mode: gradients are averaged after every step, uncompressed (DL4J's
    threshold encoding has no counterpart: all-reduce sends them whole)."""

    batch_size_per_worker: int | None = None
    worker_prefetch_num_batches: int = 16
    workers: int | None = None
    export_directory: str | None = None

    def parallel_options(self, workers: int) -> ParallelOptions:
        return ParallelOptions(workers=workers, parallelism=ParallelPlan("data", sync="shared_gradients"),
                               prefetch_buffer=self.worker_prefetch_num_batches).validate()


class SparkDl4jMultiLayer:
    """``SparkDl4jMultiLayer(spark, conf_or_model, training_master)``; ``fit`` trains the
    network, which ``get_network()`` returns."""

    def __init__(self, spark, network, training_master, *, use_gpu: bool = False):

        # A GraphConfig trains here too (DL4J has SparkComputationGraph for it).
        self.network = network_model(network) if isinstance(network, (NetworkConfig, GraphConfig)) else network
        self.training_master = training_master
        workers = training_master.workers or spark.sparkContext.defaultParallelism
        self.trainer = SparkTrainer(self.network, spark=spark, use_gpu=use_gpu,
                                    staging_dir=training_master.export_directory,
                                    options=training_master.parallel_options(workers))

    def fit(self, data, epochs: int = 1, *, label=None, features=None, listeners=(), validation=None):
        """Train on a DataFrame (``label``, ``features``), a table directory, or an iterator."""
        table = is_spark_dataframe(data) or isinstance(data, (str, os.PathLike))
        batch = self.training_master.batch_size_per_worker if table else None
        return self.trainer.fit(data, epochs, listeners, validation=validation, label=label, features=features,
                                batch_size=batch)

    def get_network(self):
        return self.network
