"""Each CPU worker's intra-op threads come from the user's budget (torch.get_num_threads() where
``fit`` is called, within the process's CPU affinity), shared out; ``threads_per_worker`` wins;
a run's environment.json says what the workers trained with. Each worker reports the threads
it trained with itself (``RankReport.threads``: torch.get_num_threads() in that process)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dl4py import ArrayDataSetIterator, MultiLayerNetwork
from dl4py.cli import main
from dl4py.config.run import TrainingConfig
from dl4py.errors import ConfigError
from dl4py.parallel import ParallelWrapper
from dl4py.parallel.threads import thread_budget, worker_threads

from toy import mlp, toy  # noqa: E402

PROCESS_TEST = pytest.mark.timeout(180)  # worker processes: a hang fails here, not at the suite's backstop


@pytest.fixture
def parent_threads():
    """Set this process's intra-op threads as a user would (torch.set_num_threads); restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def one_core():
    """This thread confined to one core (as taskset would); restored after."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    yield
    os.sched_setaffinity(0, before)


def _data():
    x, y = toy(16 * 4)
    return ArrayDataSetIterator(x, y, batch_size=16, shuffle=True, seed=1)


@PROCESS_TEST
@pytest.mark.parametrize("workers", [1, 2])
def test_workers_share_the_thread_budget_the_user_set(parent_threads, workers):
    parent_threads(1)  # what OMP_NUM_THREADS=1 also gives
    with ParallelWrapper(MultiLayerNetwork(mlp(), backend="cpu"), workers=workers) as wrapper:
        wrapper.fit(_data(), verbose=0)
        assert wrapper.last_threads == {rank: 1 for rank in range(workers)}


@PROCESS_TEST
def test_threads_per_worker_wins_over_the_budget(parent_threads):
    parent_threads(1)
    with ParallelWrapper(MultiLayerNetwork(mlp(), backend="cpu"), workers=2, threads_per_worker=2) as wrapper:
        wrapper.fit(_data(), verbose=0)
        assert wrapper.last_threads == {0: 2, 1: 2}
        wrapper.threads_per_worker = None  # the same workers, given the shared-out budget at the next fit
        wrapper.fit(_data(), verbose=0)
        assert wrapper.last_threads == {0: 1, 1: 1} and wrapper._pool.starts == 1


def test_the_budget_is_capped_by_the_cores_the_process_may_use(parent_threads, one_core):
    parent_threads(4)
    assert thread_budget() == 1
    assert worker_threads(cpu_workers=2) == 1  # at least 1 each
    assert worker_threads(cpu_workers=2, threads_per_worker=3) == 3


def test_a_launched_rank_takes_its_launchers_omp_num_threads(parent_threads, monkeypatch):
    parent_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads(cpu_workers=2, launched=True) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert worker_threads(cpu_workers=2, launched=True) == 1  # its own threads, set by the user
    assert worker_threads(cpu_workers=2, threads_per_worker=2, launched=True) == 2


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_a_bad_threads_per_worker_is_one_line_naming_it(value):
    with pytest.raises(ConfigError) as wrapper_error:
        ParallelWrapper(MultiLayerNetwork(mlp()), workers=2, threads_per_worker=value)
    assert str(wrapper_error.value) == f"threads_per_worker: must be a positive integer, got {value!r}"
    with pytest.raises(ConfigError) as config_error:
        TrainingConfig.from_dict({"workers": 2, "threads_per_worker": value}, "training")
    message = str(config_error.value)
    assert message.startswith("training.threads_per_worker: ") and "\n" not in message


@pytest.mark.gpu
def test_threads_per_worker_where_no_worker_trains_on_the_cpu_is_an_error():
    wrapper = ParallelWrapper(MultiLayerNetwork(mlp(), backend="gpu"), workers=1, devices=["cuda:0"],
                              threads_per_worker=2)
    with pytest.raises(ConfigError, match=r"^threads_per_worker: applies to workers on the CPU; these all train on "
                                          r"cuda:0$"):
        wrapper.fit(_data(), verbose=0)  # refused before any worker starts


def test_threads_per_worker_without_parallel_training_is_an_error():
    with pytest.raises(ConfigError, match=r"^training\.threads_per_worker: applies to parallel training only"):
        TrainingConfig.from_dict({"workers": 1, "threads_per_worker": 2}, "training")


RUN = """\
network:
  seed: 3
  updater: {type: sgd, learning_rate: 0.1}
  input_type: {type: convolutional_flat, height: 28, width: 28, channels: 1}
  layers:
    - {type: dense, n_out: 16, activation: relu}
    - {type: output, n_out: 10, activation: softmax, loss: negativeloglikelihood}
data: {dataset: mnist, seed: 1, limit_train: 256, limit_test: 64}
training:
  epochs: 1
  batch_size: 32
  backend: cpu
  workers: 2
"""


@PROCESS_TEST
@pytest.mark.parametrize("section, given, expected", [
    ("", [], 1),
    ("", ["--set", "training.threads_per_worker=2"], 2),
    ("  early_stopping: {max_epochs: 1}\n", ["--set", "training.threads_per_worker=2"], 2),
], ids=["budget", "threads_per_worker", "early_stopping"])
def test_a_parallel_runs_environment_json_records_the_worker_threads(tmp_path, mnist, parent_threads, capsys,
                                                                      section, given, expected):
    parent_threads(1)
    config = tmp_path / "run.yaml"
    config.write_text(RUN + section)
    assert main(["train", str(config), "--output", str(tmp_path / "run"), "--no-progress", *given]) == 0, \
        capsys.readouterr().err
    environment = json.loads((tmp_path / "run" / "environment.json").read_text())
    assert environment["workers"] == 2 and environment["worker_threads"] == {"0": expected, "1": expected}
    assert environment["cpu_threads"] == 1  # this process's own
