"""The sweep's table: ``results.csv``, ``results.md`` and the best config as ``best.yaml``.

Rows are rebuilt from the run directories' ``result.json`` (the truth about a finished
run) and the sweep's own record of each process (time, exit, error), so a resumed sweep
writes one table covering the runs of both sittings. Each file is replaced atomically:
a reader, or a sweep killed mid-write, never sees half a table.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from dl4py.config.run import RunConfig
from dl4py.errors import ConfigError
from dl4py.io import atomic_write_text
from dl4py.sweep.plan import Plan, short_keys

# The numbers of result.json a sweep can rank by, and whether higher is better. A fixed
# table rather than a --minimize flag: the direction is a fact about the metric, and a
# flag could rank accuracy upside down without anyone noticing.
METRICS = {
    "val_accuracy": True, "val_f1": True, "val_precision": True, "val_recall": True, "val_loss": False,
    "val_r_squared": True, "val_mean_squared_error": False,
    "test_accuracy": True, "test_f1": True, "test_precision": True, "test_recall": True,
    "test_r2": True, "test_mse": False, "test_mae": False, "test_rmse": False,
    "train_samples_per_second": True, "final_score": False, "wall_seconds": False,
}
# Sort order of the statuses below the ranked rows.
# "pruned": stopped early by an Optuna search's pruner (dl4py.sweep.optuna_search).
_STATUS_ORDER = {"completed": 0, "pruned": 1, "failed": 2, "interrupted": 3, "pending": 4}


def check_metric(metric: str) -> str:
    if metric not in METRICS:
        raise ConfigError("--metric", f"{metric!r} is not a result.json metric a sweep can rank by; "
                                      f"choose one of {', '.join(METRICS)}")
    return metric


def direction(metric: str) -> str:
    return "higher is better" if METRICS[metric] else "lower is better"


# A run's result.json is a few hundred bytes; one edited or written by something else is
# read no further than this, and counts as no result.
RESULT_LIMIT = 16 * 1024 * 1024


def read_result(run_dir: Path) -> dict | None:
    try:
        with open(run_dir / "result.json", "rb") as f:
            data = f.read(RESULT_LIMIT + 1)
        if len(data) > RESULT_LIMIT:
            return None
        result = json.loads(data)
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def is_completed(run_dir: Path) -> bool:
    result = read_result(run_dir)
    return result is not None and result.get("status") == "completed"


def collect_rows(plan: Plan, sweep_dir: Path, outcomes: dict, metric: str) -> list[dict]:
    """One row per experiment, best first: ranked completed runs, then the others."""
    rows = []
    for experiment in plan.experiments:
        outcome = outcomes.get(experiment.name) or {}
        result = read_result(sweep_dir / experiment.name)
        completed = result is not None and result.get("status") == "completed"
        value = result.get(metric) if completed else None
        seconds = outcome.get("seconds")  # the process's time, start-up included
        if completed and outcome.get("status") != "completed":  # no record of the process
            seconds = result.get("wall_seconds")
        rows.append({
            "experiment": experiment.name, **experiment.overrides,
            metric: value if isinstance(value, (int, float)) and math.isfinite(value) else None,
            "seconds": seconds,
            "status": "completed" if completed else outcome.get("status", "pending"),
            "error": None if completed else outcome.get("error"),
            "run_dir": experiment.name,
        })
    sign = -1 if METRICS[metric] else 1

    def order(row):
        ranked = row["status"] == "completed" and row[metric] is not None
        return (0 if ranked else 1 + _STATUS_ORDER[row["status"]], sign * row[metric] if ranked else 0,
                row["experiment"])

    return sorted(rows, key=order)


def best_row(rows: list[dict], metric: str) -> dict | None:
    top = rows[0] if rows else None
    return top if top and top["status"] == "completed" and top[metric] is not None else None


def write_results(plan: Plan, sweep_dir: Path, rows: list[dict], metric: str) -> dict | None:
    """Write the three files; returns the best row (None when nothing completed)."""
    columns = ["experiment", *plan.keys, metric, "seconds", "status", "error", "run_dir"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(sweep_dir / "results.csv", buffer.getvalue())
    best = best_row(rows, metric)
    if best is not None:
        atomic_write_text(sweep_dir / "best.yaml", best_yaml(plan, best, metric))
    atomic_write_text(sweep_dir / "results.md", _markdown(plan, sweep_dir, rows, metric, best))
    return best


def best_config(plan: Plan, row: dict) -> RunConfig:
    return RunConfig.from_dict(plan.config).with_overrides([f"{k}={row[k]}" for k in plan.keys])


def best_yaml(plan: Plan, row: dict, metric: str) -> str:
    label = ",".join(f"{k}={row[k]}" for k in plan.keys)
    return (f"# Best of the sweep by {metric} ({direction(metric)}): {row['experiment']}, "
            f"{metric} {format_value(row[metric])}\n# with {label}. Train it: dl4py train best.yaml\n"
            + best_config(plan, row).to_yaml())


def _markdown(plan: Plan, sweep_dir: Path, rows: list[dict], metric: str, best: dict | None) -> str:
    short = short_keys(plan.keys)
    counts = {s: sum(r["status"] == s for r in rows) for s in _STATUS_ORDER}
    lines = [
        f"# Sweep {sweep_dir.name}", "",
        f"{len(rows)} experiments: {counts['completed']} completed, {counts['failed']} failed"
        + (f", {counts['pruned']} pruned" if counts["pruned"] else "")
        + (f", {counts['interrupted'] + counts['pending']} not finished" if counts["interrupted"] + counts["pending"]
           else "") + f". Sorted by `{metric}` ({direction(metric)}).",
        "",
    ]
    if best is not None:
        lines += [(f"Best: `{best['experiment']}` ({metric} {format_value(best[metric])}), saved as "
                   "`best.yaml` (`dl4py train best.yaml`)."), ""]
    header = ["experiment", *(short[k] for k in plan.keys), metric, "seconds", "status", "error"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["experiment"], *(row[k] for k in plan.keys), format_value(row[metric]),
                 format_value(row["seconds"], 1), row["status"], row["error"] or ""]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def format_value(value, decimals: int = 4) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{decimals}f}" if abs(value) < 1e6 else f"{value:.4g}"
    return str(value)
