"""Where computation runs: backend choice, precision policies and the CUDA environment."""

from dl4py.backend.cuda_environment import Environment, environment
from dl4py.backend.precision import Precision, get_default_dtype, resolve_precision, set_default_dtype
from dl4py.backend.selection import Backend, get_backend_choice, resolve_backend, set_backend

__all__ = [
    "Backend", "Environment", "Precision", "environment", "get_backend_choice",
    "get_default_dtype", "resolve_backend", "resolve_precision", "set_backend", "set_default_dtype",
]
