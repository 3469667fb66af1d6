"""TensorBoard event files for a training run, written by the writer that ships with torch.

    from dl4py.monitor import StatsListener, TensorBoardStatsStorage

    model.fit(train, epochs=2, listeners=[StatsListener(TensorBoardStatsStorage("runs/lenet/tensorboard"))])

then ``tensorboard --logdir runs/lenet/tensorboard``. Needs the ``tensorboard`` package:
``pip install "dl4py[tensorboard]"``.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

from dl4py.errors import MissingDependencyError, StorageError
from dl4py.monitor.scalars import (RATIO_GUIDE_TAG, RATIO_LOG10, epoch_scalars, evaluation_scalars, histograms,
                                   ratio_log10_scalars, update_scalars)
from dl4py.monitor.storage import StatsStorage

FLUSH_SECONDS = 10  # how stale a live TensorBoard may be; each epoch's end flushes too


class TensorBoardStatsStorage(StatsStorage):
    """Writes the StatsListener's records to TensorBoard event files in ``log_dir``.

    Scalars against the iteration (the step of TensorBoard's charts): ``train/score``,
    ``train/learning_rate``, ``train/samples_per_second``, ``memory/...`` and, per layer,
    ``update_ratio/<layer>``, ``parameters/<layer>``, ``gradients/<layer>``,
    ``updates/<layer>``, ``activations/<layer>``. Scalars against the epoch (0-based, as in
    History): ``epoch/loss``, ``epoch/learning_rate``, ``epoch/samples_per_second`` ... and
    ``validation/<metric>`` (from ``val_<metric>``); an evaluation's ``test/<metric>`` at the
    epoch it was taken. The model summary and the environment are text (TensorBoard's Text
    tab). A resumed run writes a new event file in the same folder, and TensorBoard shows
    both as one run.

    For DL4J's update:parameter chart: ``update_ratio_log10/<layer>`` and the guide
    ``update_ratio_log10_guide`` at -3, overlaid in one chart of the Custom Scalars tab
    (``layout``, written with the first "stats" record of each event file) beside the score,
    the loss per epoch and the per-layer magnitudes. The histograms a "stats" record carries
    go to the Histograms tab: ``histogram/parameters/<layer>``, ``histogram/gradients/<layer>``,
    ``histogram/updates/<layer>``."""

    def __init__(self, log_dir: str | Path):
        summary_writer = _summary_writer()
        self.log_dir = Path(log_dir)
        try:
            self._writer = summary_writer(str(self.log_dir), flush_secs=FLUSH_SECONDS)
        except OSError as exc:  # a file where the folder should be, no permission
            raise StorageError("write TensorBoard events to", self.log_dir, exc) from exc
        self._layout_written = False

    def put_static(self, record: dict) -> None:
        model = record.get("model") or {}
        if model.get("summary"):
            self._writer.add_text("model/summary", _preformatted(model["summary"]), 0)
        facts = {"parameters": model.get("parameters"), "workers": record.get("workers"),
                 **(record.get("environment") or {})}
        self._writer.add_text("environment", _table(facts), 0)

    def put_update(self, record: dict) -> None:
        if not self._layout_written:  # the first record names the layers the charts overlay
            self._writer.add_custom_scalars(layout(_layers_with_parameters(record)))
            self._layout_written = True
        step = record["iteration"]
        self._add(update_scalars(record) + ratio_log10_scalars(record), step)
        for tag, histogram in histograms(record):
            self._add_histogram(tag, histogram, step)

    def put_epoch(self, record: dict) -> None:
        self._add(epoch_scalars(record), record["epoch"])
        self._writer.flush()  # a TensorBoard watching the run sees each epoch as it ends

    def put(self, record: dict) -> None:
        """An "evaluation" record's test-set scores, at the epoch it was taken; other kinds
        have no place here."""
        if record.get("kind") == "evaluation":
            self._add(evaluation_scalars(record), record.get("epoch", 0))
            self._writer.flush()

    def _add(self, scalars: list[tuple[str, float]], step: int) -> None:
        for tag, value in scalars:
            self._writer.add_scalar(tag, value, step)

    def _add_histogram(self, tag: str, histogram: dict, step: int) -> None:
        """A collector's histogram (equal bins from ``min`` to ``max``) as TensorBoard's: each
        bucket given by its right edge; TensorBoard starts the first at ``min``."""
        low, high, counts = histogram["min"], histogram["max"], histogram["counts"]
        edges = [low + (high - low) * (i + 1) / len(counts) for i in range(len(counts))]
        self._writer.add_histogram_raw(
            tag, min=low, max=high, num=sum(counts), sum=_or_nan(histogram.get("sum")),
            sum_squares=_or_nan(histogram.get("sum_squares")), bucket_limits=edges, bucket_counts=counts,
            global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()  # flushes; closing twice is harmless


def layout(layers: list[str]) -> dict:
    """The Custom Scalars tab's charts (``SummaryWriter.add_custom_scalars``): each layer's log10
    update:parameter ratio with the guide at -3 in one chart, and other overlays. TensorBoard
    reads each entry as a regular expression matched from a tag's start."""
    exactly = [re.escape(f"{RATIO_LOG10}/{layer}") + "$" for layer in layers] + [re.escape(RATIO_GUIDE_TAG) + "$"]
    return {"dl4py": {
        "update:parameter ratio, log10 per layer (guide: -3)": ["Multiline", exactly],
        "score (minibatch loss)": ["Multiline", [r"train/score$"]],
        "loss per epoch: training and validation": ["Multiline", [r"epoch/loss$", r"validation/loss$"]],
        "mean |parameter| per layer": ["Multiline", ["parameters/"]],
        "mean |gradient| per layer": ["Multiline", ["gradients/"]],
        "mean |update| per layer": ["Multiline", ["updates/"]],
        "mean |activation| per layer": ["Multiline", ["activations/"]],
    }}


def _layers_with_parameters(record: dict) -> list[str]:
    return [name for name, stats in (record.get("layers") or {}).items() if stats.get("parameters") is not None]


def _or_nan(value) -> float:
    return float("nan") if value is None else value  # a sum past float range, written null


def _summary_writer():
    """torch's SummaryWriter, or an error naming what to install."""
    try:
        # torch.utils.tensorboard needs tensorboard, and says so less clearly: asked for first
        importlib.import_module("tensorboard")  # optional: tensorboard (extra tensorboard)
        from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard (extra tensorboard)
    except ImportError:  # also when sys.modules["tensorboard"] is None
        raise MissingDependencyError("TensorBoard logging", "tensorboard", "tensorboard") from None
    return SummaryWriter


def _preformatted(text: str) -> str:
    """Text TensorBoard shows as written: its Text tab renders Markdown, where an indented
    block is kept as it is (the summary's columns stay aligned)."""
    return "\n".join("    " + line for line in text.splitlines())


def _table(facts: dict) -> str:
    rows = ["| | |", "|---|---|"]
    for key, value in facts.items():
        if value is None:
            continue
        shown = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
        rows.append(f"| {key} | {shown.replace('|', '/')} |")
    return "\n".join(rows)
