"""Typed conversion between plain dicts and frozen config dataclasses.

Every config object in dl4py is a frozen dataclass whose field annotations are the
schema. One path checks every config, however it was made: the constructor
(``DenseLayer(...)``, ``NetworkConfig(...)``), the builder, ``from_dict``, YAML or JSON all
end in ``ConfigBase.__post_init__``, which brings each field to its canonical form
(``"RELU"`` -> ``"relu"``, ``kernel_size=5`` -> ``(5, 5)``, a dict -> its config object)
and then runs ``validate``. Errors name the exact path of a bad value: the key path
(``network.layers[2].kernel_size``) when the object is built from data or inside a
``NetworkConfig``, the class (``ConvolutionLayer.kernel_size``) when built on its own.
``to_dict`` writes every field, defaults included, so a saved config is complete and
round-trips unchanged.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import re
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from dl4py.errors import ConfigError

# A decimal number as written in a config: 0.01, 1e-3, -2.5E+4 (not "nan", "inf" or "0x10").
_NUMBER = re.compile(r"\s*[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][-+]?\d+)?\s*\Z")


# DL4J names enum constants in upper case (LossFunction.MCXENT, Activation.RELU,
# WeightInit.XAVIER) and input types in camelCase (InputType.convolutionalFlat); dl4py's
# names are lower snake_case. A name is matched without case, "_", "-" or a Java qualifier
# ("LossFunctions.LossFunction.MCXENT"), and stored as dl4py spells it, so configs stay canonical.
_QUALIFIED = re.compile(r"\s*(?:[A-Z]\w*\.)+([A-Za-z_]\w*)\s*\Z")  # Java classes: upper case

# DL4J names that differ from dl4py's for the *same* function. DL4J's LossFunctions maps
# SQUARED_LOSS to LossMSE, and its LossSparseMCXENT is LossMCXENT taking class indices
# (dl4py's mcxent takes either). DL4J's L1 and L2 losses *sum* over outputs, so they are
# not mse and get no alias. An alias applies only where its target is one of the choices.
DL4J_ALIASES = {"squaredloss": "mse", "sparsemcxent": "mcxent"}
# Lightning's precision names (``Trainer(precision="bf16-mixed")``) for dl4py's policies.
LIGHTNING_ALIASES = {"bf16mixed": "mixedbf16", "16mixed": "mixedfp16", "bf16true": "bfloat16", "16true": "half",
                     "32true": "float", "64true": "double"}
_ALIASES = {**DL4J_ALIASES, **LIGHTNING_ALIASES}


def did_you_mean(word: Any, choices) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to a misspelt ``word``, or ``""``."""
    names = [str(choice) for choice in choices if isinstance(choice, str)]
    close = difflib.get_close_matches(str(word), names, n=1, cutoff=0.6) if isinstance(word, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def _name_key(name: str) -> str:
    qualified = _QUALIFIED.match(name)
    if qualified:
        name = qualified.group(1)
    return re.sub(r"[-_\s]", "", name).lower()


def canonical_name(value: Any, choices) -> Any:
    """The one of ``choices`` that ``value`` names in any spelling, or None.

    >>> canonical_name("NEGATIVELOGLIKELIHOOD", ("negativeloglikelihood", "mse"))
    'negativeloglikelihood'
    """
    if not isinstance(value, str):
        return value if value in choices and not isinstance(value, bool) else None
    key = _name_key(value)
    key = _ALIASES.get(key, key)
    for choice in choices:
        if isinstance(choice, str) and _name_key(choice) == key:
            return choice
    return None


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
        name = canonical_name(value, choices)
        if name is not None:
            return name
        raise ConfigError(where, f"must be one of {', '.join(map(repr, choices))}; got {value!r}"
                                 f"{did_you_mean(value, choices)}")
    if origin is tuple and get_args(tp)[-1:] == (Ellipsis,):  # tuple[Layer, ...]: any length
        if not isinstance(value, (list, tuple)):
            raise ConfigError(where, f"must be a list, got {value!r}")
        item = get_args(tp)[0]
        return tuple(coerce(v, item, join(where, i)) for i, v in enumerate(value))
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
        args = get_args(tp)
        if not args:
            return dict(value)
        key_type, value_type = args  # dict[str, InputType]: every value checked, named by its key
        for key in value:
            if not isinstance(key, key_type):
                raise ConfigError(where, f"keys must be {_type_name(key_type)}, got {key!r}")
        return {key: coerce(item, value_type, join(where, key)) for key, item in value.items()}
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


@functools.cache  # resolving string annotations is slow, and every config construction asks
def field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


# The key path of the object ``dataclass_from_dict`` is constructing, as (class, path):
# ``__post_init__`` takes no arguments, and this is how it learns that it is
# ``network.layers[2]`` rather than a ConvolutionLayer built on its own. The class is kept
# so that a default made while constructing (``updater=Sgd()``) does not take the path.
_BUILDING: contextvars.ContextVar[tuple[type, str] | None] = contextvars.ContextVar(
    "dl4py_config_building", default=None
)


def dataclass_from_dict(cls, data: Any, where: str, skip: tuple[str, ...] = ()):
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types are ConfigErrors."""
    if not issubclass(cls, ConfigBase):  # its constructor is what checks the values
        raise TypeError(f"schema: {cls.__name__} must derive from ConfigBase")
    if not isinstance(data, dict):
        raise ConfigError(where, f"must be a mapping, got {data!r}")
    types_ = field_types(cls)
    unknown = [k for k in data if k not in types_ and k not in skip]
    if unknown:
        raise ConfigError(
            join(where, unknown[0]),
            f"unknown field for {cls.__name__}{did_you_mean(unknown[0], types_)}; valid fields: "
            f"{', '.join(sorted(types_))}",
        )
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.init and required and f.name not in data:
            raise ConfigError(join(where, f.name), f"is required for {cls.__name__}")
    token = _BUILDING.set((cls, where))
    try:  # the constructor checks and converts the values: see ConfigBase.__post_init__
        return cls(**{k: v for k, v in data.items() if k in types_})
    finally:
        _BUILDING.reset(token)


def dataclass_to_dict(obj) -> dict:
    return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}


# A keyword the dataclass's __init__ does not take, as Python words its TypeError.
_UNEXPECTED = re.compile(r"__init__\(\) got an unexpected keyword argument '(\w+)'")
# DL4J's builder fields that dl4py infers, and where from.
_INFERRED = {"n_in": "dl4py infers it from the input type and the layers before (DL4J's nIn): leave it out"}


class _NamesUnknownFields(type):
    """A config class called with a keyword it does not have (``ConvolutionLayer(n_in=1, ...)``, as
    DL4J's builder is written) is one ConfigError naming the class and the field, with a
    did-you-mean, instead of Python's bare TypeError."""

    def __call__(cls, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except TypeError as exc:
            unknown = _UNEXPECTED.search(str(exc))
            if unknown is None or not dataclasses.is_dataclass(cls):
                raise
            name = unknown.group(1)
            fields = sorted(f.name for f in dataclasses.fields(cls) if f.init)
            why = _INFERRED.get(name, f"unknown field{did_you_mean(name, fields)}; valid fields: {', '.join(fields)}")
            raise ConfigError(f"{cls.__name__}.{name}", why) from None


class ConfigBase(metaclass=_NamesUnknownFields):
    """Mixin for config dataclasses: typed from_dict / to_dict and validation hook."""

    # The path errors name when the object is built directly rather than from data
    # (None: the class name, as in ``ConvolutionLayer.kernel_size``).
    config_path: typing.ClassVar[str | None] = None

    def __post_init__(self) -> None:
        # The one validation path: every field to its canonical form (or a ConfigError
        # naming it), then the checks beyond types. A subclass extends ``validate``.
        building = _BUILDING.get()
        if building is not None and building[0] is type(self):
            where = building[1]
        else:
            where = self.config_path if self.config_path is not None else type(self).__name__
        for name, tp in field_types(type(self)).items():
            value = getattr(self, name)
            canonical = coerce(value, tp, join(where, name))
            if canonical is not value:
                object.__setattr__(self, name, canonical)  # frozen: this is its construction
        self.validate(where)

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
            name = data.get("type", cls.type_name)
            if canonical_name(name, (cls.type_name,)) is None:
                raise ConfigError(join(where, "type"), f"expected {cls.type_name!r}, got {name!r}")
            return dataclass_from_dict(cls, data, where, skip=("type",))
        if "type" not in data:
            raise ConfigError(
                join(where, "type"), f"is required; one of: {', '.join(sorted(cls.registry))}"
            )
        name = data["type"]
        sub = cls.registry.get(canonical_name(name, tuple(cls.registry)))
        if sub is None:
            raise ConfigError(
                join(where, "type"),
                f"unknown type {name!r}; known: {', '.join(sorted(cls.registry))}",
            )
        return dataclass_from_dict(sub, data, where, skip=("type",))

    def to_dict(self) -> dict:
        return {"type": self.type_name, **dataclass_to_dict(self)}
