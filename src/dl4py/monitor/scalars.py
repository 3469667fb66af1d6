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
"""

from __future__ import annotations

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
