"""DL4J's GradientNormalization: each mode against numbers worked out by hand, the layer's
own setting over the network's, every mode under every precision policy on every device (the
update steps on the normalized true gradient: unscaled, the float32 master's), an overflow
skipped whatever the mode, an exploding regression that clipping rescues, and the config keys."""

from __future__ import annotations

import math

import pytest
import torch

from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.backend.precision import NAMES
from dl4py.errors import ConfigError, TrainingError

from devices import backend_for, on_devices, tolerance

# One linear output unit, zero weights, x = [3, 4], target 1, mse: the prediction is 0, the
# loss (0 - 1)^2 and its gradient 2 (0 - 1) = -2, so dW = -2 x = [-6, -8] and db = -2. With
# SGD at learning rate 1 the weights after one step are minus the normalized gradient.
X = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
Y = torch.tensor([[1.0]], dtype=torch.float64)
ROOT104 = math.sqrt(36 + 64 + 4)  # the layer's L2 norm: weights and bias together

HAND = {  # mode, threshold -> (W, b) after the step
    ("none", 1.0): ([6, 8], 2),
    ("clip_element_wise_absolute_value", 5.0): ([5, 5], 2),
    ("clip_l2_per_layer", 5.0): ([6 * 5 / ROOT104, 8 * 5 / ROOT104], 2 * 5 / ROOT104),
    ("clip_l2_per_layer", 20.0): ([6, 8], 2),  # under the threshold: untouched
    ("clip_l2_per_param_type", 5.0): ([3, 4], 2),  # ||dW|| = 10 is clipped to 5, ||db|| = 2 is not
    ("renormalize_l2_per_layer", 1.0): ([6 / ROOT104, 8 / ROOT104], 2 / ROOT104),
    ("renormalize_l2_per_param_type", 1.0): ([0.6, 0.8], 1),
}


def _one_unit(precision="double", **settings) -> MultiLayerNetwork:
    config = NetworkConfig(
        layers=[OutputLayer(n_out=1, loss="mse", activation="identity", weight_init="zero")],
        input_type=InputType.feed_forward(2), updater=Sgd(1.0), **settings,
    )
    return MultiLayerNetwork(config, precision=precision).init()


@pytest.mark.parametrize("mode, threshold", list(HAND))
def test_each_mode_matches_the_hand_computation(mode, threshold):
    net = _one_unit(gradient_normalization=mode, gradient_normalization_threshold=threshold)
    net.train_step(X, Y)
    weight, bias = HAND[(mode, threshold)]
    layer = net.module[0].op
    torch.testing.assert_close(layer.weight.detach(), torch.tensor([weight], dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(layer.bias.detach(), torch.tensor([bias], dtype=torch.float64), rtol=1e-12, atol=0)


def test_dl4j_names_are_accepted_and_stored_canonically():
    config = _one_unit(gradient_normalization="ClipL2PerParamType").config
    assert config.gradient_normalization == "clip_l2_per_param_type"
    built = (NetworkConfig.builder().gradient_normalization("GradientNormalization.ClipL2PerLayer")
             .gradient_normalization_threshold(0.5).layer(OutputLayer(n_out=1))
             .input_type(InputType.feed_forward(2)).build())  # DL4J's builder calls
    assert (built.gradient_normalization, built.gradient_normalization_threshold) == ("clip_l2_per_layer", 0.5)


def test_under_fp16_loss_scaling_the_gradient_is_unscaled_before_clipping():
    net = _one_unit(precision="mixed-fp16", gradient_normalization="clip_element_wise_absolute_value",
                    gradient_normalization_threshold=5.0)
    net.precision_state.set_loss_scale(2.0**10)  # scaled dW is -6144: clipped, it would be 5/1024
    net.train_step(X.float(), Y.float())
    layer = net.module[0].op
    assert layer.weight.tolist() == [[5.0, 5.0]] and layer.bias.tolist() == [2.0]


# -- every mode under every precision policy, on every device ----------------------------------
# The update must be lr times the normalized *true* gradient. Under loss scaling that is the
# unscaled one: normalized while still scaled by 2**10, a clipped or renormalized update would
# be up to 1024 times too small. Under master weights it is the float32 master's: normalizing
# the 16-bit copy would round the result to 16 bits (or leave the masters' gradients as they were).
MODES = ["renormalize_l2_per_layer", "renormalize_l2_per_param_type", "clip_element_wise_absolute_value",
         "clip_l2_per_layer", "clip_l2_per_param_type"]
LR, THRESHOLD, SCALE = 0.5, 0.5, 2.0**10
_LOW = (torch.float16, torch.bfloat16)


def _policy_net(precision: str, mode: str, device: str, scale: float = SCALE) -> MultiLayerNetwork:
    if device == "cuda" and "bf" in precision and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bfloat16 needs a GPU of compute capability 8.0 or later")
    config = NetworkConfig(
        layers=[DenseLayer(n_out=6, activation="tanh"), OutputLayer(n_out=3, loss="mse", activation="identity")],
        input_type=InputType.feed_forward(5), updater=Sgd(LR), seed=2,
        gradient_normalization=mode, gradient_normalization_threshold=THRESHOLD,
    )
    net = MultiLayerNetwork(config, backend=backend_for(device), precision=precision).init()
    if net.precision_state.scales_loss:  # a known scale (the default 2**16 would overflow fp16 here)
        net.precision_state.set_loss_scale(scale)
    return net


def _policy_batch(net):
    gen = torch.Generator().manual_seed(5)
    x, y = 2 * torch.randn(16, 5, generator=gen), 3 * torch.randn(16, 3, generator=gen)
    labels = y.double() if net.precision.name == "double" else y
    return net.prepare_input(x.to(net.device)), labels.to(net.device)


def _stepped(net) -> list[list[torch.Tensor]]:
    """Per layer, the parameters the updater steps (the float32 masters where there are some)."""
    module = net.stepped_module
    return [list(layer.parameters()) for layer in module]


def _true_gradient(net, x, y) -> list[list[torch.Tensor]]:
    """Per layer, in float64, the gradient this step's backward makes: of the loss times the
    loss scale where there is one, then unscaled (a power of two: exact). Read off the module
    before the step, and cleared again."""
    scale = SCALE if net.precision_state.scales_loss else 1.0
    net.module.zero_grad(set_to_none=True)
    with net.precision.forward_context(net.device):
        outputs = net.module(x)
    (net.loss(outputs.float() if outputs.dtype in _LOW else outputs, y) * scale).backward()
    grads = [[p.grad.double() / scale for p in layer.parameters()] for layer in net.module]
    net.module.zero_grad(set_to_none=True)
    return grads


def _normalized(layers: list[list[torch.Tensor]], mode: str) -> list[list[torch.Tensor]]:
    """DL4J's formulas, written out (none of these norms is 0 here)."""
    def norm(grads):
        return torch.sqrt(sum((g * g).sum() for g in grads))

    per_layer = {
        "renormalize_l2_per_layer": lambda grads: [g / norm(grads) for g in grads],
        "renormalize_l2_per_param_type": lambda grads: [g / norm([g]) for g in grads],
        "clip_element_wise_absolute_value": lambda grads: [g.clamp(-THRESHOLD, THRESHOLD) for g in grads],
        "clip_l2_per_layer": lambda grads: [g * min(1.0, THRESHOLD / norm(grads)) for g in grads],
        "clip_l2_per_param_type": lambda grads: [g * min(1.0, THRESHOLD / norm([g])) for g in grads],
    }[mode]
    return [per_layer(grads) for grads in layers]


def _differs(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]], atol: float) -> bool:
    return any(not torch.allclose(x, y, rtol=0, atol=atol) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@on_devices
@pytest.mark.parametrize("precision", NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_the_update_steps_on_the_normalized_true_gradient_in_every_precision(mode, precision, device):
    net = _policy_net(precision, mode, device)
    x, y = _policy_batch(net)
    true = _true_gradient(net, x, y)
    before = [[p.detach().to(torch.float64, copy=True) for p in layer] for layer in _stepped(net)]
    net.train_step(x, y)
    assert net.update_count == 1  # applied: no overflow at this scale
    expected = _normalized(true, mode)
    # Float32 updates of weights below 2, or float64 ones, on the CPU: far below a 16-bit
    # rounding of the gradient (2**-9 relative) or any loss scale's factor.
    close = tolerance(device, cpu=1e-12 if precision == "double" else 1e-6)
    for layer, old, grads in zip(_stepped(net), before, expected):
        for param, b, g in zip(layer, old, grads):
            torch.testing.assert_close(param.detach().double().cpu(), (b - LR * g).cpu(), **close)
    if net.precision_state.keeps_masters:  # the module holds the masters, rounded
        for low, high in zip(net.module.parameters(), net.stepped_module.parameters()):
            assert torch.equal(low, high.to(low.dtype))
    # What the test tells apart: the normalization changes the gradient, and (under loss
    # scaling) normalizing the scaled gradient would have changed it differently.
    assert _differs(expected, true, atol=0.1)
    if net.precision_state.scales_loss:
        scaled = [[g / SCALE for g in grads] for grads in _normalized([[g * SCALE for g in gs] for gs in true], mode)]
        assert _differs(expected, scaled, atol=0.1)


@on_devices
@pytest.mark.parametrize("precision", ["half", "mixed-fp16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", [2.0**17, 2.0**60], ids=["inf", "nan"])
def test_an_overflowing_step_is_skipped_whatever_the_normalization(scale, mode, precision, device):
    # At 2**17 some weight gradients of this batch overflow fp16 to +-inf and nothing is NaN:
    # clamped to the threshold, they would look finite. The overflow must be seen as the
    # gradient is unscaled, before the normalization, and the step skipped. (At 2**60 the
    # backward makes NaNs too.)
    net = _policy_net(precision, mode, device, scale=scale)
    x, y = _policy_batch(net)
    before = [p.detach().clone() for p in net.module.parameters()]
    masters = [p.detach().clone() for layer in _stepped(net) for p in layer]
    net.train_step(x, y)
    assert net.update_count == 0 and net.precision_state.loss_scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, net.module.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, (p for layer in _stepped(net) for p in layer)))


def _two_layers(**settings) -> MultiLayerNetwork:
    first = {key[len("first_"):]: value for key, value in settings.items() if key.startswith("first_")}
    config = NetworkConfig(
        layers=[DenseLayer(n_out=3, activation="tanh", **first),
                OutputLayer(n_out=2, loss="mse", activation="identity")],
        input_type=InputType.feed_forward(4), updater=Sgd(1.0), seed=7,
        **{key: value for key, value in settings.items() if not key.startswith("first_")},
    )
    return MultiLayerNetwork(config, precision="double").init()


def _updates(**settings) -> list[list[torch.Tensor]]:
    """Per layer, the change of each parameter in one SGD(1) step: minus its normalized gradient."""
    gen = torch.Generator().manual_seed(3)
    x = 5 * torch.randn(8, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    net = _two_layers(**settings)
    before = [[p.detach().clone() for p in layer.parameters()] for layer in net.module]
    net.train_step(x, y)
    return [[b - p.detach() for b, p in zip(old, layer.parameters())] for old, layer in zip(before, net.module)]


def test_each_layer_is_clipped_by_its_own_norm():
    raw = _updates()
    clipped = _updates(gradient_normalization="clip_l2_per_layer", gradient_normalization_threshold=0.5)
    for raw_layer, clipped_layer in zip(raw, clipped):
        norm = math.sqrt(sum(float((g * g).sum()) for g in raw_layer))
        assert norm > 0.5  # both layers are over the threshold, each with its own norm
        for g, c in zip(raw_layer, clipped_layer):
            torch.testing.assert_close(c, g * (0.5 / norm), rtol=1e-12, atol=1e-15)


def test_a_layers_own_setting_wins_over_the_networks():
    raw = _updates()
    mixed = _updates(gradient_normalization="clip_element_wise_absolute_value",
                     gradient_normalization_threshold=0.01, first_gradient_normalization="none")
    for g, c in zip(raw[0], mixed[0]):  # layer 0 says none
        assert torch.equal(g, c)
    for g, c in zip(raw[1], mixed[1]):  # the output layer follows the network
        assert g.abs().max() > 0.01
        torch.testing.assert_close(c, g.clamp(-0.01, 0.01), rtol=1e-12, atol=1e-15)
    own_threshold = _updates(first_gradient_normalization="clip_element_wise_absolute_value",
                             first_gradient_normalization_threshold=0.02)
    for g, c in zip(raw[0], own_threshold[0]):
        torch.testing.assert_close(c, g.clamp(-0.02, 0.02), rtol=1e-12, atol=1e-15)
    for g, c in zip(raw[1], own_threshold[1]):
        assert torch.equal(g, c)


def _exploding(**settings) -> tuple[MultiLayerNetwork, torch.Tensor, torch.Tensor]:
    # Unscaled inputs (standard deviation 30) make the loss's curvature ~2000: SGD at 0.01 overshoots
    # further at every step. Clipping the per-layer norm to 5 bounds every step instead.
    gen = torch.Generator().manual_seed(0)
    x = 30 * torch.randn(256, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) / 30 + 0.1 * torch.randn(256, 1, generator=gen)
    config = NetworkConfig(
        layers=[DenseLayer(n_out=16, activation="relu"), OutputLayer(n_out=1, loss="mse", activation="identity")],
        input_type=InputType.feed_forward(8), updater=Sgd(0.01), seed=1, **settings,
    )
    return MultiLayerNetwork(config).init(), x, y


def test_an_exploding_gradient_diverges_without_clipping_and_trains_with_it():
    net, x, y = _exploding()
    with pytest.raises(TrainingError, match="NaN or infinite"):
        net.fit((x, y), epochs=5, batch_size=32, verbose=0)
    net, x, y = _exploding(gradient_normalization="clip_l2_per_layer", gradient_normalization_threshold=5.0)
    before = net.score((x, y))
    net.fit((x, y), epochs=5, batch_size=32, verbose=0)
    after = net.score((x, y))
    assert math.isfinite(after) and after < 0.05 * before


@pytest.mark.parametrize("settings, key", [
    ({"gradient_normalization": "clip_everything"}, r"network\.gradient_normalization\b"),
    ({"gradient_normalization_threshold": 0}, r"network\.gradient_normalization_threshold"),
    ({"gradient_normalization_threshold": float("nan")}, r"network\.gradient_normalization_threshold"),
    ({"layers": [{"type": "dense", "n_out": 3, "gradient_normalization_threshold": -1.0}, {"type": "output", "n_out": 2}]},
     r"network\.layers\[0\]\.gradient_normalization_threshold"),
    ({"layers": [{"type": "dense", "n_out": 3, "gradient_normalization": "sometimes"}, {"type": "output", "n_out": 2}]},
     r"network\.layers\[0\]\.gradient_normalization\b"),
])
def test_bad_settings_are_named_by_key(settings, key):
    data = {"input_type": {"type": "feed_forward", "size": 4},
            "layers": [{"type": "dense", "n_out": 3}, {"type": "output", "n_out": 2}], **settings}
    with pytest.raises(ConfigError, match=key):
        NetworkConfig.from_dict(data)


def test_settings_survive_a_yaml_and_json_round_trip():
    config = NetworkConfig(
        layers=[DenseLayer(n_out=3, gradient_normalization="RenormalizeL2PerLayer"),
                OutputLayer(n_out=2, gradient_normalization_threshold=0.25)],
        input_type=InputType.feed_forward(4), gradient_normalization="clip_l2_per_param_type",
        gradient_normalization_threshold=2.5,
    )
    text = config.to_yaml()
    assert "gradient_normalization: clip_l2_per_param_type" in text
    assert NetworkConfig.from_yaml(text) == config and NetworkConfig.from_json(config.to_json()) == config
    assert NetworkConfig.from_yaml(text).layers[0].gradient_normalization == "renormalize_l2_per_layer"


def test_two_workers_sharing_gradients_clip_the_averaged_gradient_like_one_process():
    # shared_gradients averages the two workers' gradients, then clips: one process stepping
    # on each round's union (two equal batches of 8) with the same clipping must agree.
    from dl4py import ArrayDataSetIterator
    from dl4py.parallel import ParallelWrapper

    gen = torch.Generator().manual_seed(0)
    x = 4 * torch.randn(80, 4, generator=gen)
    y = torch.randn(80, 2, generator=gen)
    clip = dict(gradient_normalization="clip_l2_per_layer", gradient_normalization_threshold=0.3)
    reference = _two_layers(**clip)
    reference.fit(ArrayDataSetIterator(x.double(), y.double(), batch_size=16, shuffle=False), verbose=0)
    net = MultiLayerNetwork(_two_layers(**clip).config, backend="cpu", precision="double")
    ParallelWrapper(net, workers=2, parallelism={"kind": "data", "sync": "shared_gradients"}).fit(
        ArrayDataSetIterator(x.double(), y.double(), batch_size=8, shuffle=False), epochs=1)
    unclipped = _two_layers()
    unclipped.fit(ArrayDataSetIterator(x.double(), y.double(), batch_size=16, shuffle=False), verbose=0)
    for (name, a), b, c in zip(net.module.named_parameters(), reference.module.parameters(),
                               unclipped.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)
        assert not torch.allclose(a, c)  # the clipping made a difference
