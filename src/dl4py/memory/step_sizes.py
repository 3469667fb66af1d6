"""What the single-process estimate (``estimate``) and the sharded one (``sharded``) both count
with: the network a config names, the bytes per element of each kind of tensor, the
allocator's rounding, what lives through the whole step, and the framework's fixed costs.

Both estimates import this module, not each other's, so ``estimate`` can hand
``parallelism="sharded"`` to ``sharded`` with an import at the top.
"""

from __future__ import annotations

import torch

from dl4py.backend.device_memory import CUDA_CONTEXT_BYTES
from dl4py.config.graph import GraphConfig
from dl4py.config.network import NetworkConfig
from dl4py.errors import ConfigError
from dl4py.memory.op import Op
from dl4py.memory.step_graph import StepGraph
from dl4py.memory.timeline import Timeline
from dl4py.nn.convolution import upcasts_on_cpu

MiB = 2**20
# PyTorch's CUDA caching allocator rounds each request up to a multiple of 512 bytes, and
# memory_allocated counts whole blocks. For requests up to 1 MiB (the small pool, whose
# blocks are always split) that is exact, and it is the rule the estimate follows. A larger
# block counts more when it is not split: only a remainder over 1 MiB is split off (a fresh
# segment of 10 MiB or more is a multiple of 2 MiB; a cached block is reused best-fit), so
# up to 1 MiB more; under max_split_size_mb an oversize block is never split and may serve
# a request up to max_non_split_rounding_mb (20 MiB by default) smaller; and
# roundup_power2_divisions, when set, rounds coarser. Which applies depends on what is
# cached, so the margin covers it (docs/memory.md).
ALLOCATOR_GRANULE = 512
# CUDA kernels index some tensors with 32-bit ints (max_pool2d: safe_downcast<int>(numel))
# and raise a RuntimeError, not an out-of-memory error, at 2**31 elements. Batch sizes are
# capped below it on every device, so a CPU answer holds on a GPU.
MAX_TENSOR_ELEMENTS = 2**31 - 1


class StepSizes:
    """Bytes per element of each kind of tensor under a precision policy, and of the batch."""

    def __init__(self, policy, graph: StepGraph, device_type: str = "cuda"):
        self.param = _itemsize(policy.param_dtype)
        low = policy.autocast_dtype
        self.activation = _itemsize(low) if low is not None else self.param
        self.autocast = low is not None
        # On this CPU, 16-bit convolutions run in float32, with float32 copies around them
        # (nn/convolution.py), where it has no native kernels for the compute dtype.
        compute = policy.param_dtype if low is None else low
        self.upcast = device_type == "cpu" and upcasts_on_cpu(compute)
        self.state = 4 if policy.master_weights else self.param  # the updater steps these
        self.master = policy.master_weights
        self.input_elements = sum(graph.input_elements)
        self.example_bytes = self.input_elements * self.param  # convert_input casts to the parameter dtype
        self.classes = max(head.classes for head in graph.losses)
        self.label_bytes = sum(head.label_bytes for head in graph.losses)

    def batch_bytes(self, batch_size: int) -> int:
        """The batch on the device: its features and labels."""
        return batch_size * self.example_bytes + batch_size * self.label_bytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def network_of(config) -> tuple[NetworkConfig | GraphConfig, str | None]:
    """The network of ``config`` and the precision its run config asks for (None if it is no run config)."""
    if isinstance(config, (NetworkConfig, GraphConfig)):
        return config, None
    network = getattr(config, "network", None)
    if isinstance(network, (NetworkConfig, GraphConfig)):
        return network, config.training.precision
    raise TypeError(f"estimate needs a NetworkConfig or RunConfig (or a GraphConfig), got {type(config).__name__}")


def check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ConfigError("batch_size", f"must be a positive whole number, got {batch_size!r}")


def kernels_for(device_type: str) -> str:
    """Whose LSTM/GRU kernels the step runs: "cpu" (oneDNN's and ATen's) or "cuda" (cuDNN's)."""
    return "cpu" if device_type == "cpu" else "cuda"


def allocator_granule(device_type: str) -> int:
    """What a ``Timeline`` rounds each tensor up to: the CUDA allocator's blocks; the CPU's bytes."""
    return ALLOCATOR_GRANULE if device_type == "cuda" else 1


def hold_at_start(timeline: Timeline, parameter_bytes: int, updater_bytes: int, data_bytes: int,
                  batch_bytes: int) -> int:
    """Allocate what lives through the whole step, before it: the module (with any float32
    masters), the updater's state, a data set kept on the device and the batch. Returns the
    batch's bytes as the timeline holds them."""
    timeline.alloc("parameters", parameter_bytes, "start")
    timeline.alloc("updater_state", updater_bytes, "start")
    timeline.alloc("input", data_bytes, "start")
    return timeline.alloc("input", batch_bytes, "start")


def largest_tensor_per_example(ops: list[Op], sizes: StepSizes) -> int:
    """Elements per example of the step's largest batch-sized tensor: the batch, an operator's
    result (its gradient, pooling indices and dropout mask have as many) or the scores."""
    return max([sizes.input_elements, sizes.classes] + [op.out_elements for op in ops])


def buffer_bytes(ops: list[Op], itemsize: int) -> int:
    # Batch norm's running mean and variance, and its int64 count of batches.
    return sum(op.param_elements * itemsize + 8 for op in ops if op.name == "batch_norm")


def fixed_costs(device_type: str) -> dict:
    """The framework's costs besides the step, by name: a GPU's CUDA context and cuBLAS' workspace."""
    if device_type != "cuda":
        return {}
    return {"cuda_context": CUDA_CONTEXT_BYTES, "cublas_workspace": _cublas_workspace()}


def _cublas_workspace() -> int:
    # cuBLAS' workspace is 8.125 MiB by default (CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8"),
    # 32 MiB (":4096:8") on Hopper and newer. How many are held in the allocator depends on
    # torch: cached per (handle, stream), one handle per thread, and autograd's backward
    # runs on a thread of its own, so two; or none (recent torch leaves
    # TORCH_CUBLAS_WORKSPACE_CACHE off by default: cuBLAS then allocates its own outside
    # PyTorch, and only cuBLASLt's 1 MiB is inside). One of the larger size is charged;
    # the margin covers a second.
    return 32 * MiB
