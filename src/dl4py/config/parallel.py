"""The parallel trainers' options, as one frozen object checked by one ``validate``, and the
plan they train by (``ParallelPlan``), in one vocabulary.

The ``training`` section of a run config, the ParallelWrapper, the SparkTrainer and every
rank read the same ``ParallelOptions``; an error names the option
(``training.averaging_frequency: ...`` in a config) the same way wherever it was given. The
object is validated once, where it is made, and travels as it is (it pickles): to the
workers, to each Spark task.

    options = ParallelOptions(workers=2, averaging_frequency=3).validate()
    ParallelWrapper(model, options=options)
    ParallelWrapper(model, workers=4, parallelism=ParallelPlan("hybrid", tensor_size=2))

Config floor: nothing here imports ``parallel/``, ``nn/`` or ``train/``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace

import torch

from dl4py.config.schema import did_you_mean
from dl4py.errors import ConfigError

log = logging.getLogger("dl4py")

# The plans, in the one vocabulary of the config, the CLI, the trainers and ``dl4py memory``.
PLANS = ("data", "sharded", "tensor", "hybrid")
# A run config's word for "the planner chooses" (plan/auto.py): resolved by the runner before
# any trainer sees the options, which refuse it.
AUTO = "auto"
# How the data plan's replicas meet: DL4J's parameter averaging, or the mean gradient every step.
SYNCS = ("averaging", "shared_gradients")
# The rank program's names for a plan (ParallelPlan.mode): what its code branches on.
MODES = ("averaging", "shared_gradients", "sharded", "tensor", "hybrid")
# Modes in which the replicas meet every step, in the update (no averaging rounds).
STEP_MODES = ("shared_gradients", "sharded", "tensor", "hybrid")
# Modes whose replicas hold parts of the parameters (parallel/sharding.py, tensor_parallel.py).
DISTRIBUTED_MODES = ("sharded", "tensor", "hybrid")
# The per-kind-of-layer spellings of an earlier release (docs/model-parallel.md).
_BY_LAYER_KIND = {("data", "tensor"): "hybrid", ("data", "data"): "data"}
_noted: set[str] = set()


@dataclass(frozen=True)
class ParallelPlan:
    """How the workers split the training (docs/model-parallel.md):

    - ``"data"``: every worker holds the whole model and trains its own batches; ``sync``
      says how the replicas meet: ``"averaging"`` (DL4J's parameter averaging every
      ``averaging_frequency`` rounds, the default) or ``"shared_gradients"`` (the mean
      gradient every step);
    - ``"sharded"``: parameters, gradients and updater state split across the workers (FSDP2);
    - ``"tensor"``: the large dense layers split across the workers, which all train the same
      batches;
    - ``"hybrid"``: data-parallel convolutions, tensor-parallel dense layers (Krizhevsky).

    ``tensor_size`` (tensor, hybrid): the workers each dense pair splits over; the workers
    form ``workers / tensor_size`` data-parallel groups of that many (a 2-D device mesh).
    Default: all workers, one group.

    Spelt in a config as a word (``parallelism: sharded``) or a mapping
    (``parallelism: {kind: hybrid, tensor_size: 2}``), in Python as either or as the object.
    """

    kind: str = "data"
    sync: str = "averaging"
    tensor_size: int | None = None

    @classmethod
    def from_dict(cls, value, where: str = "parallelism") -> "ParallelPlan":
        """The plan a config value spells: a word, a mapping or a ParallelPlan; a ConfigError
        naming ``where`` (and the key inside it) otherwise."""
        if isinstance(value, ParallelPlan):
            return value.checked(where)
        if isinstance(value, str):
            return cls(value).checked(where)
        if not isinstance(value, dict):
            raise ConfigError(where, f"must be one of {', '.join(PLANS)}, or a mapping such as "
                                     f"{{kind: hybrid, tensor_size: 2}}; got {value!r}")
        if set(value) == {"conv", "dense"}:
            return cls._by_layer_kind(value, where)
        unknown = sorted(set(value) - {"kind", "sync", "tensor_size"}, key=str)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", "is not a key of a plan: give kind, sync or tensor_size")
        return cls(**value).checked(where)

    @classmethod
    def _by_layer_kind(cls, value: dict, where: str) -> "ParallelPlan":
        given = (value["conv"], value["dense"])  # compared, not hashed: a YAML list is no key
        kind = next((kind for pair, kind in _BY_LAYER_KIND.items() if pair == given), None)
        if kind is None:
            raise ConfigError(where, f"per kind of layer, dl4py trains {{conv: data, dense: tensor}} (the hybrid) or "
                                     f"{{conv: data, dense: data}}; got {value!r}")
        note_deprecated(f"{where}: {{conv: {value['conv']}, dense: {value['dense']}}}", f"{where}: {kind}")
        return cls(kind)

    @classmethod
    def from_training_mode(cls, mode: str, tensor_size: int | None = None, where: str = "training_mode"):
        """The plan an earlier release's ``training_mode`` (and ``tensor_parallel_size``) named."""
        if mode not in MODES:
            raise ConfigError(where, f"must be one of {', '.join(MODES)}; got {mode!r}{did_you_mean(mode, MODES)}")
        if mode in SYNCS:
            return cls("data", sync=mode, tensor_size=tensor_size)
        return cls(mode, tensor_size=tensor_size)

    def checked(self, where: str = "parallelism") -> "ParallelPlan":
        """The plan, or a ConfigError naming the field that is wrong."""
        words = PLANS + (AUTO,)
        if self.kind not in words:
            # auto is a run config's word (the planner chooses), so not offered to a trainer's caller
            raise ConfigError(where, f"must be one of {', '.join(PLANS)}; got {self.kind!r}{did_you_mean(self.kind, words)}")
        if self.kind == AUTO and (self.sync != "averaging" or self.tensor_size is not None):
            raise ConfigError(where, "auto chooses the whole plan: give sync and tensor_size with a plan of your own")
        if self.sync not in SYNCS:
            raise ConfigError(f"{where}.sync", f"must be one of {', '.join(SYNCS)}; got {self.sync!r}{did_you_mean(self.sync, SYNCS)}")
        if self.kind != "data" and self.sync != "averaging":
            raise ConfigError(f"{where}.sync", f"applies to the data plan only: {self.kind} meets every step")
        if self.tensor_size is not None:
            if self.kind not in ("tensor", "hybrid"):
                raise ConfigError(f"{where}.tensor_size", f"applies to the tensor and hybrid plans only, not {self.kind!r}")
            if not _is_int(self.tensor_size, minimum=1):
                raise ConfigError(f"{where}.tensor_size", f"must be a positive integer, got {self.tensor_size!r}")
        return self

    @property
    def mode(self) -> str:
        """The rank program's name for this plan: averaging, shared_gradients, sharded, tensor
        or hybrid."""
        return self.sync if self.kind == "data" else self.kind

    def to_dict(self):
        """The shortest config spelling: the word alone when nothing else is set."""
        if self == ParallelPlan(self.kind):
            return self.kind
        shown = {"kind": self.kind}
        if self.sync != "averaging":
            shown["sync"] = self.sync
        if self.tensor_size is not None:
            shown["tensor_size"] = self.tensor_size
        return shown

    def __str__(self) -> str:
        text = self.to_dict()
        return text if isinstance(text, str) else "{" + ", ".join(f"{k}: {v}" for k, v in text.items()) + "}"


def note_deprecated(old: str, new: str) -> None:
    """One line, once per process, for a spelling that still works: what to write instead."""
    if old not in _noted:
        _noted.add(old)
        log.warning("%s is deprecated (it still works): write %s", old, new)


@dataclass(frozen=True)
class ParallelOptions:
    """DL4J's ParallelWrapper.Builder options; ``None`` means the default.

    - ``workers``: processes (default: the number of usable GPUs, or 2 on CPU).
    - ``prefetch_buffer``: batches each worker keeps ready on its device (0: none).
    - ``averaging_frequency``: rounds between parameter averages (averaging mode; default 1).
    - ``report_score_after_averaging``: log the averaged score and the averaging time.
    - ``average_updaters``: average the updater state too (averaging mode; default on).
    - ``parallelism``: the plan (``ParallelPlan``, or its spelling: ``"data"``, ``"sharded"``,
      ``"tensor"``, ``"hybrid"``, ``{"kind": "data", "sync": "shared_gradients"}``,
      ``{"kind": "hybrid", "tensor_size": 2}``); default: data parallel with averaging.
    - ``devices``: e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu"]`` (default: the model's backend).
    - ``timeout``: seconds any wait on another process may last before it is an error; a
      rank kept waiting that long at a collective has the rank that did not arrive named,
      with the phase it is in, and the fit ends (``parallel/watchdog.py``).
    - ``threads_per_worker``: intra-op threads of each CPU worker. Default: the user's budget
      (``torch.get_num_threads()`` where ``fit`` is called, which ``OMP_NUM_THREADS`` and
      ``torch.set_num_threads`` set, within the process's CPU affinity) shared out among the
      CPU workers, at least 1 each (``parallel/threads.py``).

    ``validated`` is true for what ``validate`` returned (and its pickled copies); an object
    made or ``replace``d since is not, and a trainer given one validates it first.
    """

    workers: int | None = None
    prefetch_buffer: int = 16
    averaging_frequency: int | None = None
    report_score_after_averaging: bool = False
    average_updaters: bool | None = None
    parallelism: ParallelPlan = ParallelPlan()
    devices: tuple[str, ...] | None = None
    timeout: float = 300.0
    threads_per_worker: int | None = None
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

        plan = ParallelPlan.from_dict(self.parallelism, key("parallelism"))
        if plan.kind == AUTO:
            raise ConfigError(key("parallelism"), "auto is chosen by a run (dl4py train, train_run: the planner of "
                                                  "dl4py plan); a trainer takes a plan: " + ", ".join(PLANS))
        if plan.mode in STEP_MODES:
            # An option that cannot apply is an error, not silently ignored as DL4J did.
            for name, unset in (("averaging_frequency", None), ("average_updaters", None),
                                ("report_score_after_averaging", False)):
                if getattr(self, name) != unset:
                    raise ConfigError(key(name), f"applies to the data plan with averaging only: "
                                                 f"parallelism {plan} keeps every replica identical")
        for name in ("workers", "averaging_frequency", "threads_per_worker"):
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
        if plan.tensor_size is not None and self.workers is not None:
            replace(self, parallelism=plan).mesh_shape(self.workers, key("parallelism.tensor_size"))
        devices = self.devices
        if devices is not None:
            if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__iter__"):
                raise ConfigError(key("devices"),
                                  f"must be a list of devices, e.g. ['cuda:0', 'cuda:1'], got {devices!r}")
            devices = tuple(device_name(d, key(f"devices[{i}]")) for i, d in enumerate(devices))
            if not devices:
                raise ConfigError(key("devices"), "must name at least one device")
        checked = replace(self, parallelism=plan, devices=devices, timeout=float(self.timeout))
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

    def mesh_shape(self, world: int, where: str = "parallelism.tensor_size") -> tuple[int, ...]:
        """The device mesh of a tensor or hybrid fit over ``world`` ranks: ``(world,)``, or
        ``(data groups, tensor_size)``; a ConfigError (at ``where``) when the size does not
        divide ``world`` (checked again where the number of ranks is known: a default or
        torchrun's)."""
        size = self.parallelism.tensor_size
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
    keywords = fold_training_mode(keywords, owner)
    if options is None:
        return ParallelOptions(**keywords).validate()
    if not isinstance(options, ParallelOptions):
        raise TypeError(f"{owner}: options must be a ParallelOptions, got {type(options).__name__}")
    defaults = ParallelOptions()
    for name, value in keywords.items():
        if value != getattr(defaults, name):
            raise ConfigError(name, f"is given to {owner} twice, as a keyword and in options: give it in one")
    return options if options.validated else options.validate()


def fold_training_mode(keywords: dict, owner: str) -> dict:
    """``keywords`` with an earlier release's ``training_mode`` and ``tensor_parallel_size``
    (None: not given) folded into ``parallelism`` (None: the default plan), noted once as
    deprecated; both spellings at once are an error."""
    keywords = dict(keywords)
    mode, size = keywords.pop("training_mode", None), keywords.pop("tensor_parallel_size", None)
    if keywords.get("parallelism") is None:
        keywords.pop("parallelism", None)
    if mode is None and size is None:
        return keywords
    old = ", ".join(f"{name}={value!r}" for name, value in (("training_mode", mode), ("tensor_parallel_size", size))
                    if value is not None)
    if "parallelism" in keywords:
        raise ConfigError("parallelism", f"and {old} both choose the plan for {owner}: give parallelism alone")
    plan = ParallelPlan.from_training_mode(mode or "averaging", size, "training_mode").checked("parallelism")
    note_deprecated(f"{owner}({old})", f"{owner}(parallelism={plan.to_dict()!r})")
    return {**keywords, "parallelism": plan}


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
        raise ConfigError("training.accumulate_batches", "is not supported with parallelism sharded yet: use a "
                                                         "larger batch, or {kind: data, sync: shared_gradients}")
    if mode == "hybrid" and model.accumulate_batches > 1:
        # Each rank weighs its batch by its own rows, but the loss is its tensor group's over the
        # gathered rows: a short or empty batch (an epoch's last) would weigh the same gradient
        # differently on the ranks of one group, or divide by zero.
        raise ConfigError("training.accumulate_batches", "is not supported with parallelism hybrid yet: "
                                                         "use a larger batch, or parallelism tensor")
    if mode in ("tensor", "hybrid"):
        if model.kind != "multilayer":
            raise ConfigError("parallelism", f"{mode!r} splits the dense layers of a MultiLayerNetwork; this "
                                               f"model is a {type(model).__name__}: use 'sharded' or a data-parallel mode")
        precision = model.precision
        if precision.master_weights or precision.uses_loss_scaling:
            raise ConfigError("training.precision", f"{precision.name!r} keeps float32 master weights or scales the "
                                                    f"loss, which parallelism {mode} does not support yet: use "
                                                    "'float', 'double' or 'mixed-bf16', or parallelism sharded")
