"""dl4py sweep --sampler tpe: an Optuna study asked and told by the sweep's process queue.

Real optuna (a SQLite study in the sweep folder) and real `dl4py train` processes on a tiny
CSV problem (4 features, 2 classes, a logistic regression with data held out for
validation), so each experiment costs only its process start.
"""

from __future__ import annotations

import csv
import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from dl4py.cli import main
from dl4py.errors import ConfigError
from dl4py.sweep import run
from dl4py.sweep.processes import Job, ProcessQueue
from dl4py.sweep.slots import make_slots
from test_sweep import ctrl_c_when

optuna = pytest.importorskip("optuna")

LEARNING_RATE = "network.updater.learning_rate"
CONFIG = """\
network:
  seed: 1
  updater: {{type: sgd, learning_rate: 0.1}}
  input_type: {{type: feed_forward, size: 4}}
  layers:
    - {{type: output, n_out: 2, activation: softmax, loss: mcxent}}
data:
  dataset: csv
  train_path: {train}
  test_path: {test}
  num_classes: 2
  validation: {{split: 0.25}}
training: {{epochs: {epochs}, batch_size: 16, score_every: 0}}
"""


def write_config(folder: Path, epochs: int = 2) -> Path:
    """Two classes split by x0 + x1 > 0: a learning rate of 0.5 finds it in one epoch, 1e-9 never."""
    rng = random.Random(0)
    rows = []
    for _ in range(200):
        x = [rng.gauss(0, 1) for _ in range(4)]
        rows.append(",".join(f"{v:.4f}" for v in x) + f",{int(x[0] + x[1] > 0)}\n")
    (folder / "train.csv").write_text("".join(rows[:160]))
    (folder / "test.csv").write_text("".join(rows[160:]))
    path = folder / "run.yaml"
    path.write_text(CONFIG.format(train=folder / "train.csv", test=folder / "test.csv", epochs=epochs))
    return path


def load_study(sweep_dir: Path):
    return optuna.load_study(study_name="dl4py-sweep", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")


def epoch_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "epoch"]


def read_rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def tpe_sweep(tmp_path_factory):
    """Three TPE trials on two CPU slots, through the command line."""
    folder = tmp_path_factory.mktemp("tpe")
    out = folder / "sweep"
    code = main(["sweep", str(write_config(folder)), "--range", f"{LEARNING_RATE}=1e-3:1:log", "--sampler", "tpe",
                 "--trials", "3", "--seed", "5", "--devices", "cpu", "--per-device", "2", "--output", str(out)])
    return out, code


# -- errors up front -----------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--grid", f"{LEARNING_RATE}=0.1,0.2", "--trials", "3"], "--trials: counts the trials of --sampler tpe"),
    (["--random", "2", "--range", f"{LEARNING_RATE}=0.1:1", "--trials", "3"], "--trials: counts the trials"),
    (["--grid", f"{LEARNING_RATE}=0.1,0.2", "--prune", "median"], "--prune: needs --sampler tpe"),
    (["--sampler", "grid", "--grid", f"{LEARNING_RATE}=0.1,0.2", "--prune", "median"], "--prune: needs --sampler tpe"),
    (["--sampler", "tpe", "--range", f"{LEARNING_RATE}=0.1:1"], "--sampler tpe: needs --trials N"),
    (["--sampler", "tpe", "--trials", "0", "--range", f"{LEARNING_RATE}=0.1:1"], "--trials: must be a positive"),
    (["--sampler", "tpe", "--trials", "2"], "--sampler tpe: needs a search space"),
    (["--sampler", "tpe", "--trials", "2", "--random", "2", "--range", f"{LEARNING_RATE}=0.1:1"],
     "--random: is the count of --sampler random"),
    (["--sampler", "random", "--range", f"{LEARNING_RATE}=0.1:1"], "--sampler random: needs --random N"),
    (["--sampler", "tpe", "--trials", "2", "--range", f"{LEARNING_RATE}=0.1:1", "--prune", "median",
      "--metric", "test_accuracy"], "--prune: needs a score of every epoch"),
])
def test_combinations_that_cannot_apply_are_one_line_errors(tmp_path, capsys, args, message):
    out = tmp_path / "sweep"
    assert main(["sweep", str(write_config(tmp_path)), *args, "--devices", "cpu", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was created or run


def test_tpe_without_optuna_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError
    out = tmp_path / "sweep"
    assert main(["sweep", str(write_config(tmp_path)), "--sampler", "tpe", "--trials", "2", "--range",
                 f"{LEARNING_RATE}=0.1:1", "--devices", "cpu", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dl4py sweep: error: --sampler tpe needs the 'optuna' package: pip install \"dl4py[optuna]\""]
    assert not out.exists()


# -- the queue a search drives -------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_queue_asks_for_jobs_while_slots_free_and_stops_one_as_ctrl_c_would(tmp_path):
    """``more`` is asked until its first None; ``stop`` sends SIGINT to one job, which ends with
    the status asked for, while the others finish on their own."""
    waits = ("import signal, sys, time\n"
             "signal.signal(signal.SIGINT, lambda *a: sys.exit(130))\n"
             "print('started', flush=True)\n"
             "time.sleep(30)\n")
    fine = "print('done')"
    made = iter([("slow", waits), ("quick", fine), ("third", fine)])
    asked = []

    def more():
        asked.append(len(asked))
        name, code = next(made, (None, None))
        if name is None:
            return None
        return Job(name, lambda slot, code=code: [sys.executable, "-c", code], tmp_path / f"{name}.log")

    outcomes = {}

    def on_change(event, name, outcome):
        if outcome is not None:
            outcomes[name] = outcome

    def watch(queue):
        if "slow" in queue.running and "started" in (tmp_path / "slow.log").read_text():
            queue.stop("slow", "pruned")

    queue = ProcessQueue([], make_slots(None, 2, cpus=2), on_change, poll=0.02, more=more, watch=watch)
    queue.run()
    assert not queue.interrupted and queue.more is None and len(asked) == 4  # three jobs, then None
    assert outcomes["slow"].status == "pruned" and outcomes["slow"].returncode == 130
    assert outcomes["slow"].error is None
    assert outcomes["quick"].status == outcomes["third"].status == "completed"


# -- whole searches ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tpe_runs_n_trials_and_the_study_holds_the_result_json_values(tpe_sweep, tmp_path, capsys):
    out, code = tpe_sweep
    assert code == 0
    plan = json.loads((out / "sweep.json").read_text())
    assert plan["search"] == {"sampler": "tpe", "trials": 3, "prune": "none"}
    names = [e["name"] for e in plan["experiments"]]
    assert len(names) == 3 and names[0].startswith("001-learning_rate=")
    trials = load_study(out).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    for trial in trials:
        name = trial.user_attrs["experiment"]
        assert name == names[trial.number]
        result = json.loads((out / name / "result.json").read_text())
        assert result["status"] == "completed" and trial.value == result["val_accuracy"]
        rate = trial.params[LEARNING_RATE]
        assert 1e-3 <= rate <= 1
        resolved = yaml.safe_load((out / name / "config.yaml").read_text())
        assert resolved["network"]["updater"]["learning_rate"] == rate  # it trained with the trial's point
        # Each epoch's validation score was reported to the study as it came.
        assert trial.intermediate_values == {r["epoch"]: r["val_accuracy"] for r in epoch_records(out / name)}
    rows = read_rows(out)
    assert len(rows) == 3 and {r["experiment"] for r in rows} == set(names)
    assert [float(r["val_accuracy"]) for r in rows] == sorted((t.value for t in trials), reverse=True)
    # The sweep folder is still one `dl4py report` reads.
    report = tmp_path / "report.html"
    assert main(["report", str(out), "--output", str(report)]) == 0
    assert all(name in report.read_text() for name in names)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_continues_the_study_with_a_larger_budget(tpe_sweep, tmp_path):
    finished, _ = tpe_sweep
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    before = [(t.number, t.params, t.value) for t in load_study(out).trials]

    result = run(resume=True, output=out, trials=4, devices="cpu", progress=False)
    assert (result.skipped, result.ran) == (3, 1) and result.counts["completed"] == 4
    trials = load_study(out).trials
    assert [(t.number, t.params, t.value) for t in trials[:3]] == before  # the same study, not a new one
    assert len(trials) == 4 and trials[3].state == optuna.trial.TrialState.COMPLETE
    assert trials[3].params not in [t.params for t in trials[:3]]  # the sampler went on, not from its start
    plan = json.loads((out / "sweep.json").read_text())
    assert plan["search"]["trials"] == 4 and plan["experiments"][3]["name"].startswith("004-")
    assert len(read_rows(out)) == 4

    again = run(resume=True, output=out, progress=False)
    assert (again.skipped, again.ran) == (4, 0) and len(load_study(out).trials) == 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_median_pruner_stops_an_experiment_that_falls_behind(tmp_path):
    """Trial 0 (learning rate 0.5) completes; trial 1 (1e-9) scores worse after its first epoch,
    is stopped with SIGINT, keeps its checkpoint and is PRUNED in the study."""
    epochs = 200  # far more than the pruned run gets through before the signal lands (20 raced it)
    out = tmp_path / "sweep"
    result = run(write_config(tmp_path, epochs), ranges={LEARNING_RATE: (1e-9, 1.0, "log")}, sampler="tpe",
                 trials=2, prune=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0),
                 enqueue=[{LEARNING_RATE: 0.5}, {LEARNING_RATE: 1e-9}], devices="cpu", progress=False, output=out)
    assert result.counts == {"completed": 1, "pruned": 1, "failed": 0, "interrupted": 0, "pending": 0}
    good, bad = load_study(out).trials
    assert good.state == optuna.trial.TrialState.COMPLETE and good.params == {LEARNING_RATE: 0.5}
    assert bad.state == optuna.trial.TrialState.PRUNED and bad.params == {LEARNING_RATE: 1e-9}
    assert bad.intermediate_values[0] < good.intermediate_values[0]
    assert len(good.intermediate_values) == epochs and len(bad.intermediate_values) < epochs

    bad_dir = out / bad.user_attrs["experiment"]
    assert len(epoch_records(out / good.user_attrs["experiment"])) == epochs
    assert len(epoch_records(bad_dir)) < epochs  # stopped early, as Ctrl-C stops a run
    assert json.loads((bad_dir / "result.json").read_text())["status"] == "interrupted"
    assert (bad_dir / "checkpoint.dl4py").is_file()
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["completed", "pruned"] and rows[1]["error"] == ""
    assert "1 completed, 0 failed, 1 pruned" in (out / "results.md").read_text()
    # A resumed search leaves a pruned trial pruned: its experiment is not run again.
    again = run(resume=True, output=out, prune=optuna.pruners.MedianPruner(n_startup_trials=1), progress=False)
    assert (again.skipped, again.ran) == (2, 0)


@pytest.mark.soak  # make test's budget: the resume of a study with more trials stays there
@pytest.mark.timeout(400)
def test_a_trial_interrupted_with_the_sweep_is_continued_by_resume(tmp_path):
    """Ctrl-C leaves the trial RUNNING with the epochs it reported; --resume continues its
    experiment from the checkpoint and the same trial completes with every epoch reported once."""
    epochs = 30
    out = tmp_path / "sweep"
    argv = [sys.executable, "-m", "dl4py", "sweep", str(write_config(tmp_path, epochs)), "--sampler", "tpe",
            "--trials", "1", "--range", f"{LEARNING_RATE}=0.1:0.5", "--devices", "cpu", "--output", str(out)]
    returncode, err = ctrl_c_when(argv, lambda: reported(out), 120)
    assert returncode == 130, err
    (trial,) = load_study(out).trials
    assert trial.state == optuna.trial.TrialState.RUNNING and 0 < len(trial.intermediate_values) < epochs
    run_dir = out / trial.user_attrs["experiment"]
    assert (run_dir / "checkpoint.dl4py").is_file()

    result = run(resume=True, output=out, devices="cpu", progress=False)
    assert (result.skipped, result.ran, result.continued) == (0, 1, 1)
    (done,) = load_study(out).trials
    assert done.number == trial.number and done.state == optuna.trial.TrialState.COMPLETE
    final = json.loads((run_dir / "result.json").read_text())
    assert final["epochs"] == epochs and done.value == final["val_accuracy"]
    assert sorted(done.intermediate_values) == list(range(epochs))
    assert {e: done.intermediate_values[e] for e in trial.intermediate_values} == trial.intermediate_values


def reported(sweep_dir: Path) -> bool:
    """Whether the study in ``sweep_dir`` holds an epoch reported by a running trial."""
    if not (sweep_dir / "optuna.db").is_file():
        return False
    try:
        return any(t.intermediate_values for t in load_study(sweep_dir).trials)
    except Exception:  # the study's tables are still being created
        return False


def test_enqueue_points_outside_the_search_are_refused_before_the_folder_is_made(tmp_path):
    config, out = write_config(tmp_path), tmp_path / "sweep"
    search = dict(ranges={LEARNING_RATE: (1e-3, 1.0, "log")}, sampler="tpe", trials=2, output=out, progress=False)
    with pytest.raises(ConfigError, match="enqueue training.batch_size: must be a --grid or --range key"):
        run(config, enqueue=[{"training.batch_size": 32}], **search)
    with pytest.raises(ConfigError, match="enqueue: names points for a sampler='tpe' search"):
        run(config, grid={LEARNING_RATE: [0.1, 0.2]}, enqueue=[{LEARNING_RATE: 0.1}], output=out, progress=False)
    assert not out.exists()
