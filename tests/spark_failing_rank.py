"""Run by tests/test_spark.py in a process of its own: a SparkTrainer fit on Spark's
local-cluster master (each rank in an executor process) over a table directory whose second
file holds a label the network does not have. Prints how the fit ended, as JSON."""

import json
import sys

import torch

from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.errors import WorkerError
from dl4py.spark import SparkTrainer, spark_session


def main(folder: str, master: str) -> None:
    config = NetworkConfig(layers=[DenseLayer(n_out=12, activation="tanh"), OutputLayer(n_out=3)],
                           input_type=InputType.feed_forward(5), updater=Sgd(0.1), seed=11)
    model = MultiLayerNetwork(config, backend="cpu").init()
    before = [p.detach().clone() for p in model.module.parameters()]
    outcome = {"rank": None}
    with spark_session(master, conf={"spark.ui.enabled": "false"}) as spark:
        spark.sparkContext.setLogLevel("ERROR")
        try:
            SparkTrainer(model, 2, timeout=60).fit(folder, epochs=1, label="y", batch_size=8)
        except WorkerError as exc:
            outcome = {"rank": exc.rank, "device": exc.device, "detail": exc.detail, "message": str(exc)}
    outcome["model_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))
    print(json.dumps(outcome))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
