"""Shared test set-up: the real MNIST files, the gpu marker, and clean-up checks."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Tests read MNIST from the shared folder beside the repository when it is there,
# so no download is needed (DL4PY_DATA set by the caller wins).
if "DL4PY_DATA" not in os.environ and (SHARED_DATA / "mnist").is_dir():
    os.environ["DL4PY_DATA"] = str(SHARED_DATA)

# Tests train eagerly unless they ask for compile: `compile: auto` (the default) would compile a
# test's long-planned fit, about half a minute of a 2-core machine each time (subprocesses
# inherit this). The tests of auto itself unset it (test_compile_auto.py).
os.environ.setdefault("DL4PY_COMPILE", "off")


def mnist_dir() -> Path | None:
    root = os.environ.get("DL4PY_DATA")
    if root and (Path(root) / "mnist").is_dir():
        return Path(root) / "mnist"
    return None


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)


def require_mnist() -> Path:
    """The MNIST folder, or a skip that says how to give it (module-scoped fixtures call it:
    they cannot take the ``mnist`` fixture)."""
    folder = mnist_dir()
    if folder is None:
        pytest.skip("MNIST files not found: set DL4PY_DATA to a folder holding mnist/")
    return folder


@pytest.fixture
def mnist():
    """The MNIST folder; tests that train on real data skip (with the reason) without it."""
    return require_mnist()


# Set by pytest and lazily by torch itself; not a leak of the code under test.
_SET_BY_TOOLS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                 "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH"}  # Inductor's GPU kernels, compiled by Triton


@pytest.fixture(autouse=True)
def _no_leaks(request):
    """Fail a test that leaves process-wide dl4py settings, env variables or threads behind."""
    import dl4py.backend.precision as precision
    import dl4py.backend.selection as selection

    env_before = dict(os.environ)
    threads_before = set(threading.enumerate())
    yield
    leaks = []
    if selection.get_backend_choice() != "auto":
        leaks.append(f"backend left at {selection.get_backend_choice()!r}")
        selection.set_backend("auto")
    if precision.get_default_dtype() != "float":
        leaks.append(f"default dtype left at {precision.get_default_dtype()!r}")
        precision.set_default_dtype("float")
    changed = {
        k for k in set(env_before) | set(os.environ)
        if env_before.get(k) != os.environ.get(k) and k not in _SET_BY_TOOLS
    }
    if changed:
        leaks.append(f"environment variables changed: {sorted(changed)}")
        os.environ.clear()
        os.environ.update(env_before)
    extra = [t for t in threading.enumerate() if t not in threads_before and t.is_alive() and not t.daemon]
    if request.node.get_closest_marker("torch_compile_threads"):
        # torch.compile keeps its compile-worker pool for the life of the process.
        extra = [t for t in extra if not t.name.startswith("ThreadPoolExecutor")]
    if extra:
        leaks.append(f"threads left running: {[t.name for t in extra]}")
    assert not leaks, "; ".join(leaks)
