"""YAML as users mean it: ``1e-3`` is a number.

PyYAML follows YAML 1.1, whose float pattern needs a dot and a signed exponent, so
``1e-3``, ``5e4`` and ``1.0e3`` load as strings. YAML 1.2 (and every user) reads them
as floats; this loader adds that pattern to PyYAML's safe loader and changes nothing else.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["load_yaml"]


class _Loader(yaml.SafeLoader):
    """SafeLoader plus YAML 1.2's exponent floats."""


_Loader.add_implicit_resolver(  # copies SafeLoader's table, so yaml.safe_load is untouched
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with ``1e-3`` read as 0.001."""
    return yaml.load(text, Loader=_Loader)
