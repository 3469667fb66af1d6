"""Run by tests/test_spark.py in a process of its own, on Spark's local-cluster master (each
rank in an executor process): a SparkTrainer fit over a clean table directory, then one over a
directory whose second file holds a label the network does not have. Prints, as JSON, the
first fit's trained parameters and how the second ended. Arguments: the two directories, the
master, and (optional) the JVM options of the driver and the executors."""

import json
import sys

import torch

from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.errors import WorkerError
from dl4py.spark import SparkTrainer, spark_session


def main(clean: str, folder: str, master: str, java_options: str = "") -> None:
    config = NetworkConfig(layers=[DenseLayer(n_out=12, activation="tanh"), OutputLayer(n_out=3)],
                           input_type=InputType.feed_forward(5), updater=Sgd(0.1), seed=11)
    model = MultiLayerNetwork(config, backend="cpu").init()
    before = [p.detach().clone() for p in model.module.parameters()]
    outcome = {"rank": None}
    conf = {"spark.ui.enabled": "false", "spark.driver.extraJavaOptions": java_options,
            "spark.executor.extraJavaOptions": java_options}
    with spark_session(master, conf=conf) as spark:
        spark.sparkContext.setLogLevel("ERROR")
        trained = MultiLayerNetwork(config, backend="cpu")
        history = SparkTrainer(trained, 2, averaging_frequency=2, timeout=60).fit(clean, epochs=2, label="y",
                                                                               batch_size=8)
        outcome["trained"] = {"examples": history.history["examples"], "epochs": trained.epoch_count,
                              "iterations": trained.iteration_count,
                              "parameters": [p.detach().flatten().tolist() for p in trained.module.parameters()]}
        try:
            SparkTrainer(model, 2, timeout=60).fit(folder, epochs=1, label="y", batch_size=8)
        except WorkerError as exc:
            outcome.update(rank=exc.rank, device=exc.device, detail=exc.detail, message=str(exc))
    outcome["model_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))
    print(json.dumps(outcome))


if __name__ == "__main__":
    main(*sys.argv[1:])
