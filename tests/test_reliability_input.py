"""Bad input is one sentence naming what is wrong and where (issue 13, groups 5 and 8):
corrupt model files, zip bombs, binary configs, labels beyond the output layer, limits
beyond the data, and ``1e-3`` in YAML."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import dl4py
from dl4py import ArrayDataSetIterator, DataError, MultiLayerNetwork, NetworkConfig
from dl4py.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
NETWORK = {
    "seed": 1,
    "updater": {"type": "sgd", "learning_rate": 0.1},
    "input_type": {"type": "feed_forward", "size": 4},
    "layers": [{"type": "dense", "n_out": 8, "activation": "relu"},
               {"type": "output", "n_out": 3, "activation": "softmax", "loss": "mcxent"}],
}


def _python(code: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _dl4py(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dl4py", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def _assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---- corrupt model files ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_entries(tmp_path_factory) -> dict[str, bytes]:
    """The entries of a real tiny model saved with its updater state (momentum buffers)."""
    config = NetworkConfig.from_dict({**NETWORK, "updater": {"type": "nesterovs", "learning_rate": 0.1}})
    net = MultiLayerNetwork(config, backend="cpu")
    rng = np.random.default_rng(0)
    net.fit((rng.random((8, 4), dtype=np.float32), np.arange(8) % 3))
    path = tmp_path_factory.mktemp("good") / "m.dl4py"
    net.save(path)
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _zip(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def _with(**changes):
    """A rewrite of the good file: entry -> new bytes, or None to drop it (dots as __)."""
    def make(entries):
        out = dict(entries)
        for key, value in changes.items():
            name = key.replace("__", ".")
            if value is None:
                out.pop(name)
            else:
                out[name] = value(entries[name]) if callable(value) else value
        return _zip(out)
    return make


def _generators(state: bytes) -> bytes:
    from safetensors.torch import save

    return save({"cpu": torch.frombuffer(bytearray(state), dtype=torch.uint8)})


def _meta(edit):
    return lambda raw: json.dumps(edit(json.loads(raw))).encode()


CORRUPT = {
    "missing meta": _with(meta__json=None),
    "non-JSON meta": _with(meta__json=b"{format: dl4py-model"),
    "meta a list": _with(meta__json=b'["dl4py-model", 1]'),
    "missing config": _with(config__json=None),
    "non-JSON config": _with(config__json=b"\x00\xff not json"),
    "unknown precision": _with(meta__json=_meta(lambda m: {**m, "precision": "float128"})),
    "missing precision": _with(meta__json=_meta(lambda m: {k: v for k, v in m.items() if k != "precision"})),
    "garbage updater.json": _with(updater__json=b"{{{"),
    "missing updater tensors": _with(updater__safetensors=None),
    "garbage weights": _with(weights__safetensors=b"\x07" * 64),
    # A mid-epoch checkpoint's dropout generator state (issue: exact mid-epoch resume).
    "randomness without its entry": _with(meta__json=_meta(lambda m: {**m, "randomness": [0, 3, 0]})),
    "randomness entry without a position": lambda entries: _zip(
        {**entries, "randomness.safetensors": _generators(b"\x00" * 16)}),
    "randomness not a generator state": lambda entries: _with(meta__json=_meta(
        lambda m: {**m, "randomness": [0, 3, 0]}))({**entries, "randomness.safetensors": _generators(b"\x01" * 16)}),
    "randomness position of the wrong shape": _with(meta__json=_meta(lambda m: {**m, "randomness": [0, -3]})),
    "not a zip": lambda entries: b"this is a text file, not a model\n",
    "truncated": lambda entries: _zip(entries)[: len(_zip(entries)) // 2],
    "directory": None,  # made in the test
}


@pytest.fixture(scope="module")
def corrupt_files(good_entries, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("corrupt")
    files = {}
    for index, (name, make) in enumerate(CORRUPT.items()):
        path = folder / f"case{index}.dl4py"
        if make is None:
            path.mkdir()
        else:
            path.write_bytes(make(good_entries))
        files[name] = path
    return files


def test_the_good_file_loads(good_entries, tmp_path):
    (tmp_path / "m.dl4py").write_bytes(_zip(good_entries))
    assert dl4py.load(tmp_path / "m.dl4py").iteration_count == 1


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_corrupt_model_file_is_one_data_error_naming_the_file(case, corrupt_files):
    path = corrupt_files[case]
    with pytest.raises(DataError) as caught:
        dl4py.load(path)
    assert str(caught.value).startswith(f"{path} is not a valid dl4py model: "), str(caught.value)


def test_every_corrupt_model_file_is_a_one_line_cli_error(corrupt_files):
    # One process runs the CLI's main on every file (a process per file would cost ~3 s each);
    # the next test runs `python -m dl4py evaluate` itself.
    report = _python("""
        import contextlib, io, json, sys, traceback
        from dl4py.cli import main
        out = {}
        for path in sys.argv[1:]:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    rc = main(["evaluate", path])
                except BaseException:
                    traceback.print_exc()
                    rc = "raised"
            out[path] = [rc, err.getvalue()]
        print(json.dumps(out))
    """, *corrupt_files.values())
    assert report.returncode == 0, report.stderr
    results = json.loads(report.stdout)
    for case, path in corrupt_files.items():
        rc, stderr = results[str(path)]
        lines = stderr.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, (case, stderr)
        assert lines[0].startswith("dl4py evaluate: error: ") and str(path) in lines[0], (case, stderr)


def test_python_m_dl4py_evaluate_a_corrupt_file(corrupt_files):
    path = corrupt_files["garbage updater.json"]
    _assert_one_line_error(_dl4py("evaluate", path), f"{path} is not a valid dl4py model", "updater.json")


# ---- zip bombs ---------------------------------------------------------------------------------
GIB = 2**30


def _bomb(good_entries: dict[str, bytes], path: Path, name: str) -> None:
    """The good file plus entry ``name``: 1 GiB of zeros, deflated to a few MB."""
    with zipfile.ZipFile(path, "w") as zf:
        for entry, data in good_entries.items():
            if entry != name:
                zf.writestr(entry, data)
        info = zipfile.ZipInfo(name)
        info.compress_type, zf.compresslevel = zipfile.ZIP_DEFLATED, 1
        with zf.open(info, "w") as stream:
            chunk = bytes(2**24)
            for _ in range(GIB // len(chunk)):
                stream.write(chunk)


def _lie_about_size(path: Path, name: str, size: int) -> None:
    """Make the central directory declare ``size`` bytes for ``name`` (the stream is unchanged)."""
    data = bytearray(path.read_bytes())
    end = data.rindex(b"PK\x05\x06")  # end of central directory: where the directory starts
    at = struct.unpack_from("<I", data, end + 16)[0]
    while True:
        name_length = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + name_length] == name.encode():
            break
        extra, comment = struct.unpack_from("<HH", data, at + 30)
        at += 46 + name_length + extra + comment
    struct.pack_into("<I", data, at + 24, size)
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_zip_bombs_are_not_inflated(good_entries, tmp_path):
    foreign, honest, lying = tmp_path / "foreign.dl4py", tmp_path / "honest.dl4py", tmp_path / "lying.dl4py"
    _bomb(good_entries, foreign, "notes.bin")  # unknown entry: never read
    _bomb(good_entries, honest, "config.json")  # declares 1 GiB: refused before reading
    lying.write_bytes(honest.read_bytes())
    _lie_about_size(lying, "config.json", 1000)  # declares 1000 bytes, inflates to 1 GiB
    assert foreign.stat().st_size < 8 * 2**20
    (tmp_path / "good.dl4py").write_bytes(_zip(good_entries))
    report = _python("""
        import json, resource, sys
        import dl4py
        from dl4py import DataError

        def peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

        good, *bombs = sys.argv[1:]
        dl4py.load(good)  # imports and first-load allocations happen before the measurement
        before, out = peak(), {}
        for path in bombs:
            try:
                out[path] = ["loaded", dl4py.load(path).iteration_count]
            except DataError as exc:
                out[path] = ["refused", str(exc)]
        print(json.dumps({"growth": peak() - before, "results": out}))
    """, tmp_path / "good.dl4py", foreign, honest, lying)
    assert report.returncode == 0, report.stderr
    answer = json.loads(report.stdout)
    results = answer["results"]
    assert results[str(foreign)] == ["loaded", 1]
    assert results[str(honest)][0] == "refused" and "config.json declares 1073741824 bytes" in results[str(honest)][1]
    assert results[str(lying)][0] == "refused"
    assert results[str(lying)][1].startswith(f"{lying} is not a valid dl4py model: entry config.json")
    assert answer["growth"] < 200 * 2**20, f"memory grew by {answer['growth'] / 2**20:.0f} MiB"


# ---- configs -----------------------------------------------------------------------------------
def test_a_binary_config_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_bytes(b"PK\x03\x04\x14\x00\x00\x00\x08\x00\xa7\xb5\xff\xfe" * 20)
    _assert_one_line_error(_dl4py("train", path), str(path), "not a text file")


def _write_config(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_learning_rate_written_1e_3_is_a_number(tmp_path):
    path = _write_config(tmp_path, """
        network:
          updater: {type: adam, learning_rate: 1e-3}
          input_type: {type: feed_forward, size: 4}
          layers:
            - {type: output, n_out: 3, activation: softmax, loss: mcxent, l2: 5E-4}
    """)
    config = RunConfig.from_file(path)
    assert config.network.updater.learning_rate == 0.001
    assert config.network.layers[0].l2 == 0.0005
    overridden = config.with_overrides(["network.updater.learning_rate=2e-3"])
    assert overridden.network.updater.learning_rate == 0.002
    # the YAML reader itself says number, for fields that also take strings and for lists
    from dl4py.config.yaml_loader import load_yaml

    assert load_yaml("[1e-3, 5E4, 1.0e3, 2GiB]") == [0.001, 50000.0, 1000.0, "2GiB"]
    # from a dict too (JSON, Python): a float field takes a string that is a number
    assert NetworkConfig.from_dict({**NETWORK, "updater": {"type": "sgd", "learning_rate": "1e-2"}}).updater.learning_rate == 0.01


# ---- labels beyond the output layer ------------------------------------------------------------
def _csv(tmp_path, rows: int, bad_row: int, bad_label: int) -> Path:
    rng = np.random.default_rng(0)
    labels = np.arange(rows) % 3
    labels[bad_row] = bad_label
    path = tmp_path / "train.csv"
    path.write_text("".join(",".join(f"{v:.3f}" for v in rng.random(4)) + f",{label}\n" for label in labels))
    return path


def _csv_run_config(tmp_path, csv: Path, **data) -> Path:
    config = {"network": NETWORK, "data": {"dataset": "csv", "train_path": str(csv), "shuffle": False, **data},
              "training": {"epochs": 1, "batch_size": 32, "backend": "cpu"}}
    path = tmp_path / "csv.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
def test_a_csv_label_beyond_n_out_in_a_later_batch_is_named_before_training(tmp_path):
    # Row 150 is in the fifth batch; num_classes 5 lets the file's own check pass.
    csv = _csv(tmp_path, rows=200, bad_row=150, bad_label=4)
    net = MultiLayerNetwork(NetworkConfig.from_dict(NETWORK), backend="cpu")
    iterator = dl4py.CsvDataSetIterator(csv, 32, num_classes=5, shuffle=False)
    with pytest.raises(DataError, match=r"train\.csv: line 151, column 5: label 4 .*n_out=3.*\[0, 3\)"):
        net.fit(iterator)
    assert net.iteration_count == 0  # refused before the first step
    result = _dl4py("train", _csv_run_config(tmp_path, csv, num_classes=5), "--output", tmp_path / "run")
    _assert_one_line_error(result, "train.csv: line 151", "label 4", "n_out=3")


def test_an_array_label_beyond_n_out_is_named_before_training():
    rng = np.random.default_rng(0)
    labels = np.arange(600) % 3
    labels[500] = 3
    iterator = ArrayDataSetIterator(rng.random((600, 4), dtype=np.float32), labels, batch_size=50, shuffle=False)
    net = MultiLayerNetwork(NetworkConfig.from_dict(NETWORK), backend="cpu")
    with pytest.raises(DataError, match=r"example 500: label 3 .*n_out=3.*\[0, 3\)"):
        net.fit(iterator)
    assert net.iteration_count == 0


# ---- limits beyond the data --------------------------------------------------------------------
def test_limit_train_beyond_the_data_set_is_one_line_naming_the_key():
    result = _dl4py("train", ROOT / "examples" / "lenet_mnist.yaml", "--set", "data.limit_train=70000")
    _assert_one_line_error(result, "data.limit_train", "70000", "60000")


def test_a_limit_beyond_a_csv_file_names_the_value_and_the_size(tmp_path):
    csv = _csv(tmp_path, rows=20, bad_row=0, bad_label=0)
    with pytest.raises(DataError, match=r"train\.csv: limit=50 exceeds the 20 examples"):
        dl4py.CsvDataSetIterator(csv, 8, num_classes=3, limit=50)
