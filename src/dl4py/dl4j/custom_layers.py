"""DL4J users' own layer classes, mapped onto dl4py layers: the import's extension point.

DL4J users write layers (``public class CustomLayer extends FeedForwardLayer``). Their
configuration.json names the Java class and holds its fields; their parameters sit in
coefficients.bin as the layer's ``ParamInitializer`` lays them out. dl4py cannot run Java, so the
user says what the class is in dl4py: the Java class name, a function from the layer's JSON
fields to a dl4py layer config (an existing one, or their own layer type registered with dl4py's
layer registry, ``dl4py.config.registry``), and which DL4J parameter initializer lays out its
parameters::

    from dl4py.dl4j import register_custom_layer

    register_custom_layer(
        "org.deeplearning4j.examples.CustomLayer",
        lambda fields: DenseLayer(n_out=fields.n_out, activation=fields.activation()),
        initializer="DefaultParamInitializer",
    )
    net = dl4py.import_dl4j("model.zip")

``fields`` is a ``dl4py.dl4j.config_json.LayerFields``: ``n_in``, ``n_out``, ``activation(key)``
(a DL4J activation field as dl4py's name), ``get(key)`` and ``raw`` (the JSON object). The
initializer decides where each value of coefficients.bin lands (``param_layout``): with
``DefaultParamInitializer`` the layer's module must hold an ``nn.Linear``-shaped ``weight``
[n_out, n_in] and ``bias`` [n_out] under ``op`` (what dl4py's dense layer builds), unless
``torch_names`` says otherwise, e.g. ``{"W": "op.linear.weight", "b": "op.linear.bias"}``.

A custom class met without a registration is refused, naming the class, the layer and the file.
Registrations are process-wide; ``unregister_custom_layer`` removes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# The parameter layouts param_layout.py implements, by DL4J's class name (param_layout checks
# that it implements exactly these).
INITIALIZERS = (
    "DefaultParamInitializer",
    "EmbeddingLayerParamInitializer",
    "ConvolutionParamInitializer",
    "BatchNormalizationParamInitializer",
    "LSTMParamInitializer",
    "GravesLSTMParamInitializer",
    "GravesBidirectionalLSTMParamInitializer",
    "EmptyParamInitializer",
    "DeconvolutionParamInitializer",
    "SimpleRnnParamInitializer",
    "DepthwiseConvolutionParamInitializer",
    "SeparableConvolutionParamInitializer",
)


@dataclass(frozen=True)
class CustomLayer:
    """One registration: what ``java_class`` is in dl4py."""

    java_class: str
    make_layer: Callable  # LayerFields -> dl4py Layer config
    initializer: str
    torch_names: dict[str, str] = field(default_factory=dict)  # DL4J param key -> path under the layer


_REGISTERED: dict[str, CustomLayer] = {}


def register_custom_layer(java_class: str, make_layer: Callable, initializer: str = "DefaultParamInitializer",
                          torch_names: dict[str, str] | None = None) -> None:
    """Map DL4J's ``java_class`` (its full name, as configuration.json's ``@class`` holds it)
    onto the dl4py layer ``make_layer(fields)`` returns, its parameters laid out by DL4J's
    ``initializer``. Registering a class again replaces its mapping."""
    if not isinstance(java_class, str) or "." not in java_class:
        raise ValueError(f"register_custom_layer: give the Java class's full name "
                         f"(e.g. 'org.example.CustomLayer'), got {java_class!r}")
    if not callable(make_layer):
        raise TypeError(f"register_custom_layer: make_layer must be callable, got {type(make_layer).__name__}")
    if initializer not in INITIALIZERS:
        raise ValueError(f"register_custom_layer: unknown parameter initializer {initializer!r}; "
                         f"dl4py lays out: {', '.join(INITIALIZERS)}")
    _REGISTERED[java_class] = CustomLayer(java_class, make_layer, initializer, dict(torch_names or {}))


def unregister_custom_layer(java_class: str) -> None:
    """Forget ``java_class``'s mapping (nothing happens when it has none)."""
    _REGISTERED.pop(java_class, None)


def custom_layer(java_class: str) -> CustomLayer | None:
    """The registration of ``java_class``, or None."""
    return _REGISTERED.get(java_class)
