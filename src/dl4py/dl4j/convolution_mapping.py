"""DL4J's convolutional layers mapped onto dl4py's: 2-D convolution (plain, depthwise, separable)
and pooling with DL4J's convolution modes, transposed 2-D convolution, 1-D convolution and pooling
over sequences, global pooling, zero padding and cropping (2-D and 1-D), upsampling and the CNN
loss layer.

DL4J's ``Same`` mode: the output is ``ceil(in / stride)``, the padding that takes is split with
the smaller half on the top and left (``ConvolutionUtils.getSameModeTopLeftPadding``); ``Truncate``
and ``Strict`` take the file's padding. A convolution's uneven Same padding becomes a
ZeroPaddingLayer before it (zeros are what its own padding would be); pooling and 1-D windows
take dl4py's ``convolution_mode="same"``, which pads the same way at run time (a sequence's padding
depends on its length) and never lets the padding win a max or count in an average. DL4J's 1-D
layers are its 2-D ones over ``[time, 1]``: only the first value of ``kernelSize``, ``stride``,
``padding`` and ``dilation`` counts (the second is the unit width's, and DL4J leaves whatever a
builder put there). ``Causal`` mode (all padding before the sequence) is refused. A transposed
convolution's Same mode (output ``in * stride``; libnd4j's ``deconv2d`` pads ``(span - stride) / 2``,
rounded down, on the top and left, and crops the rest from the bottom and right) maps where that
cropping is even. dl4py's convolutions take NCHW (channels first): the data-format check is
``layer_mapping``'s, for every layer.
"""

from __future__ import annotations

from dl4py.config import (
    CnnLossLayer,
    Convolution1DLayer,
    ConvolutionLayer,
    Cropping1D,
    Cropping2D,
    Deconvolution2D,
    DepthwiseConvolution2D,
    GlobalPoolingLayer,
    SeparableConvolution2D,
    Subsampling1DLayer,
    SubsamplingLayer,
    Upsampling2D,
    ZeroPadding1DLayer,
    ZeroPaddingLayer,
)
from dl4py.dl4j.json_dialects import LayerFields
from dl4py.dl4j.mapping_state import NetworkMapping


def map_convolution(mapping: NetworkMapping, fields: LayerFields) -> None:
    kernel, stride, dilation = fields.pair("kernelSize"), fields.pair("stride"), fields.pair("dilation")
    padding = _padding(mapping, fields, kernel, stride, dilation)
    layer = ConvolutionLayer(n_out=fields.n_out, kernel_size=kernel, stride=stride, padding=padding[:2],
                             dilation=dilation, activation=fields.activation(),
                             has_bias=bool(fields.get("hasBias", True)), l2=mapping.l2(fields),
                             **mapping.common(fields))
    # Same mode padding one side more than the other: the zeros first, then the convolution.
    mapping.add_with_dropout(fields, layer, "op", None if padding[2] is None else ZeroPaddingLayer(padding=padding[2]))


def _padding(mapping: NetworkMapping, fields: LayerFields, kernel, stride, dilation):
    """``(top, left, None)``, or ``(0, 0, (top, bottom, left, right))`` where Same mode pads
    unevenly; Truncate and Strict take the file's padding."""
    mode = str(fields.get("convolutionMode", "Truncate"))
    if mode.lower() != "same":
        top, left = fields.pair("padding", (0, 0))
        return top, left, None
    if mapping.shape.kind != "cnn":
        raise fields.error("Same convolution mode needs convolutional input")
    sides = []
    for axis in range(2):
        size = mapping.shape.dims[1 + axis]
        out = -(-size // stride[axis])
        span = (kernel[axis] - 1) * dilation[axis] + 1
        total = max((out - 1) * stride[axis] + span - size, 0)
        sides += [total // 2, total - total // 2]  # DL4J: the top/left side gets the smaller half
    top, bottom, left, right = sides
    if top == bottom and left == right:
        return top, left, None
    return 0, 0, (top, bottom, left, right)


def map_subsampling(mapping: NetworkMapping, fields: LayerFields) -> None:
    pooling = str(fields.get("poolingType", "MAX")).lower()
    if pooling not in ("max", "avg"):
        raise fields.error(f"pooling type {pooling.upper()} has no dl4py counterpart (dl4py pools max or avg)")
    kernel, stride = fields.pair("kernelSize", (2, 2)), fields.pair("stride", (2, 2))
    if fields.pair("dilation") != (1, 1):
        raise fields.error(f"pooling dilation {fields.pair('dilation')}: dl4py's pooling has none")
    if _mode(fields) == "same":  # the padding out of the window (max) and of the divisor (avg), as DL4J
        _check_same_mode_average(fields, pooling)
        layer = SubsamplingLayer(pooling_type=pooling, kernel_size=kernel, stride=stride, convolution_mode="same")
    else:
        top, left = fields.pair("padding", (0, 0))
        if pooling == "avg" and (top or left) and not fields.get("avgPoolIncludePadInDivisor", False):
            raise fields.error("average pooling with padding that DL4J leaves out of the divisor: dl4py's average "
                               "pooling counts the padding")
        layer = SubsamplingLayer(pooling_type=pooling, kernel_size=kernel, stride=stride, padding=(top, left))
    mapping.add_with_dropout(fields, layer, None)



def map_global_pooling(mapping: NetworkMapping, fields: LayerFields) -> None:
    pooling = str(fields.get("poolingType", "MAX")).lower()
    collapsed = fields.get("collapseDimensions", True) is not False
    if pooling not in ("max", "avg", "sum") or mapping.shape.kind not in ("cnn", "rnn") or not collapsed:
        raise fields.error(f"global {pooling} pooling over {mapping.shape.kind} input: dl4py pools convolutional "
                           "input to one value per channel, and sequences to one per feature (max, avg or sum)")
    mapping.add_with_dropout(fields, GlobalPoolingLayer(pooling_type=pooling), None)


def map_zero_padding(mapping: NetworkMapping, fields: LayerFields) -> None:
    padding = fields.get("padding", [0, 0, 0, 0])
    mapping.add_with_dropout(fields, ZeroPaddingLayer(padding=tuple(int(p) for p in padding)), None)


def map_upsampling(mapping: NetworkMapping, fields: LayerFields) -> None:
    size = fields.get("size", [2, 2])
    size = (size, size) if isinstance(size, int) else tuple(int(s) for s in size)
    mapping.add_with_dropout(fields, Upsampling2D(size=size), None)


def map_deconvolution(mapping: NetworkMapping, fields: LayerFields) -> None:
    kernel, stride, dilation = fields.pair("kernelSize"), fields.pair("stride"), fields.pair("dilation")
    mode = _mode(fields)
    if mode == "same":
        padding = []
        for axis, name in enumerate(("height", "width")):
            crop = (kernel[axis] - 1) * dilation[axis] + 1 - stride[axis]
            if crop < 0 or crop % 2:
                raise fields.error(f"Same mode crops {crop} from the transposed convolution's {name}, one side more "
                                   "than the other: dl4py's transposed convolution crops both sides alike")
            padding.append(crop // 2)
        padding = tuple(padding)
    else:
        padding = fields.pair("padding", (0, 0))
    layer = Deconvolution2D(n_out=fields.n_out, kernel_size=kernel, stride=stride, padding=padding,
                            dilation=dilation, activation=fields.activation(),
                            has_bias=bool(fields.get("hasBias", True)), l2=mapping.l2(fields),
                            **mapping.common(fields))
    mapping.add_with_dropout(fields, layer, "op")


def map_convolution_1d(mapping: NetworkMapping, fields: LayerFields) -> None:
    kernel, stride, dilation = (fields.pair(key)[0] for key in ("kernelSize", "stride", "dilation"))
    window = _window_1d(fields, kernel, stride, dilation)
    layer = Convolution1DLayer(n_out=fields.n_out, kernel_size=kernel, stride=stride, dilation=dilation,
                               activation=fields.activation(), has_bias=bool(fields.get("hasBias", True)),
                               l2=mapping.l2(fields), **window, **mapping.common(fields))
    mapping.add_with_dropout(fields, layer, "op.op")  # dl4py's window module holds the nn.Conv1d


def map_subsampling_1d(mapping: NetworkMapping, fields: LayerFields) -> None:
    pooling = str(fields.get("poolingType", "MAX")).lower()
    if pooling not in ("max", "avg"):
        raise fields.error(f"pooling type {pooling.upper()} has no dl4py counterpart (dl4py pools max or avg)")
    kernel, stride = fields.pair("kernelSize", (2, 2))[0], fields.pair("stride", (2, 2))[0]
    if fields.pair("dilation")[0] != 1:
        raise fields.error(f"pooling dilation {fields.pair('dilation')[0]}: dl4py's pooling has none")
    if _mode(fields) == "same":  # the padding out of the window (max) and of the divisor (avg), as DL4J
        _check_same_mode_average(fields, pooling)
        window = {"convolution_mode": "same"}
    else:
        window = _window_1d(fields, kernel, stride, 1)
        if pooling == "avg" and window["padding"] and not fields.get("avgPoolIncludePadInDivisor", False):
            raise fields.error("average pooling with padding that DL4J leaves out of the divisor: dl4py's average "
                               "pooling counts the padding")
    layer = Subsampling1DLayer(pooling_type=pooling, kernel_size=kernel, stride=stride, **window)
    mapping.add_with_dropout(fields, layer, None)


def _check_same_mode_average(fields: LayerFields, pooling: str) -> None:
    """dl4py's Same-mode average divides by the real elements only, DL4J's default; a file that
    counts the padding in the divisor computes something else."""
    if pooling == "avg" and fields.get("avgPoolIncludePadInDivisor", False):
        raise fields.error("Same-mode average pooling that counts the padding in its divisor "
                           "(avgPoolIncludePadInDivisor): dl4py's Same mode divides by the real elements only")


def _mode(fields: LayerFields) -> str:
    return str(fields.get("convolutionMode", "Truncate")).lower()


def _window_1d(fields: LayerFields, kernel: int, stride: int, dilation: int) -> dict:
    """A 1-D window's padding: ``{"padding": steps}`` at each end, or ``{"convolution_mode": "same"}``
    where DL4J's Same mode pads unevenly or by the sequence's length (stride above 1); a fixed
    even padding keeps masked batches possible."""
    mode = _mode(fields)
    if mode == "causal":
        raise fields.error("Causal convolution mode pads the start of the sequence only: dl4py's 1-D windows pad "
                           "both ends alike")
    if mode != "same":
        return {"padding": fields.pair("padding", (0, 0))[0]}
    total = (kernel - 1) * dilation  # the window's span less one
    if stride != 1 or total % 2:
        return {"convolution_mode": "same"}
    return {"padding": total // 2}


def map_depthwise_convolution(mapping: NetworkMapping, fields: LayerFields) -> None:
    kernel, stride, dilation = fields.pair("kernelSize"), fields.pair("stride"), fields.pair("dilation")
    padding = _padding(mapping, fields, kernel, stride, dilation)
    layer = DepthwiseConvolution2D(depth_multiplier=fields.integer("depthMultiplier", default=1), kernel_size=kernel,
                                   stride=stride, padding=padding[:2], dilation=dilation,
                                   activation=fields.activation(), has_bias=bool(fields.get("hasBias", True)),
                                   l2=mapping.l2(fields), **mapping.common(fields))
    mapping.add_with_dropout(fields, layer, "op", None if padding[2] is None else ZeroPaddingLayer(padding=padding[2]))


def map_separable_convolution(mapping: NetworkMapping, fields: LayerFields) -> None:
    kernel, stride, dilation = fields.pair("kernelSize"), fields.pair("stride"), fields.pair("dilation")
    padding = _padding(mapping, fields, kernel, stride, dilation)
    layer = SeparableConvolution2D(n_out=fields.n_out, depth_multiplier=fields.integer("depthMultiplier", default=1),
                                   kernel_size=kernel, stride=stride, padding=padding[:2], dilation=dilation,
                                   activation=fields.activation(), has_bias=bool(fields.get("hasBias", True)),
                                   l2=mapping.l2(fields), **mapping.common(fields))
    mapping.add_with_dropout(fields, layer, "op", None if padding[2] is None else ZeroPaddingLayer(padding=padding[2]))


def map_cropping(mapping: NetworkMapping, fields: LayerFields) -> None:
    mapping.add_with_dropout(fields, Cropping2D(cropping=_four(fields, "cropping")), None)


def map_cropping_1d(mapping: NetworkMapping, fields: LayerFields) -> None:
    mapping.add_with_dropout(fields, Cropping1D(cropping=_two(fields, "cropping")), None)


def map_zero_padding_1d(mapping: NetworkMapping, fields: LayerFields) -> None:
    mapping.add_with_dropout(fields, ZeroPadding1DLayer(padding=_two(fields, "padding")), None)


def map_cnn_loss(mapping: NetworkMapping, fields: LayerFields) -> None:
    layer = CnnLossLayer(activation=fields.activation(default="identity"), loss=fields.loss())
    mapping.add_with_dropout(fields, layer, None)


def _four(fields: LayerFields, key: str) -> tuple[int, int, int, int]:
    value = fields.get(key, [0, 0, 0, 0])
    if not isinstance(value, list) or len(value) != 4:
        raise fields.error(f"'{key}' is {value!r}, not four numbers (top, bottom, left, right)")
    return tuple(int(v) for v in value)


def _two(fields: LayerFields, key: str) -> tuple[int, int]:
    value = fields.get(key, [0, 0])
    if not isinstance(value, list) or len(value) != 2:
        raise fields.error(f"'{key}' is {value!r}, not two numbers (before, after)")
    return int(value[0]), int(value[1])
