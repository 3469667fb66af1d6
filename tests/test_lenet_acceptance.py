"""The seed's tutorial, end to end: `dl4py train examples/lenet_mnist.yaml --epochs 2`.

The real command, in its own process, on the full MNIST sets, reaches at least 98.5% test
accuracy; a second run with the same seed, stopped after its first epoch, trained exactly
as the first did in that epoch (one epoch is enough to show it and halves the cost).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def train_lenet(out: Path, epochs: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "dl4py", "train", str(ROOT / "examples" / "lenet_mnist.yaml"),
         "--epochs", str(epochs), "--output", str(out), "--no-progress"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
def test_lenet_two_epochs_reaches_98_5_percent_reproducibly(tmp_path, mnist):
    first = train_lenet(tmp_path / "a", epochs=2)
    second = train_lenet(tmp_path / "b", epochs=1)
    assert first["test_examples"] == 10_000 and first["epochs"] == 2
    assert first["epoch_summaries"][0]["examples"] == 60_000
    assert first["test_accuracy"] >= 0.985, first
    # Same seed, same data order, same steps: the first epoch's mean loss to the last bits
    # a float32 sum keeps.
    assert second["epoch_summaries"][0]["mean_loss"] == pytest.approx(first["epoch_summaries"][0]["mean_loss"],
                                                                     rel=1e-6)
