"""ParallelInference's runtimes: ONNX Runtime and TorchScript answer what ``model.output`` answers
(normalizer and output activation folded into the file) from many threads, in every mode;
``auto`` takes ONNX Runtime where it can and torch where it cannot, saying why; a runtime that
cannot give the model's answers is refused in one line naming it."""

from __future__ import annotations

import sys

import pytest
import torch
from test_parallel_inference import _ask_from_threads
from torch import nn

from dl4py import ConfigError, MnistDataSetIterator, MultiLayerNetwork, ParallelInference, TorchModel
from dl4py.export.formats import onnx_bytes
from dl4py.inference.runtimes import TOLERANCE, OnnxReplica, _check_answers

REQUESTS, THREADS = 256, 8
pytest.importorskip("onnxruntime", reason="the runtimes need dl4py[export]")


@pytest.fixture(scope="module")
def trained():
    """An MLP with a standardizing normalizer, MNIST test images, and ``model.output`` of each
    asked one at a time: (model, x, expected)."""
    from toy import trained_mnist_mlp

    model = trained_mnist_mlp(examples=512, batch=64)
    x = MnistDataSetIterator(REQUESTS, train=False, shuffle=False, limit=REQUESTS).features
    expected = torch.cat([model.output(x[i:i + 1]) for i in range(REQUESTS)])
    return model, x, expected


def assert_model_answers(answers, expected):
    """Within the runtimes' promise: TOLERANCE relative to the output's size, at least 1."""
    assert answers.shape == expected.shape and answers.dtype == expected.dtype
    apart = float(((answers - expected).abs() / expected.abs().clamp(min=1.0)).max())
    assert apart <= TOLERANCE, apart


@pytest.mark.parametrize("runtime, mode", [("onnx", "batched"), ("onnx", "inplace"), ("torchscript", "batched"),
                                           ("auto", "sequential")])
def test_each_runtime_answers_model_outputs_answers_from_many_threads(trained, runtime, mode):
    model, x, expected = trained
    with ParallelInference(model, workers=2, inference_mode=mode, runtime=runtime) as inference:
        assert inference.runtime == ("onnx" if runtime == "auto" else runtime), inference.runtime_reason
        answers = torch.cat(_ask_from_threads(inference, x, threads=THREADS))
        merged = inference.output(x[:100])  # several examples in one request
        stats = inference.stats()
    assert_model_answers(answers, expected)
    assert_model_answers(merged, expected[:100])
    assert stats["requests"] == REQUESTS + 1 and stats["failed"] == 0


def test_auto_takes_torch_where_a_file_runtime_would_not_give_the_models_answers(trained):
    model = trained[0]
    half = MultiLayerNetwork(model.config, backend="cpu", precision="bfloat16").init()
    with ParallelInference(half, runtime="auto") as inference:
        assert inference.runtime == "torch"
        assert "precision is bfloat16" in inference.runtime_reason
    with pytest.raises(ConfigError, match="runtime.*onnx cannot serve this model.*precision is bfloat16"):
        ParallelInference(half, runtime="onnx")
    with pytest.raises(ConfigError, match="runtime.*torchscript cannot serve this model.*bfloat16"):
        ParallelInference(half, runtime="torchscript")


def test_auto_takes_torch_without_onnx_runtime_installed_and_says_what_to_install(trained, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    with ParallelInference(trained[0], runtime="auto") as inference:
        assert inference.runtime == "torch"
        assert 'onnxruntime not installed (pip install "dl4py[export]")' in inference.runtime_reason


def test_a_model_without_a_config_is_served_by_torch_under_auto_and_refused_by_onnx():
    model = TorchModel(nn.Sequential(nn.Linear(4, 3)), loss=nn.CrossEntropyLoss(),
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1), backend="cpu").init()
    with ParallelInference(model) as inference:
        assert inference.runtime == "torch"
        assert "no config to read its input shape from" in inference.runtime_reason
    with pytest.raises(ConfigError, match="onnx cannot serve this model.*no config"):
        ParallelInference(model, runtime="onnx")


def test_a_runtime_whose_answers_differ_from_the_models_is_refused(trained):
    import onnxruntime

    model = trained[0]
    other = MultiLayerNetwork(model.config, backend="cpu").init()  # the same network, other weights
    other.set_normalizer(model.normalizer)
    session = onnxruntime.InferenceSession(onnx_bytes(other), providers=["CPUExecutionProvider"])
    with pytest.raises(ConfigError, match=r"onnx answers differ from model.output by \S+ on a probe batch"):
        _check_answers(model, OnnxReplica(model, session, torch.device("cpu"), 0), "onnx")


def test_an_unknown_runtime_names_the_choices(trained):
    with pytest.raises(ConfigError, match="runtime.*auto, torch, onnx, torchscript; got 'tensorrt'"):
        ParallelInference(trained[0], runtime="tensorrt")


def test_an_onnx_replica_runs_more_examples_than_a_chunk_in_chunks(trained):
    """Over CHUNK examples the session runs chunk by chunk and the answers are joined in order."""
    from dl4py.inference.replicas import CHUNK

    model, x, _ = trained
    many = x.repeat(-(-(CHUNK + 5) // len(x)), 1)[:CHUNK + 5]
    with ParallelInference(model, workers=1, runtime="onnx") as inference:
        answers = inference.replicas[0].run(many)
    assert_model_answers(answers, model.output(many))
