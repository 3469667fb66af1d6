"""Precision as one setting: float, double, half, bfloat16, mixed-fp16, mixed-bf16.

The policies' mechanics (dtypes, master weights, loss scaling and its skipped steps, the NaN
error) are checked on every device: on CUDA, float16 and bfloat16 really run in 16 bits.
16-bit convolutions on CPUs are in test_precision_convolution.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import dl4py
from dl4py import (
    DenseLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
    RunConfig,
    Sgd,
    TorchModel,
)
from dl4py.config import OneCycleSchedule, PolySchedule, StepSchedule
from dl4py.errors import TrainingError
from dl4py.nn.convolution import cpu_has_native

from devices import backend_for, on_devices, tolerance

ROOT = Path(__file__).resolve().parents[1]
LENET = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml").network


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.module.parameters())


def mlp(**kw) -> NetworkConfig:
    settings = dict(layers=[DenseLayer(n_out=16, activation="relu"), OutputLayer(n_out=3)],
                    input_type=InputType.feed_forward(6), updater=Sgd(0.1), seed=4)
    settings.update(kw)
    return NetworkConfig(**settings)


def needs(device: str, precision: str) -> None:
    """Skip a bfloat16 policy on a GPU before Ampere, which dl4py refuses (tested below)."""
    if device == "cuda" and "bf" in precision and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bfloat16 needs a GPU of compute capability 8.0 or later")


def toy_data(n=256):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=gen)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


@pytest.mark.soak  # long for make test's budget: make soak runs it (DEVELOPERS.md)
def test_lenet_bfloat16_and_mixed_bf16_match_float_accuracy(mnist):
    """The seed LeNet on an MNIST slice: 16-bit training within 0.5% of float."""
    train = MnistDataSetIterator(128, train=True, seed=12345, limit=12_000)
    test = MnistDataSetIterator(1000, train=False, shuffle=False, limit=5_000)
    accuracy = {}
    for precision in ("float", "bfloat16", "mixed-bf16"):
        net = MultiLayerNetwork(LENET, precision=precision)
        net.fit(train, epochs=1)
        accuracy[precision] = net.evaluate(test).accuracy()
    assert accuracy["float"] > 0.9, accuracy
    for precision in ("bfloat16", "mixed-bf16"):
        assert abs(accuracy[precision] - accuracy["float"]) <= 0.005, accuracy


@pytest.mark.slow
def test_lenet_trains_in_double_along_the_float_path(mnist):
    train = MnistDataSetIterator(128, train=True, seed=12345, limit=6144)
    probe = MnistDataSetIterator(1024, train=False, shuffle=False, limit=1024)
    scores = {}
    for precision in ("double", "float"):
        net = MultiLayerNetwork(LENET, precision=precision)
        before = net.score(probe)
        net.fit(train, epochs=1)
        scores[precision] = net.score(probe)
    assert next(net.module.parameters()).dtype == torch.float32
    assert scores["double"] < 0.5 * before
    assert scores["double"] == pytest.approx(scores["float"], rel=1e-2)


@on_devices
@pytest.mark.parametrize("precision, dtype, ratio", [
    ("float", torch.float32, 1.0), ("double", torch.float64, 2.0), ("half", torch.float16, 0.5),
    ("bfloat16", torch.bfloat16, 0.5), ("mixed-bf16", torch.float32, 1.0), ("mixed-fp16", torch.float32, 1.0),
])
def test_parameter_memory_follows_the_precision(precision, dtype, ratio, device):
    needs(device, precision)
    float_bytes = param_bytes(MultiLayerNetwork(LENET, backend=backend_for(device), precision="float").init())
    net = MultiLayerNetwork(LENET, backend=backend_for(device), precision=precision).init()
    assert {p.dtype for p in net.module.parameters()} == {dtype}
    assert {p.device.type for p in net.module.parameters()} == {device}
    assert param_bytes(net) == ratio * float_bytes == ratio * 431_080 * 4
    if net.precision_state.keeps_masters:  # the float32 masters are the updater's, 4 bytes per parameter
        assert sum(p.numel() * p.element_size() for p in net.stepped_module.parameters()) == float_bytes


@on_devices
def test_activations_run_in_the_chosen_precision(device):
    needs(device, "bfloat16")
    x, backend = torch.rand(4, 784), backend_for(device)
    assert MultiLayerNetwork(LENET, backend=backend, precision="bfloat16").output(x).dtype == torch.bfloat16
    assert MultiLayerNetwork(LENET, backend=backend, precision="double").output(x).dtype == torch.float64
    assert MultiLayerNetwork(LENET, backend=backend, precision="half").output(x).dtype == torch.float16
    with torch.no_grad():
        for precision, dtype in (("mixed-bf16", torch.bfloat16), ("mixed-fp16", torch.float16)):
            net = MultiLayerNetwork(LENET, backend=backend, precision=precision).init()
            with net.precision.forward_context(net.device):
                assert net.module(x.to(device)).dtype == dtype  # autocast computes in 16 bits
    assert next(net.module.parameters()).dtype == torch.float32


@on_devices
def test_master_weights_keep_updates_too_small_for_16_bits(device):
    """lr * grad = 1e-4 on a weight of 1.0: below bfloat16's spacing there (2**-7), so plain
    bf16 updates would leave the weight at exactly 1.0 forever."""
    needs(device, "bfloat16")

    def model():
        module = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(module.weight)
        return TorchModel(module, loss=lambda out, _: out.mean(), backend=backend_for(device),
                          optimizer=lambda p: torch.optim.SGD(p, lr=1e-4), precision="bfloat16")

    net = model()
    x, y = torch.ones(8, 1), torch.zeros(8, dtype=torch.long)
    net.fit((x, y), epochs=100)
    master = net.stepped_module.weight.item()
    assert master == pytest.approx(0.99, abs=1e-5)  # float32 sum of 100 steps
    assert net.module.weight.dtype == torch.bfloat16
    assert net.module.weight.item() == torch.tensor(master).to(torch.bfloat16).item() != 1.0

    plain = torch.ones(1, dtype=torch.bfloat16, device=device)
    for _ in range(100):
        plain -= 1e-4
    assert plain.item() == 1.0  # what happens without master weights


@on_devices
def test_half_with_loss_scaling_trains(caplog, monkeypatch, device):
    import dl4py.nn.model

    monkeypatch.setattr(dl4py.nn.model, "_warned", set())  # the warning is once per process
    x, y = toy_data()
    with caplog.at_level(logging.WARNING, logger="dl4py"):
        net = MultiLayerNetwork(mlp(), backend=backend_for(device), precision="half")
        before = net.score((x, y))
        net.fit((x, y), epochs=10, batch_size=32)
    assert net.precision_state.scales_loss and net.precision_state.keeps_masters
    assert net.score((x, y)) < 0.7 * before
    assert next(net.module.parameters()).dtype == torch.float16
    # says fp16 is slow on a CPU without native float16 kernels, once; a GPU has the kernels
    slow = device == "cpu" and not cpu_has_native(torch.float16)
    assert ("no fast float16 kernels" in caplog.text) == slow, caplog.text


@on_devices
def test_skipped_fp16_steps_do_not_advance_the_schedule(device):
    x, y = toy_data(64)
    config = mlp(updater=Nesterovs(learning_rate=0.1, schedule=StepSchedule(decay_rate=0.5, step=1)))
    net = MultiLayerNetwork(config, backend=backend_for(device), precision="mixed-fp16").init()
    # A scale this large overflows fp16 gradients: GradScaler skips and halves it each step.
    net.precision_state.set_loss_scale(2.0**60)
    weights = [p.detach().clone() for p in net.module.parameters()]
    net.fit((x, y), epochs=5, batch_size=16)  # 20 minibatches, all overflowing
    assert net.iteration_count == 20 and net.update_count == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, net.module.parameters()))
    assert net.optimizer.param_groups[0]["lr"] == 0.1  # the schedule stayed at step 0
    assert net.precision_state.loss_scale == 2.0**40

    net.precision_state.set_loss_scale(2.0**8)  # sane scale: updates apply
    net.fit((x, y), epochs=1, batch_size=16)
    assert net.update_count == 4
    assert net.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3  # set before the 4th update


@on_devices
@pytest.mark.parametrize("precision", ["half", "mixed-fp16"])
def test_without_a_schedule_skipped_steps_are_counted_and_shown_in_history(precision, device):
    # The skipped updates are counted from the optimizer's own step (a step hook; GradScaler
    # calls it only for an update it applies): skipped steps do not count, nor move a weight,
    # and each epoch's record says how many there were.
    x, y = toy_data(64)
    net = MultiLayerNetwork(mlp(updater=Nesterovs(learning_rate=0.1)), backend=backend_for(device),
                            precision=precision).init()
    net.precision_state.set_loss_scale(2.0**60)
    weights = [p.detach().clone() for p in net.module.parameters()]
    history = net.fit((x, y), epochs=2, batch_size=16)  # 8 minibatches, all overflowing
    assert net.update_count == 0 and net.precision_state.skipped_steps == 8
    assert history.history["skipped_steps"] == [4, 4]
    assert all(torch.equal(a, b) for a, b in zip(weights, net.module.parameters()))
    net.precision_state.set_loss_scale(2.0**8)
    history = net.fit((x, y), epochs=1, batch_size=16)
    assert net.update_count == 4 and net.iteration_count == 12 and history.history["skipped_steps"] == [0]
    assert net.precision_state.skipped_steps == 8 and net.precision_state.skipped_in_a_row == 0
    assert not all(torch.equal(a, b) for a, b in zip(weights, net.module.parameters()))


@on_devices
def test_nan_error_names_the_precision_and_a_remedy(device):
    needs(device, "bfloat16")
    x, y = toy_data(32)
    x[5, 2] = float("inf")
    with pytest.raises(TrainingError, match=r"precision 'bfloat16'"):
        MultiLayerNetwork(mlp(), backend=backend_for(device), precision="bfloat16").fit((x, y), batch_size=8)
    with pytest.raises(TrainingError, match=r"precision 'half'; use 'mixed-fp16' \(loss scaling\) or 'bfloat16'"):
        MultiLayerNetwork(mlp(), backend=backend_for(device), precision="half").fit((x, y), batch_size=8)


@on_devices
def test_bfloat16_save_load_keeps_masters_and_resumes_exactly(tmp_path, device):
    needs(device, "bfloat16")
    x, y = toy_data()
    backend = backend_for(device)
    straight = MultiLayerNetwork(mlp(), backend=backend, precision="bfloat16")
    straight.fit((x, y), epochs=2, batch_size=32)
    first = MultiLayerNetwork(mlp(), backend=backend, precision="bfloat16")
    first.fit((x, y), epochs=1, batch_size=32)
    first.save(tmp_path / "bf16.dl4py")
    resumed = dl4py.load(tmp_path / "bf16.dl4py", backend=backend)
    assert resumed.precision.name == "bfloat16" and resumed.device.type == device
    assert torch.equal(resumed.output(x), first.output(x))
    resumed.fit((x, y), epochs=1, batch_size=32)
    for a, b in zip(straight.stepped_module.parameters(), resumed.stepped_module.parameters()):
        torch.testing.assert_close(a.cpu(), b.cpu(), **tolerance(device))  # on the CPU: equal
    # Loaded as float, the float32 masters become the weights (not their bf16 roundings).
    as_float = dl4py.load(tmp_path / "bf16.dl4py", backend=backend, precision="float")
    for a, b in zip(first.stepped_module.parameters(), as_float.module.parameters()):
        assert torch.equal(a, b)


def test_schedule_sets_the_learning_rate_and_resumes(tmp_path):
    x, y = toy_data(64)
    schedule = PolySchedule(power=1.0, max_steps=16)
    net = MultiLayerNetwork(mlp(updater=Sgd(0.2, schedule=schedule)))
    net.fit((x, y), epochs=2, batch_size=16)  # 8 updates; the 8th used t = 7
    assert net.optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * (1 - 7 / 16))
    net.save(tmp_path / "s.dl4py")
    resumed = dl4py.load(tmp_path / "s.dl4py")
    resumed.fit((x, y), epochs=1, batch_size=16)
    assert resumed.update_count == 12
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * (1 - 11 / 16))


def test_schedule_factors():
    step = StepSchedule(decay_rate=0.1, step=10)
    assert [step.factor(t) for t in (0, 9, 10, 25)] == pytest.approx([1, 1, 0.1, 0.01])
    cycle = OneCycleSchedule(total_steps=100, warmup_fraction=0.2, start_factor=0.1, end_factor=0.0)
    assert cycle.factor(0) == pytest.approx(0.1) and cycle.factor(20) == pytest.approx(1.0)
    assert cycle.factor(60) == pytest.approx(0.5) and cycle.factor(100) == pytest.approx(0.0)
    assert cycle.factor(500) == pytest.approx(0.0)
    epochs = StepSchedule(decay_rate=0.5, step=1, unit="epoch")
    assert epochs.step_count(updates=1000, epochs=3) == 3


def test_precision_from_config_and_command_line(tmp_path, mnist, capsys):
    from dl4py.cli import main

    out = tmp_path / "run"
    # Two batches: what is under test is where the setting goes, and bfloat16 is slow on CPUs.
    code = main(["train", str(ROOT / "examples" / "lenet_mnist.yaml"), "--precision", "bfloat16",
                 "--output", str(out), "--no-progress", "--set", "data.limit_train=256",
                 "--set", "data.limit_test=100"])
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    assert result["precision"] == "bfloat16"
    assert json.loads((out / "environment.json").read_text())["precision"] == "bfloat16"
    assert dl4py.load(out / "model.dl4py").precision.name == "bfloat16"
    assert main(["train", str(ROOT / "examples" / "lenet_mnist.yaml"), "--precision", "fp8",
                 "--output", str(tmp_path / "x")]) == 2
    assert "training.precision: must be one of" in capsys.readouterr().err


def test_set_default_dtype_is_the_process_default():
    dl4py.set_default_dtype("bfloat16")
    try:
        net = MultiLayerNetwork(mlp()).init()
        assert net.precision.name == "bfloat16"
        assert MultiLayerNetwork(mlp(), precision="float").init().precision.name == "float"
    finally:
        dl4py.set_default_dtype("float")


@pytest.mark.slow
@pytest.mark.torch_compile_threads
def test_compiled_step_equals_eager():
    """environment compile='default': torch.compile'd forward and backward, same results."""
    from dl4py.backend.cuda_environment import environment

    x, y = toy_data(64)
    eager = MultiLayerNetwork(mlp())
    eager.fit((x, y), epochs=3, batch_size=16)
    env = environment()
    env.update(compile="default")
    try:
        compiled = MultiLayerNetwork(mlp())
        compiled.fit((x, y), epochs=3, batch_size=16)
        from dl4py.train.step import forward_function

        assert type(forward_function(compiled)).__name__ == "OptimizedModule"
    finally:
        env.update(compile="off")
    for a, b in zip(eager.module.parameters(), compiled.module.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(dl4py.BackendError, match="cuda_graphs needs the GPU backend"):
        env.update(cuda_graphs=True)
        try:
            MultiLayerNetwork(mlp(), backend="cpu").fit((x, y), batch_size=16)
        finally:
            env.update(cuda_graphs=False)


@pytest.mark.parametrize("precision", ["bfloat16", "mixed-bf16"])
def test_bfloat16_on_a_gpu_before_ampere_is_a_clear_error(monkeypatch, precision):
    # torch.cuda.is_bf16_supported() counts emulation and says yes on a V100; the check
    # must go by compute capability, as `dl4py info` does.
    from dl4py.backend.precision import resolve_precision
    from dl4py.backend.selection import Backend
    from dl4py.errors import BackendError

    capability = {"value": (7, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    net = MultiLayerNetwork(LENET, precision=precision)
    net.backend, net.precision = Backend("gpu", torch.device("cuda", 0), "test"), resolve_precision(precision)
    with pytest.raises(BackendError, match=r"needs bfloat16, which Tesla V100 \(compute capability 7.0\)"):
        net._check_precision_supported()
    capability["value"] = (8, 0)
    net._check_precision_supported()  # an A100 has it
