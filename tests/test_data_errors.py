"""Bad data is one line naming the file and its row or column (issue 28, item 6): a ragged
row or a NaN in a streamed CSV, a NaN in Parquet, a NaN label in a DataFrame, a NaN in a
CSV a run config trains on, and an image with more pixels than Pillow's limit."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from dl4py import CsvDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer
from dl4py import TableDirectoryIterator
from dl4py.data.images import ImageFolderIterator
from dl4py.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
HEADER = "a,b,c,d,y\n"
GOOD = "0.1,0.2,0.3,0.4,1\n"


def _table(tmp_path, rows: list[str], header: str = HEADER) -> Path:
    """A folder holding one CSV file, part.csv: the header, then ``rows`` (line 2 onwards)."""
    folder = tmp_path / "table"
    folder.mkdir()
    (folder / "part.csv").write_text(header + "".join(rows))
    return folder


def _read_all(folder, **options):
    return list(TableDirectoryIterator(folder, label="y", batch_size=2, chunk_rows=3, **options))


def _net(inputs: int = 4) -> MultiLayerNetwork:
    return MultiLayerNetwork(NetworkConfig(seed=1, layers=[DenseLayer(n_out=4), OutputLayer(n_out=2)],
                                           input_type=InputType.feed_forward(inputs)))


# ---- a streamed CSV ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad, fields", [
    ("0.1,0.2,0.3\n", 3),            # pandas would fill NaN: a regression label, silently
    ("0.1,0.2,0.3,0.4,1,7\n", 6),    # pandas would stop with its own count of lines
])
@pytest.mark.parametrize("at", [0, 5])  # the first data row (pandas would take an index), a later chunk
def test_a_ragged_row_of_a_streamed_csv_names_its_line_and_field_count(tmp_path, bad, fields, at):
    rows = [GOOD] * 7
    rows[at] = bad
    with pytest.raises(DataError) as caught:
        _read_all(_table(tmp_path, rows))
    assert str(caught.value) == f"{tmp_path / 'table' / 'part.csv'}: line {at + 2} has {fields} fields, the header has 5"


@pytest.mark.parametrize("cell, column, problem", [
    ("nan", "b", "'nan' is not a finite number"),
    ("", "b", "the field is empty"),
    ("x", "b", "'x' is not a number"),
    ("-inf", "d", "'-inf' is not a finite number"),
    ("", "y", "the field is empty"),           # a label: pandas would make the labels floats
    ("cat", "y", "'cat' is not a number"),
])
def test_a_bad_cell_of_a_streamed_csv_names_its_line_and_column(tmp_path, cell, column, problem):
    rows = [GOOD] * 8
    values = GOOD.strip().split(",")
    values["abcdy".index(column)] = cell
    rows[6] = ",".join(values) + "\n"
    rows.insert(2, "\n")  # a blank line: not a data row, yet a line
    with pytest.raises(DataError) as caught:
        _read_all(_table(tmp_path, rows))  # chunks of 3 rows: the bad one is in the third
    assert str(caught.value) == f"{tmp_path / 'table' / 'part.csv'}: line 9, column {column!r}: {problem}"


def test_rows_spanning_lines_are_named_by_the_line_they_start_on(tmp_path):
    # features= leaves the note column out; its quoted line breaks still count as lines.
    rows = ['1,"two\nlines",0.5,1\n', "2,fine,0.5,1\n", '3,"three\nlines",nan,0\n']  # lines 2-3, 4, 5-6
    with pytest.raises(DataError, match=r"part\.csv: line 5, column 'b': 'nan' is not a finite number$"):
        _read_all(_table(tmp_path, rows, header="a,note,b,y\n"), features=["a", "b"])


def test_a_nan_in_a_parquet_row_group_names_the_files_row(tmp_path):
    folder = tmp_path / "table"
    folder.mkdir()
    frame = pd.DataFrame({"a": np.arange(10.0), "y": np.arange(10) % 2})
    frame.loc[7, "a"] = np.nan
    frame.to_parquet(folder / "part.parquet", index=False, row_group_size=4)  # row 7: the second group's fourth
    with pytest.raises(DataError) as caught:
        list(TableDirectoryIterator(folder, label="y", batch_size=2, chunk_rows=3))
    assert str(caught.value) == f"{folder / 'part.parquet'}: column 'a' is NaN (a missing value) at row 7 (counting from 0)"


def test_a_clean_streamed_csv_still_reads_every_row(tmp_path):
    rows = [f"{i},0.2,0.3,0.4,{i % 2}\n" for i in range(7)]
    batches = _read_all(_table(tmp_path, rows[:3] + ["\n"] + rows[3:]))
    assert sorted(int(v) for b in batches for v in b.features[:, 0]) == list(range(7))


# ---- a DataFrame -------------------------------------------------------------------------------
def test_a_nan_label_in_a_dataframe_names_its_column_and_index_label():
    frame = pd.DataFrame({"a": [1.0, 2, 3, 4], "b": 1.0, "c": 1.0, "d": 1.0, "y": [0, np.nan, 1, 1]},
                         index=["r1", "r2", "r3", "r4"])
    with pytest.raises(DataError) as caught:
        _net().fit(frame, label="y")
    assert str(caught.value) == ("the DataFrame: column 'y' is NaN (a missing value) at index 'r2' (row 1); "
                                 "drop or fill such rows first (e.g. df.dropna())")


def test_a_nan_feature_in_a_dataframe_is_named_before_the_loss_sees_it():
    frame = pd.DataFrame({"a": [1.0, 2, 3, 4], "b": [1.0, 2, np.inf, 4], "c": 1.0, "d": 1.0, "y": [0, 1, 1, 0]})
    with pytest.raises(DataError, match=r"^the DataFrame: column 'b' is inf at index 2; drop or fill"):
        _net().fit(frame, label="y")


def test_a_nan_label_in_a_pandas_series_beside_a_frame_names_the_series_and_index():
    features = pd.DataFrame(np.ones((3, 4)), index=[10, 11, 12])
    labels = pd.Series([0.0, 1.0, np.nan], index=[10, 11, 12], name="target")
    with pytest.raises(DataError, match=r"^labels: the pandas Series: column 'target' is NaN \(a missing value\) "
                                        r"at index 12 \(row 2\)"):
        _net().fit((features, labels))


# ---- a CSV file read whole (a run config's dataset: csv) ---------------------------------------
@pytest.mark.parametrize("cell, shown", [("nan", "nan"), ("inf", "inf")])
def test_a_nan_in_a_csv_file_names_its_line_and_column(tmp_path, cell, shown):
    path = tmp_path / "train.csv"
    path.write_text("a,b,y\n1,2,0\n\n3," + cell + ",1\n")
    with pytest.raises(DataError) as caught:
        CsvDataSetIterator(path, 2, skip_lines=1, num_classes=2)
    assert str(caught.value) == f"{path}: line 4, column 2: {shown} is not a finite number"


# ---- images past Pillow's limit ----------------------------------------------------------------
def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header says width x height (8-bit grey) but holds almost no pixel data:
    opening it costs nothing, decoding it would allocate width * height bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def _image_folder(tmp_path, width: int, height: int) -> Path:
    root = tmp_path / "images"
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        Image.new("L", (8, 8), 40 if name == "a" else 200).save(root / name / "ok.png")
    _png_header(root / "b" / "huge.png", width, height)
    return root


def test_an_image_past_pillows_limit_names_the_file_its_size_and_the_way_to_allow_it(tmp_path):
    # In a child, so that its peak memory is its own: the 400 MB of pixels are never allocated.
    root = _image_folder(tmp_path, 20000, 20000)
    code = """
        import resource, sys
        from dl4py.data.images import ImageFolderIterator
        from dl4py.errors import DataError
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            ImageFolderIterator(sys.argv[1], 2, height=8, width=8, channels=1)
        except DataError as exc:
            print(exc)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)  # KiB -> MiB (Linux)
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(root)], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    message, grown_mib = result.stdout.splitlines()
    assert message == (f"{root / 'b' / 'huge.png'}: 20000x20000 = 400,000,000 pixels, over Pillow's limit of "
                       f"{Image.MAX_IMAGE_PIXELS:,} for one image (its guard against decompression bombs); shrink "
                       "the file, or if you trust it raise PIL.Image.MAX_IMAGE_PIXELS before reading (None turns "
                       "the guard off)"), result.stderr
    assert int(grown_mib) < 64


def test_an_image_pillow_only_warns_about_is_refused_too_and_a_raised_limit_allows_it(tmp_path, monkeypatch):
    root = _image_folder(tmp_path, 12, 12)  # 144 pixels: over a limit of 100, under twice it
    Image.new("L", (12, 12), 90).save(root / "b" / "huge.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(DataError, match=r"huge\.png: 12x12 = 144 pixels, over Pillow's limit of 100 for one image"):
        ImageFolderIterator(root, 2, height=8, width=8, channels=1)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 144)  # the user trusts it
    assert ImageFolderIterator(root, 2, height=8, width=8, channels=1).total_examples() == 3


# ---- through dl4py train ----------------------------------------------------------------------
def _run_config(tmp_path, data: dict, input_type: dict) -> Path:
    config = {"network": {"seed": 1, "input_type": input_type,
                          "layers": [{"type": "dense", "n_out": 4},
                                     {"type": "output", "n_out": 2, "activation": "softmax", "loss": "mcxent"}]},
              "data": data, "training": {"epochs": 1, "batch_size": 2, "backend": "cpu"}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    return path


def _csv_case(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("".join(["0.1,0.2,0.3,0.4,1\n"] * 5 + ["0.1,nan,0.3,0.4,0\n"]))
    config = _run_config(tmp_path, {"dataset": "csv", "train_path": str(path), "num_classes": 2},
                         {"type": "feed_forward", "size": 4})
    return config, f"{path}: line 6, column 2: nan is not a finite number"


def _image_case(tmp_path):
    root = _image_folder(tmp_path, 20000, 20000)
    config = _run_config(tmp_path, {"dataset": "image_folder", "train_path": str(root)},
                         {"type": "convolutional", "height": 8, "width": 8, "channels": 1})
    return config, f"{root / 'b' / 'huge.png'}: 20000x20000 = 400,000,000 pixels, over Pillow's limit"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", [_csv_case, _image_case], ids=["csv-nan", "image-past-the-limit"])
def test_dl4py_train_says_it_in_one_line(tmp_path, case):
    config, expected = case(tmp_path)
    result = subprocess.run([sys.executable, "-m", "dl4py", "train", str(config), "--output", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dl4py train: error: " + expected), result.stderr
