"""``training.parallelism: auto`` and ``training.workers: auto`` (``dl4py.plan.auto``): the run
trains by the planner's choice and records it beside what it measured.

The choices here are made on made-up devices (test_plan_model's), so that which plan is
fastest is known without timing anything; the launchers' own runs (spawn here, torchrun and
Spark in test_spark.py) check that a chosen plan trains and is recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dl4py import MultiLayerNetwork, RunConfig
from dl4py.cli import main
from dl4py.errors import ConfigError
from dl4py.parallel import ParallelWrapper
from dl4py.plan import auto
from dl4py.plan.auto import PlanChoice, choose
from dl4py.plan.model import predict
from dl4py.plan.profile import default_profile_path, save_profile
from test_plan_model import LINK_BANDWIDTH, device

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "examples" / "mlp_4000.yaml"  # 784-4000-4000-10: dense layers hold every parameter
LENET = ROOT / "examples" / "lenet_mnist.yaml"
CPU = torch.device("cpu")


def config_of(path: Path, **training) -> RunConfig:
    return RunConfig.from_file(path).with_overrides([f"training.{k}={json.dumps(v)}" for k, v in training.items()])


def fastest_known_to_fit(predictions):
    trainable = [p for p in predictions if p.admitted and p.plan not in ("experiments", "single") and p.fits is True]
    return max(trainable, key=lambda p: p.samples_per_second)


@pytest.mark.parametrize("link_bandwidth", [LINK_BANDWIDTH / 1000, LINK_BANDWIDTH * 1000])
def test_auto_trains_the_plan_predicted_fastest_among_those_known_to_fit(link_bandwidth):
    config = config_of(MLP, workers=4, parallelism="auto")
    profile = device("cuda", link_bandwidth=link_bandwidth)
    choice = choose(config, CPU, "spawn", profile=(profile, "made up"))
    expected = fastest_known_to_fit(predict(config, profile, 4, device_memory=profile.memory_bytes))
    assert (choice.plan, choice.workers) == (expected.plan, 4)
    assert choice.predicted["samples_per_second"] == pytest.approx(expected.samples_per_second)
    assert choice.asked == {"workers": 4, "parallelism": "auto"} and choice.profile == "made up"
    # Every plan it weighed is in the record, the chosen one the fastest of them.
    assert max(c["samples_per_second"] for c in choice.candidates) == pytest.approx(expected.samples_per_second)
    assert "tensor" in {c["plan"] for c in choice.candidates}  # its memory is estimated: weighed with the rest


def test_slow_and_fast_links_choose_apart_and_the_choice_is_a_config_that_trains():
    config = config_of(MLP, workers=4, parallelism="auto")
    slow = choose(config, CPU, "spawn", profile=(device("cuda", link_bandwidth=LINK_BANDWIDTH / 1000), "slow"))
    fast = choose(config, CPU, "spawn", profile=(device("cuda", link_bandwidth=LINK_BANDWIDTH * 1000), "fast"))
    assert slow.plan != fast.plan, (slow.plan, fast.plan)
    for choice in (slow, fast):
        trained = config.with_overrides(choice.overrides()).training
        assert trained.workers == 4 and trained.parallel_options().parallelism.kind in ("data", "sharded", "tensor")


def test_workers_auto_takes_one_device_unless_more_pay_and_records_why(monkeypatch):
    config = config_of(LENET, workers="auto")
    monkeypatch.setattr(auto, "_counts", lambda workers_auto, workers, device, world: [1, 2, 4] if workers_auto else [workers])
    # Ranks on one CPU share it: more of them never train faster than one process.
    shared = choose(config, CPU, "spawn", profile=(device("cpu"), "made up"))
    assert (shared.plan, shared.workers) == ("single", 1) and "single" in {c["plan"] for c in shared.candidates}
    assert shared.overrides() == ["training.workers=1", "training.parallelism=null"]
    weighed = [(c["plan"], c["workers"]) for c in shared.candidates]
    assert len(set(weighed)) == len(weighed), weighed  # one device's plan weighed once, not once per count
    # Four GPUs with fast links: the config's plan (the data plan, averaging) over all four.
    gpus = device("cuda", link_bandwidth=LINK_BANDWIDTH * 1000)
    spread = choose(config, CPU, "spawn", profile=(gpus, "gpus"))
    assert (spread.plan, spread.workers) == ("data-averaging", 4), spread
    assert spread.why.startswith("data-averaging on 4 device(s) is predicted to train")
    # parallelism: auto with the workers left at their default of 1 chooses the count as well,
    # among every plan.
    alone = choose(config_of(LENET, parallelism="auto"), CPU, "spawn", profile=(gpus, "gpus"))
    weighed = [p for n in (2, 4) for p in predict(config, gpus, n, device_memory=gpus.memory_bytes)]
    expected = fastest_known_to_fit(weighed)
    assert (alone.plan, alone.workers) == (expected.plan, expected.workers)
    # A plan given with workers: auto is kept; only the count is chosen.
    sharded = choose(config_of(LENET, workers="auto", parallelism="sharded"), CPU, "spawn", profile=(gpus, "gpus"))
    assert {c["plan"] for c in sharded.candidates} == {"single", "sharded"}


def test_what_auto_cannot_choose_is_one_line_naming_the_key():
    profile = (device("cuda"), "made up")
    cases = [(config_of(LENET, workers="auto", batch_size="auto"), "spawn",
              "training.batch_size: is auto, and so is the plan"),
             (config_of(LENET, workers="auto"), "spark", "training.workers: is auto: with launcher spark"),
             (config_of(MLP, workers=2, parallelism="auto"), "spawn", "training.parallelism: auto: no plan for 2")]
    tiny = (device("cuda", memory=2**20), "made up")
    for config, launcher, message in cases:
        with pytest.raises(ConfigError) as caught:
            choose(config, CPU, launcher, profile=tiny if "no plan" in message else profile)
        assert str(caught.value).startswith(message), str(caught.value)
    with pytest.raises(ConfigError, match="parallelism: auto is chosen by a run"):
        ParallelWrapper(MultiLayerNetwork(config_of(LENET).network).init(), workers=2, parallelism="auto")


def test_the_config_reads_auto_and_refuses_what_goes_with_a_plan_of_ones_own():
    assert config_of(LENET, workers="auto").training.chooses_plan
    assert config_of(LENET, parallelism="auto").training.parallelism.kind == "auto"
    for training, message in (({"parallelism": {"kind": "auto", "sync": "shared_gradients"}},
                               "training.parallelism: auto chooses the whole plan"),
                              ({"parallelism": "auot"}, "(did you mean 'auto'?)"),
                              ({"workers": 2, "parallelism": "auto", "training_mode": "sharded"},
                               "training.parallelism: is auto: leave training_mode")):
        with pytest.raises(ConfigError) as caught:
            config_of(LENET, **training)
        assert message in str(caught.value), str(caught.value)


def test_a_choice_is_recorded_and_read_back_whole():
    config = config_of(MLP, workers=4, parallelism="auto")
    choice = choose(config, CPU, "spawn", profile=(device("cuda"), "made up"))
    assert PlanChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice
    record = choice.with_measured(choice.predicted["samples_per_second"] / 2)
    assert record["measured"]["over_predicted"] == pytest.approx(0.5)


@pytest.mark.slow  # two spawned workers train
@pytest.mark.timeout(300)
def test_dl4py_train_with_parallelism_auto_trains_the_choice_and_records_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_profile(device("cpu"), default_profile_path("cpu"))  # this machine's "measured" profile
    out = tmp_path / "run"
    code = main(["train", str(LENET), "--workers", "2", "--parallelism", "auto", "--output", str(out),
                 "--set", "data.limit_train=512", "--set", "data.limit_test=100", "--no-progress"])
    assert code == 0, capsys.readouterr().err[-2000:]
    result = json.loads((out / "result.json").read_text())
    plan = result["plan"]
    expected = fastest_known_to_fit(predict(config_of(LENET, workers=2), device("cpu"), 2,
                                            device_memory=device("cpu").memory_bytes))
    assert (plan["plan"], plan["workers"]) == (expected.plan, 2) and result["workers"] == 2
    assert plan["profile"] == str(default_profile_path("cpu"))
    assert plan["measured"]["samples_per_second"] == result["train_samples_per_second"] > 0
    assert plan["measured"]["over_predicted"] == pytest.approx(
        result["train_samples_per_second"] / plan["predicted"]["samples_per_second"])
    recorded = RunConfig.from_file(out / "config.yaml").training  # the run's config holds the choice
    assert recorded.workers == 2 and recorded.parallel_options().parallelism == auto.PLAN_SETTINGS[expected.plan]
    assert os.environ["XDG_CACHE_HOME"] == str(tmp_path / "cache")
