"""Typed conversion between plain dicts and frozen config dataclasses.

Every config object in dl4py is a frozen dataclass whose field annotations are the
schema: ``from_dict`` checks keys and types against them and reports the exact path
of a bad value (``network.layers[2].kernel_size``), ``to_dict`` writes every field,
defaults included, so a saved config is complete and round-trips unchanged.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from dl4py.errors import ConfigError

# A decimal number as written in a config: 0.01, 1e-3, -2.5E+4 (not "nan", "inf" or "0x10").
_NUMBER = re.compile(r"\s*[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][-+]?\d+)?\s*\Z")


def join(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _type_name(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in get_args(tp)) + "]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp, where: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it in canonical form or raise ConfigError."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(where, f"must be {_type_name(tp)}, got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(where, f"must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, str) and value.lower() in choices:
            return value.lower()
        raise ConfigError(where, f"must be one of {', '.join(map(repr, choices))}; got {value!r}")
    if origin is tuple:
        args = get_args(tp)
        # A single number stands for the same value in every dimension (kernel_size: 5).
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value] * len(args)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(where, f"must be a list of {len(args)} values {_type_name(tp)}, got {value!r}")
        return tuple(coerce(v, a, join(where, i)) for i, (v, a) in enumerate(zip(value, args)))
    if tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(where, f"must be a list, got {value!r}")
        return tuple(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(where, f"must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(where, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _NUMBER.match(value):
            # "1e-3" from JSON, a Python dict or a YAML 1.1 reader: the number every user means
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(where, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(where, f"must be a string, got {value!r}")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(where, f"must be a mapping, got {value!r}")
        return dict(value)
    if isinstance(tp, type) and hasattr(tp, "from_dict"):
        if isinstance(value, tp):
            return value
        return tp.from_dict(value, where)
    raise TypeError(f"schema: unsupported annotation {tp!r} at {where}")


def to_plain(value: Any) -> Any:
    """Config value -> JSON/YAML-ready value (tuples become lists, configs become dicts)."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def dataclass_from_dict(cls, data: Any, where: str, skip: tuple[str, ...] = ()):
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(where, f"must be a mapping, got {data!r}")
    types_ = field_types(cls)
    unknown = [k for k in data if k not in types_ and k not in skip]
    if unknown:
        raise ConfigError(
            join(where, unknown[0]),
            f"unknown field for {cls.__name__}; valid fields: {', '.join(sorted(types_))}",
        )
    kwargs = {k: coerce(v, types_[k], join(where, k)) for k, v in data.items() if k in types_}
    try:
        obj = cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(join(where, missing[0]), f"is required for {cls.__name__}") from None
        raise ConfigError(where, str(exc)) from None
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(where)
    return obj


def dataclass_to_dict(obj) -> dict:
    return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}


class ConfigBase:
    """Mixin for config dataclasses: typed from_dict / to_dict and validation hook."""

    @classmethod
    def from_dict(cls, data: Any, where: str = ""):
        return dataclass_from_dict(cls, data, where)

    def to_dict(self) -> dict:
        return dataclass_to_dict(self)

    def validate(self, where: str) -> None:
        """Check values beyond their types; raise ConfigError naming the field."""


class TaggedConfig(ConfigBase):
    """A config family chosen by a ``type`` key (layers, updaters, input types)."""

    registry: typing.ClassVar[dict[str, type]]
    type_name: typing.ClassVar[str]

    @classmethod
    def register(cls, name: str):
        def deco(sub):
            sub.type_name = name
            cls.registry[name] = sub
            return sub

        return deco

    @classmethod
    def from_dict(cls, data: Any, where: str = ""):
        if isinstance(data, str):  # shorthand: "adam" means {"type": "adam"}
            data = {"type": data}
        if not isinstance(data, dict):
            raise ConfigError(where, f"must be a mapping with a 'type' key, got {data!r}")
        if cls.type_name is not None:  # a concrete class: the tag is optional but must agree
            name = str(data.get("type", cls.type_name)).lower()
            if name != cls.type_name:
                raise ConfigError(join(where, "type"), f"expected {cls.type_name!r}, got {name!r}")
            return dataclass_from_dict(cls, data, where, skip=("type",))
        if "type" not in data:
            raise ConfigError(
                join(where, "type"), f"is required; one of: {', '.join(sorted(cls.registry))}"
            )
        name = data["type"]
        sub = cls.registry.get(str(name).lower().replace("-", "_"))
        if sub is None:
            raise ConfigError(
                join(where, "type"),
                f"unknown type {name!r}; known: {', '.join(sorted(cls.registry))}",
            )
        return dataclass_from_dict(sub, data, where, skip=("type",))

    def to_dict(self) -> dict:
        return {"type": self.type_name, **dataclass_to_dict(self)}
