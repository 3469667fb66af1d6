"""Handing allocator settings to PyTorch's caching allocator.

PyTorch parses ``PYTORCH_CUDA_ALLOC_CONF`` once, lazily; after that only its setter
(``torch._C._accelerator_setAllocatorSettings``) changes what the allocator uses. The
allocator reads ``max_split_size_mb``, ``garbage_collection_threshold`` and
``expandable_segments`` on every allocation, so a push takes effect while CUDA runs.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from dl4py.backend.environment_settings import ALLOC_VARS, parse_conf
from dl4py.errors import BackendError

log = logging.getLogger("dl4py")


def allocator_setter():
    """PyTorch's function that re-parses allocator settings, or None on a build without CUDA."""
    if not (torch.version.cuda or getattr(torch.version, "hip", None)):  # ROCm builds use the same allocator
        return None
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    # Older PyTorch (before the accelerator-generic setter) has only the CUDA one.
    return setter or getattr(torch.cuda.memory, "_set_allocator_settings", None)


def settings_to_push(environ: Mapping[str, str]) -> str:
    """The allocator settings as PyTorch should hold them. PyTorch reads PYTORCH_CUDA_ALLOC_CONF
    before PYTORCH_ALLOC_CONF. Its parser puts max_split_size_mb, garbage_collection_threshold and
    roundup_power2_divisions back to default when they are absent, but leaves expandable_segments
    as it was, so turning that off has to be said."""
    conf = next((environ[v] for v in ALLOC_VARS if v in environ), "")
    if "expandable_segments" in parse_conf(conf):
        return conf
    return f"{conf},expandable_segments:False" if conf else "expandable_segments:False"


def push_allocator_settings(environ: Mapping[str, str], live: bool) -> None:
    """Hand the allocator settings to PyTorch: at once while CUDA runs (its allocator reads them
    on every allocation), and before it starts too, in case PyTorch parsed the variable already."""
    setter, conf = allocator_setter(), settings_to_push(environ)
    if setter is None:
        if live:
            raise BackendError("this PyTorch cannot change allocator settings while CUDA runs; set "
                               "them before any CUDA work")
        return
    try:
        setter(conf)
    except (RuntimeError, ValueError) as exc:  # TORCH_CHECK / TORCH_CHECK_VALUE in the parser
        if live:
            raise BackendError(f"PyTorch refused the allocator settings {conf!r}: {exc}") from exc
        log.debug("dl4py: allocator settings not pushed to PyTorch early: %s", exc)
