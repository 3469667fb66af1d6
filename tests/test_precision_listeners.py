"""``dl4py train`` in every precision policy, with the listeners it attaches by default.

The StatsListener reads every parameter, gradient, update and activation of the model, in
whatever dtype the policy made them: a sum it asks for in float32 must not be refused for a
float64 tensor (``double`` once failed at the first stats record, as LeNet showed).
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

import dl4py.nn.model
from dl4py.backend.precision import NAMES
from dl4py.cli import main
from dl4py.nn.convolution import cpu_has_native

from devices import backend_for, on_devices

EXAMPLES, BATCH = 192, 16  # 12 iterations: the default stats_every (10) records one step
FP16_ON_CPU = "no fast float16 kernels"  # what the CPU run of a float16 policy warns


def _toy_run_config(tmp_path, device: str) -> str:
    """A run config over a CSV of 4x4 one-channel images in 3 classes; a network with a
    convolution, a dense and an output layer, as LeNet has, but small enough for seconds."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((EXAMPLES + 48, 16))
    y = (x[:, 0] > 0).astype(int) + (x[:, 5] > 0.5).astype(int)
    table = np.column_stack([x, y])
    np.savetxt(tmp_path / "train.csv", table[:EXAMPLES], delimiter=",", fmt="%.6f")
    np.savetxt(tmp_path / "test.csv", table[EXAMPLES:], delimiter=",", fmt="%.6f")
    config = tmp_path / "toy.yaml"
    config.write_text(f"""\
network:
  seed: 7
  updater: {{type: nesterovs, learning_rate: 0.05, momentum: 0.9}}
  input_type: {{type: convolutional_flat, height: 4, width: 4, channels: 1}}
  layers:
    - {{type: convolution, kernel_size: [3, 3], n_out: 3, activation: relu}}
    - {{type: dense, n_out: 8, activation: tanh}}
    - {{type: output, n_out: 3, activation: softmax, loss: negativeloglikelihood}}
data: {{dataset: csv, train_path: {tmp_path / 'train.csv'}, test_path: {tmp_path / 'test.csv'}, num_classes: 3}}
training: {{epochs: 1, batch_size: {BATCH}, backend: {backend_for(device)}}}
""")
    return str(config)


@pytest.mark.timeout(120)
@on_devices
@pytest.mark.parametrize("precision", NAMES)
def test_train_records_stats_in_every_precision(tmp_path, precision, device, caplog, capsys, monkeypatch):
    if device == "cuda" and "bf" in precision and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bfloat16 needs a GPU of compute capability 8.0 or later")
    monkeypatch.setattr(dl4py.nn.model, "_warned", set())  # the fp16 warning is once per process
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="dl4py"):
        code = main(["train", _toy_run_config(tmp_path, device), "--precision", precision, "--output", str(run_dir),
                     "--no-progress"])
    assert code == 0, capsys.readouterr().err
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["precision"] == precision
    assert result["device"].startswith(device)
    assert result["iterations"] == EXAMPLES // BATCH

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stats = [r for r in records if r["kind"] == "stats"]
    assert [r["iteration"] for r in stats] == [10]
    layers = stats[0]["layers"]
    assert len(layers) == 3
    for name, numbers in layers.items():
        for key in ("parameters", "gradients", "updates", "update_ratio", "activations"):
            assert numbers[key] is not None and math.isfinite(numbers[key]), (name, key, numbers)
        assert numbers["parameters"] > 0 and numbers["updates"] > 0, (name, numbers)

    # A CPU has no float16 kernels worth the name: such a policy runs, and says it is slow.
    slow = device == "cpu" and not cpu_has_native(torch.float16)
    assert (FP16_ON_CPU in caplog.text) == (precision in ("half", "mixed-fp16") and slow), caplog.text
