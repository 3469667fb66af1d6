"""dl4py.spark: ranks started as Spark tasks by TorchDistributor.

The tests share one ``local[2]`` SparkSession (starting one costs seconds), which
``dl4py train --launcher spark``, run in this process, uses as its default master. The
failing-rank test runs in a process of its own on ``local-cluster[2,1,1024]``: a master
and two workers, each starting an executor process, so the ranks run where a cluster's
would, and what a failure leaves behind is looked for there. Spark needs Java: without
it those tests skip and say so."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dl4py
from dl4py import ArrayDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.cli import main
from dl4py.errors import ConfigError, DataError
from dl4py.parallel import ParallelWrapper

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = ROOT / "src"
LENET = ROOT / "examples" / "lenet_mnist.yaml"
QUICK = ["--set", "data.limit_train=512", "--set", "data.limit_test=100", "--no-progress"]
HAS_JAVA = shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))
# TorchDistributor's processes: the watcher around torchrun, torchrun, and each rank's script.
RANK_PROCESSES = ("torch_run_process_wrapper", "torch.distributed.run", "/train.py")

# The tests' JVMs live for seconds and run tiny jobs: C1 alone (no C2 compiles) and the serial
# collector start Spark with about a third less CPU, which is what a 2-core CI machine lacks.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

pytestmark = pytest.mark.spark
needs_java = pytest.mark.skipif(not HAS_JAVA, reason="Spark needs a Java 17 runtime (java on PATH or JAVA_HOME)")


@pytest.fixture(scope="module")
def spark():
    """One local[2] session for the module."""
    from dl4py.spark import spark_session

    conf = {"spark.ui.enabled": "false", "spark.executorEnv.PYTHONPATH": str(SRC),
            "spark.driver.extraJavaOptions": QUICK_JVM}
    with spark_session("local[2]", conf=conf) as session:
        session.sparkContext.setLogLevel("ERROR")
        yield session


def run_cli(*args) -> int:
    return main([str(a) for a in args])


def network(seed: int = 11) -> MultiLayerNetwork:
    config = NetworkConfig(layers=[DenseLayer(n_out=12, activation="tanh"), OutputLayer(n_out=3)],
                           input_type=InputType.feed_forward(5), updater=Sgd(0.1), seed=seed)
    return MultiLayerNetwork(config, backend="cpu")


def examples(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


# The tables of the DataFrame and local-cluster tests: rank i reads part i (a partition, a file).
BATCH, PER_PART = 8, 32
PARTS = [examples(PER_PART, seed=part) for part in range(2)]


@pytest.fixture(scope="module")
def twin():
    """The network spawned workers train on the in-memory twin of PARTS (2 epochs, averaging
    every 2 rounds), trained once for the tests that compare a Spark fit with it. Rank i reads
    part i, so the twin holds the batches interleaved (round r: batch r of each part)."""
    x = torch.cat([part[0] for part in PARTS])
    y = torch.cat([part[1] for part in PARTS])
    order = torch.cat([torch.arange(part * PER_PART + r * BATCH, part * PER_PART + (r + 1) * BATCH)
                       for r in range(PER_PART // BATCH) for part in range(2)])
    reference = network()
    with ParallelWrapper(reference, workers=2, averaging_frequency=2) as wrapper:
        wrapper.fit(ArrayDataSetIterator(x[order], y[order], batch_size=BATCH, shuffle=False), epochs=2)
    return reference


def assert_same_parameters(a, b, what: str) -> None:
    assert (a.epoch_count, a.iteration_count) == (b.epoch_count, b.iteration_count), what
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), f"{what}: {name} differs by {(pa - pb).abs().max().item():.2e}"


def rank_processes(since: float) -> list[str]:
    """TorchDistributor's processes started after ``since``, on the whole machine: ranks
    orphaned by a dead task would no longer be this process's descendants."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        try:
            command = " ".join(proc.info["cmdline"] or [])
            if proc.info["create_time"] >= since and any(sign in command for sign in RANK_PROCESSES):
                found.append(f"{proc.pid}: {command}")
        except psutil.Error:
            continue
    return found


def assert_nothing_left(since: float, patience: float = 20.0) -> None:
    deadline = time.monotonic() + patience  # a cancelled task's processes take a moment to go
    while rank_processes(since) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not rank_processes(since)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.soak  # long for make test's budget: make soak runs it (DEVELOPERS.md)
@needs_java
def test_lenet_trains_alike_under_spawn_torchrun_and_spark(spark, tmp_path, mnist, capsys):
    """``dl4py train`` on an MNIST slice under the three launchers: the workers slice the same
    batches of the same in-memory data, so all three train the same parameters; Spark's
    (on local[2], the default master) writes the same run directory as the others."""
    runs = {name: tmp_path / name for name in ("spawn", "torchrun", "spark")}
    args = ["train", str(LENET), *QUICK]
    assert run_cli(*args, "--workers", 2, "--output", runs["spawn"]) == 0
    capsys.readouterr()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "dl4py", *args,
                               "--launcher", "torchrun", "--output", str(runs["torchrun"])],  # 2 workers: the world
                              env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert len(torchrun.stdout.strip().splitlines()) == 1  # rank 0 alone tells of the run it wrote
    assert spark.sparkContext.master == "local[2]"
    started = time.time()
    assert run_cli(*args, "--workers", 2, "--launcher", "spark", "--output", runs["spark"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_dir"] == str(runs["spark"])
    assert_nothing_left(started)

    out = runs["spark"]
    for name in ("config.yaml", "environment.json", "metrics.jsonl", "model.dl4py", "checkpoint.dl4py",
                 "evaluation.txt", "result.json"):
        assert (out / name).is_file(), name
    results = {name: json.loads((run / "result.json").read_text()) for name, run in runs.items()}
    for name, result in results.items():
        assert result["launcher"] == name and result["status"] == "completed" and result["workers"] == 2
    result = results["spark"]
    assert result["iterations"] == 4 and result["test_examples"] == 100
    assert result["epoch_summaries"][0]["examples"] == 512
    # The driver wrote the metrics from rank 0's events, then the evaluation of the model it took back.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["kind"] not in ("static", "stats")]  # the StatsListener's own
    assert [r["kind"] for r in records] == ["epoch", "evaluation"]
    assert records[0]["examples"] == 512 and records[1]["test_accuracy"] == result["test_accuracy"]

    reference = dl4py.load(runs["spawn"] / "model.dl4py")
    for name in ("torchrun", "spark"):
        assert_same_parameters(reference, dl4py.load(runs[name] / "model.dl4py"), name)
    assert result["test_accuracy"] == results["spawn"]["test_accuracy"]
    # History's training accuracy counts both workers' batches, alike under the three launchers.
    accuracies = {name: run["epoch_summaries"][0].get("accuracy") for name, run in results.items()}
    assert len(set(accuracies.values())) == 1 and 0 < accuracies["spark"] <= 1, accuracies


@pytest.mark.slow
@needs_java
@pytest.mark.timeout(600)
def test_parallelism_auto_trains_under_spawn_torchrun_and_spark_and_records_its_choice(spark, tmp_path, mnist,
                                                                                         capsys, monkeypatch):
    """The issue's line: ``parallelism: auto`` trains through every launcher and records its
    choice. The speeds are a made-up CPU profile saved as this machine's, so that the choice
    is known; under torchrun rank 0 makes it and the other rank trains by it."""
    from dl4py.plan.model import predict
    from dl4py.plan.profile import default_profile_path, save_profile
    from test_plan_auto import config_of, fastest_known_to_fit
    from test_plan_model import device

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_profile(device("cpu"), default_profile_path("cpu"))
    expected = fastest_known_to_fit(predict(config_of(LENET, workers=2), device("cpu"), 2,
                                            device_memory=device("cpu").memory_bytes))
    runs = {name: tmp_path / name for name in ("spawn", "torchrun", "spark")}
    args = ["train", str(LENET), *QUICK, "--parallelism", "auto"]
    assert run_cli(*args, "--workers", 2, "--output", runs["spawn"]) == 0
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "dl4py", *args,
                               "--output", str(runs["torchrun"])],  # the world: 2 workers
                              env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=300)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert run_cli(*args, "--workers", 2, "--launcher", "spark", "--output", runs["spark"]) == 0
    capsys.readouterr()
    for name, run in runs.items():
        result = json.loads((run / "result.json").read_text())
        plan = result["plan"]
        assert result["launcher"] == name and result["status"] == "completed" and result["workers"] == 2, name
        assert (plan["plan"], plan["workers"], plan["asked"]) == (expected.plan, 2, {"workers": 2, "parallelism": "auto"})
        assert plan["measured"]["samples_per_second"] == result["train_samples_per_second"] > 0, name


def test_cli_launcher_choices_are_checked(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", LENET, "--launcher", "torchrun", "--output", out, *QUICK) == 2
    assert "torchrun --nproc-per-node=N -m dl4py train" in capsys.readouterr().err
    assert run_cli("train", LENET, "--spark-master", "local[2]", "--output", out, *QUICK) == 2
    assert "spark_master: applies to launcher spark only" in capsys.readouterr().err
    assert run_cli("train", LENET, "--launcher", "spark", "--batch-size", "auto", "--output", out, *QUICK) == 2
    assert "training.batch_size: auto" in capsys.readouterr().err
    assert run_cli("train", LENET, "--launcher", "spark", "--output", out, *QUICK,
                   "--set", "training.early_stopping={metric: accuracy, patience: 2}") == 2
    assert "training.early_stopping: is not supported with launcher spark" in capsys.readouterr().err
    assert not out.exists()


def test_without_pyspark_the_import_and_the_launcher_name_the_extra(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "dl4py.spark" or m.startswith("dl4py.spark.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ["pyspark", *(m for m in sys.modules if m.startswith("pyspark."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'dl4py\[spark\]'"):
        import dl4py.spark  # noqa: F401
    out = tmp_path / "run"
    assert run_cli("train", LENET, "--launcher", "spark", "--output", out, *QUICK) == 2
    assert "launcher: spark: dl4py.spark needs pyspark" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
@needs_java
def test_a_dataframe_trains_as_its_in_memory_equivalent(spark, twin):
    """Two partitions of 4 batches (PARTS): rank i reads partition i, and the fit trains what
    spawned workers train on the in-memory twin."""
    rows = [(row, label) for x, y in PARTS for row, label in zip(x.tolist(), y.tolist())]
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2), "features array<double>, label int")
    from dl4py.spark import ParameterAveragingTrainingMaster, SparkDl4jMultiLayer, SparkTrainer

    master = ParameterAveragingTrainingMaster(batch_size_per_worker=BATCH, averaging_frequency=2, workers=2)
    spark_net = SparkDl4jMultiLayer(spark, network(), master)
    history = spark_net.fit(df, epochs=2, label="label")
    assert history.history["examples"] == [64, 64]
    assert_same_parameters(twin, spark_net.get_network(), "DataFrame")

    with pytest.raises(DataError, match="cast them"):  # a classifier's labels are class indices
        SparkTrainer(network(), 2).fit(df.withColumn("label", df.label.cast("double")), label="label", batch_size=8)
    with pytest.raises(ConfigError, match="batch_size"):
        SparkTrainer(network(), 2).fit(df, label="label")


@pytest.mark.soak  # the sharded plan under torchrun's variables stays in make test (test_multinode); suite budget
@needs_java
def test_a_sharded_dataframe_fit_steps_as_one_process_on_each_rounds_batches(spark):
    """parallelism sharded (FSDP2) on Spark tasks: rank i reads partition i, and each
    update is the mean gradient of the round's two batches, so the fit ends where a single
    process ends that steps on batch r of both partitions together."""
    from dl4py.spark import SparkTrainer

    rows = [(row, label) for x, y in PARTS for row, label in zip(x.tolist(), y.tolist())]
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2), "features array<double>, label int")
    sharded = network()
    SparkTrainer(sharded, 2, spark=spark, parallelism="sharded").fit(df, label="label", batch_size=BATCH, epochs=1)
    reference = network().init()
    for r in range(PER_PART // BATCH):
        rows_r = slice(r * BATCH, (r + 1) * BATCH)
        features = torch.cat([x[rows_r] for x, _ in PARTS]).to(torch.float32)
        reference.train_step(reference.prepare_input(features), torch.cat([y[rows_r] for _, y in PARTS]))
    assert (sharded.epoch_count, sharded.iteration_count) == (1, 8)
    for (name, a), b in zip(reference.module.named_parameters(), sharded.module.parameters()):
        assert torch.allclose(a, b, atol=1e-6), f"{name} differs by {(a - b).abs().max().item():.2e}"


@pytest.mark.soak  # 85 s: make test's budget; Spark under local[2] stays there (three launchers alike)
@needs_java
def test_local_cluster_ranks_train_exactly_and_a_failing_rank_fails_the_job_with_its_error(tmp_path, twin):
    """On local-cluster (ranks in executor processes), in one Spark application: a fit over
    two Parquet files (PARTS: rank i reads file i) ends with the parameters of spawned workers
    on the in-memory twin. Then rank 1's file has a label the network does not have, so rank 1
    fails on its first batch while rank 0 trains on. The job stops, naming rank 1 and its
    error; the model is as it was, and no process is left behind."""
    import pandas as pd

    for name, bad in (("clean", False), ("table", True)):
        (tmp_path / name).mkdir()
        for part, (x, y) in enumerate(PARTS):
            y = y.clone()
            if bad and part == 1:
                y[5] = 7
            frame = pd.DataFrame(x.numpy(), columns=[f"x{i}" for i in range(5)]).assign(y=y.numpy())
            frame.to_parquet(tmp_path / name / f"part-{part}.parquet")
    started = time.time()
    proc = subprocess.run([sys.executable, str(HERE / "spark_failing_rank.py"), str(tmp_path / "clean"),
                           str(tmp_path / "table"), "local-cluster[2,1,1024]", QUICK_JVM],
                          env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])

    trained = outcome["trained"]
    assert trained["examples"] == [64, 64] and (trained["epochs"], trained["iterations"]) == (2, 16)
    for (name, expected), got in zip(twin.module.named_parameters(), trained["parameters"]):
        difference = (expected.detach().flatten() - torch.tensor(got)).abs().max().item()
        assert difference < 1e-6, f"{name} differs by {difference:.2e}"

    assert outcome["rank"] == 1, outcome
    assert "label 7" in outcome["detail"] and "Traceback" not in outcome["detail"], outcome
    assert outcome["message"].startswith("worker 1 (device cpu on "), outcome
    assert outcome["model_unchanged"]
    assert_nothing_left(started)
