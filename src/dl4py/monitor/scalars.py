"""How ``metrics.jsonl`` records become named scalars: one naming for TensorBoard tags and
MLflow metric keys, so a chart has the same name in both tools.

- a "stats" record (step = its ``iteration``): ``train/score``, ``train/learning_rate``,
  ``train/samples_per_second``, ``memory/<what>`` and, per layer, ``update_ratio/<layer>``,
  ``parameters/<layer>``, ``gradients/<layer>``, ``updates/<layer>``, ``activations/<layer>``;
- an "epoch" record (step = its ``epoch``, 0-based as in History): ``val_<metric>`` becomes
  ``validation/<metric>`` and every other number ``epoch/<key>`` (``epoch/loss``,
  ``epoch/learning_rate``, ``epoch/samples_per_second``, ...);
- an "evaluation" record (step = its ``epoch``): ``test_<metric>`` becomes ``test/<metric>``.

Values that are not known (null) are left out; NaN and infinity are kept, as a diverged
loss is worth seeing.

For TensorBoard also, from a "stats" record: ``update_ratio_log10/<layer>`` (log10 of the
update:parameter ratio; a ratio of 0 has none) with the guide ``update_ratio_log10_guide``
at -3 (DL4J's rule of thumb: an update about 1e-3 of the parameter) at the same steps, and,
where the record carries ``histograms``, ``histogram/<kind>/<layer>`` (kind ``parameters``,
``gradients``, ``updates``).
"""

from __future__ import annotations

import math

RATIO_LOG10 = "update_ratio_log10"
RATIO_GUIDE_TAG = "update_ratio_log10_guide"  # no "/": no layer's tag can be it
RATIO_GUIDE = -3.0
LAYER_STATS = ("update_ratio", "parameters", "gradients", "updates", "activations")
_BOOKKEEPING = ("kind", "time", "epoch", "iteration", "completed")  # not charted


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def update_scalars(record: dict) -> list[tuple[str, float]]:
    """The scalars of a "stats" record, charted against ``record["iteration"]``."""
    named = [("train/score", record.get("score")), ("train/learning_rate", record.get("learning_rate")),
             ("train/samples_per_second", record.get("samples_per_second"))]
    named += [(f"memory/{what}", value) for what, value in (record.get("memory") or {}).items()]
    for layer, stats in (record.get("layers") or {}).items():
        named += [(f"{stat}/{layer}", stats.get(stat)) for stat in LAYER_STATS]
    return _known(named)


def ratio_log10_scalars(record: dict) -> list[tuple[str, float]]:
    """log10 of each layer's update:parameter ratio in a "stats" record, and the guide at -3
    when there is any (charted against ``record["iteration"]``)."""
    named = []
    for layer, stats in (record.get("layers") or {}).items():
        ratio = _number(stats.get("update_ratio"))
        if ratio is not None and not ratio <= 0:  # 0 (no update) has no logarithm; NaN stays NaN
            named.append((f"{RATIO_LOG10}/{layer}", math.log10(ratio)))
    return named + [(RATIO_GUIDE_TAG, RATIO_GUIDE)] if named else []


def histograms(record: dict) -> list[tuple[str, dict]]:
    """``(histogram/<kind>/<layer>, {"min", "max", "counts", "sum", "sum_squares"})`` for each
    histogram a "stats" record carries (none for most: ``StatsListener(histogram_every=)``)."""
    return [(f"histogram/{kind}/{layer}", histogram)
            for layer, kinds in (record.get("histograms") or {}).items() for kind, histogram in kinds.items()]


def epoch_scalars(record: dict) -> list[tuple[str, float]]:
    """The scalars of an "epoch" record, charted against ``record["epoch"]``."""
    named = []
    for key, value in record.items():
        if key in _BOOKKEEPING:
            continue
        named.append((f"validation/{key[4:]}" if key.startswith("val_") else f"epoch/{key}", value))
    return _known(named)


def evaluation_scalars(record: dict) -> list[tuple[str, float]]:
    """The test-set scores of an "evaluation" record (``test_accuracy`` -> ``test/accuracy``)."""
    return _known([(f"test/{key[5:]}", value) for key, value in record.items() if key.startswith("test_")])


def _known(named: list[tuple[str, object]]) -> list[tuple[str, float]]:
    return [(name, number) for name, value in named if (number := _number(value)) is not None]
