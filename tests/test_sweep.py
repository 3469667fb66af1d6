"""dl4py sweep: grid and random plans, device slots, failures, interrupt and resume.

Each experiment is a real `dl4py train` process on a slice of MNIST with a tiny MLP, so
every process start costs seconds; the tests share one 2x2 sweep where they can.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dl4py import RunConfig
from dl4py.cli import main
from dl4py.errors import ConfigError
from dl4py.folders import FolderLock
from dl4py.sweep import expand, make_slots, parse_range, run
from dl4py.sweep.plan import Plan, normalise_grid
from dl4py.sweep.processes import Job, ProcessQueue
from dl4py.sweep import results
from dl4py.sweep.results import collect_rows, read_result
from dl4py.sweep.runner import _claim
from dl4py.parallel.threads import usable_cores

MLP = """\
network:
  seed: 7
  updater: {type: sgd, learning_rate: 0.1}
  input_type: {type: convolutional_flat, height: 28, width: 28, channels: 1}
  layers:
    - {type: dense, n_out: 16, activation: relu}
    - {type: output, n_out: 10, activation: softmax, loss: negativeloglikelihood}
data: {limit_train: 512, limit_test: 256}
training: {epochs: 1, batch_size: 64, score_every: 0}
"""
GRID = ["--grid", "network.updater.learning_rate=0.02,0.2", "--grid", "training.batch_size=32,128"]


def write_config(folder: Path) -> Path:
    path = folder / "mlp.yaml"
    path.write_text(MLP)
    return path


def run_cli(*args) -> int:
    return main([str(a) for a in args])


def ctrl_c_when(argv: list[str], ready, wait: float) -> tuple[int, str]:
    """Run ``argv`` (a sweep) in a session of its own and Ctrl-C it once ``ready()`` holds (or it
    ended, or ``wait`` seconds passed); its exit code and stderr. Killed in any case."""
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + wait
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, err


def read_rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory):
    """One 2x2 sweep (learning rate x batch size) on two CPU slots, shared by several tests."""
    from conftest import require_mnist

    require_mnist()
    folder = tmp_path_factory.mktemp("grid")
    config = write_config(folder)
    out = folder / "sweep"
    code = run_cli("sweep", config, *GRID, "--devices", "cpu", "--per-device", 2, "--output", out)
    return config, out, code


# -- plans ---------------------------------------------------------------------------


def test_grid_expands_to_every_combination_with_readable_names():
    grid = normalise_grid(["network.updater.learning_rate=0.1,0.05", "training.batch_size=32,64",
                           "network.layers[0].kernel_size=[3, 3],[5, 5]"])
    assert grid["network.layers[0].kernel_size"] == ["[3, 3]", "[5, 5]"]  # commas in brackets stay
    layers = normalise_grid(["network.layers[0]={type: convolution, n_out: 20, kernel_size: [5, 5]},"
                             "{type: convolution, n_out: 8, kernel_size: [3, 3]}"])["network.layers[0]"]
    assert [yaml.safe_load(v)["kernel_size"] for v in layers] == [[5, 5], [3, 3]]  # nested brackets too
    experiments = expand(grid, {})
    assert len(experiments) == 8 and len({e.name for e in experiments}) == 8
    assert experiments[0].name == "001-learning_rate=0.1,batch_size=32,kernel_size=3_3"
    assert experiments[0].overrides == {"network.updater.learning_rate": "0.1", "training.batch_size": "32",
                                        "network.layers[0].kernel_size": "[3, 3]"}
    assert experiments[-1].label() == "learning_rate=0.05,batch_size=64,kernel_size=[5, 5]"
    # From Python: values become --set text that YAML reads back as the same value.
    python = normalise_grid({"network.updater.learning_rate": [1e-5, 0.5], "data.shuffle": [True, False]})
    assert python == {"network.updater.learning_rate": ["1.0e-05", "0.5"], "data.shuffle": ["true", "false"]}
    assert yaml.safe_load(python["network.updater.learning_rate"][0]) == 1e-5


def test_random_points_are_reproducible_by_seed_and_log_ranges_spread_over_decades():
    ranges = {"network.updater.learning_rate": parse_range("network.updater.learning_rate=1e-4:1e-1:log")[1],
              "training.batch_size": parse_range("training.batch_size=16:256")[1]}
    grid = {"data.shuffle": ["true", "false"]}
    first = expand(grid, ranges, random=60, seed=3)
    assert first == expand(grid, ranges, random=60, seed=3)
    assert first != expand(grid, ranges, random=60, seed=4)
    rates = [yaml.safe_load(e.overrides["network.updater.learning_rate"]) for e in first]
    assert all(isinstance(r, float) and 1e-4 <= r <= 1e-1 for r in rates)
    # Log-uniform: about half the points lie below the geometric middle (uniform: 3%).
    below = sum(r < math.sqrt(1e-4 * 1e-1) for r in rates)
    assert 15 <= below <= 45
    sizes = [yaml.safe_load(e.overrides["training.batch_size"]) for e in first]
    assert all(isinstance(s, int) and 16 <= s <= 256 for s in sizes)
    assert {e.overrides["data.shuffle"] for e in first} == {"true", "false"}


@pytest.mark.parametrize("args, message", [
    (["--grid", "training.batch_size"], "--grid training.batch_size: must look like key=v1,v2"),
    (["--grid", "training.batch_size=32,,64"], "--grid training.batch_size=32,,64: has an empty value"),
    (["--grid", "training.batch_sise=32,64"], "--grid training.batch_sise: unknown key 'batch_sise' in training"),
    (["--grid", "training.backend=cpu,gpu"], "--grid training.backend: is set by the sweep"),
    (["--random", "4", "--range", "network.updater.learning_rate=0.1:0.01"],
     "--range network.updater.learning_rate=0.1:0.01: low must be below high"),
    (["--random", "4", "--range", "network.updater.learning_rate=0:0.1:log"], "a log range needs a positive low"),
    (["--random", "4", "--range", "network.updater.learning_rate=0.1:1:ln"], "must look like key=low:high"),
    (["--range", "network.updater.learning_rate=0.01:0.1"], "needs --random N"),
    (["--grid", "training.epochs=1,2", "--metric", "accuracy"], "--metric: 'accuracy' is not a result.json metric"),
    (["--grid", "training.epochs=1,2", "--devices", "0,x"], "--devices: must be all, cpu, or GPU indices"),
])
def test_bad_sweep_arguments_are_refused_up_front_naming_the_argument(tmp_path, capsys, args, message):
    out = tmp_path / "sweep"
    assert run_cli("sweep", write_config(tmp_path), *args, "--output", out) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before anything was created or run


def test_slots_divide_the_cores_and_hide_gpus_from_cpu_slots():
    slots = make_slots(None, 3, cpus=8)
    assert [s.name for s in slots] == ["cpu#0", "cpu#1", "cpu#2"] and {s.threads for s in slots} == {2}
    env = slots[0].environ({"DL4PY_DEVICES": "1", "PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "2" and "DL4PY_DEVICES" not in env
    # GPU slots interleave devices and name the physical device the sweep sees as index i.
    gpus = make_slots([0, 1], 2, cpus=16, environ={"CUDA_VISIBLE_DEVICES": "4,6"})
    assert [(s.name, s.visible, s.threads) for s in gpus] == [
        ("gpu0#0", "4", 4), ("gpu1#0", "6", 4), ("gpu0#1", "4", 4), ("gpu1#1", "6", 4)]
    # K experiments on one GPU: each capped at 1/K of it, unless the caller set a cap.
    assert gpus[0].environ({})["DL4PY_MAX_DEVICE_CACHE"] == "0.5000"
    assert gpus[0].environ({"DL4PY_MAX_DEVICE_CACHE": "2GB"})["DL4PY_MAX_DEVICE_CACHE"] == "2GB"
    assert "DL4PY_MAX_DEVICE_CACHE" not in make_slots([0], 1, cpus=4)[0].environ({})
    assert "DL4PY_MAX_DEVICE_CACHE" not in env  # CPU slots: no device memory to share
    with pytest.raises(ConfigError, match="--per-device"):
        make_slots(None, 0)


# -- processes -----------------------------------------------------------------------


def test_a_crashing_process_is_recorded_with_its_signal_or_error_and_the_others_go_on(tmp_path):
    scripts = {
        "killed": "print('half way', flush=True); import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        "error": "import sys; print('dl4py train: error: training.epochs: must be positive', file=sys.stderr); "
                 "sys.exit(2)",
        "fine": "import os; print(os.environ['OMP_NUM_THREADS'], repr(os.environ['CUDA_VISIBLE_DEVICES']))",
    }
    jobs = [Job(name, lambda slot, code=code: [sys.executable, "-c", code], tmp_path / f"{name}.log")
            for name, code in scripts.items()]
    events, outcomes = [], {}

    def on_change(event, name, outcome):
        events.append((event, name))
        if outcome is not None:
            outcomes[name] = outcome

    queue = ProcessQueue(jobs, make_slots(None, 2, cpus=4), on_change, poll=0.02)
    queue.run()
    assert not queue.interrupted and len(events) == 6
    assert outcomes["killed"].status == "failed" and outcomes["killed"].returncode == -signal.SIGKILL
    assert outcomes["killed"].error == "killed by SIGKILL: half way"
    assert outcomes["error"].status == "failed" and outcomes["error"].error == "training.epochs: must be positive"
    assert outcomes["fine"].status == "completed" and outcomes["fine"].error is None
    assert (tmp_path / "fine.log").read_text().split() == ["2", "''"]  # 4 cores / 2 slots; no GPU


# -- whole sweeps --------------------------------------------------------------------


@pytest.mark.slow
def test_a_2x2_grid_on_two_cpu_slots_ranks_four_runs_and_saves_the_best_config(grid_sweep):
    config, out, code = grid_sweep
    assert code == 0
    plan = json.loads((out / "sweep.json").read_text())
    names = [e["name"] for e in plan["experiments"]]
    assert len(names) == 4
    for name in names:
        result = json.loads((out / name / "result.json").read_text())
        assert result["status"] == "completed" and result["backend"] == "cpu"
        # two slots share the cores: each run had its share of threads, not all of them
        env = json.loads((out / name / "environment.json").read_text())
        assert env["cpu_threads"] == max(1, usable_cores() // 2)
    outcomes = json.loads((out / "outcomes.json").read_text())
    assert {o["slot"] for o in outcomes.values()} == {"cpu#0", "cpu#1"}

    rows = read_rows(out)
    assert len(rows) == 4 and {r["experiment"] for r in rows} == set(names)
    accuracies = [float(r["test_accuracy"]) for r in rows]
    assert accuracies == sorted(accuracies, reverse=True) and len(set(accuracies)) > 1
    for row in rows:  # each row is its run: the metric is the run's result.json
        result = json.loads((out / row["run_dir"] / "result.json").read_text())
        assert float(row["test_accuracy"]) == result["test_accuracy"]
        assert int(row["training.batch_size"]) == result["batch_size"]
        assert row["status"] == "completed" and float(row["seconds"]) > 0
    table = (out / "results.md").read_text()
    assert table.count("| completed |") == 4 and f"Best: `{rows[0]['experiment']}`" in table

    best = rows[0]
    saved = RunConfig.from_file(out / "best.yaml")
    expected = RunConfig.from_file(config).with_overrides(
        [f"{k}={best[k]}" for k in ("network.updater.learning_rate", "training.batch_size")])
    assert saved == expected
    assert saved != RunConfig.from_file(config)

    # Ranking by a lower-is-better metric puts the fastest first.
    by_time = collect_rows(Plan.from_dict(plan), out, outcomes, "wall_seconds")
    times = [r["wall_seconds"] for r in by_time]
    assert times == sorted(times)


@pytest.mark.slow
def test_an_invalid_grid_value_fails_its_experiments_with_the_message_and_the_others_finish(tmp_path, mnist,
                                                                                             capsys):
    out = tmp_path / "sweep"
    code = run_cli("sweep", write_config(tmp_path), "--grid", "training.batch_size=64,0", "--devices", "cpu",
                   "--per-device", 2, "--output", out)
    assert code == 1  # the sweep ran; not every experiment did
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["completed"] == 1 and summary["failed"] == 1
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["completed", "failed"]
    assert rows[0]["training.batch_size"] == "64" and (out / rows[0]["run_dir"] / "result.json").is_file()
    assert rows[1]["training.batch_size"] == "0" and not (out / rows[1]["run_dir"] / "result.json").exists()
    assert rows[1]["error"] == "training.batch_size: must be positive, got 0 (after --set overrides)"
    assert "| failed | training.batch_size: must be positive, got 0" in (out / "results.md").read_text()


@pytest.mark.soak  # make test's budget (DEVELOPERS.md): an Optuna sweep's resume stays there
def test_an_interrupted_sweep_resumes_only_what_was_missing(tmp_path, mnist):
    config, out = write_config(tmp_path), tmp_path / "sweep"
    # One slot; the second experiment trains long enough (~2 s) to be stopped in the middle.
    argv = [sys.executable, "-m", "dl4py", "sweep", str(config), "--grid", "training.epochs=1,60,2",
            "--devices", "cpu", "--output", str(out)]
    second = out / "002-epochs=60"
    returncode, err = ctrl_c_when(argv, (second / "metrics.jsonl").is_file, 60)
    assert returncode == 130, err
    assert f"continue with dl4py sweep --resume --output {out}" in err
    assert json.loads((out / "001-epochs=1" / "result.json").read_text())["status"] == "completed"
    assert json.loads((second / "result.json").read_text())["status"] == "interrupted"
    assert (second / "checkpoint.dl4py").is_file() and not (out / "003-epochs=2").exists()
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["completed", "interrupted", "pending"]

    result = run(resume=True, output=out, devices="cpu", per_device=2, progress=False)
    assert (result.skipped, result.ran, result.continued, result.restarted) == (1, 2, 1, 0)
    assert result.counts == {"completed": 3, "failed": 0, "interrupted": 0, "pending": 0}
    resumed = json.loads((second / "result.json").read_text())
    assert resumed["status"] == "completed" and resumed["epochs"] == 60


@pytest.mark.slow
def test_resume_skips_finished_runs_and_reruns_partial_ones(grid_sweep, tmp_path):
    config, finished, _ = grid_sweep
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    names = [e["name"] for e in json.loads((out / "sweep.json").read_text())["experiments"]]
    (out / names[0] / "result.json").unlink()  # killed after its last checkpoint: continued
    for path in (out / names[1]).iterdir():  # killed before its first checkpoint: started over
        if path.name != "config.yaml":
            path.unlink()
    with pytest.raises(ConfigError, match="differs from the sweep"):
        run(config, grid={"training.batch_size": [32, 64]}, resume=True, output=out, progress=False)

    result = run(config, grid=GRID[1::2], resume=True, output=out, devices="cpu", per_device=2, progress=False)
    assert (result.skipped, result.ran, result.continued, result.restarted) == (2, 2, 1, 1)
    assert result.counts["completed"] == 4 and len(result.rows) == 4
    assert all((out / name / "result.json").is_file() for name in names)
    again = run(resume=True, output=out, progress=False)
    assert (again.skipped, again.ran) == (4, 0)


def test_two_sweeps_never_share_a_folder(grid_sweep, tmp_path, capsys):
    config, out, _ = grid_sweep
    assert run_cli("sweep", config, *GRID, "--output", out) == 2
    assert "already holds files" in capsys.readouterr().err
    # A sweep is running there: a --resume beside it is refused.
    with FolderLock(out, "sweep folder"), pytest.raises(ConfigError, match=rf"in use by process {os.getpid()}"):
        run(resume=True, output=out, progress=False)
    claimed = tmp_path / "sweep.json"
    _claim(claimed, "{}")  # two sweeps started on one empty folder: the second claim fails
    with pytest.raises(ConfigError, match="another sweep already owns"):
        _claim(claimed, "{}")
    assert claimed.read_text() == "{}" and list(tmp_path.iterdir()) == [claimed]


def test_a_result_json_over_its_limit_or_not_an_object_counts_as_no_result(tmp_path, monkeypatch):
    """The sweep table reads each experiment's result.json no further than its limit: one edited
    into something huge, or into JSON that is not an object, is no result, not a crash."""
    run_dir = tmp_path / "lr=0.1"
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps({"status": "completed", "accuracy": 0.5}))
    assert read_result(run_dir) == {"status": "completed", "accuracy": 0.5}
    monkeypatch.setattr(results, "RESULT_LIMIT", 16)
    (run_dir / "result.json").write_text('{"a": 1}' + " " * 64)  # its first 17 bytes are JSON too
    assert read_result(run_dir) is None
    monkeypatch.undo()
    (run_dir / "result.json").write_text("[1, 2]")
    assert read_result(run_dir) is None
