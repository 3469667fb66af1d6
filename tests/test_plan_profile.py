"""Device profiles (``dl4py.plan.profile``, ``plan.measure``, ``plan.builtin_profiles``): a quick real
measurement of this CPU with two gloo ranks, the JSON file and its errors, the published
profiles, calibration and cluster links."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dl4py.errors import BackendError, ConfigError
from dl4py.plan.builtin_profiles import PUBLISHED, builtin_profile, calibrate, cluster_profile, parse_rate
from dl4py.plan.measure import fit_latency_bandwidth, measure_profile
from dl4py.plan.profile import (
    COLLECTIVES,
    KINDS,
    NETWORK,
    Curve,
    default_profile_path,
    load_profile,
    save_profile,
)
from ranks import commands_running

RANK_MARK = "link_rank_main"  # in the command line of every rank process


def children() -> set[int]:
    """Process ids whose parent is this process."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            found.add(int(entry.name))
    return found


@pytest.fixture(scope="module")
def measured():
    """One quick measurement for the module: one thread, so another process on the other
    core does not make a large product wait for its second thread."""
    before = children()
    profile = measure_profile("cpu", ranks=(2,), threads=1, quick=True)
    return profile, children() - before


@pytest.mark.timeout(180)  # a rank that hangs must fail this test, not hang the suite
def test_quick_measurement_gives_positive_finite_rates(measured):
    profile, _ = measured
    assert profile.kind == "cpu" and profile.threads == 1 and profile.source.kind == "measured"
    assert profile.source.torch and profile.source.date and profile.source.hardware
    rates = [rate for kind in KINDS for curve in getattr(profile, kind).values() for _, rate in curve.points]
    assert rates and set(profile.matmul) == set(profile.conv) == {"float"}
    for value in rates + [profile.memory_bandwidth, profile.overhead_s, profile.memory_bytes]:
        assert 0 < value < math.inf


@pytest.mark.timeout(180)
def test_matmul_is_faster_per_flop_at_a_large_size_than_at_a_tiny_one(measured):
    profile, _ = measured
    points = profile.matmul["float"].points
    assert len(points) >= 2, points
    (tiny, tiny_rate), (large, large_rate) = points[0], points[-1]
    assert large_rate > tiny_rate, points
    assert profile.rate("matmul", "float", large) > profile.rate("matmul", "float", tiny)


@pytest.mark.timeout(180)
def test_collectives_are_timed_among_two_gloo_ranks_and_none_is_left(measured):
    profile, started = measured
    for collective in COLLECTIVES:
        link = profile.link(collective, 2)
        assert link is not None and link.backend == "gloo", profile.links
        assert 0 < link.bandwidth < math.inf and link.latency_s >= 0
        assert len(link.samples) >= 2 and all(seconds > 0 for _, seconds in link.samples)
        assert link.seconds(2**24) > link.seconds(2**12)
    # a collective inside a sharded step costs something, and not seconds (sharded_probe)
    within_step = profile.sharded_collective_s(2)
    assert within_step is not None and 0 < within_step < 1, profile.sharded
    assert started == set()  # every rank process this test's measurement started has exited
    assert commands_running(RANK_MARK) == []


@pytest.mark.timeout(120)
def test_a_measurement_past_its_budget_kills_its_ranks():
    with pytest.raises(BackendError, match="killed; give a larger budget_s"):
        measure_profile("cpu", ranks=(2,), threads=1, quick=True, budget_s=0.5)
    assert commands_running(RANK_MARK) == []


def test_bad_arguments_are_named():
    with pytest.raises(ConfigError, match="^ranks:"):
        measure_profile("cpu", ranks=(1,), quick=True)
    with pytest.raises(ConfigError, match="^backend:"):
        measure_profile("cpu", backend="nccl", quick=True)
    with pytest.raises(ConfigError, match="^budget_s:"):
        measure_profile("cpu", budget_s=0, quick=True)


def test_latency_and_bandwidth_are_recovered_from_exact_timings():
    samples = [(n, 50e-6 + n / 2e9) for n in (4096, 65536, 2**20, 2**24)]
    latency, bandwidth = fit_latency_bandwidth(samples)
    assert latency == pytest.approx(50e-6, rel=1e-6) and bandwidth == pytest.approx(2e9, rel=1e-6)


def test_a_curve_interpolates_and_keeps_its_ends():
    curve = Curve(((1e3, 1e9), (1e6, 1e11), (1e9, 1e12)))
    assert curve.rate(1e6) == pytest.approx(1e11)
    assert 1e11 < curve.rate(1e7) < 1e12
    assert curve.rate(1e12) == 1e12  # the plateau
    assert curve.rate(1e2) == pytest.approx(1e8)  # below the smallest: that call's time, no faster
    assert curve.peak == 1e12


def test_json_round_trip_is_exact(tmp_path, measured):
    for profile in (measured[0], builtin_profile("h100"), cluster_profile(measured[0])):
        path = save_profile(profile, tmp_path / "profile.json")
        assert load_profile(path) == profile
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]  # no temporary file left


def _broken(tmp_path, edit) -> str:
    data = builtin_profile("a100").to_dict()
    edit(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as caught:
        load_profile(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    return message


def test_a_bad_file_is_a_one_line_error_naming_file_and_key(tmp_path):
    assert "links[3].bandwidth: must be a positive number" in _broken(
        tmp_path, lambda d: d["links"][3].update(bandwidth=-1))
    assert "matmul.bfloat16[1]" in _broken(tmp_path, lambda d: d["matmul"]["bfloat16"][1].pop())
    assert "links[0].ranks: must be a positive whole number" in _broken(
        tmp_path, lambda d: d["links"][0].update(ranks=2.5))
    assert "overhead_s: missing" in _broken(tmp_path, lambda d: d.pop("overhead_s"))
    assert "conv.fp8: unknown key" in _broken(tmp_path, lambda d: d["conv"].update(fp8=[[1, 1]]))
    assert "source.kind: must be one of" in _broken(tmp_path, lambda d: d["source"].update(kind="guessed"))
    assert "format: must be 1" in _broken(tmp_path, lambda d: d.update(format=2))
    assert "sharded[0].seconds: must be a number >= 0" in _broken(tmp_path, lambda d: d.update(
        sharded=[{"backend": "gloo", "ranks": 2, "seconds": -1.0, "scope": "local"}]))
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(builtin_profile("a100").to_dict())[:200])
    with pytest.raises(ConfigError, match=f"^{partial}: is not valid JSON"):
        load_profile(partial)
    with pytest.raises(ConfigError, match="cannot read the profile"):
        load_profile(tmp_path / "absent.json")


def test_default_location_is_in_dl4py_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = default_profile_path("cuda:1")
    assert path.parent == tmp_path / "dl4py"
    assert path.name.startswith("plan-profile-") and path.name.endswith("-cuda1.json")


def test_builtin_profiles_have_sane_orders_of_magnitude():
    for name in ("h100", "h200", "a100", "l4", "rtx4090", "t4"):
        profile = builtin_profile(name)
        assert 1e12 < profile.matmul["float"].peak < 1e14, name
        assert 1e13 < profile.matmul["half"].peak < 1e15, name
        assert 1e11 < profile.memory_bandwidth < 1e13 and 1e10 < profile.memory_bytes < 2e11, name
        assert profile.link("all_reduce", 8).bandwidth > 1e9, name
    h100 = builtin_profile("h100")
    assert h100.matmul["bfloat16"].peak > 10 * h100.matmul["float"].peak
    assert h100.conv["float"].peak > h100.matmul["float"].peak  # cuDNN's TF32, PyTorch's default
    assert h100.source.efficiency["compute"] == 0.6
    assert h100.matmul["bfloat16"].peak == pytest.approx(0.6 * PUBLISHED["h100"]["matmul"]["bfloat16"])
    assert builtin_profile("h200").memory_bytes > h100.memory_bytes
    with pytest.raises(BackendError, match="no matmul rate in bfloat16"):
        builtin_profile("t4").rate("matmul", "bfloat16", 1e9)
    with pytest.raises(ConfigError, match="^profile: no built-in profile 'h300'"):
        builtin_profile("h300")


def test_calibrate_puts_measured_rates_in_and_records_the_efficiency(measured):
    builtin = builtin_profile("h100")
    on_gpu = replace(measured[0], kind="cuda", matmul={"bfloat16": Curve(((1e9, 1e14), (1e12, 4.947e14)))})
    calibrated = calibrate(builtin, on_gpu)
    assert calibrated.matmul["bfloat16"] == on_gpu.matmul["bfloat16"]
    assert calibrated.source.kind == "calibrated"
    assert calibrated.source.efficiency["matmul/bfloat16"] == pytest.approx(0.5)
    # not measured: the published peak at the efficiency found for matrix products
    assert calibrated.matmul["half"].peak == pytest.approx(0.5 * PUBLISHED["h100"]["matmul"]["half"])
    assert calibrated.memory_bandwidth == on_gpu.memory_bandwidth and calibrated.overhead_s == on_gpu.overhead_s
    assert calibrated.link("all_reduce", 2).samples  # measured, in place of the published one
    assert calibrated.link("all_reduce", 8) == builtin.link("all_reduce", 8)
    with pytest.raises(ConfigError, match="^measured:"):
        calibrate(builtin, measured[0])  # measured on a CPU


def test_cluster_profile_parses_rates_and_refuses_nonsense(measured):
    cluster = cluster_profile(measured[0], bandwidth="25GB/s", latency="10us", ranks=(2, 4))
    link = cluster.link("all_reduce", 2, NETWORK)
    assert link.bandwidth == pytest.approx(25e9)  # 2 ranks: the buffer crosses once each way
    assert link.latency_s == pytest.approx(20e-6)
    assert cluster.link("all_reduce", 2) == measured[0].link("all_reduce", 2)  # within the machine: kept
    assert parse_rate("200Gbit/s", "bandwidth") == 25e9
    for bad in ("fast", "25Gb/s", "0GB/s"):
        with pytest.raises(ConfigError, match="^bandwidth:"):
            cluster_profile(measured[0], bandwidth=bad)
    with pytest.raises(ConfigError, match="^latency:"):
        cluster_profile(measured[0], latency="soon")


def test_a_curve_whose_first_size_stalls_still_measures_the_next():
    """On a loaded machine every call of the first size can wait on the thread pool; the budget
    projected from that one point must not end the curve at it (a matmul curve of one point at
    4 MFLOP/s made every prediction seconds long)."""
    from dl4py.plan.measure import _Timer

    def stalled():
        return lambda: time.sleep(0.016)  # a 32x32 product's 65,536 FLOPs at 4 MFLOP/s

    def quick():
        return lambda: None

    curve = _Timer(torch.device("cpu"), repeats=3).curve([(65_536, stalled), (4_194_304, quick)], share_s=0.5)
    assert len(curve.points) == 2 and curve.points[1][1] > curve.points[0][1]
