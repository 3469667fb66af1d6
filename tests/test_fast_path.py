"""The fast single-GPU path, on CPU where it runs there: data held on the device, fused and
multi-tensor optimizers, channels_last. Each must give the results of the plain path."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch

import dl4py
from dl4py import (
    Adam,
    AdamW,
    ArrayDataSetIterator,
    ConvolutionLayer,
    DataSet,
    DataSetIterator,
    DenseLayer,
    DeviceDataSetIterator,
    InputType,
    MultiLayerNetwork,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
    RmsProp,
    Sgd,
    SubsamplingLayer,
    TorchModel,
)
from dl4py.backend.cuda_environment import Environment, environment
from dl4py.data import device as device_data
from dl4py.data.prefetch import PrefetchIterator
from dl4py.errors import BackendError, ConfigError, DataError
from dl4py.nn.optimizers import optimizer_kernel
from dl4py.nn.serialization import model_bytes
from toy import mlp, toy


def settings(**values):
    return environment().temporarily(**values)


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.module.parameters()]


def conv_net(updater=None, seed=3) -> NetworkConfig:
    """A LeNet in miniature: 8x8 images, two convolutions, a dense layer."""
    return NetworkConfig(
        layers=[ConvolutionLayer(n_out=4, kernel_size=(3, 3), activation="relu"),
                SubsamplingLayer(pooling_type="max", kernel_size=(2, 2), stride=(2, 2)),
                ConvolutionLayer(n_out=6, kernel_size=(2, 2), activation="identity"),
                DenseLayer(n_out=16, activation="relu"), OutputLayer(n_out=3)],
        input_type=InputType.convolutional_flat(8, 8, 1),
        updater=updater or Nesterovs(learning_rate=0.05, momentum=0.9), seed=seed,
        l2=0.0 if isinstance(updater, AdamW) else 1e-3,  # AdamW decays weights itself
    )


def images(n=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 64, generator=gen)
    return x, (x[:, :20].sum(1) > x[:, 40:].sum(1)).long() + (x[:, 0] > 0.7).long()


# -- data held on the device ---------------------------------------------------------------

@pytest.mark.parametrize("shuffle, drop_last, limit", [
    (True, False, None), (False, False, None), (True, True, None), (False, True, 90), (True, False, 75),
])
def test_device_data_trains_exactly_like_host_batches(shuffle, drop_last, limit):
    x, y = toy(100)

    def train(setting):
        it = ArrayDataSetIterator(x, y, batch_size=16, shuffle=shuffle, seed=7, drop_last=drop_last, limit=limit)
        with settings(device_data=setting):
            net = MultiLayerNetwork(mlp(), backend="cpu")
            summaries = net.fit(it, epochs=3)
        return net, it, summaries

    host, host_it, host_summaries = train("off")
    dev, dev_it, dev_summaries = train("on")
    assert host.device_data is None and isinstance(dev.device_data, DeviceDataSetIterator)
    assert all(torch.equal(a, b) for a, b in zip(params(host), params(dev)))
    assert [s.examples for s in dev_summaries] == [s.examples for s in host_summaries]
    assert dev_it._next_epoch == host_it._next_epoch == 3  # the wrapped iterator's counter moved


def test_device_iterator_yields_the_iterators_batches_and_shares_its_epochs():
    x, y = toy(50)
    it = ArrayDataSetIterator(x, y, batch_size=8, seed=2)
    on_device = DeviceDataSetIterator(it, "cpu")
    first = list(on_device)  # epoch 0
    second = list(it)  # epoch 1, from the wrapped iterator
    it.set_epoch(0)
    again, next_epoch = list(it), list(on_device)
    for a, b in zip(first + next_epoch, again + second):
        assert torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels)
    assert len(on_device) == len(it) == 7 and on_device.total_examples() == 50
    assert on_device.num_classes() == it.num_classes() and on_device.input_shape() == (5,)


def test_fit_keeps_the_device_copy_between_calls():
    x, y = toy(64)
    it = ArrayDataSetIterator(x, y, batch_size=16)
    with settings(device_data="on"):
        net = MultiLayerNetwork(mlp(), backend="cpu")
        net.fit(it)
        copy = net.device_data
        net.fit(it)
        assert net.device_data is copy  # early stopping fits one epoch at a time
        other = ArrayDataSetIterator(x, y, batch_size=16)
        net.fit(other)
        assert net.device_data is not copy and net.device_data.copies(other)
    with settings(device_data="off"):
        net.fit(it)
        assert net.device_data is None


class Stream(DataSetIterator):
    """An iterator that is not in memory: batches made as they are asked for."""

    batch_size = 16

    def __iter__(self):
        x, y = toy(64)
        return (DataSet(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16))

    def __len__(self):
        return 4


def test_device_data_on_needs_an_in_memory_iterator():
    with settings(device_data="on"):
        with pytest.raises(DataError, match="device_data=on, but Stream does not hold its data"):
            MultiLayerNetwork(mlp(), backend="cpu").fit(Stream())
    with settings(device_data="auto"):
        net = MultiLayerNetwork(mlp(), backend="cpu")
        net.fit(Stream())
        assert net.iteration_count == 4 and net.device_data is None
    with pytest.raises(DataError, match="needs an in-memory ArrayDataSetIterator"):
        DeviceDataSetIterator(Stream(), "cpu")


def test_auto_rule_keeps_data_on_a_gpu_that_has_room(monkeypatch):
    quarter = device_data.DEVICE_DATA_FRACTION
    assert device_data.dataset_fits(250, "cuda:0", free_bytes=int(250 / quarter))
    assert not device_data.dataset_fits(251, "cuda:0", free_bytes=int(250 / quarter))
    assert device_data.dataset_fits(10**15, "cpu")  # host memory: the data is there already
    # With the memory estimator's figure for the step, data and step share 85% of the free memory.
    share = device_data.DEVICE_DATA_WITH_ESTIMATE
    assert device_data.dataset_fits(600, "cuda:0", free_bytes=1000, step_bytes=int(1000 * share) - 600)
    assert not device_data.dataset_fits(600, "cuda:0", free_bytes=1000, step_bytes=int(1000 * share) - 599)
    x, y = toy(100)  # 100 * 5 * 4 + 100 * 8 = 2800 bytes
    it = ArrayDataSetIterator(x, y, batch_size=10)
    assert device_data.data_bytes(it) == 2800
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(device_data, "_free_bytes", lambda device: 4 * 2800)
    assert device_data.use_device_data("auto", it, cuda)
    monkeypatch.setattr(device_data, "_free_bytes", lambda device: 4 * 2800 - 1)
    assert not device_data.use_device_data("auto", it, cuda)
    assert device_data.use_device_data("on", it, cuda)  # on insists (and may run out of memory)
    assert not device_data.use_device_data("auto", it, cpu)  # nothing to gain on a CPU
    assert device_data.use_device_data("on", it, cpu)
    assert not device_data.use_device_data("off", it, cuda)
    assert not device_data.use_device_data("auto", Stream(), cuda)


def test_prefetch_on_cpu_passes_batches_through():
    it = ArrayDataSetIterator(*toy(40), batch_size=16, seed=1)
    prefetched = PrefetchIterator(it, "cpu", depth=2)
    got = list(prefetched)
    it.set_epoch(0)
    assert [b.num_examples() for b in got] == [16, 16, 8]
    assert all(torch.equal(a.features, b.features) for a, b in zip(got, it))
    assert len(prefetched) == 3 and prefetched.total_examples() == 40


@pytest.mark.gpu
def test_gpu_paths_train_like_the_host_path():
    """Device-resident, prefetched (pinned, side stream) and plain host batches on CUDA."""
    x, y = toy(256)
    results = {}
    for name, setting, iterator in (("device", "on", None), ("prefetch", "off", None), ("stream", "auto", Stream())):
        it = iterator or ArrayDataSetIterator(x[:64], y[:64], batch_size=16, seed=4, shuffle=False)
        with settings(device_data=setting):
            net = MultiLayerNetwork(mlp(), backend="gpu")
            net.fit(it, epochs=2)
        results[name] = [p.cpu() for p in params(net)]
    for name in ("prefetch", "stream"):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results["device"], results[name])), name


@pytest.mark.gpu
@pytest.mark.torch_compile_threads
def test_gpu_fast_path_equals_the_plain_path():
    """Everything on (data on the device, fused optimizer, channels_last, CUDA graphs) against
    everything off, on a convolutional network, in float and mixed-bf16."""
    x, y = images(128)
    bf16 = torch.cuda.get_device_capability() >= (8, 0)  # before Ampere, dl4py refuses bfloat16
    for precision in ("float", "mixed-bf16") if bf16 else ("float",):
        trained = []
        for fast in (False, True):
            switch = "on" if fast else "off"
            with settings(device_data=switch, fused_optimizer=switch, channels_last=switch,
                          compile="default" if fast else "off", cuda_graphs=fast):
                net = MultiLayerNetwork(conv_net(), backend="gpu", precision=precision)
                net.fit(ArrayDataSetIterator(x, y, batch_size=32, seed=1, drop_last=True), epochs=3)
            trained.append([p.float().cpu() for p in params(net)])
        tolerance = 2e-3 if precision == "float" else 2e-2  # cuDNN convolutions run in TF32 by default
        for a, b in zip(*trained):
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


# -- optimizers -------------------------------------------------------------------------------

UPDATERS = [Sgd(0.1), Nesterovs(learning_rate=0.05, momentum=0.9), Adam(learning_rate=0.01),
            AdamW(learning_rate=0.01, weight_decay=0.05), RmsProp(learning_rate=0.01)]


@pytest.mark.parametrize("updater", UPDATERS, ids=lambda u: type(u).__name__)
def test_fused_and_foreach_optimizers_equal_the_for_loop(updater):
    x, y = images(96)
    trained = {}
    for setting in ("off", "auto", "on"):
        with settings(fused_optimizer=setting):
            net = MultiLayerNetwork(conv_net(updater), backend="cpu")
            if setting == "on" and isinstance(updater, RmsProp):
                with pytest.raises(BackendError, match="no fused kernel for RmsProp"):
                    net.init()
                continue
            net.fit((x, y), epochs=3, batch_size=16)  # 18 steps
        group = net.optimizer.param_groups[0]
        trained[setting] = (params(net), group.get("fused"), group.get("foreach"))
    reference, fused, foreach = trained["off"]
    assert not fused and foreach is False
    expected = "foreach" if isinstance(updater, RmsProp) else "fused"
    _, fused, foreach = trained["auto"]
    assert (bool(fused), bool(foreach)) == (expected == "fused", expected == "foreach")
    for setting in trained.keys() - {"off"}:
        for a, b in zip(reference, trained[setting][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_optimizer_kernel_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    nesterovs, adam = Nesterovs(learning_rate=0.1), Adam(learning_rate=0.1)
    assert optimizer_kernel("auto", nesterovs, cuda) == optimizer_kernel("auto", adam, cpu) == "fused"
    assert optimizer_kernel("auto", RmsProp(learning_rate=0.1), cuda) == "foreach"
    assert optimizer_kernel("off", adam, cuda) == "loop"
    # torch's fused SGD corrupts momentum on steps a loss scaler skips; fused Adam does not
    assert optimizer_kernel("auto", nesterovs, cuda, loss_scaling=True) == "foreach"
    assert optimizer_kernel("auto", adam, cuda, loss_scaling=True) == "fused"
    with pytest.raises(BackendError, match="corrupts its momentum"):
        optimizer_kernel("on", nesterovs, cuda, loss_scaling=True)
    with pytest.raises(BackendError, match="fused_optimizer=on, but torch has no fused kernel for RmsProp"):
        optimizer_kernel("on", RmsProp(learning_rate=0.1), cpu)


def test_fused_optimizer_on_is_an_error_for_a_torch_model():
    module = torch.nn.Linear(5, 3)
    model = TorchModel(module, loss=torch.nn.functional.cross_entropy,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1), backend="cpu")
    with settings(fused_optimizer="on"):
        with pytest.raises(BackendError, match="a TorchModel's optimizer is yours"):
            model.init()


def test_saved_updater_state_does_not_depend_on_the_kernel(tmp_path):
    x, y = images(64)
    with settings(fused_optimizer="on"):
        fused = MultiLayerNetwork(conv_net(Adam(learning_rate=0.01)), backend="cpu")
        fused.fit((x, y), epochs=2, batch_size=16)
        fused.save(tmp_path / "m.dl4py")
    with zipfile.ZipFile(tmp_path / "m.dl4py") as zf:
        groups = json.loads(zf.read("updater.json"))["param_groups"]
    assert all("fused" not in g and "foreach" not in g for g in groups)
    with settings(fused_optimizer="off"):
        loop = dl4py.load(tmp_path / "m.dl4py")
    group = loop.optimizer.param_groups[0]
    assert not group["fused"] and group["foreach"] is False  # the environment's choice, not the file's
    fused.fit((x, y), epochs=1, batch_size=16)
    loop.fit((x, y), epochs=1, batch_size=16)
    for a, b in zip(params(fused), params(loop)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- channels_last ---------------------------------------------------------------------------

def test_channels_last_trains_like_the_default_format():
    x, y = images(96)
    trained = {}
    for setting in ("off", "on"):
        with settings(channels_last=setting):
            net = MultiLayerNetwork(conv_net(), backend="cpu")
            net.fit((x, y), epochs=3, batch_size=16)
        weight = net.module[2].op.weight  # [6, 4, 2, 2]: with one input channel both formats coincide
        assert weight.is_contiguous(memory_format=torch.channels_last) == (setting == "on")
        trained[setting] = net
    for a, b in zip(params(trained["off"]), params(trained["on"])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(trained["off"].output(x), trained["on"].output(x), rtol=1e-4, atol=1e-5)
    four_d = torch.rand(3, 1, 8, 8)
    with settings(channels_last="on"):
        net = trained["on"]
        assert net.prepare_input(four_d).is_contiguous(memory_format=torch.channels_last)
        assert net.prepare_input(x[:3]).shape == (3, 64)  # flat rows stay rows


def test_channels_last_model_files_are_the_default_formats_and_resume_exactly(tmp_path):
    x, y = images(64)
    with settings(channels_last="on", fused_optimizer="on"):
        net = MultiLayerNetwork(conv_net(), backend="cpu")
        net.fit((x, y), epochs=2, batch_size=16)
        saved = model_bytes(net)
        restored = dl4py.load(saved)
        assert model_bytes(restored) == saved  # bit-identical round trip
        # Loaded momentum buffers take the weights' layout: fused kernels need them alike.
        weight = restored.module[2].op.weight
        assert weight.is_contiguous(memory_format=torch.channels_last)
        assert restored.optimizer.state[weight]["momentum_buffer"].stride() == weight.stride()
        net.fit((x, y), epochs=1, batch_size=16)
        restored.fit((x, y), epochs=1, batch_size=16)
        assert all(torch.equal(a, b) for a, b in zip(params(net), params(restored)))
    with settings(channels_last="off"):
        plain = dl4py.load(saved)
    with zipfile.ZipFile(io.BytesIO(saved)) as zf, zipfile.ZipFile(io.BytesIO(model_bytes(plain))) as zp:
        assert zf.read("weights.safetensors") == zp.read("weights.safetensors")  # no layout in the file


def test_channels_last_rule():
    with settings(channels_last="on"):
        with pytest.raises(BackendError, match="channels_last=on, but this network has no 2-D convolutions"):
            MultiLayerNetwork(mlp(), backend="cpu").init()
    with settings(channels_last="auto"):  # auto: CUDA, and a CPU's oneDNN convolutions in float32/float64
        assert MultiLayerNetwork(mlp(), backend="cpu").init()._channels_last is False  # nothing to convert
        on_cpu = MultiLayerNetwork(conv_net(), backend="cpu").init()
        assert on_cpu._channels_last is torch.backends.mkldnn.is_available()
        weights = [p for p in on_cpu.module.parameters() if p.dim() == 4]
        assert all(w.is_contiguous(memory_format=torch.channels_last) for w in weights) is on_cpu._channels_last
        # bfloat16 convolutions in NHWC are not measured here: auto leaves them as they are
        assert MultiLayerNetwork(conv_net(), backend="cpu", precision="bfloat16").init()._channels_last is False


# -- the settings ----------------------------------------------------------------------------

def test_speed_settings_validate_and_read_their_variables():
    env = Environment.from_environ({"DL4PY_DEVICE_DATA": "1", "DL4PY_FUSED_OPTIMIZER": "off",
                                    "DL4PY_CHANNELS_LAST": "AUTO"})
    assert (env.device_data, env.fused_optimizer, env.channels_last) == ("on", "off", "auto")
    assert Environment(channels_last=False).channels_last == "off"  # YAML's bare off
    with pytest.raises(ConfigError, match="^fused_optimizer: must be one of auto, on, off; got 'fast'"):
        Environment(fused_optimizer="fast")
    with pytest.raises(ConfigError, match="^DL4PY_DEVICE_DATA: must be one of auto, on, off"):
        Environment.from_environ({"DL4PY_DEVICE_DATA": "gpu"})
    from dl4py.config import EnvironmentConfig

    assert EnvironmentConfig.from_dict({"device_data": True}).device_data == "on"
    assert Environment().to_dict()["device_data"] == "auto"


# -- dl4py bench ------------------------------------------------------------------------------

def test_bench_finds_the_checkouts_benchmarks_and_fails_clearly_without_them(tmp_path, capsys):
    from dl4py import bench
    from dl4py.cli import main

    assert (bench.find_benchmarks() / "throughput.py").is_file()
    assert main(["bench", "overhead", "--benchmarks", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "dl4py bench: error: the benchmark scripts" in err and "not with an installed wheel" in err
