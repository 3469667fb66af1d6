"""Training on a Spark cluster (DL4J's ``SparkDl4jMultiLayer``), launched by Spark's own
``TorchDistributor``: each rank is a Spark task that runs the ParallelWrapper as a
launched process's worker, exactly as under ``torchrun``.

    from dl4py.spark import SparkTrainer

    trainer = SparkTrainer(model, workers=4, averaging_frequency=3)
    history = trainer.fit(df, label="y", batch_size=64, epochs=2)   # a Spark DataFrame
    model.evaluate(test)                                            # holds the averaged state

Needs pyspark >= 3.4 and a Java 17 runtime: ``pip install "dl4py[spark]"``.
See docs/spark.md.
"""

try:
    from pyspark.ml.torch.distributor import TorchDistributor  # noqa: F401  (pyspark >= 3.4)
except ImportError as exc:  # pyspark, or one of its own dependencies, is missing or too old
    raise ImportError(
        "dl4py.spark needs pyspark >= 3.4 (with pandas and pyarrow) and a Java 17 runtime: "
        f"pip install 'dl4py[spark]' ({exc})"
    ) from None

from dl4py.spark.session import spark_session
from dl4py.spark.trainer import SparkTrainer
from dl4py.spark.training_master import (
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkDl4jMultiLayer,
)

__all__ = [
    "ParameterAveragingTrainingMaster",
    "SharedTrainingMaster",
    "SparkDl4jMultiLayer",
    "SparkTrainer",
    "spark_session",
]
