"""The LSTM's forget gate starts at ``forget_gate_bias_init`` (DL4J's ``forgetGateBiasInit``,
1.0 by default), and only the forget gate: checked on the gate's own rows of the bias, and by
what the recurrence does with the cell state, on every LSTM of a network or graph."""

from __future__ import annotations

import torch
from torch import nn

from devices import backend_for, on_devices
from dl4py.config import (
    LSTM,
    Adam,
    GraphConfig,
    InputType,
    LastTimeStep,
    NetworkConfig,
    OutputLayer,
    RnnOutputLayer,
)
from dl4py.nn import ComputationGraph, MultiLayerNetwork

GATES = ("input", "forget", "cell", "output")  # the order of the 4h rows in PyTorch's (and cuDNN's) LSTM


def _conf(input_type, *layers) -> NetworkConfig:
    builder = NetworkConfig.builder().seed(7).updater(Adam(learning_rate=0.01))
    for layer in layers:
        builder.layer(layer)
    return builder.input_type(input_type).build()


def _gate_biases(rnn: nn.LSTM) -> list[dict[str, list[float]]]:
    """Each gate's effective bias, for every stacked layer and direction the LSTM has (one of
    each in dl4py today). PyTorch adds two biases, ``bias_ih`` and ``bias_hh``, where DL4J has
    one: what a gate starts with is their sum."""
    found = []
    for name, bias_ih in rnn.named_parameters():
        if name.startswith("bias_ih"):
            total = (bias_ih + rnn.get_parameter(name.replace("bias_ih", "bias_hh"))).detach().cpu()
            found.append({gate: rows.tolist() for gate, rows in zip(GATES, total.chunk(4))})
    return found


def _lstms(module: nn.Module) -> list[nn.LSTM]:
    return [m for m in module.modules() if isinstance(m, nn.LSTM)]


def _expected_gates(n_out: int, forget: float) -> dict[str, list[float]]:
    return {gate: [forget if gate == "forget" else 0.0] * n_out for gate in GATES}  # DL4J's other biases: 0


@on_devices
def test_forget_gate_bias_init_lands_on_the_forget_gate_of_every_lstm(device):
    conf = _conf(InputType.recurrent(2), LSTM(n_out=5, forget_gate_bias_init=2.5), LSTM(n_out=3),
                 LastTimeStep(LSTM(n_out=4, forget_gate_bias_init=-0.75)), OutputLayer(n_out=2))
    net = MultiLayerNetwork(conf, backend=backend_for(device)).init()
    rnns = _lstms(net.module)
    assert {p.device.type for rnn in rnns for p in rnn.parameters()} == {device}
    assert [_gate_biases(rnn) for rnn in rnns] == [
        [_expected_gates(5, 2.5)], [_expected_gates(3, 1.0)], [_expected_gates(4, -0.75)]]  # 1.0: DL4J's default


@on_devices
def test_the_forget_gate_bias_scales_the_carried_cell_state(device):
    """What the bias means, read from the recurrence itself (cuDNN's on a GPU) rather than from
    a row order: with no weights, one step keeps sigmoid(b) of the cell state, c1 = sigmoid(b) c0,
    and the output gate (bias 0) halves h1 = 0.5 tanh(c1). On another gate's rows the value
    would scale the output, or add to the cell, instead."""
    conf = _conf(InputType.recurrent(2), LSTM(n_out=3, forget_gate_bias_init=2.5), RnnOutputLayer(n_out=2))
    (rnn,) = _lstms(MultiLayerNetwork(conf, backend=backend_for(device)).init().module)
    with torch.no_grad():
        rnn.weight_ih_l0.zero_()
        rnn.weight_hh_l0.zero_()
        c0 = torch.tensor([[[0.5, -1.0, 2.0]]], device=device)
        _, (h1, c1) = rnn(torch.randn(1, 1, 2, device=device), (torch.zeros_like(c0), c0))
    kept = torch.sigmoid(torch.tensor(2.5))
    torch.testing.assert_close(c1.cpu(), kept * c0.cpu())
    torch.testing.assert_close(h1.cpu(), 0.5 * torch.tanh(kept * c0.cpu()))


def test_forget_gate_bias_init_from_yaml_reaches_a_graphs_lstm():
    config = GraphConfig.from_yaml("""
inputs: {words: {type: recurrent, size: 3}}
vertices:
  seq: {inputs: [words], layer: {type: last_time_step, layer: {type: lstm, n_out: 4, forget_gate_bias_init: 2.5}}}
  out: {inputs: [seq], layer: {type: output, n_out: 2}}
outputs: [out]
""")
    assert [_gate_biases(rnn) for rnn in _lstms(ComputationGraph(config).init().module)] == [[_expected_gates(4, 2.5)]]
