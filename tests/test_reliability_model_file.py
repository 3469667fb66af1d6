"""A model file's config.json cannot make dl4py allocate what its weights never needed (issue 28).

``n_out: 1000000000`` in the config of a file whose weights hold 10 outputs once built the
network first: terabytes asked of the allocator and a traceback, or, for a size that fits,
the memory really taken before the weights were compared. The config's tensors are now
compared with the weights, by name and shape, before anything is built."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import dl4py
from dl4py import ComputationGraph, MultiLayerNetwork, NetworkConfig
from dl4py.config.graph import GraphConfig
from dl4py.errors import ModelFileError
from test_config import SAMPLES, sample_layers

ROOT = Path(__file__).resolve().parents[1]
NETWORK = {
    "seed": 1,
    "updater": {"type": "nesterovs", "learning_rate": 0.1},
    "input_type": {"type": "feed_forward", "size": 4},
    "layers": [{"type": "dense", "n_out": 8, "activation": "relu"},
               {"type": "output", "n_out": 3, "activation": "softmax", "loss": "mcxent"}],
}
HUGE = 10**12  # output rows of 8 weights: 32 TB in float32, beyond any allocator
FITS = 25_000_000  # 800 MB in float32: an allocator gives it, and the build would take it
MIB = 2**20


def _saved_entries(tmp_path: Path, precision: str = "float") -> dict[str, bytes]:
    """The entries of a real tiny model, trained one step (so it has updater state) and saved."""
    net = MultiLayerNetwork(NetworkConfig.from_dict(NETWORK), backend="cpu", precision=precision)
    rng = np.random.default_rng(0)
    net.fit((rng.random((8, 4), dtype=np.float32), np.arange(8) % 3))
    path = tmp_path / f"good-{precision}.dl4py"
    net.save(path)
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _write(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return path


def _with_n_out(entries: dict[str, bytes], layer: int, n_out: int) -> dict[str, bytes]:
    config = json.loads(entries["config.json"])
    config["layers"][layer]["n_out"] = n_out
    return {**entries, "config.json": json.dumps(config).encode()}


def _with_tensors(entries: dict[str, bytes], entry: str, edit) -> dict[str, bytes]:
    return {**entries, entry: st_save(edit(st_load(entries[entry])))}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, bytes]:
    return _saved_entries(tmp_path_factory.mktemp("good"))


@pytest.fixture(scope="module")
def crafted(good, tmp_path_factory) -> dict[str, Path]:
    """A real saved model with config.json rewritten: outputs beyond any memory, outputs that
    fit in memory, a hidden layer one wider than its weights."""
    folder = tmp_path_factory.mktemp("crafted")
    return {
        "huge": _write(folder / "huge.dl4py", _with_n_out(good, 1, HUGE)),
        "fits": _write(folder / "fits.dl4py", _with_n_out(good, 1, FITS)),
        "hidden": _write(folder / "hidden.dl4py", _with_n_out(good, 0, 9)),
        "good": _write(folder / "good.dl4py", good),
    }



@pytest.mark.parametrize("case, message", [
    ("huge", "config.json's network.layers[1] (output) declares 1.op.weight of shape [1000000000000, 8] "
             "(8,000,000,000,000 values), but weights.safetensors holds it as [3, 8] (24 values)"),
    ("fits", "config.json's network.layers[1] (output) declares 1.op.weight of shape [25000000, 8] "
             "(200,000,000 values), but weights.safetensors holds it as [3, 8] (24 values)"),
    ("hidden", "config.json's network.layers[0] (dense) declares 0.op.weight of shape [9, 4] (36 values), "
               "but weights.safetensors holds it as [8, 4] (32 values)"),
], ids=["huge", "fits", "hidden"])
def test_a_config_larger_than_its_weights_is_refused_naming_the_layer(crafted, case, message):
    path = crafted[case]
    with pytest.raises(ModelFileError) as caught:
        dl4py.load(path)
    assert str(caught.value) == f"{path} is not a valid dl4py model: {message}"


def test_weights_the_config_does_not_declare_are_refused(good, tmp_path):
    missing = _write(tmp_path / "missing.dl4py",
                     _with_tensors(good, "weights.safetensors", lambda t: {k: v for k, v in t.items() if k != "1.op.bias"}))
    extra = _write(tmp_path / "extra.dl4py",
                   _with_tensors(good, "weights.safetensors", lambda t: {**t, "2.op.weight": t["1.op.weight"].clone()}))
    with pytest.raises(ModelFileError, match=r"network\.layers\[1\] \(output\) declares 1\.op\.bias of shape \[3\], "
                                             r"which weights\.safetensors lacks$"):
        dl4py.load(missing)
    with pytest.raises(ModelFileError, match=r"weights\.safetensors holds 2\.op\.weight, which config\.json's "
                                             r"network does not declare$"):
        dl4py.load(extra)


def test_float32_master_weights_of_another_shape_are_refused(tmp_path):
    entries = _saved_entries(tmp_path, precision="bfloat16")
    assert "master.safetensors" in entries
    wider = _with_tensors(entries, "master.safetensors", lambda t: {**t, "0.op.weight": t["0.op.weight"].repeat(2, 1)})
    with pytest.raises(ModelFileError, match=r"master\.safetensors holds 0\.op\.weight as \[16, 4\], but "
                                             r"config\.json's network\.layers\[0\] \(dense\) declares \[8, 4\]$"):
        dl4py.load(_write(tmp_path / "wider.dl4py", wider))


def test_a_size_no_tensor_can_have_is_one_line(good, tmp_path):
    path = _write(tmp_path / "overflow.dl4py", _with_n_out(good, 0, 10**30))
    with pytest.raises(ModelFileError) as caught:
        dl4py.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path} is not a valid dl4py model: config.json declares a network that cannot "
                              "be built: "), message
    assert "\n" not in message, message


def test_a_graph_config_larger_than_its_weights_names_the_vertex(tmp_path):
    config = GraphConfig.from_dict({
        "inputs": {"x": {"type": "feed_forward", "size": 4}},
        "vertices": {"hidden": {"inputs": ["x"], "layer": {"type": "dense", "n_out": 5}},
                     "out": {"inputs": ["hidden"], "layer": {"type": "output", "n_out": 2}}},
        "outputs": ["out"], "seed": 3})
    path = tmp_path / "graph.dl4py"
    ComputationGraph(config, backend="cpu").save(path)
    assert dl4py.load(path).num_params() == 4 * 5 + 5 + 5 * 2 + 2
    with zipfile.ZipFile(path) as zf:
        entries = {name: zf.read(name) for name in zf.namelist()}
    raw = json.loads(entries["config.json"])
    raw["vertices"]["out"]["layer"]["n_out"] = HUGE
    crafted = _write(tmp_path / "crafted.dl4py", {**entries, "config.json": json.dumps(raw).encode()})
    with pytest.raises(ModelFileError, match=r"config\.json's network\.vertices\.out \(output\) declares "
                                             r"vertices\.out\.op\.weight of shape \[1000000000000, 5\]"):
        dl4py.load(crafted)


def _network_of(type_name: str) -> NetworkConfig:
    """A valid network holding test_config's sample of ``type_name`` (as its round-trip test places it)."""
    input_type, layers = sample_layers(type_name)
    return NetworkConfig(layers=layers, input_type=input_type, seed=7)


def test_every_layer_type_saved_honestly_still_loads(tmp_path):
    # The declared shapes come from the layers' own constructors on the meta device: none may
    # differ from a real build's, or honest files would be refused.
    for type_name in sorted(SAMPLES):
        net = MultiLayerNetwork(_network_of(type_name), backend="cpu").init()
        path = tmp_path / f"{type_name}.dl4py"
        net.save(path)
        assert dl4py.load(path).num_params() == net.num_params(), type_name


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_memory_stays_bounded_and_the_cli_says_one_line(crafted):
    # One process (each costs seconds of imports): the library's load, then the CLI's main
    # for each command that loads a model file, peak resident memory measured around both.
    report = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import contextlib, io, json, resource, sys, traceback
        import dl4py
        from dl4py import DataError
        from dl4py.cli import main

        def peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

        good, *crafted = sys.argv[1:]
        dl4py.load(good)  # imports and first-load allocations happen before the measurement
        before, loads, cli = peak(), {}, {}
        for path in crafted:
            try:
                loads[path] = ["loaded", dl4py.load(path).num_params()]
            except DataError as exc:
                loads[path] = ["refused", str(exc)]
            for command in (["evaluate", path], ["predict", path, good], ["export", path, "--format", "safetensors"],
                            ["serve", path, "--port", "0"]):
                err = io.StringIO()
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    try:
                        rc = main(command)
                    except BaseException:
                        traceback.print_exc()
                        rc = "raised"
                cli[" ".join(command)] = [rc, err.getvalue()]
        print(json.dumps({"growth": peak() - before, "loads": loads, "cli": cli}))
    """), *(crafted[name] for name in ("good", "huge", "fits"))],
        capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert report.returncode == 0, report.stderr
    answer = json.loads(report.stdout)
    for path in (crafted["huge"], crafted["fits"]):
        outcome, message = answer["loads"][str(path)]
        assert outcome == "refused" and message.startswith(f"{path} is not a valid dl4py model: config.json's "
                                                           "network.layers[1] (output) declares"), message
    for command, (rc, stderr) in answer["cli"].items():
        lines = stderr.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, (command, stderr)
        assert "is not a valid dl4py model: config.json's network.layers[1] (output)" in lines[0], (command, stderr)
    assert answer["growth"] < 200 * MIB, f"peak memory grew by {answer['growth'] / MIB:.0f} MiB"
