"""RunConfig: everything one training run needs, in five sections.

``network`` (the NetworkConfig), ``data`` (which data set, limits), ``training`` (epochs,
batch size, backend, precision, workers), ``environment`` (CUDA environment knobs) and
``logging`` (where the run's stats go besides ``metrics.jsonl``: TensorBoard, MLflow).
It is what ``dl4py train CONFIG.yaml`` reads, and what a run directory records.
Any key can be overridden with ``key=value`` strings (``--set`` on the command line),
type-checked against the same schema as the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import yaml

from dl4py.backend.environment_settings import check_setting
from dl4py.config.graph import GraphConfig, network_from_dict
from dl4py.config.network import NetworkConfig
from dl4py.config.parallel import AUTO, ParallelOptions, ParallelPlan, note_deprecated
from dl4py.config.schema import ConfigBase, TaggedConfig, dataclass_from_dict, did_you_mean, join
from dl4py.config.yaml_loader import ConfigSyntaxError, load_json, load_yaml
from dl4py.errors import ConfigError

Precision = Literal["float", "double", "half", "bfloat16", "mixed-fp16", "mixed-bf16"]


class NormalizerSection(TaggedConfig):
    """``data.normalizer``: fitted on the training data before training and saved inside the
    model (docs/data.md). A name (``standardize``) or a mapping with options
    (``{type: minmax, min_range: -1, max_range: 1}``)."""

    registry: ClassVar[dict[str, type]] = {}
    type_name: ClassVar[Optional[str]] = None
    # The normalizer class of each type name: dl4py.data.normalizers registers its classes where
    # it defines them (as nn/ registers layer builders), so that config imports nothing of data/.
    classes: ClassVar[dict[str, type]] = {}

    @classmethod
    def builds(cls, normalizer: type) -> type:
        """Class decorator: sections of ``normalizer.type_name`` build ``normalizer``, passing
        their fields (its options, by the same names) as keyword arguments."""
        if normalizer.type_name not in cls.registry:
            raise ValueError(f"{normalizer.__name__}: {normalizer.type_name!r} is no normalizer section; "
                             f"known: {', '.join(cls.registry)}")
        cls.classes[normalizer.type_name] = normalizer
        return normalizer

    def build(self):
        """The unfitted dl4py.data.normalizers object this section describes."""
        options = {option.name: getattr(self, option.name) for option in fields(self)}
        return NormalizerSection.classes[self.type_name](**options)


@NormalizerSection.register("standardize")
@dataclass(frozen=True)
class StandardizeSection(NormalizerSection):
    """NormalizerStandardize: zero mean, unit variance per feature (per channel for images)."""


@NormalizerSection.register("minmax")
@dataclass(frozen=True)
class MinMaxSection(NormalizerSection):
    """NormalizerMinMaxScaler: each feature's training range onto [min_range, max_range]."""

    min_range: float = 0.0
    max_range: float = 1.0

    def validate(self, where: str) -> None:
        if self.max_range <= self.min_range:
            raise ConfigError(join(where, "max_range"), f"must be above min_range ({self.min_range}), got {self.max_range}")


@NormalizerSection.register("image_scaler")
@dataclass(frozen=True)
class ImageScalerSection(MinMaxSection):
    """ImagePreProcessingScaler: pixels 0 .. 2**max_bits - 1 onto [min_range, max_range]; no fitting."""

    max_bits: int = 8

    def validate(self, where: str) -> None:
        super().validate(where)
        if not 1 <= self.max_bits <= 32:
            raise ConfigError(join(where, "max_bits"), f"must be from 1 to 32, got {self.max_bits}")


IMAGE_KEYS = ("height", "width", "channels", "random_crop", "flip")  # dataset image_folder only
# Examples per split of MNIST's files (data/mnist.py; their SHA-256 fixes them): a config's
# limits are checked against these before anything is read.
MNIST_EXAMPLES = {"train": 60_000, "test": 10_000}


@dataclass(frozen=True)
class ValidationSection(ConfigBase):
    """``data.validation``: held-out data scored after each epoch (``val_loss``,
    ``val_accuracy`` in the history and ``metrics.jsonl``); early stopping and sweeps rank on
    it, and the test set is used once, at the end. ``{split: 0.1}`` holds out a fraction of
    the training data (chosen by ``data.seed``); ``{path: FILE}`` reads another file or folder
    like the training one."""

    split: Optional[float] = None
    path: Optional[str] = None

    def validate(self, where: str) -> None:
        if (self.split is None) == (self.path is None):
            raise ConfigError(where, "give one of split (a fraction of the training data, e.g. 0.1) or path")
        if self.split is not None and not 0 < self.split < 1:
            raise ConfigError(join(where, "split"), f"must be a fraction between 0 and 1 (exclusive), got {self.split}")


@dataclass(frozen=True)
class DataConfig(ConfigBase):
    dataset: Literal["mnist", "csv", "image_folder"] = "mnist"
    limit_train: Optional[int] = None  # use only the first N training examples
    limit_test: Optional[int] = None
    shuffle: bool = True
    seed: int = 12345  # shuffle seed, as in MnistDataSetIterator(batch, train, 12345)
    train_path: Optional[str] = None  # csv (a file), image_folder (a folder per class)
    test_path: Optional[str] = None  # csv, image_folder
    label_index: int = -1  # csv only
    num_classes: Optional[int] = None  # csv only; None means regression
    skip_lines: int = 0  # csv only
    height: Optional[int] = None  # image_folder only; height/width/channels default to the network's input type
    width: Optional[int] = None
    channels: Optional[int] = None  # 1 grey, 3 RGB, 4 RGBA
    random_crop: int = 0  # image_folder only: pad N pixels, take a random window (training data)
    flip: bool = False  # image_folder only: mirror half the training images, drawn per epoch
    normalizer: Optional[NormalizerSection] = None  # fitted on the training data, saved in the model
    validation: Optional[ValidationSection] = None  # held-out data scored after each epoch

    def validate(self, where: str) -> None:
        if self.validation is not None and self.validation.path is not None and self.dataset == "mnist":
            raise ConfigError(join(where, "validation.path"), "applies to datasets read from files (csv, "
                                                             "image_folder); for mnist use validation: {split: 0.1}")
        for name in ("limit_train", "limit_test"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(join(where, name), f"must be positive, got {value}")
        if self.dataset == "mnist":  # its size is fixed: refuse a limit before reading anything
            for name, split in (("limit_train", "train"), ("limit_test", "test")):
                value = getattr(self, name)
                if value is not None and value > MNIST_EXAMPLES[split]:
                    raise ConfigError(join(where, name), f"is {value}, more than the {MNIST_EXAMPLES[split]} "
                                                         f"examples of MNIST's {split} set")
        if self.dataset in ("csv", "image_folder") and not self.train_path:
            raise ConfigError(join(where, "train_path"), f"is required when dataset is {self.dataset!r}")
        for name in ("train_path", "test_path", "num_classes"):
            allowed = ("csv", "image_folder") if name != "num_classes" else ("csv",)
            if getattr(self, name) is not None and self.dataset not in allowed:
                raise ConfigError(
                    join(where, name), f"applies only to dataset {' or '.join(map(repr, allowed))}, not {self.dataset!r}"
                )
        self._validate_images(where)

    def _validate_images(self, where: str) -> None:
        if self.dataset != "image_folder":
            for name in IMAGE_KEYS:
                if getattr(self, name) != DataConfig.__dataclass_fields__[name].default:
                    raise ConfigError(join(where, name), f"applies only to dataset 'image_folder', not {self.dataset!r}")
            return
        for name in ("limit_train", "limit_test"):  # the first N files would be the first classes only
            if getattr(self, name) is not None:
                raise ConfigError(join(where, name), "is not supported for dataset 'image_folder'; "
                                                     "use a folder holding fewer images")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(join(where, name), f"must be positive, got {value}")
        if self.channels is not None and self.channels not in (1, 3, 4):
            raise ConfigError(join(where, "channels"), f"must be 1 (grey), 3 (RGB) or 4 (RGBA), got {self.channels}")
        if self.random_crop < 0:
            raise ConfigError(join(where, "random_crop"), f"must be zero or more pixels, got {self.random_crop}")


@dataclass(frozen=True)
class EarlyStoppingSection(ConfigBase):
    """``training.early_stopping``: stop when the held-out score (the data's test set, as in
    DL4J's examples) stops improving; the best model is kept as ``bestModel.dl4py``."""

    # classification (maximised), loss, or regression: mse, mae, rmse, rse (minimised), r2, pc (maximised)
    metric: Literal["accuracy", "f1", "precision", "recall", "loss", "mse", "mae", "rmse", "rse", "r2", "pc"] = "accuracy"
    patience: Optional[int] = None  # epochs without improvement before stopping (None: never)
    min_delta: float = 0.0  # smaller improvements do not count
    max_epochs: Optional[int] = None  # default: training.epochs
    max_minutes: Optional[float] = None
    evaluate_every_n_epochs: int = 1

    def validate(self, where: str) -> None:
        for name in ("patience", "max_epochs", "max_minutes", "evaluate_every_n_epochs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(join(where, name), f"must be positive, got {value}")
        if self.min_delta < 0:
            raise ConfigError(join(where, "min_delta"), f"must be zero or more, got {self.min_delta}")


def checked_batches(value, where: str) -> int:
    """``value`` as a number of batches per update, or a ConfigError naming ``where``
    (``training.accumulate_batches`` here, ``Model.fit(accumulate_batches=)`` by train/accumulate.py)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(where, f"must be a positive integer (batches whose gradients make one update), "
                                 f"got {value!r}")
    return value


@dataclass(frozen=True)
class TrainingConfig(ConfigBase):
    epochs: int = 1
    batch_size: int | Literal["auto"] = 128  # auto: the largest that fits the device (docs/memory.md)
    backend: Literal["auto", "cpu", "gpu"] = "auto"
    precision: Precision = "float"
    workers: int | Literal["auto"] = 1  # more than 1: parallel training; auto: the planner's count (docs/plan.md)
    score_every: int = 100  # iterations between score reports (0: never)
    accumulate_batches: int = 1  # batches whose summed gradients make one update (docs/training.md)
    # ParallelWrapper options (training.workers > 1); null = the wrapper's default
    # The plan (docs/model-parallel.md): data | sharded | tensor | hybrid, or a mapping such as
    # {kind: data, sync: shared_gradients} or {kind: hybrid, tensor_size: 2}; null: data.
    parallelism: Optional[ParallelPlan] = None
    averaging_frequency: Optional[int] = None  # rounds between averages (default 1)
    prefetch_buffer: int = 16  # batches each worker keeps ready
    report_score_after_averaging: bool = False
    timeout: float = 300.0  # seconds a rank may wait for another (a collective, a batch) before it is an error
    threads_per_worker: Optional[int] = None  # intra-op threads of each CPU worker (null: the budget shared out)
    early_stopping: Optional[EarlyStoppingSection] = None
    # An earlier release's spelling of parallelism, still read (noted as deprecated); null: not given.
    training_mode: Optional[Literal["averaging", "shared_gradients", "sharded", "tensor", "hybrid"]] = None
    tensor_parallel_size: Optional[int] = None

    def validate(self, where: str) -> None:
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
            if value != "auto" and value <= 0:
                raise ConfigError(join(where, name), f"must be positive, got {value}")
        if self.score_every < 0:
            raise ConfigError(join(where, "score_every"), f"must be zero or more, got {self.score_every}")
        checked_batches(self.accumulate_batches, join(where, "accumulate_batches"))
        if self.workers == 1 and not self.plan_is_auto:  # parallel options must not be silently ignored
            for name, inert in (("training_mode", None), ("averaging_frequency", None),
                                ("report_score_after_averaging", False), ("parallelism", None),
                                ("tensor_parallel_size", None), ("timeout", 300.0), ("threads_per_worker", None)):
                if getattr(self, name) != inert:
                    raise ConfigError(join(where, name), "applies to parallel training only: set training.workers > 1")
        if self.plan_is_auto and any(getattr(self, name) is not None for name in ("training_mode", "tensor_parallel_size")):
            raise ConfigError(join(where, "parallelism"), "is auto: leave training_mode and tensor_parallel_size out")
        # The ParallelWrapper's own checks, under this section's keys; with auto, those of a plan
        # it may choose (the chosen one is checked again once known).
        self.parallel_options(where) if not self.chooses_plan else self._as_chosen().parallel_options(where)

    @property
    def plan_is_auto(self) -> bool:
        return self.parallelism is not None and self.parallelism.kind == AUTO

    @property
    def chooses_plan(self) -> bool:
        """Whether the planner chooses the workers or the plan (plan/auto.py)."""
        return self.workers == AUTO or self.plan_is_auto

    def _as_chosen(self) -> "TrainingConfig":
        return replace(self, workers=2 if self.workers in (AUTO, 1) else self.workers,
                       parallelism=None if self.plan_is_auto else self.parallelism)

    def plan(self, where: str = "training") -> ParallelPlan:
        """The plan ``parallelism`` names (the data plan when unset), or the one an earlier
        release's ``training_mode`` and ``tensor_parallel_size`` named (noted once as deprecated)."""
        earlier = {name: getattr(self, name) for name in ("training_mode", "tensor_parallel_size")
                   if getattr(self, name) is not None}
        if not earlier:
            return self.parallelism or ParallelPlan()
        given = ", ".join(f"{join(where, name)}: {value}" for name, value in earlier.items())
        key = join(where, "parallelism")
        if self.parallelism is not None:
            raise ConfigError(key, f"and {given} both choose the plan: give {key} alone")
        plan = ParallelPlan.from_training_mode(self.training_mode or "averaging", self.tensor_parallel_size,
                                               join(where, "training_mode")).checked(key)
        note_deprecated(given, f"{key}: {plan}")
        return plan

    def parallel_options(self, where: str = "training") -> ParallelOptions:
        """The parallel trainers' options this section sets (their defaults for the rest),
        validated (an error names the key under ``where``): the object the runner hands to
        the ParallelWrapper or the SparkTrainer, as it is."""
        return ParallelOptions(workers=self.workers, prefetch_buffer=self.prefetch_buffer,
                               averaging_frequency=self.averaging_frequency,
                               report_score_after_averaging=self.report_score_after_averaging,
                               parallelism=self.plan(where), timeout=self.timeout,
                               threads_per_worker=self.threads_per_worker).validate(where)


@dataclass(frozen=True)
class EnvironmentConfig(ConfigBase):
    """CUDA environment settings (docs/environment.md). Every field defaults to null, meaning
    "not set here": a DL4PY_* variable or the built-in default applies. A non-null field
    overrides both when the run merges this section (``Environment.update_from_config``)."""

    allow_multi_gpu: Optional[bool] = None  # default true
    devices: Optional[tuple] = None  # default: all visible
    max_device_cache: Optional[int | float | str] = None  # fraction up to 1, or a size
    max_cacheable_chunk: Optional[int | str] = None  # a size, at least 20 MiB
    gc_threshold: Optional[float] = None
    expandable_segments: Optional[bool] = None  # default false
    caching: Optional[bool] = None  # default true
    pinned_memory: Optional[bool] = None  # default true
    tf32: Optional[bool] = None  # default: PyTorch's own flags
    cudnn_benchmark: Optional[bool] = None  # default false
    deterministic: Optional[bool] = None  # default false
    debug: Optional[bool] = None  # default false
    compile: Optional[Literal["auto", "off", "default", "max-autotune"]] = None  # default auto
    cuda_graphs: Optional[bool] = None  # default false
    device_data: Optional[Literal["auto", "on", "off"]] = None  # default auto
    fused_optimizer: Optional[Literal["auto", "on", "off"]] = None  # default auto
    channels_last: Optional[Literal["auto", "on", "off"]] = None  # default auto

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> "EnvironmentConfig":
        if isinstance(data, dict) and isinstance(data.get("compile"), bool):  # YAML reads `off` as false
            data = {**data, "compile": "default" if data["compile"] else "off"}
        if isinstance(data, dict):  # and a bare on/off as true/false
            for name in ("device_data", "fused_optimizer", "channels_last"):
                if isinstance(data.get(name), bool):
                    data = {**data, name: "on" if data[name] else "off"}
        return dataclass_from_dict(cls, data, where)

    def validate(self, where: str) -> None:
        for name in self.__dataclass_fields__:  # check_setting: the one rule set for every source
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_setting(name, value, join(where, name)))


@dataclass(frozen=True)
class LoggingConfig(ConfigBase):
    """``logging``: what a run records as it trains (docs/monitoring.md). ``metrics.jsonl`` in
    the run directory always gets the StatsListener's records; TensorBoard event files, an
    MLflow run and a W&B run are added on request."""

    stats_every: int = 10  # iterations between stats records: score, update ratios, memory (0: none)
    histogram_every: int = 10  # stats records between parameter/gradient/update histograms (0: none)
    tensorboard: bool | str = False  # true: RUN_DIR/tensorboard; or a folder of one's own
    mlflow: Optional[str] = None  # a tracking URI: sqlite:///mlflow.db, http://127.0.0.1:5000, a folder
    mlflow_experiment: str = "dl4py"
    wandb: Optional[str] = None  # a W&B project name: the run's W&B run, its files in RUN_DIR/wandb
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None  # null: WANDB_MODE, else online
    report: bool = True  # write RUN_DIR/report.html when the run completes

    def validate(self, where: str) -> None:
        if self.stats_every < 0:
            raise ConfigError(join(where, "stats_every"), f"must be zero or more iterations, got {self.stats_every}")
        if self.histogram_every < 0:
            raise ConfigError(join(where, "histogram_every"),
                              f"must be zero or more stats records, got {self.histogram_every}")
        if isinstance(self.tensorboard, str) and not self.tensorboard.strip():
            raise ConfigError(join(where, "tensorboard"), "must be true, false or a folder, got an empty string")
        if self.mlflow is not None and not self.mlflow.strip():
            raise ConfigError(join(where, "mlflow"), "must be a tracking URI (e.g. sqlite:///mlflow.db) or null, "
                                                     "got an empty string")
        if not self.mlflow_experiment.strip():
            raise ConfigError(join(where, "mlflow_experiment"), "must name an MLflow experiment, got an empty string")
        if self.wandb is not None and not self.wandb.strip():
            raise ConfigError(join(where, "wandb"), "must name a W&B project or be null, got an empty string")


@dataclass(frozen=True)
class RunConfig(ConfigBase):
    network: NetworkConfig | GraphConfig  # a graph when the section has vertices (config/graph.py)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> "RunConfig":
        if isinstance(data, dict) and "network" not in data:
            raise ConfigError("network", "is required: the layers and input type of the network")
        if isinstance(data, dict):  # chosen by its keys, so that errors name the one it is
            data = {**data, "network": network_from_dict(data["network"], join(where, "network"))}
        return dataclass_from_dict(cls, data, where)

    @classmethod
    def from_file(cls, path: str | Path) -> "RunConfig":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(str(path), f"cannot read config file: {exc.strerror}") from None
        except UnicodeDecodeError as exc:  # a binary file (a model, an archive) given by mistake
            raise ConfigError(
                str(path), f"is not a text file (byte {exc.start} is not UTF-8); a config is YAML or JSON text"
            ) from None
        # A syntax error names the file, line and column itself (ConfigSyntaxError).
        data = load_json(text, str(path)) if path.suffix == ".json" else load_yaml(text, str(path))
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            message = str(exc)[len(exc.where) + 2:] if exc.where else str(exc)
            raise ConfigError(f"{path}: {exc.where}" if exc.where else str(path), message) from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, assignments: list[str]) -> "RunConfig":
        """Apply ``key=value`` overrides (``training.epochs=3``, ``network.layers[0].n_out=32``).

        The value is read as YAML (``3`` is an int, ``0.01`` a float, ``[5, 5]`` a list) and
        checked against the schema like a value in the file.
        """
        data = self.to_dict()
        for assignment in assignments:
            key, sep, raw = assignment.partition("=")
            if not sep or not key.strip():
                raise ConfigError(assignment, "an override must look like key=value, e.g. training.epochs=3")
            key = key.strip()
            try:  # text YAML cannot read is an error, not a string: "[5, 5" is a typo
                value = load_yaml(raw, f"--set {assignment}")
            except ConfigSyntaxError as exc:
                raise ConfigError(
                    f"--set {assignment}",
                    f"the value is not valid YAML: {exc.problem}; to pass it as text, quote it: {key}='...'",
                ) from None
            _assign(data, key, value)
        try:
            return RunConfig.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(exc.where, f"{str(exc).split(': ', 1)[-1]} (after --set overrides)") from None


_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def _split_key(key: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in key.split("."):
        pos = 0
        while pos < len(piece):
            m = _PART.match(piece, pos)
            if not m:
                if piece.isdigit():  # layers.0.n_out means layers[0].n_out
                    parts.append(int(piece))
                    break
                raise ConfigError(key, f"is not a valid key (at {piece[pos:]!r})")
            parts.append(m.group(1) if m.group(1) else int(m.group(2)))
            pos = m.end()
    return parts


def _assign(data: dict, key: str, value: Any) -> None:
    parts = _split_key(key)
    node: Any = data
    where = ""
    created = False  # inside a section this key creates: its keys are the schema's to check
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(part, int):
            if not isinstance(node, list):
                raise ConfigError(key, f"{where or 'this'} is not a list, so [{part}] does not apply")
            if not 0 <= part < len(node):
                raise ConfigError(key, f"index {part} is out of range: {where} has {len(node)} entries")
        else:
            if not isinstance(node, dict):
                raise ConfigError(key, f"{where} is not a section, so .{part} does not apply")
            if part not in node and not created:
                raise ConfigError(
                    key, f"unknown key {part!r} in {where or 'the config'}{did_you_mean(part, node)}; "
                         f"valid keys: {', '.join(node)}"
                )
        if last:
            node[part] = value
        else:
            if node[part] is None and not isinstance(parts[i + 1], int):
                # An optional section not in the config yet (data.validation): a dotted key
                # creates it, and the schema checks it as if the file had it.
                node[part], created = {}, True
            node = node[part]
            where = join(where, part)
