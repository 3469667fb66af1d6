"""dl4py's version: its own module, so that any floor may read it without importing the package root."""

__version__ = "0.1.0"  # the same as pyproject.toml's
