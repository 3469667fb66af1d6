"""``dl4py plan --measure-layers`` (``dl4py.plan.layer_times``): the network's own layers timed
on this CPU, used by the cost model in place of the profile's curves.

The arithmetic is checked with made-up times (so that each plan's compute can be written down
by hand); the timing itself only for what it must give: every layer with a module, in both
layouts, and the update in both kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dl4py import RunConfig
from dl4py.cli import main
from dl4py.errors import ConfigError
from dl4py.plan.layer_times import LayerTimes, measure_layers
from dl4py.plan.model import predict
from dl4py.plan.profile import default_profile_path, save_profile
from dl4py.plan.work import layer_parts, step_work
from test_plan_model import device

ROOT = Path(__file__).resolve().parents[1]
LENET = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml")
MLP = RunConfig.from_file(ROOT / "examples" / "mlp_4000.yaml")
BATCH = 16


def made_up(config, batch: int) -> LayerTimes:
    """Times that tell the layouts and kernels apart: the whole step 0.5 s channels-last and
    0.9 s contiguous; layer i's forward i+1 ms in NHWC and 10x that in NCHW, its backward twice
    its forward; the update 3 ms fused, 7 ms looped; FSDP2's own work 40 ms."""
    indices = [part.index for part in layer_parts(config.network) if part.module is not None]
    forward = {"nhwc": {i: (i + 1) * 1e-3 for i in indices}, "nchw": {i: (i + 1) * 1e-2 for i in indices}}
    backward = {layout: {i: 2 * t for i, t in times.items()} for layout, times in forward.items()}
    return LayerTimes(batch, 2, forward, backward, {"fused": 3e-3, "loop": 7e-3}, 0.04, {"nhwc": 0.5, "nchw": 0.9})


def test_the_whole_steps_time_is_kept_and_only_what_a_rank_leaves_or_adds_is_taken_off_or_on():
    """With the network timed, each plan's compute is its whole step (the glue between layers
    included) in the plan's layout, less the parts of split layers a rank leaves to the others,
    its update swapped for the for-loop kernel's where the plan is distributed; FSDP2's
    measured work is added to the sharded plan's."""
    times = made_up(MLP, BATCH)
    profile = device("cpu")
    plans = {p.plan: p for p in predict(MLP, profile, 2, batch_size=BATCH, layer_times=times)}
    curves = {p.plan: p for p in predict(MLP, profile, 2, batch_size=BATCH)}
    assert plans["single"].compute_s == pytest.approx(0.5)  # channels-last, as channels_last auto trains it
    assert curves["single"].compute_s != pytest.approx(0.5)
    assert plans["data-averaging"].compute_s == pytest.approx(2 * 0.5)  # half the CPU each
    assert plans["sharded"].compute_s == pytest.approx(2 * (0.9 + 7e-3 - 3e-3))  # NCHW, the for-loop update
    assert plans["sharded"].communication_s == pytest.approx(curves["sharded"].communication_s + 0.04)
    # Tensor: the dense pair (layers 0 and 1) split in two, every rank the same batch: half of
    # each layer's time and half of its update is another rank's.
    work = {layer.index: layer for layer in step_work(MLP, BATCH, device="cpu").layers}
    trained = sum(layer.parameters for layer in work.values())
    left = sum(0.5 * 3 * times.forward["nchw"][i] + 0.5 * 3e-3 * work[i].parameters / trained for i in (0, 1))
    swapped = sum((0.5 if i in (0, 1) else 1.0) * (7e-3 - 3e-3) * work[i].parameters / trained for i in work)
    assert plans["tensor"].compute_s == pytest.approx(2 * (0.9 - left + swapped))


def test_layers_are_timed_in_both_layouts_and_the_update_in_both_kernels():
    times = measure_layers(MLP, BATCH)
    modules = [part.index for part in layer_parts(MLP.network) if part.module is not None]
    for layout in ("nhwc", "nchw"):
        assert sorted(times.forward[layout]) == modules and sorted(times.backward[layout]) == modules
        assert all(seconds > 0 for seconds in times.forward[layout].values())
    # The 4000x4000 layer does 400 times the work of the 4000x10 output layer: it times slower.
    assert times.forward["nhwc"][1] > times.forward["nhwc"][2]
    assert set(times.update) == {"fused", "loop"} and all(s > 0 for s in times.update.values())
    assert set(times.step) == {"nhwc", "nchw"} and all(s > 0 for s in times.step.values())
    assert times.sharded_overhead_s is not None and times.sharded_overhead_s >= 0


def test_times_of_another_batch_or_device_are_refused(tmp_path, capsys, monkeypatch):
    with pytest.raises(ConfigError, match="layer_times: were timed at batch 16, not 32"):
        predict(LENET, device("cpu"), 2, batch_size=32, layer_times=made_up(LENET, BATCH))
    gpu_profile = tmp_path / "gpu.json"
    save_profile(device("cuda"), gpu_profile)
    code = main(["plan", str(ROOT / "examples" / "lenet_mnist.yaml"), "--devices", "2", "--profile",
                 str(gpu_profile), "--measure-layers"])
    if torch.cuda.is_available():  # a GPU's profile: the network timed on this machine's GPU
        assert code == 0, capsys.readouterr().err
    else:  # a machine without one refuses, naming why
        assert code == 2 and "--measure-layers: times the network on this machine, which has no CUDA device" \
            in capsys.readouterr().err


def test_a_plan_with_this_machines_own_profile_times_the_network_unless_told_not_to(tmp_path, capsys, monkeypatch):
    """With this machine's saved profile (no --profile) ``dl4py plan`` times the network here by
    default, and says so; ``--no-measure-layers`` predicts from the curves alone; a named
    profile (a device one may not have) is not timed unless asked."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    save_profile(device("cpu"), default_profile_path("cpu"))
    config = str(ROOT / "examples" / "lenet_mnist.yaml")
    timed_here = "the network's layers timed here at batch 16"
    assert main(["plan", config, "--devices", "2", "--batch-size", "16", "--json"]) == 0
    out, err = capsys.readouterr()
    assert timed_here in json.loads(out)["profile"] and "--no-measure-layers skips it" in err
    assert main(["plan", config, "--devices", "2", "--batch-size", "16", "--no-measure-layers", "--json"]) == 0
    assert timed_here not in json.loads(capsys.readouterr().out)["profile"]
    named = save_profile(device("cpu"), tmp_path / "named.json")
    assert main(["plan", config, "--devices", "2", "--batch-size", "16", "--profile", str(named), "--json"]) == 0
    assert timed_here not in json.loads(capsys.readouterr().out)["profile"]
