"""The run config as a JSON Schema (draft 2020-12), made from the same annotations that check a
config (``schema.coerce``), so that an editor completes and checks a dl4py YAML file:
``dl4py schema > dl4py.schema.json``, then a first line ``# yaml-language-server:
$schema=dl4py.schema.json`` (the YAML language server of VS Code and others).

The schema says what the file may hold, in dl4py's spellings: the loader also takes DL4J's
(``RELU``, ``NEGATIVELOGLIKELIHOOD``), which an editor using the schema marks though they load;
a pair may be one number (``kernel_size: 5``);
a type-tagged family (layers, updaters, input types, schedules) is a ``oneOf`` of its members,
each with its ``type`` constant, and a member named by its type alone (``updater: adam``) is a
string. Checks that need values (positive sizes, a layer that fits its input) stay the loader's:
the schema is for completion and typos, not a second validator.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, Union, get_args, get_origin

from dl4py.config.run import RunConfig
from dl4py.config.schema import ConfigBase, TaggedConfig, field_types

DRAFT = "https://json-schema.org/draft/2020-12/schema"


def run_config_schema() -> dict:
    """The JSON Schema of a run config file (``RunConfig``)."""
    builder = _SchemaBuilder()
    root = builder.object_schema(RunConfig)
    return {"$schema": DRAFT, "title": "dl4py run config", **root, "$defs": dict(sorted(builder.defs.items()))}


class _SchemaBuilder:
    """Schemas by annotation; each config class once, in ``defs``, referred to by name."""

    def __init__(self) -> None:
        self.defs: dict[str, dict] = {}

    def of(self, tp: Any) -> dict:
        origin = get_origin(tp)
        if origin in (Union, types.UnionType):
            return {"anyOf": [self.of(arg) for arg in get_args(tp)]}
        if origin is Literal:
            return {"enum": list(get_args(tp))}
        if tp is type(None):
            return {"type": "null"}
        if tp is bool:
            return {"type": "boolean"}
        if tp is int:
            return {"type": "integer"}
        if tp is float:
            return {"type": "number"}
        if tp is str:
            return {"type": "string"}
        if origin is tuple and get_args(tp)[-1:] == (Ellipsis,):
            return {"type": "array", "items": self.of(get_args(tp)[0])}
        if origin is tuple:  # a list of up to its length (padding: [1, 2] is top/bottom, left/right)
            args = get_args(tp)
            fixed = {"type": "array", "prefixItems": [self.of(a) for a in args], "maxItems": len(args)}
            same = {self.of(a).get("type") for a in args}
            # ... or one number for every place (kernel_size: 5)
            return {"anyOf": [fixed, {"type": "number"}]} if same <= {"integer", "number"} else fixed
        if tp is tuple:
            return {"type": "array"}
        if tp is dict or origin is dict:
            args = get_args(tp)
            return {"type": "object", **({"additionalProperties": self.of(args[1])} if args else {})}
        if isinstance(tp, type) and issubclass(tp, TaggedConfig) and getattr(tp, "type_name", None) is None:
            return self.family(tp)
        if isinstance(tp, type) and issubclass(tp, ConfigBase):
            return self.ref(tp)
        return {}  # a value its own class parses (a parallel plan: a word or a mapping): anything

    def family(self, base: type) -> dict:
        """A type-tagged family: one of its members, or a member's type name alone."""
        members = [self.ref(cls) for _, cls in sorted(base.registry.items())]
        return {"anyOf": [{"enum": sorted(base.registry)}, *members]}

    def ref(self, cls: type) -> dict:
        name = cls.__name__
        if name not in self.defs:
            self.defs[name] = {}  # placeholder first: a class may refer to itself (a frozen layer)
            self.defs[name] = self.object_schema(cls)
        return {"$ref": f"#/$defs/{name}"}

    def object_schema(self, cls: type) -> dict:
        properties, required = {}, []
        hints = field_types(cls)
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            properties[field.name] = self.of(hints[field.name])
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                required.append(field.name)
        tag = getattr(cls, "type_name", None)
        if isinstance(cls, type) and issubclass(cls, TaggedConfig) and tag is not None:
            properties = {"type": {"const": tag}, **properties}
            required = ["type", *required]
        schema = {"type": "object", "properties": properties, "additionalProperties": False}
        if cls.__doc__:
            schema["description"] = " ".join(cls.__doc__.split())[:500]
        if required:
            schema["required"] = required
        return schema
