"""Convolutions that stay fast in 16 bits on CPUs without native 16-bit arithmetic.

PyTorch runs a bfloat16 (or float16) convolution on a CPU through oneDNN only when the
CPU has native instructions for it (AVX512-BF16 or AMX; AVX512-FP16 for float16). On other
CPUs, most laptops and many servers, it falls back to ``_slow_conv2d`` and
``slow_conv_transpose2d`` (im2col and a generic matrix product), 5-15x slower than float32:
the seed LeNet trained 10x slower in bfloat16 than in float. There, these modules compute
the convolution in float32 from the 16-bit values and round the result to 16 bits. Every
16-bit value is exact in float32, so the result and the input's gradient are the float32
ones rounded once (the parameters' gradients are summed over chunks of examples in float32,
then rounded): within 16-bit rounding of PyTorch's own 16-bit kernel, and no less accurate.

The modules are ``nn.Conv1d``/``nn.Conv2d``/``nn.ConvTranspose2d`` subclasses: the same
parameters and state_dict keys, the same ``isinstance`` answers. Autograd keeps the
16-bit input and weight for the backward pass, as the 16-bit kernel does; the float32
copies exist only while a convolution runs, a chunk of examples at a time
(``CHUNK_BYTES``), and ``memory/replay.py`` counts them. Under autocast (``mixed-bf16``)
the inputs are first rounded to the autocast dtype, so the convolution computes what
autocast's would. Where PyTorch's own kernel is fast (a CPU with native support, a GPU)
and while tracing or exporting, the modules run PyTorch's convolution unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.autograd.function import once_differentiable

_LOW = (torch.float16, torch.bfloat16)


@functools.cache
def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether PyTorch runs ``dtype`` convolutions on this CPU with oneDNN's native kernels.

    The same checks PyTorch's convolution makes before choosing oneDNN for a 16-bit input;
    asked once per process. Where this torch cannot say, PyTorch's own choice is kept."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):
        return True


def upcasts_on_cpu(dtype: torch.dtype) -> bool:
    """Whether convolutions computing in ``dtype`` run in float32 on this CPU (16-bit
    types this CPU has no native kernels for). The memory estimate asks this too."""
    return dtype in _LOW and not cpu_has_native(dtype)


def cpu_autocast_upcasts() -> bool:
    """Whether CPU autocast is on with a 16-bit dtype this CPU has no native kernels for (the
    recurrent layers then run in float32, as these convolutions do)."""
    return _autocast_cpu_enabled() and upcasts_on_cpu(_autocast_cpu_dtype())


def upcast_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype a convolution of ``x`` with ``weight`` computes in, where it is one
    that this CPU has no native kernels for (the convolution then runs in float32); else None."""
    if x.device.type != "cpu" or x.dim() != weight.dim() or x.shape[0] == 0 or _tracing():
        return None  # an unbatched or empty input goes through PyTorch's own convolution
    if _autocast_cpu_enabled():
        dtype = _autocast_cpu_dtype()
        if not all(t.dtype in (torch.float32,) + _LOW for t in (x, weight)):
            return None  # autocast leaves float64 alone
    else:
        dtype = x.dtype
        if weight.dtype != dtype:
            return None  # PyTorch's error for mismatched dtypes, not ours
    return dtype if upcasts_on_cpu(dtype) else None


def upcast_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
                       dtype: torch.dtype) -> torch.Tensor:
    """``aten.convolution`` in float32 on ``dtype`` (16-bit) values; the result in ``dtype``."""
    if _autocast_cpu_enabled():  # round the inputs as autocast would, then leave it
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        with _autocast_off():
            return _UpcastConvolution.apply(x, weight, bias, stride, padding, dilation, transposed,
                                            output_padding, groups)
    return _UpcastConvolution.apply(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


# Float32 copies of a chunk's input and result (per example: ``4 * (inputs + outputs)`` bytes)
# take at most this much: however large the batch, they stay a fixed size beside its 16-bit
# tensors. A chunk is many examples (all of LeNet's 128), so the kernels stay few and large.
CHUNK_BYTES = 16 * 2**20


def chunk_examples(input_elements: int, output_elements: int) -> int:
    """Examples per chunk for a convolution with these elements per example (in and out)."""
    return max(1, CHUNK_BYTES // (4 * (input_elements + output_elements)))


class _UpcastConvolution(torch.autograd.Function):
    """A 16-bit convolution computed in float32, ``CHUNK_BYTES`` of float32 copies at a time. It
    saves the 16-bit input and weight, not float32 copies, so it keeps for backward what
    PyTorch's 16-bit convolution keeps."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        ctx.save_for_backward(x, weight)
        ctx.geometry = (stride, padding, dilation, transposed, output_padding, groups)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.chunk = chunk_examples(x[0].numel(), _output_elements(x, weight, *ctx.geometry))
        weight, bias = weight.float(), None if bias is None else bias.float()
        result = None
        for start, part in _chunks(x, ctx.chunk):
            wide = torch.ops.aten.convolution(part.float(), weight, bias, *ctx.geometry)
            if result is None:  # in the layout oneDNN chose (channels_last follows its input)
                result = _batch_like(wide, x.shape[0], x.dtype)
            result[start:start + part.shape[0]].copy_(wide)  # rounds to 16 bits
            del wide  # before the next chunk's copies exist
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        wants_x, wants_weight = ctx.needs_input_grad[:2]
        wants_bias = ctx.bias_sizes is not None and ctx.needs_input_grad[2]
        grad_x = grad_weight = grad_bias = None
        with _autocast_off():
            # One gradient at a time, each from only the float32 copies it reads (the other
            # operand only gives its shape: one element, expanded, as torch.nn.grad does).
            if wants_x:
                wide_weight = weight.float()
                for start, part in _chunks(grad, ctx.chunk):
                    wide = torch.ops.aten.convolution_backward(
                        part.float(), _shape_of(x[start:start + part.shape[0]]), wide_weight, None,
                        *ctx.geometry, [True, False, False])[0]
                    if grad_x is None:
                        grad_x = _batch_like(wide, x.shape[0], x.dtype)
                    grad_x[start:start + part.shape[0]].copy_(wide)
                    del wide
                del wide_weight
            if wants_weight or wants_bias:
                for start, part in _chunks(grad, ctx.chunk):
                    _, weight_part, bias_part = torch.ops.aten.convolution_backward(
                        part.float(), x[start:start + part.shape[0]].float(), _shape_of(weight), ctx.bias_sizes,
                        *ctx.geometry, [False, wants_weight, wants_bias])
                    grad_weight = _add(grad_weight, weight_part)  # summed in float32
                    grad_bias = _add(grad_bias, bias_part)
                    del weight_part, bias_part
                grad_weight = grad_weight.to(x.dtype) if wants_weight else None
                grad_bias = grad_bias.to(x.dtype) if wants_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


def _chunks(batch: torch.Tensor, examples: int):
    """(first example, view) of each run of ``examples`` examples."""
    return [(i * examples, part) for i, part in enumerate(batch.split(examples))]


def _output_elements(x, weight, stride, padding, dilation, transposed, output_padding, groups) -> int:
    """Elements per example of the convolution's result (PyTorch's shape arithmetic)."""
    size = weight.shape[1] * groups if transposed else weight.shape[0]
    for i, extent in enumerate(x.shape[2:]):
        span = dilation[i] * (weight.shape[2 + i] - 1)
        if transposed:
            size *= (extent - 1) * stride[i] - 2 * padding[i] + span + output_padding[i] + 1
        else:
            size *= (extent + 2 * padding[i] - span - 1) // stride[i] + 1
    return size


def _batch_like(part: torch.Tensor, examples: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``dtype`` batch of ``examples`` shaped and laid out like ``part``."""
    channels_last = part.dim() == 4 and not part.is_contiguous() and part.is_contiguous(
        memory_format=torch.channels_last)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty((examples,) + tuple(part.shape[1:]), dtype=dtype, device=part.device, memory_format=layout)


def _add(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Sum a chunk's float32 parameter gradient into the total, in place (undefined: None)."""
    if total is None or part is None:
        return part if total is None else total
    return total.add_(part)


def _shape_of(t: torch.Tensor) -> torch.Tensor:
    """A float32 stand-in with ``t``'s shape and one element of memory."""
    return torch.empty(1, dtype=torch.float32, device=t.device).expand(t.shape)


class Conv1d(nn.Conv1d):
    """``nn.Conv1d``, computed in float32 where this CPU has no native 16-bit kernels."""

    def _conv_forward(self, input, weight, bias):
        dtype = upcast_dtype(input, weight)
        if dtype is None or self.padding_mode != "zeros" or isinstance(self.padding, str):
            return super()._conv_forward(input, weight, bias)
        return upcast_convolution(input, weight, bias, self.stride, self.padding, self.dilation, False,
                                  (0,), self.groups, dtype)


class Conv2d(nn.Conv2d):
    """``nn.Conv2d``, computed in float32 where this CPU has no native 16-bit kernels."""

    def _conv_forward(self, input, weight, bias):
        dtype = upcast_dtype(input, weight)
        if dtype is None or self.padding_mode != "zeros" or isinstance(self.padding, str):
            return super()._conv_forward(input, weight, bias)
        return upcast_convolution(input, weight, bias, self.stride, self.padding, self.dilation, False,
                                  (0, 0), self.groups, dtype)


class ConvTranspose2d(nn.ConvTranspose2d):
    """``nn.ConvTranspose2d``, computed in float32 where this CPU has no native 16-bit kernels."""

    def forward(self, input, output_size=None):
        dtype = upcast_dtype(input, self.weight)
        if dtype is None or self.padding_mode != "zeros":
            return super().forward(input, output_size)
        output_padding = self._output_padding(input, output_size, self.stride, self.padding, self.kernel_size,
                                              2, self.dilation)
        return upcast_convolution(input, self.weight, self.bias, self.stride, self.padding, self.dilation, True,
                                  output_padding, self.groups, dtype)


def _tracing() -> bool:
    """Tracing, compiling or exporting: the graph keeps PyTorch's own convolution."""
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or exporting()


def _autocast_cpu_enabled() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()


def _autocast_cpu_dtype() -> torch.dtype:
    try:
        return torch.get_autocast_dtype("cpu")
    except AttributeError:  # torch < 2.4
        return torch.get_autocast_cpu_dtype()


def _autocast_off():
    return torch.autocast("cpu", enabled=False)


__all__ = ["CHUNK_BYTES", "Conv1d", "Conv2d", "ConvTranspose2d", "chunk_examples", "cpu_autocast_upcasts", "cpu_has_native",
           "upcast_convolution", "upcast_dtype", "upcasts_on_cpu"]
