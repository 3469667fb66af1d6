"""An Optuna study behind ``dl4py sweep --sampler tpe``: the sweep's process queue drives
Optuna's ask-and-tell interface, so slots, logs, interrupt and resume stay the sweep's.

- a slot is free: ``next_job`` asks the study for a trial, turns its parameters into
  ``--set`` overrides and adds the experiment to ``sweep.json``;
- after each poll: ``watch`` reads the new "epoch" records of each running experiment's
  ``metrics.jsonl``, reports the sweep's metric (``trial.report(value, epoch)``) and, when
  the pruner says so, stops the process as Ctrl-C would (``dl4py train`` keeps its
  checkpoint and writes result.json);
- a process ends: ``ended`` tells the study COMPLETE with result.json's metric, PRUNED or
  FAIL. One interrupted with the sweep stays RUNNING; ``--resume`` continues it, then asks
  new trials up to ``--trials``.

The study is ``optuna.db`` (SQLite) in the sweep folder. Optuna is optional (the
``optuna`` extra) and imported only here, when a search is asked for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from dl4py.console_logging import route_foreign_loggers
from dl4py.errors import ConfigError, MissingDependencyError
from dl4py.io import atomic_write_text
from dl4py.sweep import results as table
from dl4py.sweep.plan import Experiment, Plan, experiment_name, short_keys, value_text, yaml_float
from dl4py.sweep.processes import Job, Outcome, ProcessQueue

STUDY_FILE, STUDY_NAME = "optuna.db", "dl4py-sweep"
METRICS_FILE = "metrics.jsonl"
SAMPLERS = ("grid", "random", "tpe")  # grid and random: the plans fixed up front (dl4py.sweep.plan)
PRUNERS = ("none", "median")


def import_optuna(what: str = "--sampler tpe"):
    try:
        import optuna  # optional: the `optuna` extra
    except ImportError:
        raise MissingDependencyError(what, "optuna", "optuna") from None
    route_foreign_loggers()  # its import gave its logger a handler of its own: a command's console has one format
    return optuna


def search_settings(sampler: str | None, trials: int | None, prune: Any, random: int | None,
                    metric: str) -> dict | None:
    """The ``search`` of a new plan (None for a grid or random plan); every combination that
    cannot apply is refused here, naming the flag."""
    if sampler is None:
        sampler = "grid" if random is None else "random"
    if sampler not in SAMPLERS:
        raise ConfigError("--sampler", f"must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    if sampler != "tpe":
        if trials is not None:
            raise ConfigError("--trials", f"counts the trials of --sampler tpe; a {sampler} sweep runs "
                                          + ("every grid point" if sampler == "grid" else "--random N points"))
        if prune is not None and prune != "none":
            raise ConfigError("--prune", f"needs --sampler tpe: a {sampler} sweep's experiments are fixed "
                                         "up front and not watched while they train")
        if sampler == "random" and random is None:
            raise ConfigError("--sampler random", "needs --random N: the number of points to draw")
        if sampler == "grid" and random is not None:
            raise ConfigError("--random", "draws random points: leave --sampler out or use --sampler random")
        return None
    if random is not None:
        raise ConfigError("--random", "is the count of --sampler random; with --sampler tpe give --trials N")
    if trials is None:
        raise ConfigError("--sampler tpe", "needs --trials N: the number of experiments to run")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ConfigError("--trials", f"must be a positive number of experiments, got {trials!r}")
    optuna = import_optuna()
    return {"sampler": "tpe", "trials": trials, "prune": _pruner_name(optuna, prune, metric)}


def check_search_space(grid: Mapping[str, list], ranges: Mapping[str, Any]) -> None:
    both = set(grid) & set(ranges)
    if both:
        raise ConfigError(f"--range {min(both)}", "is also given by --grid; give a key one or the other")
    if not grid and not ranges:
        raise ConfigError("--sampler tpe", "needs a search space: --range key=low:high[:log] or --grid key=v1,v2,...")


def _pruner_name(optuna, prune: Any, metric: str) -> str:
    if prune is None or prune == "none":
        return "none"
    if isinstance(prune, optuna.pruners.BasePruner):
        name = f"{type(prune).__name__} (from Python)"
    elif prune in PRUNERS:
        name = prune
    else:
        raise ConfigError("--prune", f"must be one of {', '.join(PRUNERS)} (or an optuna pruner from Python), "
                                     f"got {prune!r}")
    if not metric.startswith("val_"):
        raise ConfigError("--prune", f"needs a score of every epoch, and the sweep ranks by {metric}, known only "
                                     "at the end; hold out validation data (data.validation: {split: 0.1}) to "
                                     "rank and prune by val_accuracy")
    return name


def resumed_plan(stored: Plan, sampler: str | None, trials: int | None, prune: Any, metric: str | None) -> Plan:
    """The stored plan of a search to continue; ``trials`` may raise (or lower) its budget,
    the other settings must be the stored ones."""
    search = stored.search
    if search is None:
        if sampler == "tpe" or trials is not None or (prune is not None and prune != "none"):
            raise ConfigError("--resume", "the sweep in the folder is a grid or random sweep, not a --sampler tpe "
                                          "search; resume it without --sampler, --trials and --prune")
        return stored
    if sampler is not None and sampler != search["sampler"]:
        raise ConfigError("--sampler", f"the sweep in the folder is a --sampler {search['sampler']} search")
    if metric is not None and metric != stored.metric:
        raise ConfigError("--metric", f"the study in the folder optimises {stored.metric}; resume it with that")
    optuna = import_optuna()
    if prune is not None and _pruner_name(optuna, prune, stored.metric) != search["prune"]:
        raise ConfigError("--prune", f"the sweep in the folder prunes with {search['prune']}")
    if trials is not None:
        search_settings("tpe", trials, None, None, stored.metric)  # the same check as a new search
        return replace(stored, search={**search, "trials": trials})
    return stored


class OptunaSearch:
    """The study of one sweep folder, asked and told by the sweep's process queue."""

    def __init__(self, plan: Plan, sweep_dir: Path, prune: Any = None, enqueue: Sequence[Mapping] = (),
                 write_plan: Callable[[Plan], None] | None = None):
        optuna = import_optuna()
        self.optuna, self.plan, self.sweep_dir = optuna, plan, sweep_dir
        self.write_plan = write_plan or (lambda p: None)
        self.distributions = _distributions(optuna, plan)
        self.study = optuna.create_study(
            study_name=STUDY_NAME, storage=f"sqlite:///{sweep_dir / STUDY_FILE}", load_if_exists=True,
            direction="maximize" if table.METRICS[plan.metric] else "minimize", pruner=_pruner(optuna, plan, prune))
        asked = self._asked()
        # A resumed search draws on from where it was, not the first sitting's points again.
        self.study.sampler = optuna.samplers.TPESampler(seed=plan.seed + asked)
        if not asked:
            for point in enqueue:
                self.study.enqueue_trial(_fixed_params(plan, point))
        self.trials: dict[str, Any] = {}  # experiment name -> its optuna Trial, while it may still run
        self.reported: dict[str, set[int]] = {}  # experiment name -> the epochs told to the study
        self.offsets: dict[str, int] = {}  # experiment name -> bytes of metrics.jsonl read
        self._reconcile()

    def is_finished(self, name: str) -> bool:
        """Whether the study holds the experiment's final state (skipped by ``--resume``)."""
        return name not in self.trials

    def next_job(self, make_job: Callable[[Experiment], Job]) -> Job | None:
        if self._asked() >= self.plan.search["trials"]:
            return None
        trial = self.study.ask(self.distributions)
        point = {key: _override(trial.params[key]) for key in self.distributions}
        label = {key: _override(trial.params[key], digits=4) for key in self.distributions}
        width = max(3, len(str(self.plan.search["trials"])))
        experiment = Experiment(experiment_name(trial.number + 1, label, short_keys(list(point)), width), point)
        trial.set_user_attr("experiment", experiment.name)
        self.plan = replace(self.plan, experiments=(*self.plan.experiments, experiment))
        self.write_plan(self.plan)
        self.trials[experiment.name], self.reported[experiment.name] = trial, set()
        return make_job(experiment)

    def _asked(self) -> int:
        """Trials begun, ended or not (``enqueue``'s waiting ones are not yet)."""
        waiting = self.optuna.trial.TrialState.WAITING
        return sum(t.state != waiting for t in self.study.get_trials(deepcopy=False))

    def started(self, name: str) -> None:
        self.offsets[name] = 0  # a continued run's metrics.jsonl is read again; its epochs were told

    def watch(self, queue: ProcessQueue) -> None:
        for name in list(queue.running):
            trial = self.trials.get(name)
            if trial is not None and name not in queue.stopping and self._report(name) and trial.should_prune():
                queue.stop(name, "pruned")

    def ended(self, name: str, outcome: Outcome) -> None:
        trial = self.trials.get(name)
        if trial is None:
            return
        self._report(name)  # the epochs written since the last poll
        if outcome.status == "interrupted":  # stays RUNNING: --resume continues it
            return
        del self.trials[name]
        state = self.optuna.trial.TrialState
        if outcome.status == "pruned":
            self.study.tell(trial, state=state.PRUNED)
            return
        value = (table.read_result(self.sweep_dir / name) or {}).get(self.plan.metric)
        if outcome.status == "completed" and _is_number(value):
            self.study.tell(trial, float(value))
        else:
            self.study.tell(trial, state=state.FAIL)

    def _report(self, name: str) -> bool:
        """Report the experiment's new epochs to its trial; whether there were any."""
        told = False
        for record in self._new_epochs(name):
            value, epoch = record.get(self.plan.metric), record.get("epoch")
            if isinstance(epoch, int) and _is_number(value) and epoch not in self.reported[name]:
                self.trials[name].report(float(value), epoch)
                self.reported[name].add(epoch)
                told = True
        return told

    def _reconcile(self) -> None:
        """Trials left RUNNING by an earlier sitting: told when their run finished meanwhile,
        failed when no experiment was ever written for them, else kept to be continued."""
        names = {e.name for e in self.plan.experiments}
        for frozen in self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.RUNNING,)):
            name = frozen.user_attrs.get("experiment")
            # Optuna's way back to a trial asked by another process: a Trial on its storage id.
            trial = self.optuna.Trial(self.study, frozen._trial_id)
            if name not in names:
                self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
                continue
            self.trials[name], self.reported[name] = trial, set(frozen.intermediate_values)
            if table.is_completed(self.sweep_dir / name):
                self.ended(name, Outcome(name, "completed", 0.0))

    def _new_epochs(self, name: str) -> list[dict]:
        """The completed-epoch records appended to the experiment's metrics.jsonl since the last read."""
        offset = self.offsets.get(name, 0)
        try:
            with open(self.sweep_dir / name / METRICS_FILE, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:  # not written yet
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offsets[name] = offset + end
        records = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("kind") == "epoch" and record.get("completed", True):
                records.append(record)
        return records


def _distributions(optuna, plan: Plan) -> dict:
    """A grid key is a categorical choice among its value texts; a range, an int or float interval."""
    distributions = {key: optuna.distributions.CategoricalDistribution(values) for key, values in plan.grid.items()}
    for key, r in plan.ranges.items():
        distributions[key] = (optuna.distributions.IntDistribution(int(r.low), int(r.high), log=r.log) if r.integer
                              else optuna.distributions.FloatDistribution(r.low, r.high, log=r.log))
    return distributions


def _pruner(optuna, plan: Plan, prune: Any):
    name = plan.search["prune"]
    if isinstance(prune, optuna.pruners.BasePruner):
        return prune
    if name == "median":
        return optuna.pruners.MedianPruner()
    if name == "none":
        return optuna.pruners.NopPruner()
    raise ConfigError("--resume", f"the sweep prunes with {name}, an optuna pruner given from Python: "
                                  "pass it again (dl4py.sweep.run(..., resume=True, prune=...))")


def check_enqueue(plan: Plan, enqueue: Sequence[Mapping]) -> None:
    """Refuse a bad ``enqueue`` before the sweep folder is claimed."""
    if enqueue and plan.search is None:
        raise ConfigError("enqueue", "names points for a sampler='tpe' search to try first")
    for point in enqueue:
        _fixed_params(plan, point)


def _fixed_params(plan: Plan, point: Mapping) -> dict:
    """An ``enqueue`` point as the study's parameters: every key one of the search's."""
    params = {}
    for key, value in point.items():
        if key in plan.grid:
            text = value_text(value)
            if text not in plan.grid[key]:
                raise ConfigError(f"enqueue {key}", f"{text} is not one of its grid values {plan.grid[key]}")
            params[key] = text
        elif key in plan.ranges and _is_number(value):
            params[key] = int(value) if plan.ranges[key].integer else float(value)
        else:
            raise ConfigError(f"enqueue {key}", "must be a --grid or --range key of the search, with a number "
                                                "for a range")
    return params


def _override(value: Any, digits: int | None = None) -> str:
    """A parameter as ``--set`` text; a float to ``digits`` significant digits (names)."""
    return yaml_float(value, digits) if isinstance(value, float) else value_text(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plan_writer(path: Path) -> Callable[[Plan], None]:
    """Rewrites ``sweep.json`` whole and atomically: a reader sees the plan before or after a trial was added."""
    return lambda plan: atomic_write_text(path, json.dumps(plan.to_dict(), indent=2) + "\n")
