"""Modules and the per-step loss of the recurrent and embedding layers (config/recurrent.py).

Sequences are ``[batch, time, size]``. Variable-length sequences come padded at the end
with a mask ``[batch, time]`` (1 for a real step, 0 for padding), as DL4J's feature mask
array. As DL4J's ``setLayerMaskArrays``, the model puts the batch's mask in a ``SequenceMask``
its modules and loss share, before the forward pass:

- LSTM/GRU run over the whole padded batch (one cuDNN call, no packing): they run forward
  in time, so padding at the end cannot reach a real step; their outputs at padded steps
  are zeroed, as DL4J does, so the next layer sees nothing of the padding either; so do
  the step loops of ``nn/recurrent_cells.py`` (GravesLSTM, SimpleRnn, a non-tanh LSTM);
- a Bidirectional (and GravesBidirectionalLSTM) runs its backward direction over each
  sequence reversed in its real steps (``reverse_steps``): it starts at the last real step
  from zero states, as DL4J's masked reverse pass does;
- LastTimeStep takes each sequence's last real step;
- RnnOutputLayer's loss is the mean over real steps only.

Their builders register under their type names (``config/registry.py``); RnnOutputLayer's
module is a dense layer per step (``nn/builder.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from dl4py.config.recurrent import RnnOutputLayer
from dl4py.config.registry import LAYERS
from dl4py.errors import DataError
from dl4py.nn.convolution import cpu_autocast_upcasts
from dl4py.nn.layer_init import ACTIVATIONS, init_weight
from dl4py.nn.output_loss import OutputLoss
from dl4py.nn.recurrent_cells import KernelGRU, KernelLSTM, LoopLSTM, LoopRnn, init_cell


class SequenceMask:
    """The current batch's mask ``[batch, time]``, or None for sequences without padding.
    A plain holder (not a module, not saved): the model sets ``current`` for each batch."""

    def __init__(self):
        self.current: torch.Tensor | None = None


class RecurrentOp(nn.Module):
    """``nn.LSTM`` / ``nn.GRU`` (batch first), its outputs zeroed at padded steps."""

    def __init__(self, rnn: nn.RNNBase, masks: SequenceMask):
        super().__init__()
        self.rnn = rnn
        self.masks = masks

    def forward(self, x):
        if isinstance(self.rnn, nn.LSTM) and x.device.type == "cpu" and cpu_autocast_upcasts():
            # CPU autocast sends an LSTM to oneDNN in 16 bits, which fails where the CPU has no
            # native 16-bit kernels ("could not create a primitive descriptor"): float32 there.
            with torch.autocast("cpu", enabled=False):
                out, _ = self.rnn(x.float())
        else:
            out, _ = self.rnn(x)
        return _zero_padding(out, self.masks.current)


class BidirectionalOp(nn.Module):
    """DL4J's Bidirectional: ``rnn`` (both directions' parameters, ``recurrent_cells``) runs
    forward over ``x`` and backward over each sequence's real steps; ``mode`` combines them."""

    def __init__(self, rnn: nn.Module, mode: str, masks: SequenceMask):
        super().__init__()
        self.rnn = rnn
        self.mode = mode
        self.masks = masks

    def forward(self, x):
        mask = self.masks.current
        return _zero_padding(self._both_directions(x, mask), mask)

    def _both_directions(self, x, mask):
        # A function of its own, so that the two directions' results are gone (unless saved)
        # before the mask multiplies (memory/sequence_ops.py counts on it).
        forward = self.rnn.run(x, "")
        backward = reverse_steps(self.rnn.run(reverse_steps(x, mask), "_reverse"), mask)
        if self.mode == "concat":
            return torch.cat([forward, backward], dim=-1)
        if self.mode == "add":
            return forward + backward
        if self.mode == "mul":
            return forward * backward
        return (forward + backward) * 0.5  # average

    def extra_repr(self) -> str:
        return f"mode={self.mode}"


def reverse_steps(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's real steps in reverse order, its padding left at the end (its own
    inverse). ``x`` ``[batch, time, size]``; ``mask`` ``[batch, time]``, left-aligned, or None."""
    if mask is None:
        return x.flip(1)
    time = x.shape[1]
    steps = torch.arange(time, device=x.device).unsqueeze(0)
    lengths = mask.sum(dim=1, keepdim=True).long()
    order = torch.where(steps < lengths, lengths - 1 - steps, steps)
    return x.gather(1, order.unsqueeze(-1).expand(-1, -1, x.shape[2]))


class LastStep(nn.Module):
    """The output of ``op`` at each sequence's last real step: ``[n, time, h] -> [n, h]``."""

    def __init__(self, op: RecurrentOp, masks: SequenceMask):
        super().__init__()
        self.op = op
        self.masks = masks

    def forward(self, x):
        out = self.op(x)
        mask = self.masks.current
        if mask is None:
            return out[:, -1]
        last = (mask.sum(dim=1).long() - 1).clamp_min(0)  # a left-aligned mask: its length - 1
        return out[torch.arange(out.shape[0], device=out.device), last]


class Embedding(nn.Module):
    """Indices (held as floating-point features, one per example or step, in a trailing
    axis of size 1) -> vectors. ``sequence``: ``[n, time, 1] -> [n, time, n_out]``, padding
    zeroed; else ``[n, 1] -> [n, n_out]``."""

    def __init__(self, vocab_size: int, n_out: int, sequence: bool, masks: SequenceMask, where: str):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, n_out)
        self.sequence = sequence
        self.masks = masks
        self.where = where

    def forward(self, x):
        indices = x[..., 0]
        if indices.device.type == "cpu":  # on a GPU a wrong index is the kernel's assertion
            _check_indices(indices, self.embedding.num_embeddings, self.where)
        out = self.embedding(indices.long())
        return _zero_padding(out, self.masks.current) if self.sequence else out

    def extra_repr(self) -> str:
        return f"sequence={self.sequence}"


def _check_indices(indices: torch.Tensor, vocab_size: int, where: str) -> None:
    if not indices.numel():
        return
    if indices.is_floating_point() and not torch.equal(indices, indices.round()):
        raise DataError(f"{where}: embedding inputs must be whole-number indices, got {indices.flatten()[:5].tolist()}...")
    low, high = float(indices.min()), float(indices.max())
    if low < 0 or high >= vocab_size:
        raise DataError(f"{where}: index {int(low if low < 0 else high)} is outside the embedding's "
                        f"vocab_size {vocab_size} [0, {vocab_size})")


def _zero_padding(out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return out
    return out * mask.unsqueeze(-1).to(out.dtype)


# Builders (config/registry.py): (layer, shape, config, generator, masks, where) -> (op, activation or None).


@LAYERS.builder("last_time_step")
def _last_time_step(layer, shape, config, gen, masks: SequenceMask, where: str):
    inner = layer.layer
    op, _ = LAYERS.builder_for(inner)(inner, shape, config, gen, masks, where)
    return LastStep(op, masks), None


@LAYERS.builder("lstm")
def _lstm(layer, shape, config, gen, masks: SequenceMask, where: str):
    if layer.activation not in (None, "tanh"):  # PyTorch's kernels have tanh only: dl4py's loop
        return RecurrentOp(_cell(layer, shape, config, gen, directions=1), masks), None
    rnn = _recurrent(nn.LSTM, layer, shape, config, gen)
    with torch.no_grad():  # PyTorch's gate order: input, forget, cell, output
        rnn.bias_ih_l0[layer.n_out : 2 * layer.n_out] = layer.forget_gate_bias_init
    return RecurrentOp(rnn, masks), None


@LAYERS.builder("gru")
def _gru(layer, shape, config, gen, masks: SequenceMask, where: str):
    return RecurrentOp(_recurrent(nn.GRU, layer, shape, config, gen), masks), None


@LAYERS.builder("graves_lstm", "simple_rnn")
def _own_loop(layer, shape, config, gen, masks: SequenceMask, where: str):
    return RecurrentOp(_cell(layer, shape, config, gen, directions=1), masks), None


@LAYERS.builder("graves_bidirectional_lstm")
def _graves_bidirectional(layer, shape, config, gen, masks: SequenceMask, where: str):
    return BidirectionalOp(_cell(layer, shape, config, gen, directions=2), "add", masks), None  # DL4J sums


@LAYERS.builder("bidirectional")
def _bidirectional(layer, shape, config, gen, masks: SequenceMask, where: str):
    return BidirectionalOp(_cell(layer.layer, shape, config, gen, directions=2), layer.mode, masks), None


def _cell(layer, shape, config, gen, directions: int) -> nn.Module:
    """The parameters and step function of ``layer`` (one of a Bidirectional's), initialised:
    PyTorch's kernels where they compute DL4J's cell (a tanh LSTM, a GRU), else dl4py's loops."""
    size, n = shape.dims[1], layer.n_out
    activation = ACTIVATIONS[layer.activation or "tanh"]()  # DL4J's default, not the network's
    name = layer.type_name
    if name == "gru":
        rnn = KernelGRU(size, n, batch_first=True, bidirectional=directions == 2)
    elif name == "lstm" and layer.activation in (None, "tanh"):
        rnn = KernelLSTM(size, n, batch_first=True, bidirectional=directions == 2)
    elif name == "simple_rnn":
        rnn = LoopRnn(size, n, directions, activation)
    elif name == "lstm":
        rnn = LoopLSTM(size, n, directions, False, activation)
    else:  # graves_lstm, graves_bidirectional_lstm: peepholes
        rnn = LoopLSTM(size, n, directions, True, activation, layer.gate_activation)
    forget_gate_bias = None if name in ("gru", "simple_rnn") else layer.forget_gate_bias_init
    init_cell(rnn, layer.weight_init or config.weight_init, gen, forget_gate_bias)
    return rnn


def _recurrent(cls: type[nn.RNNBase], layer, shape, config, gen) -> nn.RNNBase:
    """One layer of ``cls`` (its activation inside), weights by the layer's scheme, biases zero."""
    rnn = cls(shape.dims[1], layer.n_out, batch_first=True)
    scheme = layer.weight_init or config.weight_init
    init_weight(rnn.weight_ih_l0, scheme, gen)
    init_weight(rnn.weight_hh_l0, scheme, gen)
    nn.init.zeros_(rnn.bias_ih_l0)
    nn.init.zeros_(rnn.bias_hh_l0)
    return rnn


@LAYERS.builder("embedding")
def _embedding(layer, shape, config, gen, masks: SequenceMask, where: str):
    return _embedding_parts(layer, config, gen, masks, where, sequence=False)


@LAYERS.builder("embedding_sequence")
def _embedding_sequence(layer, shape, config, gen, masks: SequenceMask, where: str):
    return _embedding_parts(layer, config, gen, masks, where, sequence=True)


def _embedding_parts(layer, config, gen, masks: SequenceMask, where: str, sequence: bool):
    module = Embedding(layer.vocab_size, layer.n_out, sequence, masks, where)
    init_weight(module.embedding.weight, layer.weight_init or config.weight_init, gen)
    if layer.activation in (None, "identity"):  # None: identity, not the network's default
        return module, None
    if layer.activation == "softmax":
        return module, nn.Softmax(dim=-1)  # over each vector, of a sequence's steps too
    return module, ACTIVATIONS[layer.activation]()


class RnnOutputLoss:
    """RnnOutputLayer's loss: the output layer's loss at every real step, averaged over
    them (padded steps count nothing). Scores ``[n, time, k]``; labels ``[n, time]`` class
    indices or ``[n, time, k]`` targets."""

    def __init__(self, layer: RnnOutputLayer, masks: SequenceMask):
        self.step_loss = OutputLoss(layer)
        self.masks = masks
        self.n_out = layer.n_out

    def __call__(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = self.masks.current
        if mask is None:
            steps = scores.reshape(-1, self.n_out)
            targets = labels.reshape(-1) if labels.dim() == 2 else labels.reshape(-1, self.n_out)
        else:
            real = mask.bool()
            steps, targets = scores[real], labels[real]
        return self.step_loss(steps, targets)

    def activate(self, scores: torch.Tensor) -> torch.Tensor:
        return self.step_loss.activate(scores.reshape(-1, self.n_out)).reshape(scores.shape)


__all__ = ["SequenceMask", "RnnOutputLoss"]
