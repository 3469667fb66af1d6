"""What ``--resume`` accepts: the run that was stopped, continued.

The checkpoint holds its own network, so it is compared with the config's, whatever
``config.yaml`` says: another network is refused with the differing keys named. The
training and data keys that decide which examples make up each batch (batch size, data
set, limits, seed, shuffling, workers) may change only at an epoch boundary: mid-epoch,
the batches left would no longer be the ones the stopped epoch had not yet seen.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dl4py.config.run import RunConfig
from dl4py.errors import ConfigError
from dl4py.train.numbering import epoch_name

log = logging.getLogger("dl4py")

# Keys that decide an epoch's batches (a key names itself and everything under it).
EPOCH_COMPOSITION_KEYS = ("data", "training.batch_size", "training.workers", "training.parallelism")
SHOWN = 4  # differences listed in a message before "and N more"


def differences(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Every key path at which two plain-data configs differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in list(old) + [k for k in new if k not in old]:
            path = f"{prefix}.{key}" if prefix else str(key)
            found += differences(old.get(key), new.get(key), path)
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        found = []
        for i, (a, b) in enumerate(zip(old, new)):
            found += differences(a, b, f"{prefix}[{i}]")
        return found
    return [] if old == new else [(prefix, old, new)]


def describe(found: list[tuple[str, Any, Any]], old_name: str, new_name: str) -> str:
    shown = [f"{path} is {_short(a)} in {old_name}, {_short(b)} in {new_name}" for path, a, b in found[:SHOWN]]
    more = len(found) - SHOWN
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def check_resume(config: RunConfig, checkpoint_model, run_dir: Path) -> None:
    """Refuse a resume that would not continue the run in ``run_dir`` (ConfigError naming the keys)."""
    checkpoint = run_dir / "checkpoint.dl4py"
    saved_network = getattr(checkpoint_model, "config", None)
    if saved_network is not None:
        found = differences(saved_network.to_dict(), config.network.to_dict(), "network")
        if found:
            raise ConfigError("--resume", f"the checkpoint {checkpoint} holds another network than the config: "
                                          f"{describe(found, 'the checkpoint', 'the config')}; resume with the "
                                          f"run's own config ({run_dir / 'config.yaml'}) or train into a new "
                                          "directory")
    mid_epoch = checkpoint_model.batch_in_epoch > 0
    try:
        recorded = RunConfig.from_file(run_dir / "config.yaml")
    except FileNotFoundError:
        if mid_epoch:
            raise ConfigError("--resume", f"{run_dir / 'config.yaml'} is missing, so a resume in the middle of "
                                          "an epoch cannot be checked to read the same batches") from None
        return
    if config.training.batch_size == "auto":  # an auto run keeps the batch size it recorded
        config = config.with_overrides([f"training.batch_size={recorded.training.batch_size}"])
    found = [d for d in differences(_compared(recorded), _compared(config)) if _decides_batches(d[0])]
    if not found:
        return
    what = describe(found, "the run", "this config")
    if mid_epoch:
        stopped = epoch_name(checkpoint_model.epoch_count)
        raise ConfigError("--resume", f"the checkpoint stopped in the middle of {stopped} "
                                      f"(after batch {checkpoint_model.batch_in_epoch}), and {what}: the rest of the "
                                      "epoch would read other batches; resume with the run's values")
    log.info("resuming at an epoch boundary with changed data or batching: %s", what)


def resumed_message(run_dir: Path, model, saved_meta: dict, batches_per_epoch: int | None) -> str:
    """What ``--resume`` continues and what it restored, e.g. "resuming runs/mlp in epoch 3
    after batch 1,207 of 1,875 (iteration 4,957); weights, updater state, loss scale, RNG and
    data position restored" (epochs counted from 1: two epochs were complete), or "resuming
    runs/mlp after epoch 2 (iteration 3,750); ..." at an epoch boundary. Named only where
    restored: the loss scale when the checkpoint holds the scaler's state and this run scales
    the loss, the data position part-way through an epoch (its first batches are read again
    and skipped). The RNG needs no state: training seeds it for each batch from the batch's
    position (``train/randomness.py``)."""
    position = _resumed_position(model, batches_per_epoch)
    where = f"resuming {run_dir} {position} (iteration {model.iteration_count:,})"
    parts = ["weights"]
    if model.precision_state.keeps_masters and saved_meta["precision"] == model.precision.name:
        parts.append("float32 master weights")
    if saved_meta["has_updater"]:
        parts.append("updater state")
    if model.precision_state.scales_loss and saved_meta.get("scaler"):
        parts.append("loss scale")
    if model.normalizer is not None:
        parts.append("normalizer")
    parts.append("RNG")
    if model.batch_in_epoch:
        parts.append("data position")
    return f"{where}; {', '.join(parts[:-1])} and {parts[-1]} restored"


def _resumed_position(model, batches_per_epoch: int | None) -> str:
    """Where the run goes on, for a person: "in epoch 3 after batch 1,207 of 1,875" (the model
    is in its epoch ``epoch_count``, 0-based), "after epoch 2", "at the start of epoch 1"."""
    if model.batch_in_epoch:
        total = f" of {batches_per_epoch:,}" if batches_per_epoch is not None else ""
        return f"in {epoch_name(model.epoch_count)} after batch {model.batch_in_epoch:,}{total}"
    if model.epoch_count:
        return f"after {epoch_name(model.epoch_count - 1)}"
    return f"at the start of {epoch_name(0)}"


def _compared(config: RunConfig) -> dict:
    """The config as plain data, its plan in one spelling: a run recorded with an earlier
    release's ``training_mode`` resumes under the ``parallelism`` that names the same plan."""
    plain = config.to_dict()
    training = plain.setdefault("training", {})
    for earlier in ("training_mode", "tensor_parallel_size"):
        training.pop(earlier, None)
    training["parallelism"] = config.training.plan().to_dict()
    return plain


def _decides_batches(path: str) -> bool:
    return any(path == key or path.startswith(key + ".") for key in EPOCH_COMPOSITION_KEYS)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
