"""The layer registry (config/registry.py): one table from a layer's type name to its config
class, its module builder and its memory rule, which every place that needs "all layer types"
asks. A type dropped by mistake, a part left unregistered or registered under a misspelt name
fails here; the config round trip of every type is test_config's ``test_round_trip_every_layer_type``."""

from __future__ import annotations

import pytest
import torch

import dl4py
import dl4py.config
from dl4py.config import InputType, NetworkConfig
from dl4py.config.registry import BUILDER, LAYERS, MEMORY_RULE, LayerRegistry
from dl4py.errors import ConfigError
from dl4py.memory.operations import network_ops  # imported, it has every memory rule registered
from dl4py.nn.builder import build_module  # ... and this every builder
from test_config import SAMPLES, SEQUENCE_SAMPLES, sample_layers

# The layer types before the registry, written out so that a type lost on the way fails
# (sorted, as the registry lists them), then those added since (DL4J's, for its model files).
TYPE_NAMES = sorted([
    "activation", "batch_normalization", "convolution", "convolution1d", "deconvolution2d", "dense",
    "dropout", "embedding", "embedding_sequence", "frozen", "global_pooling", "gru", "last_time_step",
    "layer_normalization", "lstm", "output", "rnn_output", "self_attention", "subsampling",
    "subsampling1d", "upsampling2d", "zero_padding",
    "cnn_loss", "cropping1d", "cropping2d", "depthwise_convolution2d", "separable_convolution2d", "zero_padding1d",
    "bidirectional", "graves_bidirectional_lstm", "graves_lstm", "simple_rnn",
])
# Those a sequence [time, size] may go into (before: config/recurrent.py's TAKES_SEQUENCES, and dropout).
TAKE_SEQUENCES = {"convolution1d", "dropout", "embedding_sequence", "gru", "last_time_step",
                  "layer_normalization", "lstm", "rnn_output", "self_attention", "subsampling1d"}
# ... and since (DL4J's layers for its model files): 1-D cropping and padding, the peephole,
# simple and bidirectional recurrent layers, and global pooling over a sequence's steps.
TAKE_SEQUENCES |= {"cropping1d", "zero_padding1d", "bidirectional", "graves_bidirectional_lstm", "graves_lstm",
                   "simple_rnn", "global_pooling"}
# What an unknown ``type:`` said before the registry, word for word.
UNKNOWN_TYPE = ("network.layers[1].type: unknown type 'pooling'; known: " + ", ".join(TYPE_NAMES))


def test_the_layer_types_are_those_before_the_registry():
    assert LAYERS.type_names() == TYPE_NAMES
    assert all(LAYERS.config_class(name).type_name == name for name in TYPE_NAMES)


@pytest.mark.parametrize("part", [BUILDER, MEMORY_RULE])
def test_every_layer_type_has_a_builder_and_a_memory_rule(part):
    assert LAYERS.missing(part) == []


def test_the_layer_types_that_take_sequences_are_those_before():
    assert {name for name in TYPE_NAMES if LAYERS.config_class(name).takes_sequences} == TAKE_SEQUENCES


def test_every_layer_class_is_exported_from_dl4py_and_dl4py_config():
    # The public surface lists the classes by name (an explicit surface); this keeps it whole.
    for name in TYPE_NAMES:
        cls = LAYERS.config_class(name)
        for package in (dl4py, dl4py.config):
            assert getattr(package, cls.__name__) is cls and cls.__name__ in package.__all__, (package, name)


def _sample_network(type_name: str) -> NetworkConfig:
    """test_config's sample of the type in a network (as its round trip builds it), every
    sequence of a fixed length, so that its memory can be estimated."""
    input_type, layers = sample_layers(type_name)
    if type_name in SEQUENCE_SAMPLES:
        if hasattr(input_type, "length"):
            input_type = InputType.recurrent(input_type.size, input_type.length or 5)
    return NetworkConfig(layers=layers, input_type=input_type, seed=7, weight_init="relu", activation="tanh")


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_the_builder_and_the_memory_rule_of_each_type_count_the_same_parameters(type_name):
    # Both parts found through the registry for one type must describe the same layer.
    config = _sample_network(type_name)
    module = build_module(config, torch.Generator().manual_seed(0))
    for index, layer_module in enumerate(module):
        built = sum(p.numel() for p in layer_module.parameters())
        for device in ("cpu", "cuda"):  # the rules' two kernels (an LSTM's), both from the config alone
            counted = sum(op.param_elements for op in network_ops(config, device) if op.layer == index)
            assert counted == built, (config.layers[index].type_name, device)


def test_an_unknown_type_is_the_same_one_line_error():
    data = {"input_type": {"type": "feed_forward", "size": 3},
            "layers": [{"type": "dense", "n_out": 5}, {"type": "pooling"}, {"type": "output", "n_out": 2}]}
    with pytest.raises(ConfigError) as error:
        NetworkConfig.from_dict(data)
    assert str(error.value) == UNKNOWN_TYPE


def test_a_part_for_no_layer_type_or_a_second_one_is_refused_when_registered():
    registry = LayerRegistry()  # not the one dl4py uses: these registrations must not stay
    with pytest.raises(ValueError, match=r"a module builder for 'dense_layer', which is no layer type; known: "
                                         r"activation, batch_normalization"):
        registry.builder("dense_layer")
    registry.memory_rule("dense")(lambda *args: [])
    with pytest.raises(ValueError, match=r"layer type 'dense' has a memory rule already"):
        registry.memory_rule("output", "dense")


def test_a_layer_type_without_its_part_is_named():
    registry = LayerRegistry()
    registry.builder("dense")(lambda *args: None)  # a builder, and nothing else
    with pytest.raises(TypeError, match=r"no module builder for layer type 'lstm' \(LSTM\)"):
        registry.builder_for(SAMPLES["lstm"])
    with pytest.raises(TypeError, match=r"no memory rule for layer type 'dense' \(DenseLayer\)"):
        registry.memory_rule_for(SAMPLES["dense"])
