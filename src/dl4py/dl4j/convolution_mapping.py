"""DL4J's convolutional layers mapped onto dl4py's: 2-D convolution and pooling with DL4J's
convolution modes (``Same`` padding that splits unevenly becomes a ZeroPaddingLayer before the
convolution), transposed 2-D convolution, 1-D convolution and pooling over sequences, global
pooling, zero padding and upsampling.

DL4J's ``Same`` mode: the output is ``ceil(in / stride)``, the padding that takes is split with
the smaller half on the top and left (``ConvolutionUtils.getSameModeTopLeftPadding``); ``Truncate``
and ``Strict`` take the file's padding. DL4J's 1-D layers are its 2-D ones over ``[time, 1]``:
only the first value of ``kernelSize``, ``stride``, ``padding`` and ``dilation`` counts (the
second is the unit width's, and DL4J leaves whatever a builder put there). dl4py has no 1-D
zero padding, so 1-D Same mode maps where it pads both ends alike (stride 1, an odd window),
and ``Causal`` mode (all padding before the sequence) is refused. A transposed convolution's
Same mode (output ``in * stride``; libnd4j's ``deconv2d`` pads ``(span - stride) / 2``, rounded
down, on the top and left, and crops the rest from the bottom and right) maps where that
cropping is even. dl4py's convolutions take NCHW (channels first): the data-format check is
``layer_mapping``'s, for every layer.
"""

from __future__ import annotations

from dl4py.config.layers import ConvolutionLayer, GlobalPoolingLayer, SubsamplingLayer
from dl4py.config.layers_extra import (
    Convolution1DLayer,
    Deconvolution2D,
    Subsampling1DLayer,
    Upsampling2D,
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
    top, left, uneven = _padding(mapping, fields, kernel, stride, (1, 1))
    if uneven is not None:
        raise fields.error(f"Same mode pads this pooling unevenly {list(uneven)} (top, bottom, left, right), and "
                           "DL4J leaves the padding out of the window: dl4py's pooling pads evenly only")
    if pooling == "avg" and (top or left) and not fields.get("avgPoolIncludePadInDivisor", False):
        raise fields.error("average pooling with padding that DL4J leaves out of the divisor: dl4py's average "
                           "pooling counts the padding")
    mapping.add_with_dropout(fields, SubsamplingLayer(pooling_type=pooling, kernel_size=kernel, stride=stride,
                                                        padding=(top, left)), None)



def map_global_pooling(mapping: NetworkMapping, fields: LayerFields) -> None:
    pooling = str(fields.get("poolingType", "MAX")).lower()
    collapsed = fields.get("collapseDimensions", True) is not False
    if pooling not in ("max", "avg", "sum") or mapping.shape.kind != "cnn" or not collapsed:
        raise fields.error(f"global {pooling} pooling over {mapping.shape.kind} input: dl4py pools convolutional "
                           "input (max, avg or sum) to one value per channel")
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
    padding = _padding_1d(fields, kernel, stride, dilation)
    layer = Convolution1DLayer(n_out=fields.n_out, kernel_size=kernel, stride=stride, padding=padding,
                               dilation=dilation, activation=fields.activation(),
                               has_bias=bool(fields.get("hasBias", True)), l2=mapping.l2(fields),
                               **mapping.common(fields))
    mapping.add_with_dropout(fields, layer, "op.op")  # dl4py's window module holds the nn.Conv1d


def map_subsampling_1d(mapping: NetworkMapping, fields: LayerFields) -> None:
    pooling = str(fields.get("poolingType", "MAX")).lower()
    if pooling not in ("max", "avg"):
        raise fields.error(f"pooling type {pooling.upper()} has no dl4py counterpart (dl4py pools max or avg)")
    kernel, stride = fields.pair("kernelSize", (2, 2))[0], fields.pair("stride", (2, 2))[0]
    if fields.pair("dilation")[0] != 1:
        raise fields.error(f"pooling dilation {fields.pair('dilation')[0]}: dl4py's pooling has none")
    padding = _padding_1d(fields, kernel, stride, 1)
    if pooling == "avg" and padding and not fields.get("avgPoolIncludePadInDivisor", False):
        raise fields.error("average pooling with padding that DL4J leaves out of the divisor: dl4py's average "
                           "pooling counts the padding")
    layer = Subsampling1DLayer(pooling_type=pooling, kernel_size=kernel, stride=stride, padding=padding)
    mapping.add_with_dropout(fields, layer, None)


def _mode(fields: LayerFields) -> str:
    return str(fields.get("convolutionMode", "Truncate")).lower()


def _padding_1d(fields: LayerFields, kernel: int, stride: int, dilation: int) -> int:
    """The steps a 1-D window pads each end with (see the module docstring)."""
    mode = _mode(fields)
    if mode == "causal":
        raise fields.error("Causal convolution mode pads the start of the sequence only: dl4py's 1-D windows pad "
                           "both ends alike")
    if mode != "same":
        return fields.pair("padding", (0, 0))[0]
    if stride != 1:  # Same mode's padding then depends on each sequence's length
        raise fields.error(f"Same mode with stride {stride}: its padding depends on each sequence's length, and "
                           "dl4py's 1-D windows pad by a fixed amount")
    total = (kernel - 1) * dilation  # the window's span less one
    if total % 2:
        raise fields.error(f"Same mode pads this sequence unevenly ({total // 2} step(s) before, "
                           f"{total - total // 2} after): dl4py's 1-D windows pad both ends alike")
    return total // 2
