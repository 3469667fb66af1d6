"""The migration walk-through of docs/dl4j-import.md, run as a user runs it: ``examples/dl4j_migration.py``
on DL4J's own MLPMoon file and moon data, in a child process (its server on 127.0.0.1, its files in
``tmp_path``). Each of its six steps must say what it did, with the numbers the docs quote holding:
training goes on from DL4J's state (accuracy up), the served, ONNX and re-imported outputs equal
``net.output``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "dl4j_migration.py"
MOON = ROOT.parent / "shared" / "dl4j-models" / "dl4j-integration-tests"


@pytest.mark.skipif(not MOON.is_dir(), reason=f"needs DL4J's files in {MOON}")
def test_the_walk_through_runs_end_to_end(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 6, done.stdout
    assert lines[0] == "imported Model_RANDOM_INIT_UNTRAINED.zip: 2 layers, 102 parameters"
    before = float(re.fullmatch(r"accuracy as imported: (\S+)", lines[1]).group(1))
    after = float(re.fullmatch(r"accuracy after 2 epoch\(s\) in dl4py: (\S+)", lines[2]).group(1))
    assert after > before + 0.1  # DL4J saved it untrained: training in dl4py must teach it
    served = float(re.fullmatch(r"served 3 predictions, largest difference from net.output: (\S+)", lines[3]).group(1))
    assert served <= 1e-6  # JSON carries float32 values exactly enough
    onnx = float(re.fullmatch(r"exported model\.onnx; ONNX Runtime's largest difference from net\.output: (\S+)",
                              lines[4]).group(1))
    assert onnx <= 1e-5
    assert lines[5].endswith("imported again, the same outputs: True")
    assert {p.name for p in tmp_path.iterdir()} >= {"model.dl4py", "model.onnx", "model.zip"}
