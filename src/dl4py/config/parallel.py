"""The parallel trainers' options, as one frozen object checked by one ``validate``.

The ``training`` section of a run config, the ParallelWrapper, the SparkTrainer and every
rank read the same ``ParallelOptions``; an error names the option
(``training.averaging_frequency: ...`` in a config) the same way wherever it was given. The
object is validated once, where it is made, and travels as it is (it pickles): to the
workers, to each Spark task.

    options = ParallelOptions(workers=2, averaging_frequency=3).validate()
    ParallelWrapper(model, options=options)

Config floor: nothing here imports ``parallel/``, ``nn/`` or ``train/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from dl4py.errors import ConfigError

MODES = ("averaging", "shared_gradients", "sharded", "tensor", "hybrid")
# Modes in which the replicas meet every step, in the update (no averaging rounds).
STEP_MODES = ("shared_gradients", "sharded", "tensor", "hybrid")
# Modes whose replicas hold parts of the parameters (parallel/sharding.py, tensor_parallel.py).
DISTRIBUTED_MODES = ("sharded", "tensor", "hybrid")


@dataclass(frozen=True)
class ParallelOptions:
    """DL4J's ParallelWrapper.Builder options; ``None`` means the default.

    - ``workers``: processes (default: the number of usable GPUs, or 2 on CPU).
    - ``prefetch_buffer``: batches each worker keeps ready on its device (0: none).
    - ``averaging_frequency``: rounds between parameter averages (averaging mode; default 1).
    - ``report_score_after_averaging``: log the averaged score and the averaging time.
    - ``average_updaters``: average the updater state too (averaging mode; default on).
    - ``training_mode``: ``"averaging"``, ``"shared_gradients"`` (all-reduce every step),
      ``"sharded"`` (parameters, gradients and updater state split across the workers; each
      step as shared gradients' — ``parallel/sharding.py``), ``"tensor"`` (large dense layers
      split across the workers, which all train the same batches) or ``"hybrid"`` (data
      parallel convolutions, tensor parallel dense layers — ``parallel/tensor_parallel.py``).
    - ``devices``: e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu"]`` (default: the model's backend).
    - ``timeout``: seconds any wait on another process may last before it is an error; a
      rank kept waiting that long at a collective has the rank that did not arrive named,
      with the phase it is in, and the fit ends (``parallel/watchdog.py``).
    - ``tensor_parallel_size``: ranks each dense pair is split over (``"tensor"``, ``"hybrid"``;
      it divides ``workers``): the workers form ``workers / size`` data-parallel groups of
      that many (a 2-D device mesh). Default: all workers, one group.

    ``validated`` is true for what ``validate`` returned (and its pickled copies); an object
    made or ``replace``d since is not, and a trainer given one validates it first.
    """

    workers: int | None = None
    prefetch_buffer: int = 16
    averaging_frequency: int | None = None
    report_score_after_averaging: bool = False
    average_updaters: bool | None = None
    training_mode: str = "averaging"
    devices: tuple[str, ...] | None = None
    timeout: float = 300.0
    tensor_parallel_size: int | None = None
    # Not an option: set by validate alone. replace() makes a copy with it False.
    validated: bool = field(default=False, init=False, repr=False, compare=False)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]

    def validate(self, where: str = "") -> "ParallelOptions":
        """Raise a ConfigError naming the first option that is wrong (under ``where``, a
        config section such as ``training``); return the options with devices spelled
        ``cpu`` / ``cuda:N``."""
        def key(name: str) -> str:
            return f"{where}.{name}" if where else name

        if self.training_mode not in MODES:
            raise ConfigError(key("training_mode"), f"must be one of {', '.join(MODES)}; got {self.training_mode!r}")
        if self.training_mode in STEP_MODES:
            # An option that cannot apply is an error, not silently ignored as DL4J did.
            for name, unset in (("averaging_frequency", None), ("average_updaters", None),
                                ("report_score_after_averaging", False)):
                if getattr(self, name) != unset:
                    raise ConfigError(key(name), f"applies to training_mode 'averaging' only: "
                                                 f"{self.training_mode} keeps every replica identical")
        for name in ("workers", "averaging_frequency"):
            value = getattr(self, name)
            if value is not None and not _is_int(value, minimum=1):
                raise ConfigError(key(name), f"must be a positive integer, got {value!r}")
        if not _is_int(self.prefetch_buffer, minimum=0):
            raise ConfigError(key("prefetch_buffer"), f"must be an integer >= 0, got {self.prefetch_buffer!r}")
        for name in ("report_score_after_averaging", "average_updaters"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(key(name), f"must be true or false, got {value!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(key("timeout"), f"must be a positive number of seconds, got {self.timeout!r}")
        size = self.tensor_parallel_size
        if size is not None:
            if self.training_mode not in ("tensor", "hybrid"):
                raise ConfigError(key("tensor_parallel_size"), f"applies to training_mode 'tensor' or 'hybrid' only, "
                                                               f"not {self.training_mode!r}")
            if not _is_int(size, minimum=1):
                raise ConfigError(key("tensor_parallel_size"), f"must be a positive integer, got {size!r}")
            if self.workers is not None:
                self.mesh_shape(self.workers, key("tensor_parallel_size"))
        devices = self.devices
        if devices is not None:
            if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__iter__"):
                raise ConfigError(key("devices"),
                                  f"must be a list of devices, e.g. ['cuda:0', 'cuda:1'], got {devices!r}")
            devices = tuple(device_name(d, key(f"devices[{i}]")) for i, d in enumerate(devices))
            if not devices:
                raise ConfigError(key("devices"), "must name at least one device")
        checked = replace(self, devices=devices, timeout=float(self.timeout))
        object.__setattr__(checked, "validated", True)  # frozen: only validate sets it
        return checked

    @property
    def rounds_per_average(self) -> int:
        """Rounds between averages; in shared-gradients mode (every round) the rounds
        between the workers' votes on stopping."""
        return self.averaging_frequency or 1

    @property
    def averages_updater_state(self) -> bool:
        return self.average_updaters is not False

    def mesh_shape(self, world: int, where: str = "tensor_parallel_size") -> tuple[int, ...]:
        """The device mesh of a tensor or hybrid fit over ``world`` ranks: ``(world,)``, or
        ``(data groups, tensor_parallel_size)``; a ConfigError (at ``where``) when the size
        does not divide ``world`` (checked again where the number of ranks is known: a
        default or torchrun's)."""
        size = self.tensor_parallel_size
        if size is None or size == world:
            return (world,)
        if world % size:
            raise ConfigError(where, f"is {size}, which does not divide the {world} workers into tensor-parallel "
                                     "groups: use a divisor of the number of workers")
        return (world // size, size)


def given_options(options: ParallelOptions | None, keywords: dict, owner: str) -> ParallelOptions:
    """The options a trainer (``owner``) was given, validated once: ``options`` as it is
    when already validated (a run config's, the driver's in a Spark task), else the keyword
    arguments. A keyword changed from its default beside ``options`` is an error: which of the
    two would win is not for the trainer to guess."""
    if options is None:
        return ParallelOptions(**keywords).validate()
    if not isinstance(options, ParallelOptions):
        raise TypeError(f"{owner}: options must be a ParallelOptions, got {type(options).__name__}")
    defaults = ParallelOptions()
    for name, value in keywords.items():
        if value != getattr(defaults, name):
            raise ConfigError(name, f"is given to {owner} twice, as a keyword and in options: give it in one")
    return options if options.validated else options.validate()


def device_name(device, where: str) -> str:
    """``cpu`` or ``cuda:N`` for an entry of ``devices``: a GPU index, a name or a torch.device."""
    try:
        device = torch.device(f"cuda:{device}" if _is_int(device, minimum=0) else device)
    except (RuntimeError, TypeError):
        raise ConfigError(where, f"must be cpu, cuda:N or a GPU index, got {device!r}") from None
    if device.type == "cuda" and device.index is None:
        # Each worker pins itself to one GPU, and NCCL needs to know whether two share one.
        raise ConfigError(where, "names no GPU: give its index, e.g. cuda:0 or 0")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(where, f"must be cpu, cuda:N or a GPU index, got {str(device)!r}")
    return "cpu" if device.type == "cpu" else str(device)  # cpu:0 is the CPU too


def _is_int(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_mode_fits_model(mode: str, model) -> None:
    """A ConfigError, before any worker starts, for a distributed mode this model cannot
    take (what the workers would otherwise find one by one)."""
    if mode == "sharded" and model.accumulate_batches > 1:
        # FSDP reduces every backward's gradients, and a rank sitting a round out would have
        # to join each backward of its window: not done yet.
        raise ConfigError("training.accumulate_batches", "is not supported with training_mode 'sharded' yet: "
                                                         "use a larger batch, or the shared_gradients mode")
    if mode == "hybrid" and model.accumulate_batches > 1:
        # Each rank weighs its batch by its own rows, but the loss is its tensor group's over the
        # gathered rows: a short or empty batch (an epoch's last) would weigh the same gradient
        # differently on the ranks of one group, or divide by zero.
        raise ConfigError("training.accumulate_batches", "is not supported with training_mode 'hybrid' yet: "
                                                         "use a larger batch, or training_mode 'tensor'")
    if mode in ("tensor", "hybrid"):
        if model.kind != "multilayer":
            raise ConfigError("training_mode", f"{mode!r} splits the dense layers of a MultiLayerNetwork; this "
                                               f"model is a {type(model).__name__}: use 'sharded' or a data-parallel mode")
        precision = model.precision
        if precision.master_weights or precision.uses_loss_scaling:
            raise ConfigError("training.precision", f"{precision.name!r} keeps float32 master weights or scales the "
                                                    f"loss, which training_mode {mode!r} does not support yet: use "
                                                    "'float', 'double' or 'mixed-bf16', or training_mode 'sharded'")
