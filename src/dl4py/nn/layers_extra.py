"""Modules of the layers in ``config/layers_extra.py``, each built by the builder registered
under its type name (``config/registry.py``, used by ``builder.layer_module``).

Sequences are ``[batch, time, size]``; torch's 1-D convolution and pooling want
``[batch, size, time]``, so those modules transpose in and out (views, no copies).
Padded sequences carry the batch's mask in the model's ``SequenceMask`` (``nn/recurrent.py``):

- self-attention never attends to a padded step (a key mask), and zeroes its outputs there;
- layer normalization works on each step alone, and zeroes its outputs at padded steps;
- a 1-D convolution or pooling that keeps the length (stride 1, ``2 * padding`` equal to
  the window's span less one) sees padded steps as its own padding would be (zeros; minus
  infinity for max pooling), so real steps come out as for each sequence alone. One that
  changes the length would need a new mask for the layers after it: it refuses masked
  batches with a DataError naming the layer.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from dl4py.config.registry import LAYERS
from dl4py.errors import DataError
from dl4py.nn.convolution import Conv1d, ConvTranspose2d
from dl4py.nn.layer_init import ACTIVATIONS, init_weight, init_weight_and_bias
from dl4py.nn.layers_conv import SameConv1d, SamePool1d
from dl4py.nn.pooling import AvgPool1d
from dl4py.nn.recurrent import SequenceMask, _zero_padding


class _SequenceWindow(nn.Module):
    """A 1-D convolution or pooling ``op`` over the time axis of ``[batch, time, size]``."""

    def __init__(self, op: nn.Module, masks: SequenceMask, where: str, span: int, padding: int, fill: float = 0.0,
                 same: bool = False):
        super().__init__()
        self.op = op
        self.masks = masks
        self.where = where
        self.span, self.padding = span, padding  # steps one window covers; padding each side
        self.fill = fill  # what a padded step must look like: the op's own padding value
        self.same = same  # DL4J's Same mode: the op pads any length to fit (nn/layers_conv.py)

    def forward(self, x):
        if not self.same and x.shape[1] + 2 * self.padding < self.span:  # a length the config could not check
            raise DataError(
                f"{self.where}: sequences of {x.shape[1]} steps (+{2 * self.padding} padding) are shorter "
                f"than the kernel's span of {self.span} steps"
            )
        mask = self.masks.current
        if mask is None:
            return self._op(x)
        real = mask.bool().unsqueeze(-1)
        out = self._op(x.masked_fill(~real, self.fill))
        if out.shape[1] != x.shape[1]:
            raise DataError(
                f"{self.where}: this window changes the sequence length ({x.shape[1]} -> "
                f"{out.shape[1]} steps), so the batch's mask would not fit the layers after it; "
                "masked (padded) sequences need stride 1 and padding = dilation*(kernel_size-1)/2 "
                "here, or batches of equal-length sequences without a mask"
            )
        return out.masked_fill(~real, 0.0)  # not a product: max pooling's padded steps are -inf

    def _op(self, x):
        # Made contiguous: a transposed result would make the next layer (an LSTM, the
        # attention kernel) copy it, or take a slower path.
        return self.op(x.transpose(1, 2)).transpose(1, 2).contiguous()


class SequenceLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over each step's features, zero at padded steps."""

    def __init__(self, size: int, eps: float, masks: SequenceMask):
        super().__init__(size, eps=eps)
        self.masks = masks

    def forward(self, x):
        return _zero_padding(super().forward(x), self.masks.current)


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``F.scaled_dot_product_attention`` (fused kernels on a
    GPU). ``qkv`` projects the input to queries, keys and values at once (one matrix
    product); ``out`` projects the heads' concatenation to ``n_out``. Without projection the
    input is split into the heads as it is."""

    def __init__(self, n_in: int, n_out: int, n_heads: int, head_size: int, project: bool, masks: SequenceMask):
        super().__init__()
        self.n_heads, self.head_size, self.project = n_heads, head_size, project
        self.masks = masks
        if project:
            self.qkv = nn.Linear(n_in, 3 * n_heads * head_size, bias=False)
            self.out = nn.Linear(n_heads * head_size, n_out, bias=False)

    def forward(self, x):
        n, time, _ = x.shape
        h, d = self.n_heads, self.head_size
        if self.project:
            q, k, v = self.qkv(x).view(n, time, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q = k = v = x.reshape(n, time, h, d).transpose(1, 2)
        mask = self.masks.current
        # [n, 1, 1, time]: every query may look at the real steps (keys) of its sequence only.
        keys = None if mask is None else mask.bool()[:, None, None, :]
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        out = heads.transpose(1, 2).reshape(n, time, h * d)
        if self.project:
            out = self.out(out)
        return _zero_padding(out, mask)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_size={self.head_size}, project_input={self.project}"


# Builders (config/registry.py): (layer, shape, config, generator, masks, where) -> (op, activation or None).


@LAYERS.builder("convolution1d")
def _convolution1d(layer, shape, config, gen, masks: SequenceMask, where: str):
    same = layer.convolution_mode == "same"
    conv = (SameConv1d if same else Conv1d)(shape.dims[1], layer.n_out, layer.kernel_size, layer.stride,
                                            layer.padding, layer.dilation, bias=layer.has_bias)
    init_weight_and_bias(conv, layer.weight_init or config.weight_init, gen)
    span = layer.dilation * (layer.kernel_size - 1) + 1
    window = _SequenceWindow(conv, masks, where, span, layer.padding, same=same)
    return window, ACTIVATIONS[layer.activation or config.activation]()


@LAYERS.builder("subsampling1d")
def _subsampling1d(layer, shape, config, gen, masks: SequenceMask, where: str):
    window = (masks, where, layer.kernel_size, layer.padding)
    if layer.convolution_mode == "same":
        pool = SamePool1d(layer.pooling_type, layer.kernel_size, layer.stride, masks)
        fill = float("-inf") if layer.pooling_type == "max" else 0.0
        return _SequenceWindow(pool, *window, fill=fill, same=True), None
    if layer.pooling_type == "max":
        pool = nn.MaxPool1d(layer.kernel_size, layer.stride, layer.padding)
        return _SequenceWindow(pool, *window, fill=float("-inf")), None
    return _SequenceWindow(AvgPool1d(layer.kernel_size, layer.stride, layer.padding), *window), None


@LAYERS.builder("upsampling2d")
def _upsampling2d(layer, shape, config, gen, masks: SequenceMask, where: str):
    return nn.Upsample(scale_factor=tuple(float(s) for s in layer.size), mode="nearest"), None


@LAYERS.builder("deconvolution2d")
def _deconvolution2d(layer, shape, config, gen, masks: SequenceMask, where: str):
    conv = ConvTranspose2d(shape.dims[0], layer.n_out, layer.kernel_size, layer.stride, layer.padding,
                           dilation=layer.dilation, bias=layer.has_bias)
    # The weight is [in, out, kh, kw]: transposed, the fans are those of a convolution
    # from n_in to n_out channels, as DL4J counts them.
    init_weight(conv.weight.transpose(0, 1), layer.weight_init or config.weight_init, gen)
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)
    return conv, ACTIVATIONS[layer.activation or config.activation]()


@LAYERS.builder("zero_padding")
def _zero_padding_layer(layer, shape, config, gen, masks: SequenceMask, where: str):
    top, bottom, left, right = layer.padding
    return nn.ZeroPad2d((left, right, top, bottom)), None


@LAYERS.builder("layer_normalization")
def _layer_normalization(layer, shape, config, gen, masks: SequenceMask, where: str):
    if shape.kind == "cnn":
        return nn.GroupNorm(1, shape.dims[0], eps=layer.eps), None
    if shape.kind == "rnn":
        return SequenceLayerNorm(shape.dims[1], layer.eps, masks), None
    return nn.LayerNorm(shape.dims[0], eps=layer.eps), None


@LAYERS.builder("self_attention")
def _self_attention(layer, shape, config, gen, masks: SequenceMask, where: str):
    n_in = shape.dims[1]
    head_size = layer.resolved_head_size(n_in)
    module = SelfAttention(n_in, layer.n_out, layer.n_heads, head_size, layer.project_input, masks)
    if layer.project_input:
        scheme = layer.weight_init or config.weight_init
        inner = layer.n_heads * head_size
        for i in range(3):  # each of the query, key and value matrices on its own fans
            init_weight(module.qkv.weight[i * inner : (i + 1) * inner], scheme, gen)
        init_weight(module.out.weight, scheme, gen)
    return module, None


__all__ = ["SelfAttention", "SequenceLayerNorm"]
