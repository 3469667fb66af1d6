"""``dl4py.plan.step_work``: the work of one training step, per layer, from the config alone.

Checked against the textbook counts (a dense network's multiply-adds, a convolution's
2 * outputs * Cin * kh * kw), against FlopCounterMode over a real training step on the CPU
(the residual graph), and for what a cost model leans on: frozen layers train no parameters,
FLOPs grow linearly with the batch, and a 52M-parameter network is counted without memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dl4py.config import (
    GRU,
    LSTM,
    Adam,
    Convolution1DLayer,
    DenseLayer,
    EmbeddingSequenceLayer,
    FrozenLayer,
    InputType,
    LastTimeStep,
    LayerNormalization,
    NetworkConfig,
    OutputLayer,
    RnnOutputLayer,
    RunConfig,
    SelfAttentionLayer,
)
from dl4py.config.registry import LAYERS
from dl4py.data import DataSet
from dl4py.errors import ConfigError
from dl4py.nn import ComputationGraph
from dl4py.plan import KINDS, step_work
from dl4py.plan.work import LAYER_KINDS, WRAPPERS

ROOT = Path(__file__).resolve().parents[1]
MLP = RunConfig.from_file(ROOT / "examples" / "mlp_4000.yaml").network
LENET = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml").network
RESNET = RunConfig.from_file(ROOT / "examples" / "resnet_mnist.yaml").network


def _conf(input_type, *layers):
    builder = NetworkConfig.builder().seed(7).updater(Adam(learning_rate=0.01))
    for layer in layers:
        builder.layer(layer)
    return builder.input_type(input_type).build()


def test_the_dense_mlp_counts_its_textbook_multiply_adds():
    batch = 128
    work = step_work(MLP, batch)
    multiply_adds = batch * (784 * 4000 + 4000 * 4000 + 4000 * 10)
    assert work.forward_flops == 2 * multiply_adds
    # Backward: the input's gradient and the weights' gradient, each as much as the forward,
    # except the first layer's input gradient (the data takes none).
    assert work.backward_flops == 2 * work.forward_flops - 2 * batch * 784 * 4000
    assert work.flops_by_kind() == {**dict.fromkeys(KINDS, 0), "matmul": work.flops}
    assert work.parameters == 784 * 4000 + 4000 + 4000 * 4000 + 4000 + 4000 * 10 + 10
    assert work.gradient_bytes == 4 * work.parameters  # float32 gradients, all averaged
    assert [layer.output_elements for layer in work.layers] == [batch * 4000, batch * 4000, batch * 10]
    assert [layer.name for layer in work.layers] == ["layer 0", "layer 1", "layer 2"]


def test_lenet_convolutions_count_two_flops_per_output_input_channel_and_kernel_position():
    batch = 16
    work = step_work(LENET, batch)
    first, second = work.layers[0], work.layers[2]
    assert (first.kind, second.kind) == ("conv", "conv")
    assert first.forward_flops == 2 * batch * (20 * 24 * 24) * 1 * 5 * 5 == first.output_elements * 2 * 25
    assert second.forward_flops == 2 * second.output_elements * 20 * 5 * 5
    assert first.backward_flops == first.forward_flops  # weights only: the image takes no gradient
    assert second.backward_flops == 2 * second.forward_flops
    pooling = work.layers[1]
    assert (pooling.kind, pooling.flops, pooling.parameters) == ("elementwise", 0, 0)
    assert pooling.bytes > 0 and pooling.kernels > 0  # its cost is memory traffic


def test_the_residual_graph_counts_what_flop_counter_mode_counts_over_a_real_training_step():
    batch = 8
    net = ComputationGraph(RESNET).init()
    generator = torch.Generator().manual_seed(0)
    features = torch.rand(batch, 784, generator=generator)
    labels = torch.nn.functional.one_hot(torch.arange(batch) % 10, 10).float()
    prepared = net.prepare_batch(DataSet(features, labels))
    with FlopCounterMode(display=False) as counter:
        net.train_step(*prepared)
    work = step_work(RESNET, batch)
    assert work.flops == counter.get_total_flops() > 0
    assert [layer.name for layer in work.layers][:2] == ["vertex 'stem'", "vertex 'pool1'"]
    add = next(layer for layer in work.layers if layer.name == "vertex 'add'")
    assert (add.type_name, add.kind, add.flops) == ("elementwise add", "elementwise", 0)
    assert add.bytes > 0


def test_an_lstm_counts_its_gate_products_as_recurrent_work():
    batch, time, size, hidden = 4, 7, 3, 5
    config = _conf(InputType.recurrent(size, time), LSTM(n_out=hidden), GRU(n_out=4), RnnOutputLayer(n_out=3))
    work = step_work(config, batch)
    lstm = work.layers[0]
    assert lstm.kind == work.layers[1].kind == "recurrent"
    # four gates, each a product with the input and one with the previous output, per step
    assert lstm.forward_flops == 2 * batch * time * 4 * hidden * (size + hidden)
    assert work.flops_by_kind()["recurrent"] > lstm.forward_flops
    assert lstm.output_elements == batch * time * hidden


def test_a_sequence_without_a_length_needs_one_as_the_memory_estimator_does():
    config = _conf(InputType.recurrent(3), LSTM(n_out=5), RnnOutputLayer(n_out=3))
    with pytest.raises(ConfigError, match=r"network\.input_type\.length"):
        step_work(config, 4)


def test_self_attention_counts_its_batched_products_as_attention_work():
    config = _conf(InputType.recurrent(4, 9), Convolution1DLayer(n_out=6, kernel_size=3, padding=1),
                   SelfAttentionLayer(n_out=6, n_heads=2), LayerNormalization(),
                   SelfAttentionLayer(n_out=6, n_heads=3, head_size=2, project_input=False),
                   LastTimeStep(LSTM(n_out=3)), OutputLayer(n_out=2))
    work = step_work(config, 4)
    kinds = [layer.kind for layer in work.layers]
    assert kinds == ["conv", "attention", "elementwise", "attention", "recurrent", "matmul"]
    by_kind = work.flops_by_kind()
    assert by_kind["attention"] > 0 and by_kind["recurrent"] > 0
    # without projections, all of the second attention's FLOPs are its two batched products
    unprojected = work.layers[3]
    assert unprojected.parameters == 0 and unprojected.forward_flops == 2 * (2 * 4 * 3 * 9 * 9 * 2)


def test_a_frozen_layer_takes_no_parameter_gradient_flops():
    frozen = MLP.replace(layers=(MLP.layers[0], FrozenLayer(layer=MLP.layers[1]), MLP.layers[2]))
    trained, kept = step_work(MLP, 32).layers[1], step_work(frozen, 32).layers[1]
    assert kept.type_name == "dense (frozen)" and kept.frozen and not trained.frozen
    assert trained.backward_flops == 2 * trained.forward_flops  # input and weight gradients
    assert kept.backward_flops == kept.forward_flops  # the input's gradient only: layer 0 trains
    assert kept.backward_bytes < trained.backward_bytes and kept.kernels < trained.kernels
    assert step_work(frozen, 32).gradient_bytes == step_work(MLP, 32).gradient_bytes - kept.parameter_bytes
    # frozen at the bottom, nothing below trains: no backward at all
    bottom = MLP.replace(layers=(FrozenLayer(layer=MLP.layers[0]),) + MLP.layers[1:])
    assert step_work(bottom, 32).layers[0].backward_flops == 0


def test_flops_and_activations_grow_linearly_with_the_batch():
    for config in (LENET, RESNET):
        small, large = step_work(config, 3), step_work(config, 12)
        for one, four in zip(small.layers, large.layers):
            assert (four.forward_flops, four.backward_flops) == (4 * one.forward_flops, 4 * one.backward_flops)
            assert four.output_elements == 4 * one.output_elements
            assert (four.parameters, four.kernels) == (one.parameters, one.kernels)


def test_precision_sets_the_bytes_not_the_flops():
    full, half = step_work(LENET, 16, "float"), step_work(LENET, 16, "half")
    assert half.flops == full.flops and half.precision == "half"
    assert half.bytes < full.bytes and half.gradient_bytes * 2 == full.gradient_bytes


# The forum's 9000-4000-4000-32 network (52M parameters) at a batch whose real step would
# hold over 400 MB (parameters, gradients, activations), counted in a fresh process.
_FORUM_NET = """
import json, resource
from dl4py.config import DenseLayer, InputType, NetworkConfig, OutputLayer, Sgd
from dl4py.plan import step_work
builder = NetworkConfig.builder().updater(Sgd(learning_rate=0.1)).input_type(InputType.feed_forward(9000))
for layer in (DenseLayer(n_out=4000), DenseLayer(n_out=4000), OutputLayer(n_out=32)):
    builder.layer(layer)
config = builder.build()
step_work(config, 2)  # the first call's one-off costs (FlopCounterMode's set-up) out of the way
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
work = step_work(config, 1024)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"parameters": work.parameters, "flops": work.flops, "grown_kib": after - before}))
"""


def test_the_forums_52m_parameter_network_is_counted_without_allocating_its_step():
    done = subprocess.run([sys.executable, "-c", _FORUM_NET], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["parameters"] == 9000 * 4000 + 4000 + 4000 * 4000 + 4000 + 4000 * 32 + 32 == 52_136_032
    multiply_adds = 1024 * (9000 * 4000 + 4000 * 4000 + 4000 * 32)
    assert result["flops"] == 2 * multiply_adds * 3 - 2 * 1024 * 9000 * 4000
    assert result["grown_kib"] < 64 * 1024  # the real step's tensors would be over 400 MB


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_a_batch_size_that_is_not_a_positive_whole_number_is_a_config_error(batch_size):
    with pytest.raises(ConfigError, match=r"^batch_size: must be a positive whole number"):
        step_work(LENET, batch_size)


def test_an_unknown_precision_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"^precision: unknown precision 'float17'; choose one of: .*bfloat16"):
        step_work(LENET, 8, "float17")


def test_every_layer_type_has_a_kind():
    """A new layer type must say which device rate its work runs at."""
    assert sorted(set(LAYERS.type_names()) - set(WRAPPERS)) == sorted(LAYER_KINDS)
    assert set(LAYER_KINDS.values()) == set(KINDS)


def test_an_embedding_is_counted_as_a_gather():
    config = _conf(InputType.recurrent(1, 6), EmbeddingSequenceLayer(vocab_size=9, n_out=4),
                   LastTimeStep(GRU(n_out=5)), DenseLayer(n_out=4), OutputLayer(n_out=2))
    work = step_work(config, 4)
    assert [layer.kind for layer in work.layers] == ["elementwise", "recurrent", "matmul", "matmul"]
    embedding = work.layers[0]
    assert embedding.flops == 0 and embedding.parameters == 9 * 4
