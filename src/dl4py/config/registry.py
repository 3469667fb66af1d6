"""The layer registry: every layer type by its type name (YAML's ``type:``), with its config
class, the builder of its torch module and its memory rule.

Each floor registers its own part where it defines it, so that ``config`` imports neither
``nn`` nor ``memory``:

- ``config/``: ``@Layer.register("dense")`` on the config class: the name ``type: dense``
  gives, and the class it makes (``Layer.registry``);
- ``nn/``: ``@LAYERS.builder("dense")`` on the function that makes the layer's module;
- ``memory/``: ``@LAYERS.memory_rule("dense")`` on the function that lists its operators.

A new layer type is those three registrations and its class exported from ``dl4py`` and
``dl4py.config``; nothing else lists layer types. A builder is
``(layer, shape, config, generator, masks, where) -> (op, activation or None)``
(``nn/builder.py``); a memory rule is ``(layer, index, shapes, config, device) -> [Op]``
(``memory/operations.py``).
"""

from __future__ import annotations

from typing import Callable

# Each module below registers its layer classes in Layer.registry when it is imported.
from dl4py.config import frozen, layers_conv, layers_extra, recurrent, recurrent_extra  # noqa: F401
from dl4py.config.layers import Layer

BUILDER = "module builder"
MEMORY_RULE = "memory rule"


class LayerRegistry:
    """Builders and memory rules by layer type name, beside ``Layer.registry``'s classes."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[str, Callable]] = {BUILDER: {}, MEMORY_RULE: {}}

    def type_names(self) -> list[str]:
        return sorted(Layer.registry)

    def config_class(self, type_name: str) -> type[Layer]:
        return Layer.registry[type_name]

    def builder(self, *type_names: str) -> Callable[[Callable], Callable]:
        """Decorator: the function that makes the module of layers of these types."""
        return self._register(BUILDER, type_names)

    def memory_rule(self, *type_names: str) -> Callable[[Callable], Callable]:
        """Decorator: the function that lists the operators of layers of these types."""
        return self._register(MEMORY_RULE, type_names)

    def builder_for(self, layer: Layer) -> Callable:
        return self._find(BUILDER, layer)

    def memory_rule_for(self, layer: Layer) -> Callable:
        return self._find(MEMORY_RULE, layer)

    def missing(self, part: str) -> list[str]:
        """The layer types without a ``part`` (BUILDER or MEMORY_RULE) registered."""
        return [name for name in self.type_names() if name not in self._parts[part]]

    def _register(self, part: str, type_names: tuple[str, ...]) -> Callable[[Callable], Callable]:
        table = self._parts[part]
        for name in type_names:
            # Checked here, at import: a misspelt name would otherwise leave its type without
            # a part until a network using it is built or estimated.
            if name not in Layer.registry:
                raise ValueError(f"a {part} for {name!r}, which is no layer type; known: "
                                 f"{', '.join(self.type_names())}")
            if name in table:
                raise ValueError(f"layer type {name!r} has a {part} already: {table[name].__qualname__}")

        def register(function: Callable) -> Callable:
            for name in type_names:
                table[name] = function
            return function

        return register

    def _find(self, part: str, layer: Layer) -> Callable:
        function = self._parts[part].get(layer.type_name)
        if function is None:
            raise TypeError(f"no {part} for layer type {layer.type_name!r} ({type(layer).__name__})")
        return function


LAYERS = LayerRegistry()
