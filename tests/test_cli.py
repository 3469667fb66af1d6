"""The dl4py command: train, evaluate, summary, info; run directories and error messages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dl4py.cli import main

ROOT = Path(__file__).resolve().parents[1]
LENET = ROOT / "examples" / "lenet_mnist.yaml"
QUICK = ["--set", "data.limit_train=2048", "--set", "data.limit_test=300", "--no-progress"]


def run_cli(*args) -> int:
    return main([str(a) for a in args])


def test_train_writes_a_complete_run_directory(tmp_path, mnist, capsys):
    out = tmp_path / "run"
    assert run_cli("train", LENET, "--epochs", 1, "--output", out, *QUICK) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["run_dir"] == str(out)
    for name in ("config.yaml", "environment.json", "metrics.jsonl", "model.dl4py", "checkpoint.dl4py",
                 "evaluation.txt", "result.json"):
        assert (out / name).is_file(), name
    result = json.loads((out / "result.json").read_text())
    for key in ("test_accuracy", "epochs", "train_samples_per_second", "wall_seconds", "backend", "device",
                "workers", "precision"):
        assert key in result, key
    assert result["status"] == "completed" and result["epochs"] == 1 and result["test_examples"] == 300
    assert result["backend"] == "cpu" and result["workers"] == 1 and result["precision"] == "float"
    assert 0.5 < result["test_accuracy"] <= 1.0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["kind"] not in ("static", "stats")]  # the StatsListener's own
    assert [r["kind"] for r in records] == ["epoch", "evaluation"]  # 16 iterations < score_every
    assert records[1]["test_accuracy"] == result["test_accuracy"]
    env = json.loads((out / "environment.json").read_text())
    assert env["torch"] and env["backend"] == "cpu"
    # The recorded config is the resolved one, overrides included.
    assert "limit_train: 2048" in (out / "config.yaml").read_text()

    # evaluate the run directory: same test set, same accuracy
    assert run_cli("evaluate", out, "--json") == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["accuracy"] == pytest.approx(result["test_accuracy"])
    assert stats["num_examples"] == 300
    # ... and in another precision than it trained in (a device without bfloat16, say)
    assert run_cli("evaluate", out, "--json", "--precision", "double") == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == pytest.approx(result["test_accuracy"], abs=0.01)
    assert run_cli("evaluate", out, "--precision", "quarter") == 2
    assert "quarter" in capsys.readouterr().err

    # the same directory is never reused by accident
    assert run_cli("train", LENET, "--output", out, *QUICK) == 2
    assert "already holds files" in capsys.readouterr().err


def test_resume_continues_the_epoch_count(tmp_path, mnist, capsys):
    out = tmp_path / "run"
    assert run_cli("train", LENET, "--epochs", 1, "--output", out, *QUICK) == 0
    assert run_cli("train", LENET, "--epochs", 2, "--output", out, "--resume", *QUICK) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["epochs"] == 2 and len(result["epoch_summaries"]) == 1
    assert result["iterations"] == 32


@pytest.mark.parametrize("args, message", [
    (["--set", "training.epoch=2"], r"training\.epoch: unknown key 'epoch' in training"),
    (["--set", "training.epochs=two"], r"training\.epochs: must be an integer, got 'two'"),
    (["--set", "network.layers[0].kernel_size=[40, 40]"], r"network\.layers\[0\]\.kernel_size: kernel \[40, 40\]"),
    (["--set", "network.layers[5].type=dense"], r"network\.layers\[5\]\.loss: unknown field for DenseLayer"),
    (["--set", "network.layers[4].activation=swish"], r"network\.layers\[4\]\.activation: must be one of"),
    (["--averaging-frequency", "3"], r"training\.averaging_frequency: applies to parallel training only"),
    (["--workers", "2", "--parallelism", "{kind: data, sync: shared_gradients}", "--averaging-frequency", "2"],
     r"training\.averaging_frequency: applies to the data plan with averaging only"),
    (["--workers", "2", "--parallelism", "shards"], r"training\.parallelism: must be one of data, sharded, tensor"),
    (["--workers", "0"], r"training\.workers: must be a positive integer, got 0"),
    (["--backend", "gpu"], None),
])
def test_bad_settings_fail_before_training_with_the_key(tmp_path, mnist, capsys, args, message):
    out = tmp_path / "run"
    if message is None:  # gpu on a machine without CUDA
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA: --backend gpu is valid here")
        message = "the GPU backend was requested explicitly but cannot be used"
    assert run_cli("train", LENET, "--output", out, *args, *QUICK) == 2
    err = capsys.readouterr().err
    assert err.startswith("dl4py train: error: ")
    import re

    assert re.search(message, err), err
    assert not (out / "result.json").exists()


def test_unknown_layer_type_in_a_file_names_the_file_and_layer(tmp_path, capsys):
    text = LENET.read_text().replace("type: dense", "type: dense_layer")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert run_cli("summary", bad) == 2
    assert "bad.yaml: network.layers[4].type: unknown type 'dense_layer'" in capsys.readouterr().err


def test_summary_prints_shapes_without_training(capsys):
    assert run_cli("summary", LENET) == 0
    out = capsys.readouterr().out
    assert "20x24x24" in out and "400,500" in out and "Total parameters: 431,080" in out


def test_info_json_is_valid(capsys):
    assert run_cli("info", "--json") == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("backend", "backend_reason", "devices", "versions", "cpu", "default_dtype", "environment"):
        assert key in info
    assert info["versions"]["torch"]


def test_info_says_the_backend_once():
    """``dl4py info`` reports why it chose its backend; the fall-back warning other commands print
    once would say it a second time (a fresh process: the warning is once per process)."""
    proc = subprocess.run([sys.executable, "-m", "dl4py", "info"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "GPU backend unavailable" not in proc.stdout + proc.stderr
    assert re.search(r"^  why +\S", proc.stdout, re.MULTILINE), proc.stdout


@pytest.mark.slow
def test_console_entry_point_runs_as_a_module():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "dl4py", "summary", str(LENET)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Total parameters: 431,080" in proc.stdout


def test_train_with_two_workers_uses_the_parallel_wrapper(tmp_path, mnist, capsys):
    out = tmp_path / "run"
    assert run_cli("train", LENET, "--workers", 2, "--averaging-frequency", 3, "--output", out, *QUICK) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["workers"] == 2 and result["status"] == "completed"
    assert result["epoch_summaries"][0]["examples"] == 2048 and result["iterations"] == 16
    assert result["test_accuracy"] > 0.3
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["kind"] not in ("static", "stats")]  # the StatsListener's own
    assert [r["kind"] for r in records] == ["epoch", "evaluation"]  # written by worker 0
    assert (out / "checkpoint.dl4py").is_file()


@pytest.mark.parametrize("workers", [1, 2])
def test_early_stopping_from_the_config_writes_its_result_and_best_model(tmp_path, mnist, workers):
    out = tmp_path / "run"
    code = run_cli("train", LENET, "--output", out, "--workers", workers, *QUICK,
                   "--set", "training.early_stopping={metric: accuracy, patience: 2, max_epochs: 3}")
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    stopping = result["early_stopping"]
    assert stopping["termination_reason"] == "EpochTerminationCondition"
    assert stopping["termination_details"] in ("MaxEpochs(3)", "ScoreImprovement(patience=2, min_delta=0.0)")
    assert len(stopping["score_vs_epoch"]) == stopping["total_epochs"] <= 3
    best = max(stopping["score_vs_epoch"].values())
    assert stopping["best_model_score"] == best
    assert (out / "bestModel.dl4py").is_file()
    assert result["test_accuracy"] == pytest.approx(best)  # model.dl4py is the best model, scored on the same data
