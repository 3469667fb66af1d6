"""``compile: auto`` (train/compile_choice.py) and the slow-16-bit-on-this-CPU warning
(nn/cpu_precision.py): the rule's choices, what a fit and a run record of them, the warning once.

Nothing here compiles but the one ``slow`` test: the rule keeps tiny fits eager."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

import dl4py
import dl4py.nn.model
from dl4py.backend import cuda_environment
from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, RunConfig, Sgd
from dl4py.backend.precision import Precision
from dl4py.data.iterators import ArrayDataSetIterator
from dl4py.nn.cpu_precision import slow_dtype
from dl4py.runner import train_run
from dl4py.train import compile_choice
from dl4py.train.compile_choice import AUTO_MIN_STEPS, choose_compile, planned_steps, unsupported
from dl4py.train.step import forward_function

CPU = torch.device("cpu")
FLOAT = Precision("float")
SIXTEEN_BIT = ("half", "bfloat16", "mixed-fp16", "mixed-bf16")
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@pytest.fixture(autouse=True)
def default_compile_setting(monkeypatch):
    """What a user gets: conftest turns compile off for every other test (DL4PY_COMPILE), and the
    process's environment, read from the variables on first use, is read again without it."""
    monkeypatch.delenv("DL4PY_COMPILE", raising=False)
    monkeypatch.setattr(cuda_environment, "_process", None)


def mlp() -> NetworkConfig:
    return NetworkConfig(layers=[DenseLayer(n_out=8, activation="tanh"), OutputLayer(n_out=2)],
                         input_type=InputType.feed_forward(4), updater=Sgd(0.1), seed=1)


def toy(n: int = 64):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long()


class NoLength:
    """An iterator that cannot say how many batches an epoch has (a stream)."""

    def __init__(self, iterator):
        self.iterator = iterator

    def __iter__(self):
        return iter(self.iterator)


def test_a_short_run_stays_eager_and_a_long_one_compiles():
    short = choose_compile("auto", AUTO_MIN_STEPS - 1, FLOAT, CPU)
    assert not short.on and short.why == f"{AUTO_MIN_STEPS - 1} steps planned, under {AUTO_MIN_STEPS}"
    long = choose_compile("auto", AUTO_MIN_STEPS, FLOAT, CPU)
    # on, unless torch.compile cannot run in this process (then the reason says so)
    assert long.on == (unsupported(CPU) is None), long
    if long.on:
        assert long.why == f"{AUTO_MIN_STEPS} steps planned, at least {AUTO_MIN_STEPS}"


def test_planned_steps_are_epochs_times_batches_and_unknown_without_a_length():
    x, y = toy(64)
    batches = ArrayDataSetIterator(x, y, batch_size=16)
    assert planned_steps(batches, 3) == 12
    assert planned_steps(batches, 3, done_in_epoch=1) == 11  # a resumed epoch's batches already done
    assert planned_steps(NoLength(batches), 3) is None
    unknown = choose_compile("auto", None, FLOAT, CPU)
    assert not unknown.on and unknown.why == "number of steps unknown"


@pytest.mark.parametrize("setting, steps, on", [("off", 10**9, False), ("default", 1, True),
                                                ("max-autotune", None, True)])
def test_an_explicit_setting_is_obeyed(setting, steps, on):
    assert choose_compile(setting, steps, FLOAT, CPU) == compile_choice.CompileChoice(setting, on, "set")


@pytest.mark.parametrize("name", SIXTEEN_BIT)
def test_auto_stays_off_for_16_bits_this_cpu_has_no_native_kernels_for(name):
    precision = Precision(name)
    slow = slow_dtype(precision, CPU)  # the detection, whatever this CPU has
    choice = choose_compile("auto", 10**9, precision, CPU)
    if slow is not None:
        assert not choice.on and choice.why == f"precision {name} has no native {NAMES[slow]} kernels on this CPU"
    else:
        assert choice.on == (unsupported(CPU) is None)
    assert slow_dtype(precision, torch.device("cuda")) is None  # a GPU's kernels are its own business


def test_a_short_fit_says_so_once_and_does_not_compile(caplog):
    x, y = toy(64)
    net = MultiLayerNetwork(mlp(), backend="cpu")
    assert dl4py.environment().compile == "auto"  # the default
    with caplog.at_level(logging.INFO, logger="dl4py"):
        net.fit((x, y), batch_size=16, epochs=2, verbose=0)
        net.fit((x, y), batch_size=16, epochs=2, verbose=0)  # the same choice: not said again
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile:")]
    assert lines == [f"compile: auto -> off (8 steps planned, under {AUTO_MIN_STEPS})"]
    assert net.compile_choice.to_dict() == {"setting": "auto", "on": False,
                                            "why": f"8 steps planned, under {AUTO_MIN_STEPS}"}
    assert forward_function(net) is net.module


def test_an_explicit_setting_logs_nothing(caplog):
    x, y = toy(16)
    with dl4py.environment().temporarily(compile="off"), caplog.at_level(logging.INFO, logger="dl4py"):
        net = MultiLayerNetwork(mlp(), backend="cpu")
        net.fit((x, y), batch_size=16, epochs=1, verbose=0)
    assert not [r for r in caplog.records if r.getMessage().startswith("compile:")]
    assert net.compile_choice.to_dict() == {"setting": "off", "on": False, "why": "set"}


def _tiny_run(tmp_path) -> RunConfig:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 4))
    np.savetxt(tmp_path / "train.csv", np.column_stack([x, x[:, 0] > 0]), delimiter=",", fmt="%.5f")
    return RunConfig.from_dict({
        "network": {"seed": 1, "updater": {"type": "sgd", "learning_rate": 0.1},
                    "input_type": {"type": "feed_forward", "size": 4},
                    "layers": [{"type": "dense", "n_out": 8, "activation": "tanh"}, {"type": "output", "n_out": 2}]},
        "data": {"dataset": "csv", "train_path": str(tmp_path / "train.csv"), "num_classes": 2},
        "training": {"epochs": 3, "batch_size": 10},
        "logging": {"report": False},
    })


def test_the_run_records_the_choice_and_logs_it(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dl4py"):
        result = train_run(_tiny_run(tmp_path), tmp_path / "run", progress=False)
    why = f"12 steps planned, under {AUTO_MIN_STEPS}"
    recorded = json.loads((tmp_path / "run" / "result.json").read_text())
    assert recorded["compile"] == result["compile"] == {"setting": "auto", "on": False, "why": why}
    assert f"compile: auto -> off ({why})" in caplog.text


@pytest.mark.parametrize("names", [("half", "mixed-fp16"), ("bfloat16", "mixed-bf16")])
def test_a_slow_16_bit_policy_warns_once_naming_float(names, caplog, monkeypatch):
    monkeypatch.setattr(dl4py.nn.model, "_warned", set())  # once per process: this test's process
    slow = slow_dtype(Precision(names[0]), CPU)  # the detection says whether this CPU has the kernels
    with caplog.at_level(logging.WARNING, logger="dl4py"):
        for name in (*names, *names):
            MultiLayerNetwork(mlp(), backend="cpu", precision=name).init()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if slow is None:
        assert warnings == []
    else:
        assert len(warnings) == 1, warnings
        assert f"precision '{names[0]}' on this CPU" in warnings[0]
        assert "kernels" in warnings[0] and warnings[0].endswith("use precision 'float'")


def test_a_float_model_does_not_warn(caplog, monkeypatch):
    monkeypatch.setattr(dl4py.nn.model, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="dl4py"):
        MultiLayerNetwork(mlp(), backend="cpu").init()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.slow
@pytest.mark.torch_compile_threads
@pytest.mark.timeout(300)
def test_auto_compiles_a_fit_planned_long_enough(monkeypatch):
    """The one test that compiles: a tiny model, its threshold lowered to the fit's steps, so
    the fit that reaches it really runs the compiled module (dynamo counts its frames)."""
    if unsupported(CPU) is not None:
        pytest.skip(unsupported(CPU))
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compile_choice, "AUTO_MIN_STEPS", 8)
    x, y = toy(64)
    net = MultiLayerNetwork(mlp(), backend="cpu")
    net.fit((x, y), batch_size=16, epochs=1, verbose=0)  # 4 steps: eager
    assert not net.compile_choice.on and forward_function(net) is net.module
    counters.clear()
    net.fit((x, y), batch_size=16, epochs=2, verbose=0)  # 8 steps: compiled
    assert net.compile_choice.on and forward_function(net) is not net.module
    assert counters["stats"]["unique_graphs"] >= 1
    net.fit((x, y), batch_size=16, epochs=1, verbose=0)  # short again: compiled it stays
    assert net.compile_choice.on


@pytest.mark.parametrize("name", SIXTEEN_BIT)
def test_compile_asked_for_runs_eager_for_a_slow_16_bit_policy(name, caplog, monkeypatch):
    """On a CPU without native kernels for the policy's 16-bit type the compiled step ran
    slower than eager (mixed-bf16: 0.16x float), so an explicit compile runs eager, saying so once."""
    from dl4py.train import step

    monkeypatch.setattr(step, "_said_eager", set())
    slow = slow_dtype(Precision(name), CPU)
    with dl4py.environment().temporarily(compile="default"), caplog.at_level(logging.WARNING, logger="dl4py"):
        net = MultiLayerNetwork(mlp(), backend="cpu", precision=name).init()
        eager = [forward_function(net) is net.module for _ in range(2)]  # not called: nothing compiles
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dl4py: compile:")]
    assert eager == [slow is not None] * 2
    assert choose_compile("default", 1, Precision(name), CPU).on == (slow is None)  # what the run records
    assert said == ([] if slow is None else [
        f"dl4py: compile: default runs eager for precision '{name}': this CPU has no native {NAMES[slow]} kernels, "
        "and compiled it ran slower still; use precision 'float' to compile"])
