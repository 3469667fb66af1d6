"""The planner's cost model (``dl4py.plan.model``), its answer (``plan.report``) and ``dl4py plan``.

The figures here come from a made-up device with flat rates, so that each plan's time can be
written down by hand from the network's work; whether the predictions match measured steps is
``benchmarks/plan.py``'s question.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dl4py import RunConfig
from dl4py.cli import main
from dl4py.errors import ConfigError
from dl4py.memory import estimate
from dl4py.memory.sharded import sharding_layout
from dl4py.plan.model import (FOR_LOOP_UPDATE_PASSES, cpu_shares, FRESH_PAGES_FROM, L2_PASSES, PAGE_BYTES, PAGE_FAULT_S,
                             UPDATE_PASSES, predict)
from dl4py.plan.profile import LOCAL, MEASURED, Curve, DeviceProfile, Link, ShardedCollective, Source, save_profile
from dl4py.plan.report import recommend
from dl4py.plan.work import step_work

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "examples" / "mlp_4000.yaml"  # 784-4000-4000-10, Nesterov
LENET = ROOT / "examples" / "lenet_mnist.yaml"
RESNET = ROOT / "examples" / "resnet_mnist.yaml"  # a graph
RATE, BANDWIDTH, OVERHEAD = 1e11, 1e10, 1e-6
LATENCY, LINK_BANDWIDTH = 1e-4, 1e9


def device(kind: str = "cuda", link_bandwidth: float = LINK_BANDWIDTH, memory: int = 16 * 2**30) -> DeviceProfile:
    flat = Curve(((1.0, RATE), (1e18, RATE)))
    links = tuple(Link(collective, "gloo" if kind == "cpu" else "nccl", ranks, LATENCY, link_bandwidth, LOCAL)
                  for collective in ("all_reduce", "all_gather") for ranks in (2, 4))
    return DeviceProfile("test device", kind, memory, {"float": flat}, {"float": flat}, BANDWIDTH, OVERHEAD,
                         Source(MEASURED, "made up"), threads=2 if kind == "cpu" else None, links=links)


def by_plan(predictions) -> dict:
    return {p.plan: p for p in predictions}


def hand_step_seconds(config, batch: int, share: float = 1.0, kind: str = "cuda") -> float:
    work = step_work(config, batch, device=kind)
    update = UPDATE_PASSES["nesterovs"] * sum(layer.parameter_bytes for layer in work.layers if not layer.frozen)
    return (work.flops / RATE + (work.bytes + update) / BANDWIDTH + work.kernels * OVERHEAD) / share


def link_seconds(nbytes: float) -> float:
    return LATENCY + nbytes / LINK_BANDWIDTH


def test_one_devices_step_is_its_layers_work_at_the_devices_rates():
    config = RunConfig.from_file(MLP)
    single = predict(config, device(), 1)[0]
    assert single.plan == "single" and single.communication_s == 0
    assert single.compute_s == pytest.approx(hand_step_seconds(config, 128), rel=1e-9)
    assert single.samples_per_second == pytest.approx(128 / single.compute_s)


def test_the_data_plans_exchange_what_their_replicas_meet_on():
    config = RunConfig.from_file(MLP)
    trained = step_work(config, 128).parameters * 4  # float32, as averaging.py exchanges
    plans = by_plan(predict(config, device(), 2, averaging_frequency=3))
    # Shared gradients: the participant count, then the gradients, every step; averaging.average's
    # four read-write passes over the flat buffer (cat, weighting, division, copy back).
    shared = link_seconds(8) + link_seconds(trained) + 8 * trained / BANDWIDTH
    assert plans["data-shared"].communication_s == pytest.approx(shared, rel=1e-9)
    assert plans["data-shared"].moved_bytes == trained
    # Averaging: parameters and Nesterov's momentum, every third round.
    averaged = 2 * trained
    assert plans["data-averaging"].communication_s == pytest.approx(
        (link_seconds(8) + link_seconds(averaged) + 8 * averaged / BANDWIDTH) / 3, rel=1e-9)
    # Each rank trains its own batch: a round trains two, in one device's step time.
    assert plans["data-shared"].samples_per_step == 256
    assert plans["data-shared"].compute_s == pytest.approx(hand_step_seconds(config, 128), rel=1e-9)


def test_ranks_on_one_cpu_share_it_and_gpus_do_not():
    config = RunConfig.from_file(LENET)
    on_gpus = by_plan(predict(config, device("cuda"), 2))
    on_cpu = by_plan(predict(config, device("cpu"), 2))
    assert on_gpus["data-shared"].compute_s == pytest.approx(on_gpus["single"].compute_s)
    assert on_cpu["data-shared"].compute_s == pytest.approx(2 * on_cpu["single"].compute_s)
    # So on one CPU no plan beats one process: the answer is separate experiments or one run.
    chosen, why = recommend(list(on_cpu.values()), step_work(config, 128))
    assert chosen.plan in ("single", "experiments") and "faster than one device" in why


def test_ranks_that_do_not_go_round_the_cores_go_at_the_most_crowded_ones_pace_where_they_synchronize():
    """Three ranks on two cores: over a step's long compute each gets a third of the CPU (the
    data plans, one exchange a step); the plans that synchronize at every unit or pair wait for
    a rank that shares its core, a quarter of the CPU. Where the ranks go round, one figure."""
    assert cpu_shares(3, 2) == (1 / 3, 1 / 4) and cpu_shares(4, 2) == (1 / 4, 1 / 4)
    assert cpu_shares(2, 2) == (1 / 2, 1 / 2) and cpu_shares(3, 8) == (2 / 8, 2 / 8)  # 2 threads each, 2 idle
    def at_three_ranks(path, threads):  # threads unknown (None): a third of the CPU for every plan
        return by_plan(predict(RunConfig.from_file(path), replace(device("cpu"), threads=threads), 3))

    # LeNet: no buffer large enough to fault in anew (whose cost divides by the threads too)
    crowded, even = at_three_ranks(LENET, 2), at_three_ranks(LENET, None)
    assert crowded["data-shared"].compute_s == pytest.approx(even["data-shared"].compute_s, rel=1e-12)
    assert crowded["sharded"].compute_s == pytest.approx(4 / 3 * even["sharded"].compute_s, rel=1e-12)
    crowded, even = at_three_ranks(MLP, 2), at_three_ranks(MLP, None)
    assert crowded["tensor"].compute_s == pytest.approx(4 / 3 * even["tensor"].compute_s, rel=1e-12)


def test_tensor_parallelism_splits_the_dense_pair_and_moves_its_activations():
    config = RunConfig.from_file(MLP)
    plans = by_plan(predict(config, device(), 2))
    tensor = plans["tensor"]
    assert tensor.admitted and tensor.samples_per_step == 128  # every rank the same batch
    # The pair is layers 0 and 1: the all-reduce of layer 1's output forward; layer 0 reads the
    # network's input, which takes no gradient, so nothing goes back.
    assert tensor.moved_bytes == 128 * 4000 * 4
    assert tensor.communication_s == pytest.approx(link_seconds(128 * 4000 * 4), rel=1e-9)
    # Half of the pair's work, all of the output layer's; its parameters are DTensors, which
    # torch's for-loop kernel steps (Nesterov's passes and L2's: the seed MLP has L2).
    work = step_work(config, 128)
    halved = sum(layer.flops for layer in work.layers if layer.index in (0, 1)) / 2
    fraction = {0: 0.5, 1: 0.5}
    for_loop = (FOR_LOOP_UPDATE_PASSES["nesterovs"] + L2_PASSES) * sum(
        fraction.get(layer.index, 1.0) * layer.parameter_bytes for layer in work.layers)
    fused = UPDATE_PASSES["nesterovs"] * sum(layer.parameter_bytes for layer in work.layers)
    assert tensor.compute_s < plans["single"].compute_s
    assert tensor.compute_s == pytest.approx(plans["single"].compute_s - halved / RATE - (sum(
        layer.bytes / 2 for layer in work.layers if layer.index in (0, 1)) + fused - for_loop) / BANDWIDTH, rel=1e-9)


def test_sharded_gathers_each_unit_twice_and_gloo_reduces_the_whole_unit():
    config = RunConfig.from_file(MLP)
    units = [(unit.shard_elements(2) * 4, unit.trains) for unit in sharding_layout(config.network)]
    gathers = sum(2 * link_seconds(part) for part, _ in units)
    # FSDP2's copies: each gather's shard in and unit out, each gradient unit into the reduce-scatter.
    copies = sum(4 * (part + 2 * part) + (4 * part if trains else 0) for part, trains in units) / BANDWIDTH
    # NCCL's reduce-scatter moves a part per rank, as an all-gather does.
    on_gpus = by_plan(predict(config, device("cuda"), 2))["sharded"]
    assert on_gpus.communication_s == pytest.approx(
        gathers + sum(link_seconds(part) for part, trains in units if trains) + copies, rel=1e-9)
    # gloo's reduces the whole unit, as an all-reduce; the copies run on a rank's half of the CPU.
    on_cpu = by_plan(predict(config, device("cpu"), 2))["sharded"]
    assert on_cpu.communication_s == pytest.approx(
        gathers + sum(link_seconds(2 * part) for part, trains in units if trains) + 2 * copies, rel=1e-9)


def test_a_sharded_steps_collectives_cost_what_the_profile_measured_inside_such_a_step():
    """Where the profile timed a collective inside a sharded step of as many ranks, each of
    the plan's gathers and reduce-scatters costs that in place of the link's latency; the
    other plans' exchanges, and other rank counts, keep the link's."""
    config = RunConfig.from_file(MLP)
    units = sharding_layout(config.network)
    collectives = sum(3 if unit.trains else 2 for unit in units)
    within = 25 * LATENCY
    plain = by_plan(predict(config, device("cpu"), 2))
    measured = replace(device("cpu"), sharded=(ShardedCollective("gloo", 2, within),))
    timed = by_plan(predict(config, measured, 2))
    assert timed["sharded"].communication_s - plain["sharded"].communication_s == pytest.approx(
        collectives * (within - LATENCY), rel=1e-9)
    for plan in ("data-averaging", "data-shared", "tensor"):
        assert timed[plan].step_s == plain[plan].step_s
    assert by_plan(predict(config, measured, 4))["sharded"] == by_plan(predict(config, device("cpu"), 4))["sharded"]


def test_a_cpu_faults_in_the_large_buffers_made_anew_every_step():
    config = RunConfig.from_file(MLP)
    trained = step_work(config, 128).parameters * 4
    on_cpu = by_plan(predict(config, device("cpu"), 2))
    # averaging.average's flat buffer of the 77 MB of gradients is over glibc's 32 MiB mmap
    # threshold: its pages are faulted in every step, on the rank's one thread of the two.
    faults = trained / PAGE_BYTES * PAGE_FAULT_S / 2
    assert trained > FRESH_PAGES_FROM
    assert on_cpu["data-shared"].communication_s == pytest.approx(
        link_seconds(8) + link_seconds(trained) + (8 * trained / BANDWIDTH + faults) / 0.5, rel=1e-9)
    # The 4000x4000 layer's 64 MB of gradients too (zero_grad drops them; counted by layer, its
    # bias with its weight); the 784x4000 layer's 12.5 MB stay under the threshold, reused.
    gradient_faults = (4000 * 4000 + 4000) * 4 / PAGE_BYTES * PAGE_FAULT_S / 2
    cpu_single = by_plan(predict(config, device("cpu"), 1))["single"]
    assert cpu_single.compute_s == pytest.approx(hand_step_seconds(config, 128, kind="cpu") + gradient_faults, rel=1e-9)


def test_plans_dl4py_cannot_train_a_network_with_are_refused_with_the_reason():
    lenet = by_plan(predict(RunConfig.from_file(LENET), device(), 2))
    assert not lenet["tensor"].admitted and "two hidden dense layers in a row" in lenet["tensor"].why_not
    assert not lenet["hybrid"].admitted
    graph = by_plan(predict(RunConfig.from_file(RESNET), device(), 2))
    assert not graph["tensor"].admitted and "graph" in graph["tensor"].why_not
    assert graph["sharded"].admitted and graph["sharded"].peak_bytes is None  # not estimated for graphs
    mlp = by_plan(predict(RunConfig.from_file(MLP), device(), 2))
    assert not mlp["hybrid"].admitted and "before the first dense layer" in mlp["hybrid"].why_not


def test_what_fits_is_the_memory_estimate_and_the_largest_batch_is_the_last_that_does():
    config = RunConfig.from_file(MLP)
    single_peak = estimate(config, 128, device="cuda").needed_bytes(True)
    plans = by_plan(predict(config, device(memory=single_peak - 1), 2, device_memory=single_peak - 1))
    assert plans["single"].fits is False and plans["single"].peak_bytes == single_peak
    assert plans["sharded"].fits is True  # half the parameters, gradients and momentum a rank
    assert plans["tensor"].fits is True  # half of each 4000-wide pair's weights a rank
    largest = plans["single"].largest_batch
    assert estimate(config, largest, device="cuda").needed_bytes(True) <= single_peak - 1
    assert estimate(config, largest + 1, device="cuda").needed_bytes(True) > single_peak - 1
    chosen, why = recommend(list(plans.values()), step_work(config, 128))
    fitting = [p for p in plans.values() if p.fits and p.plan != "experiments"]
    assert chosen == max(fitting, key=lambda p: p.samples_per_second) and "one device cannot hold a step" in why
    assert chosen.plan in ("sharded", "tensor"), chosen
    # On a roomy device the bound is the 2**31 elements CUDA kernels index, as dl4py memory says.
    roomy = by_plan(predict(RunConfig.from_file(LENET), device(memory=80 * 2**30), 2, device_memory=80 * 2**30))
    assert roomy["single"].largest_batch == estimate(RunConfig.from_file(LENET), 1).max_batch_by_elements == 186_413


def test_slow_links_leave_a_dense_network_on_one_device_and_fast_ones_spread_it():
    config = RunConfig.from_file(MLP)
    work = step_work(config, 128)
    slow, _ = recommend(predict(config, device(link_bandwidth=1e6), 4), work)
    fast, why = recommend(predict(config, device(link_bandwidth=1e13), 4), work)
    assert slow.plan in ("single", "experiments")
    assert fast.plan not in ("single", "experiments") and "dense layers hold 100% of the parameters" in why


def test_bad_inputs_are_one_line_errors():
    config = RunConfig.from_file(MLP)
    with pytest.raises(ConfigError, match="devices"):
        predict(config, device(), 0)
    with pytest.raises(ConfigError, match="batch_size"):
        predict(config, device(), 2, batch_size=0)


def test_dl4py_plan_prints_the_plans_and_the_recommendation(tmp_path, capsys, monkeypatch):
    profile = save_profile(device(), tmp_path / "profile.json")
    assert main(["plan", str(MLP), "--devices", "2", "--profile", str(profile), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert [p["plan"] for p in answer["plans"]] == ["single", "data-averaging", "data-shared", "sharded", "tensor",
                                                    "hybrid", "experiments"]
    assert answer["recommended"] in {p["plan"] for p in answer["plans"]} and answer["why"]
    assert main(["plan", str(LENET), "--devices", "4", "--profile", "h100"]) == 0
    shown = capsys.readouterr().out
    assert "recommended:" in shown and "data-shared" in shown
    # No profile measured on this machine yet: one line saying how to get one.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["plan", str(LENET), "--devices", "2"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "dl4py plan --profile" in error
    assert main(["plan"]) == 2
    assert "give a run config" in capsys.readouterr().err


FORUM_NET = """
network:
  updater: {{type: nesterovs, learning_rate: 0.01, momentum: 0.9}}
  input_type: {{type: feed_forward, size: 9000}}
  layers:
    - {{type: dense, n_out: {width}, activation: relu}}
    - {{type: dense, n_out: {width}, activation: relu}}
    - {{type: output, n_out: 32, activation: softmax, loss: mcxent}}
training: {{batch_size: 128}}
"""


def test_the_seed_threads_worked_example(tmp_path, capsys):
    """The forum's GTX Titan, 6 GiB: (6144 - 400) MiB / 8 bytes = 752,877,568 parameters by its rule;
    its Kaggle network, 9000-4000-4000-32, is far within one card. Widened until training (which
    keeps gradients too) no longer fits one card, the answer names the plan and device count."""
    kaggle, wide = tmp_path / "kaggle.yaml", tmp_path / "wide.yaml"
    kaggle.write_text(FORUM_NET.format(width=4000))
    wide.write_text(FORUM_NET.format(width=20000))
    assert main(["plan", str(kaggle), "--devices", "2", "--device-memory", "6GiB", "--profile", "h100", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)["capacity"]
    assert "holds 752,877,568 parameters" in said and "this network has 52,136,032" in said  # 52,128,000 weights
    assert "one device holds it 9.6 times over" in said
    assert main(["plan", str(wide), "--devices", "2", "--device-memory", "6GiB", "--profile", "h100", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)["capacity"]
    assert "this network has 580,680,032" in said and "sharded over 2 devices it fits" in said
