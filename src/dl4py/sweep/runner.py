"""``dl4py.sweep.run``: plan a sweep, claim its folder, run the experiments, write the table.

The sweep folder holds ``sweep.json`` (the plan), ``config.yaml`` (the base config every
experiment starts from), one ordinary ``dl4py train`` run directory per experiment,
``logs/<experiment>.log``, ``outcomes.json`` (time, exit and error of each process),
``results.csv``, ``results.md`` and ``best.yaml``; a ``--sampler tpe`` search also its
Optuna study, ``optuna.db`` (``dl4py.sweep.optuna_search``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dl4py.config.run import RunConfig
from dl4py.errors import ConfigError, DL4PyError
from dl4py.eval.select import is_regression_loss
from dl4py.folders import FolderLock, claim_new_folder, path_inside
from dl4py.io import atomic_write_json, atomic_write_text
from dl4py.run_dir import CHECKPOINT, new_run_dir
from dl4py.sweep import results as table
from dl4py.sweep.optuna_search import (OptunaSearch, check_enqueue, check_search_space, plan_writer, resumed_plan,
                                       search_settings)
from dl4py.sweep.plan import Plan, check_keys, expand, normalise_grid, normalise_ranges
from dl4py.sweep.processes import Job, ProcessQueue
from dl4py.sweep.slots import make_slots, parse_devices

PLAN, OUTCOMES, BASE_CONFIG = "sweep.json", "outcomes.json", "config.yaml"


@dataclass
class SweepResult:
    sweep_dir: Path
    metric: str
    rows: list[dict]  # best first, as in results.csv
    best: dict | None  # the best completed row (None when none completed)
    ran: int = 0  # experiments this call started
    skipped: int = 0  # already completed in the folder (--resume)
    continued: int = 0  # rerun from their run's checkpoint (--resume)
    restarted: int = 0  # partial run directory removed, run again (--resume)
    counts: dict = field(default_factory=dict)  # status -> number of experiments ("pruned" too, for a search)

    @property
    def failed(self) -> list[dict]:
        return [row for row in self.rows if row["status"] == "failed"]


class SweepInterrupted(DL4PyError):
    """Ctrl-C or SIGTERM stopped the sweep; ``result`` holds the table so far."""

    def __init__(self, message: str, result: SweepResult):
        super().__init__(message)
        self.result = result


def run(
    config: RunConfig | str | Path | Mapping | None = None,
    grid: Mapping[str, Sequence[Any]] | Sequence[str] | None = None,
    *,
    ranges: Mapping[str, Any] | Sequence[str] | None = None,
    random: int | None = None,
    seed: int = 0,
    overrides: Sequence[str] = (),
    devices: str | Sequence[int] | None = "all",
    per_device: int = 1,
    metric: str | None = None,
    output: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    grace: float = 30.0,
    sampler: str | None = None,
    trials: int | None = None,
    prune: Any = None,
    enqueue: Sequence[Mapping[str, Any]] = (),
) -> SweepResult:
    """Run one ``dl4py train`` process per grid point (or per random point), ``per_device``
    at a time on each device, and rank them by ``metric``.

        dl4py.sweep.run("examples/lenet_mnist.yaml",
                        grid={"network.updater.learning_rate": [0.01, 0.03], "training.batch_size": [64, 128]},
                        devices="all", per_device=2)

    Grid values given as strings are read as YAML, like ``--set``. With ``resume=True``
    and ``output`` naming an earlier sweep, runs only the experiments without a completed
    ``result.json`` (``config`` and ``grid`` may be left out; given, they must match).

    ``sampler="tpe"`` runs ``trials`` experiments chosen by an Optuna study instead (the
    ``optuna`` extra): ``ranges`` and ``grid`` are its search space, ``prune="median"`` (or
    an optuna pruner) stops experiments whose validation score falls behind, and
    ``enqueue=[{key: value}]`` names points to try first. See docs/sweep.md.
    """
    plan = None
    if config is not None:
        plan = make_plan(config, grid, ranges, random, seed, overrides, metric, sampler, trials, prune)
        check_enqueue(plan, enqueue)
    elif not resume:
        raise ConfigError("config", "a sweep needs a run config (or --resume with --output of an earlier sweep)")
    elif grid or ranges or random is not None or overrides:
        raise ConfigError("config", "--grid, --range, --random and --set need the config they apply to")
    if metric is not None:
        table.check_metric(metric)
    slots = make_slots(parse_devices(devices), per_device)
    sweep_dir, plan, lock = _open_sweep_dir(plan, output, resume)
    with lock:
        search = None
        if resume:
            plan = resumed_plan(plan, sampler, trials, prune, metric)
        if plan.search is not None:
            write_plan = plan_writer(sweep_dir / PLAN)
            write_plan(plan)  # a new --trials budget
            search = OptunaSearch(plan, sweep_dir, prune, enqueue, write_plan)
        else:
            check_enqueue(plan, enqueue)
        metric = metric or plan.metric
        return _run(plan, sweep_dir, slots, metric, progress, grace, search)


def make_plan(config, grid, ranges, random, seed, overrides, metric=None, sampler=None, trials=None,
              prune=None) -> Plan:
    """The sweep's plan; ``metric`` None ranks on the validation score when the config holds
    validation data out (``data.validation``), else on the test set's."""
    if metric is not None:
        table.check_metric(metric)
    if isinstance(config, RunConfig):
        base, name = config, "sweep"
    elif isinstance(config, Mapping):
        base, name = RunConfig.from_dict(dict(config)), "sweep"
    else:
        base, name = RunConfig.from_file(config), Path(config).stem
    base = base.with_overrides(list(overrides))
    if metric is None:
        metric = default_metric(base)
    check_keys(base, [a.partition("=")[0].strip() for a in overrides], "--set")  # no training.backend
    if base.environment.devices is not None:
        raise ConfigError("environment.devices", "is set by the sweep for each device slot (--devices); remove it")
    grid, ranges = normalise_grid(grid), normalise_ranges(ranges)
    check_keys(base, list(grid), "--grid")
    check_keys(base, list(ranges), "--range")
    fixed = {a.partition("=")[0].strip() for a in overrides} & (set(grid) | set(ranges))
    if fixed:
        raise ConfigError(f"--set {min(fixed)}", "is also varied by the sweep; give it one or the other")
    search = search_settings(sampler, trials, prune, random, metric)
    if search is None:
        experiments = expand(grid, ranges, random, seed)
    else:  # added as the study's trials are asked
        check_search_space(grid, ranges)
        experiments = []
    # Through JSON once, so the plan compares equal to the one read back from sweep.json.
    return Plan(json.loads(json.dumps(base.to_dict())), name, tuple(experiments), grid, ranges, random, seed, metric,
                search)


def default_metric(config: RunConfig) -> str:
    """What a sweep ranks by unless told: the validation score when the config holds data
    out, else the test set's; R² for a network trained with a regression loss."""
    layers = config.network.layers
    regression = bool(layers) and is_regression_loss(getattr(layers[-1], "loss", None))
    if config.data.validation is not None:
        return "val_r_squared" if regression else "val_accuracy"
    return "test_r2" if regression else "test_accuracy"


def _open_sweep_dir(plan: Plan | None, output, resume: bool) -> tuple[Path, Plan, FolderLock]:
    """The sweep folder, its plan, and the lock this process holds on it (one sweep per folder)."""
    if resume:
        if output is None:
            raise ConfigError("--resume", "needs --output: the folder of the sweep to continue")
        sweep_dir = Path(output)
        if not (sweep_dir / PLAN).is_file():
            raise ConfigError("--resume", f"{sweep_dir} holds no {PLAN}: it is not a sweep folder")
        lock = FolderLock(sweep_dir, "sweep folder", "--resume").acquire()
        try:
            stored = _read_plan(sweep_dir)
            if plan is not None and not plan.same_experiments(stored):
                raise ConfigError("--resume", f"the config or grid differs from the sweep in {sweep_dir}; "
                                              "resume it with the same ones, or with --output only")
            if not (sweep_dir / BASE_CONFIG).exists():  # stopped between claiming the folder and writing it
                atomic_write_text(sweep_dir / BASE_CONFIG, RunConfig.from_dict(stored.config).to_yaml())
        except BaseException:
            lock.release()
            raise
        return sweep_dir, stored, lock
    sweep_dir = new_run_dir(plan.config_name, root=Path("sweeps")) if output is None else Path(output)
    lock, _ = claim_new_folder(sweep_dir, "sweep folder",
                               "choose another folder, or pass --resume to continue the sweep in it")
    try:
        _claim(sweep_dir / PLAN, json.dumps(plan.to_dict(), indent=2) + "\n")
        atomic_write_text(sweep_dir / BASE_CONFIG, RunConfig.from_dict(plan.config).to_yaml())
    except BaseException:
        lock.release()
        raise
    return sweep_dir, plan, lock


def _read_plan(sweep_dir: Path) -> Plan:
    """``sweep.json`` read back as untrusted input: every experiment name must be a plain
    folder inside the sweep, since ``--resume`` deletes and writes there."""
    path = sweep_dir / PLAN
    try:
        stored = Plan.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError("--resume", f"cannot read {path}: {exc}") from None
    seen = set()
    for experiment in stored.experiments:
        path_inside(sweep_dir, experiment.name, f"{path}: experiments")
        if experiment.name in seen:
            raise ConfigError(f"{path}: experiments", f"names {experiment.name!r} twice; the file was edited "
                                                      "or is corrupt, and nothing was touched")
        seen.add(experiment.name)
    return stored


def _claim(path: Path, text: str) -> None:
    """Create ``path`` whole, and only if it does not exist: two sweeps started on one
    folder at the same moment cannot both own it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    atomic_write_text(tmp, text)
    try:
        os.link(tmp, path)  # fails if path exists, and never shows a half-written file
    except FileExistsError:
        raise ConfigError("--output", f"another sweep already owns {path.parent}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _run(plan: Plan, sweep_dir: Path, slots, metric: str, progress: bool, grace: float,
         search: OptunaSearch | None = None) -> SweepResult:
    outcomes = _read_outcomes(sweep_dir)
    result = SweepResult(sweep_dir, metric, [], None)
    jobs, continuing = [], set()
    for experiment in plan.experiments:
        run_dir = path_inside(sweep_dir, experiment.name, f"{sweep_dir / PLAN}: experiments")
        if table.is_completed(run_dir) or (search is not None and search.is_finished(experiment.name)):
            result.skipped += 1  # a search's pruned and failed trials are final: the study knows them
            continue
        if (run_dir / CHECKPOINT).exists():  # an epoch or more is done: go on from there
            continuing.add(experiment.name)
            result.continued += 1
        elif run_dir.is_dir():  # started, nothing worth keeping
            shutil.rmtree(run_dir)
            result.restarted += 1
        outcomes.pop(experiment.name, None)
        jobs.append(_job(sweep_dir, experiment, experiment.name in continuing))
    report = _Progress(plan, sweep_dir, metric, outcomes, progress)
    report.start(result, slots)

    def on_change(event: str, name: str, outcome) -> None:
        nonlocal plan
        if event == "start":
            report.running.add(name)
            if search is not None:
                search.started(name)
        else:
            report.running.discard(name)
            if search is not None:
                search.ended(name, outcome)
            outcomes[name] = outcome.to_dict()
            atomic_write_json(sweep_dir / OUTCOMES, outcomes)
        if search is not None:
            plan = report.plan = search.plan  # trials asked meanwhile
        if event != "start":
            table.write_results(plan, sweep_dir, table.collect_rows(plan, sweep_dir, outcomes, metric), metric)
            report.finished(outcome)
        report.line()

    def ask() -> Job | None:
        job = search.next_job(lambda experiment: _job(sweep_dir, experiment, False))
        result.ran += job is not None
        return job

    result.ran = len(jobs)
    # A completed result.json is what counts: a run can finish and then be hit by Ctrl-C.
    queue = ProcessQueue(jobs, slots, on_change, grace=grace,
                         succeeded=lambda name, code: table.is_completed(sweep_dir / name),
                         more=ask if search is not None else None, watch=search.watch if search is not None else None)
    queue.run()
    result.rows = table.collect_rows(plan, sweep_dir, outcomes, metric)
    result.best = table.write_results(plan, sweep_dir, result.rows, metric)
    statuses = ("completed", "failed", "interrupted", "pending") + (("pruned",) if plan.search is not None else ())
    result.counts = {s: sum(r["status"] == s for r in result.rows) for s in statuses}
    if queue.interrupted:
        left = result.counts["interrupted"] + result.counts["pending"]
        raise SweepInterrupted(f"interrupted with {left} experiment(s) unfinished; continue with "
                               f"dl4py sweep --resume --output {sweep_dir}", result)
    return result


def _job(sweep_dir: Path, experiment, continuing: bool) -> Job:
    log = sweep_dir / "logs" / f"{experiment.name}.log"
    return Job(experiment.name, _command(sweep_dir, experiment, continuing), log)


def _command(sweep_dir: Path, experiment, continuing: bool):
    def command(slot) -> list[str]:
        argv = [sys.executable, "-m", "dl4py", "train", str(sweep_dir / BASE_CONFIG),
                "--output", str(sweep_dir / experiment.name), "--no-progress", "--backend", slot.backend]
        for key, value in experiment.overrides.items():
            argv += ["--set", f"{key}={value}"]
        return argv + (["--resume"] if continuing else [])
    return command


def _read_outcomes(sweep_dir: Path) -> dict:
    try:
        return json.loads((sweep_dir / OUTCOMES).read_text())
    except (OSError, ValueError):
        return {}


class _Progress:
    """One line on stderr per change: ``[3/4 done, 1 running, 0 failed] best test_accuracy 0.9712 (...)``."""

    def __init__(self, plan: Plan, sweep_dir: Path, metric: str, outcomes: dict, enabled: bool):
        self.plan, self.sweep_dir, self.metric, self.outcomes, self.enabled = plan, sweep_dir, metric, outcomes, enabled
        self.running: set[str] = set()

    def start(self, result: SweepResult, slots) -> None:
        threads = slots[0].threads
        resumed = [f"{n} {what}" for n, what in ((result.skipped, "already completed"),
                   (result.continued, "to continue from a checkpoint"), (result.restarted, "to start over")) if n]
        size = (f"a {self.plan.search['sampler'].upper()} search of {self.plan.search['trials']} trials"
                if self.plan.search is not None else f"{len(self.plan.experiments)} experiments")
        self._print(f"sweep {self.sweep_dir}: {size}"
                    + (f" ({', '.join(resumed)})" if resumed else "")
                    + f" on {len(slots)} slot{'s' * (len(slots) > 1)} ({', '.join(s.name for s in slots)}; "
                    f"{threads} CPU thread{'s' * (threads > 1)} each)")
        if result.skipped:
            self.line()

    def finished(self, outcome) -> None:
        if outcome.status == "pruned":
            self._print(f"{outcome.name} pruned: its {self.metric} fell behind the other trials'")
        elif outcome.status != "completed":
            self._print(f"{outcome.name} {outcome.status}: {outcome.error}")

    def line(self) -> None:
        if not self.enabled:
            return
        rows = table.collect_rows(self.plan, self.sweep_dir, self.outcomes, self.metric)
        # result.json appears a moment before its process ends; done means the process ended
        done = sum(r["status"] in ("completed", "failed") and r["experiment"] not in self.running for r in rows)
        failed = sum(r["status"] == "failed" for r in rows)
        best = table.best_row(rows, self.metric)
        total = max(len(rows), self.plan.search["trials"]) if self.plan.search is not None else len(rows)
        pruned = sum(r["status"] == "pruned" for r in rows)
        done += pruned
        text = (f"[{done}/{total} done, {len(self.running)} running, {failed} failed"
                + (f", {pruned} pruned]" if self.plan.search is not None else "]"))
        if best is not None:
            label = next(e.label() for e in self.plan.experiments if e.name == best["experiment"])
            text += f" best {self.metric} {table.format_value(best[self.metric])} ({label})"
        self._print(text)

    def _print(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr, flush=True)
