"""Memory estimator: will a network fit on a device, and with which batch size?

``estimate`` answers from the config alone, before anything is allocated;
``max_batch_size`` and ``max_parameters`` invert it. ``measure_training_step`` measures
the same quantity on a real step (on any device), which is how the estimate is checked.
``estimate(..., parallelism="sharded", workers=N)`` gives one rank's step when N ranks
train sharded (``memory.sharded``); ``measure_training_step`` measures it inside a rank.
"""

from dl4py.memory.capacity import (
    DeviceMemory,
    bytes_per_parameter,
    device_memory,
    max_batch_size,
    max_parameters,
)
from dl4py.memory.estimate import LayerMemory, MemoryReport, estimate
from dl4py.memory.measure import LiveTensorBytes, MeasuredStep, measure_training_step

__all__ = [
    "DeviceMemory", "LayerMemory", "LiveTensorBytes", "MeasuredStep", "MemoryReport", "bytes_per_parameter",
    "device_memory", "estimate", "max_batch_size", "max_parameters", "measure_training_step",
]
