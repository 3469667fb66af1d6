"""RunConfig: everything one training run needs, in four sections.

``network`` (the NetworkConfig), ``data`` (which data set, limits), ``training`` (epochs,
batch size, backend, precision, workers) and ``environment`` (CUDA environment knobs).
It is what ``dl4py train CONFIG.yaml`` reads, and what a run directory records.
Any key can be overridden with ``key=value`` strings (``--set`` on the command line),
type-checked against the same schema as the file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from dl4py.config.network import NetworkConfig
from dl4py.config.schema import ConfigBase, dataclass_from_dict, join
from dl4py.config.yaml_loader import load_yaml
from dl4py.errors import ConfigError

Precision = Literal["float", "double", "half", "bfloat16", "mixed-fp16", "mixed-bf16"]


@dataclass(frozen=True)
class DataConfig(ConfigBase):
    dataset: Literal["mnist", "csv"] = "mnist"
    limit_train: Optional[int] = None  # use only the first N training examples
    limit_test: Optional[int] = None
    shuffle: bool = True
    seed: int = 12345  # shuffle seed, as in MnistDataSetIterator(batch, train, 12345)
    train_path: Optional[str] = None  # csv only
    test_path: Optional[str] = None  # csv only
    label_index: int = -1  # csv only
    num_classes: Optional[int] = None  # csv only; None means regression
    skip_lines: int = 0  # csv only

    def validate(self, where: str) -> None:
        for name in ("limit_train", "limit_test"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(join(where, name), f"must be positive, got {value}")
        if self.dataset == "mnist":  # its size is fixed: refuse a limit before reading anything
            from dl4py.data.mnist import EXAMPLES

            for name, split in (("limit_train", "train"), ("limit_test", "test")):
                value = getattr(self, name)
                if value is not None and value > EXAMPLES[split]:
                    raise ConfigError(
                        join(where, name), f"is {value}, more than the {EXAMPLES[split]} examples of MNIST's {split} set"
                    )
        if self.dataset == "csv" and not self.train_path:
            raise ConfigError(join(where, "train_path"), "is required when dataset is 'csv'")
        if self.dataset != "csv":
            for name in ("train_path", "test_path", "num_classes"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        join(where, name), f"applies only to dataset 'csv', not {self.dataset!r}"
                    )


@dataclass(frozen=True)
class EarlyStoppingSection(ConfigBase):
    """``training.early_stopping``: stop when the held-out score (the data's test set, as in
    DL4J's examples) stops improving; the best model is kept as ``bestModel.dl4py``."""

    metric: Literal["accuracy", "f1", "precision", "recall", "loss"] = "accuracy"
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


@dataclass(frozen=True)
class TrainingConfig(ConfigBase):
    epochs: int = 1
    batch_size: int | Literal["auto"] = 128  # auto: the largest that fits the device (docs/memory.md)
    backend: Literal["auto", "cpu", "gpu"] = "auto"
    precision: Precision = "float"
    workers: int = 1  # more than 1: data-parallel training by a ParallelWrapper
    score_every: int = 100  # iterations between score reports (0: never)
    # ParallelWrapper options (training.workers > 1); null = the wrapper's default
    training_mode: Literal["averaging", "shared_gradients"] = "averaging"
    averaging_frequency: Optional[int] = None  # rounds between averages (default 1)
    prefetch_buffer: int = 16  # batches each worker keeps ready
    report_score_after_averaging: bool = False
    early_stopping: Optional[EarlyStoppingSection] = None

    def validate(self, where: str) -> None:
        for name in ("epochs", "batch_size", "workers"):
            value = getattr(self, name)
            if value != "auto" and value <= 0:
                raise ConfigError(join(where, name), f"must be positive, got {value}")
        if self.score_every < 0:
            raise ConfigError(join(where, "score_every"), f"must be zero or more, got {self.score_every}")
        if self.prefetch_buffer < 0:
            raise ConfigError(join(where, "prefetch_buffer"), f"must be zero or more, got {self.prefetch_buffer}")
        if self.averaging_frequency is not None and self.averaging_frequency <= 0:
            raise ConfigError(join(where, "averaging_frequency"), f"must be positive, got {self.averaging_frequency}")
        if self.workers == 1:  # options of the parallel trainer must not be silently ignored
            for name, inert in (("training_mode", "averaging"), ("averaging_frequency", None),
                                ("report_score_after_averaging", False)):
                if getattr(self, name) != inert:
                    raise ConfigError(join(where, name), "applies to parallel training only: set training.workers > 1")
        if self.training_mode == "shared_gradients":
            for name, inert in (("averaging_frequency", None), ("report_score_after_averaging", False)):
                if getattr(self, name) != inert:
                    raise ConfigError(join(where, name), "applies to training_mode 'averaging' only")


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
    compile: Optional[Literal["off", "default", "max-autotune"]] = None  # default off
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
        from dl4py.backend.cuda_environment import check_setting  # the one rule set for every source

        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_setting(name, value, join(where, name)))


@dataclass(frozen=True)
class RunConfig(ConfigBase):
    network: NetworkConfig
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> "RunConfig":
        if isinstance(data, dict) and "network" not in data:
            raise ConfigError("network", "is required: the layers and input type of the network")
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
        try:
            data = json.loads(text) if path.suffix == ".json" else load_yaml(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(str(path), f"is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc.where}", str(exc).split(": ", 1)[-1]) from None

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
            try:
                value = load_yaml(raw)
            except yaml.YAMLError:
                value = raw
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
            if part not in node:
                raise ConfigError(
                    key, f"unknown key {part!r} in {where or 'the config'}; valid keys: {', '.join(node)}"
                )
        if last:
            node[part] = value
        else:
            node = node[part]
            where = join(where, part)
