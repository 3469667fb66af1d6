"""Run directories and sweep folders under faults: one writer, resume only the same run,
untrusted state files, the operating system saying no, and failed runs that say why.

Every failing command here is a real ``dl4py`` process; its stderr must be one sentence,
never a Python traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from dl4py import load
from dl4py.sweep.plan import Plan

from conftest import require_mnist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MLP = {
    "network": {
        "seed": 7,
        "updater": {"type": "sgd", "learning_rate": 0.1},
        "input_type": {"type": "feed_forward", "size": 784},
        "layers": [
            {"type": "dense", "n_out": 32, "activation": "relu"},
            {"type": "output", "n_out": 10, "activation": "softmax", "loss": "negativeloglikelihood"},
        ],
    },
    "data": {"dataset": "mnist", "seed": 1, "limit_train": 1024, "limit_test": 200},
    "training": {"epochs": 1, "batch_size": 64, "backend": "cpu", "score_every": 0},
}


def write_config(folder: Path, name: str = "mlp.yaml", **changes) -> Path:
    config = json.loads(json.dumps(MLP))
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        config[section][key] = value
    path = folder / name
    path.write_text(yaml.safe_dump(config))
    return path


def child_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def dl4py(*args, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dl4py", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=child_env(), **kwargs)


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The command failed with one sentence on stderr that names every fragment."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], proc.stderr
    return errors[0]


def start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dl4py", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())


def wait_for(condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---- 1. one writer per run directory ---------------------------------------------------------

@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder_and_the_first_run_is_intact(tmp_path, mnist):
    long_run = write_config(tmp_path, training__epochs=10_000)
    other = write_config(tmp_path, "other.yaml", network__updater={"type": "sgd", "learning_rate": 0.5})
    out = tmp_path / "run"
    first = start("train", long_run, "--output", out, "--no-progress")
    try:
        metrics = out / "metrics.jsonl"  # written from the fit's start on: wait for an epoch record
        wait_for(lambda: metrics.is_file() and '"kind": "epoch"' in metrics.read_text(),
                 what="the first run's first epoch")
        before = (out / "config.yaml").read_text()
        second = dl4py("train", other, "--output", out, "--no-progress")
        one_line_error(second, str(out), f"in use by process {first.pid}")
        resumed = dl4py("train", other, "--output", out, "--resume", "--no-progress")
        one_line_error(resumed, "--resume", f"in use by process {first.pid}")
        assert first.poll() is None  # the first run was not disturbed
    finally:
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=60)
    assert first.returncode == 130, stderr
    assert (out / "config.yaml").read_text() == before and "learning_rate: 0.1" in before
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in records] == list(range(len(records)))  # one writer: one epoch sequence
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "interrupted" and "checkpoint.dl4py" in result["saved"]
    assert load(out / "checkpoint.dl4py").epoch_count >= len(records)
    # The lock died with its process: the run can be resumed now.
    assert dl4py("train", long_run, "--output", out, "--resume", "--epochs", records[-1]["epoch"] + 2,
                 "--no-progress").returncode == 0


@pytest.mark.slow
def test_a_sweep_folder_has_one_writer(tmp_path):
    from dl4py.folders import FolderLock

    folder = tmp_path / "sweep"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from dl4py.folders import FolderLock; FolderLock(sys.argv[2]).acquire(); "
                               "print('held', flush=True); time.sleep(60)", str(ROOT / "src"), str(folder)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        config = write_config(tmp_path)
        proc = dl4py("sweep", config, "--grid", "training.batch_size=32,64", "--output", folder)
        one_line_error(proc, str(folder), f"in use by process {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    with FolderLock(folder):  # the kernel released the dead holder's lock
        pass


# ---- 4. resume is for the same run -----------------------------------------------------------

@pytest.fixture(scope="module")
def one_trained_run(tmp_path_factory):
    """One ``dl4py train`` run for the module's tests (a process of its own: 7 s on CI's cores)."""
    require_mnist()
    folder = tmp_path_factory.mktemp("trained")
    config = write_config(folder)
    assert dl4py("train", config, "--output", folder / "run", "--no-progress").returncode == 0
    return folder / "run"


@pytest.fixture
def trained_run(tmp_path, one_trained_run):
    """``(config, run directory)``: the module's trained run, copied, for this test to change."""
    out = tmp_path / "run"
    shutil.copytree(one_trained_run, out)
    return write_config(tmp_path), out


@pytest.mark.soak  # make test's budget (DEVELOPERS.md): make soak runs it
def test_resume_with_another_network_is_refused_with_the_keys_named(tmp_path, trained_run):
    config, out = trained_run
    wider = write_config(tmp_path, "wide.yaml", training__epochs=2, network__layers=[
        {"type": "dense", "n_out": 64, "activation": "relu"},
        {"type": "output", "n_out": 10, "activation": "softmax", "loss": "negativeloglikelihood"}])
    before = (out / "checkpoint.dl4py").read_bytes()
    proc = dl4py("train", wider, "--output", out, "--resume", "--no-progress")
    one_line_error(proc, "network.layers[0].n_out is 32 in the checkpoint, 64 in the config")
    # A checkpoint of another network dropped into the run: the checkpoint's own network counts.
    other = tmp_path / "other"
    assert dl4py("train", wider, "--output", other, "--epochs", 1, "--no-progress").returncode == 0
    shutil.copy(other / "checkpoint.dl4py", out / "checkpoint.dl4py")
    proc = dl4py("train", config, "--output", out, "--resume", "--epochs", 2, "--no-progress")
    one_line_error(proc, "network.layers[0].n_out is 64 in the checkpoint, 32 in the config")
    assert (other / "checkpoint.dl4py").read_bytes() == (out / "checkpoint.dl4py").read_bytes()
    assert before != (out / "checkpoint.dl4py").read_bytes()
    assert "n_out: 32" in (out / "config.yaml").read_text()  # the refused resume wrote nothing


@pytest.mark.soak  # make test's budget (DEVELOPERS.md): make soak runs it
def test_changed_batching_is_refused_mid_epoch_and_accepted_at_an_epoch_boundary(tmp_path, trained_run):
    config, out = trained_run
    boundary = dl4py("train", config, "--output", out, "--resume", "--epochs", 2, "--set", "data.limit_train=512",
                     "--no-progress")
    assert boundary.returncode == 0, boundary.stderr
    assert "changed data or batching" in boundary.stderr and "data.limit_train" in boundary.stderr
    checkpoint = load(out / "checkpoint.dl4py")
    checkpoint.training_state.stop_at(3)  # as a run stopped after the third batch of its third epoch leaves it
    checkpoint.save(out / "checkpoint.dl4py")
    saved = (out / "checkpoint.dl4py").read_bytes()
    for override, key in (("training.batch_size=32", "training.batch_size is 64 in the run, 32 in this config"),
                          ("data.seed=2", "data.seed is 1 in the run, 2 in this config")):
        proc = dl4py("train", config, "--output", out, "--resume", "--epochs", 3, "--set", "data.limit_train=512",
                     "--set", override, "--no-progress")
        one_line_error(proc, "in the middle of epoch 3 (after batch 3)", key)
        assert (out / "checkpoint.dl4py").read_bytes() == saved
    same = dl4py("train", config, "--output", out, "--resume", "--epochs", 3, "--set", "data.limit_train=512",
                 "--no-progress")
    assert same.returncode == 0, same.stderr
    assert json.loads((out / "result.json").read_text())["epochs"] == 3


# ---- 6. sweep state is untrusted input ---------------------------------------------------------

@pytest.mark.parametrize("bad_name", ["../victim", "ABSOLUTE", "a/b", "..", ""])
def test_a_crafted_sweep_json_is_refused_without_touching_anything(tmp_path, bad_name):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    name = str(victim) if bad_name == "ABSOLUTE" else bad_name
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    plan = Plan(json.loads(json.dumps(MLP)), "mlp", (), {}, {}, None, 0, "test_accuracy").to_dict()
    plan["experiments"] = [{"name": "000-batch_size=32", "overrides": {"training.batch_size": "32"}},
                           {"name": name, "overrides": {"training.batch_size": "64"}}]
    (sweep / "sweep.json").write_text(json.dumps(plan))
    (sweep / "config.yaml").write_text(yaml.safe_dump(MLP))
    before = sorted(p.name for p in sweep.iterdir())
    proc = dl4py("sweep", "--resume", "--output", sweep)
    one_line_error(proc, "sweep.json", "not a plain folder name inside", "nothing was touched")
    assert (victim / "precious.txt").read_text() == "keep me" and len(list(victim.iterdir())) == 1
    assert sorted(p.name for p in sweep.iterdir() if p.name != ".lock") == before
    assert not (tmp_path / "sweep" / "logs").exists()


def test_path_inside_refuses_a_symbolic_link_leading_out(tmp_path):
    from dl4py.errors import ConfigError
    from dl4py.folders import path_inside

    (tmp_path / "sweep").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "sweep" / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(ConfigError, match="not a plain folder name"):
        path_inside(tmp_path / "sweep", "link", "sweep.json")
    assert path_inside(tmp_path / "sweep", "001-lr=0.1", "sweep.json") == tmp_path / "sweep" / "001-lr=0.1"


# ---- 7. the operating system says no -------------------------------------------------------------

def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@contextmanager
def tiny_filesystem(folder: Path, size_kib: int):
    """A file system of ``size_kib`` at ``folder``: a tmpfs where this process may mount one;
    else None, and the caller caps the child's file size instead (RLIMIT_FSIZE)."""
    folder.mkdir()
    mounted = False
    if _can_mount():
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder)],
                                 capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path, leave: int = 0) -> None:
    """Fill the file system holding ``folder``, leaving about ``leave`` bytes free."""
    with open(folder / "filler", "wb", buffering=0) as f:  # unbuffered: close() has nothing left to fail on
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
        f.truncate(max(0, f.tell() - leave))


def capped_file_size(limit_bytes: int):
    import resource

    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return cap


@pytest.mark.soak  # make test's budget (DEVELOPERS.md): make soak runs it
def test_a_full_disk_before_the_start_and_during_a_save_is_one_line(tmp_path, mnist):
    config = write_config(tmp_path)
    disk = tmp_path / "disk"
    with tiny_filesystem(disk, 1024) as mounted:
        out = disk / "run"
        assert dl4py("train", config, "--output", out, "--no-progress").returncode == 0
        checkpoint = (out / "checkpoint.dl4py").read_bytes()
        if mounted:
            fill(disk, leave=len(checkpoint) // 2)  # room for config.yaml, not for a checkpoint
            cause, kwargs = "No space left on device", {}
        else:  # no mount here: every write is capped below the checkpoint's size
            cause, kwargs = "File too large", {"preexec_fn": capped_file_size(len(checkpoint) // 2)}
        proc = dl4py("train", config, "--output", out, "--resume", "--epochs", 2, "--no-progress", **kwargs)
        one_line_error(proc, "checkpoint.dl4py", cause)
        assert (out / "checkpoint.dl4py").read_bytes() == checkpoint  # the previous one intact
        assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # no temporary file left
        # Full before the start: nothing trains, one line.
        fill(disk) if mounted else None
        kwargs = {} if mounted else {"preexec_fn": capped_file_size(0)}
        proc = dl4py("train", config, "--output", disk / "new", "--no-progress", **kwargs)
        one_line_error(proc, str(disk / "new"), cause)
        assert not (disk / "new").exists() or not [p for p in (disk / "new").iterdir() if p.name != ".lock"]


@contextmanager
def read_only(folder: Path):
    """``folder`` read-only even for root: a read-only bind mount where possible, else chmod."""
    if _can_mount() and subprocess.run(["mount", "--bind", str(folder), str(folder)],
                                       capture_output=True).returncode == 0:
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True, capture_output=True)
            yield
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=False)
        return
    if os.geteuid() == 0:
        pytest.skip("running as root without mount: a read-only directory cannot be made")
    mode = folder.stat().st_mode
    folder.chmod(0o555)
    try:
        yield
    finally:
        folder.chmod(mode)


@pytest.mark.soak  # make test's budget (DEVELOPERS.md): make soak runs it
def test_read_only_and_misplaced_outputs_are_one_line(tmp_path, trained_run):
    config, out = trained_run
    checkpoint = (out / "checkpoint.dl4py").read_bytes()
    with read_only(out):
        proc = dl4py("train", config, "--output", out, "--resume", "--epochs", 2, "--no-progress")
        one_line_error(proc, str(out), "Read-only file system" if _can_mount() else "Permission denied")
    assert (out / "checkpoint.dl4py").read_bytes() == checkpoint
    parent = tmp_path / "locked"
    parent.mkdir()
    with read_only(parent):
        proc = dl4py("train", config, "--output", parent / "run", "--no-progress")
        one_line_error(proc, str(parent / "run"))
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    one_line_error(dl4py("train", config, "--output", a_file, "--no-progress"), str(a_file),
                   "exists and is not a directory")
    one_line_error(dl4py("train", config, "--output", a_file / "run", "--no-progress"), str(a_file))
    assert a_file.read_text() == "not a directory"


# ---- 9. a failed run still tells what happened ------------------------------------------------------

@pytest.mark.slow
def test_a_nan_run_with_early_stopping_records_why_it_failed(tmp_path, mnist):
    config = write_config(tmp_path, network__updater={"type": "sgd", "learning_rate": 1.0e12},
                          training__early_stopping={"metric": "accuracy", "patience": 2}, training__epochs=3)
    out = tmp_path / "run"
    proc = dl4py("train", config, "--output", out, "--no-progress")
    one_line_error(proc, "InvalidScore", "no best model")
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "failed" and "no best model" in result["reason"]
    assert result["early_stopping"]["termination_reason"] == "IterationTerminationCondition"
    assert result["saved"] == [name for name in ("checkpoint.dl4py",) if (out / name).exists()]
    assert not (out / "model.dl4py").exists()


@pytest.mark.slow
def test_a_run_that_fails_before_training_leaves_no_directory(tmp_path, mnist):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    config = write_config(tmp_path)
    out = tmp_path / "run"
    one_line_error(dl4py("train", config, "--output", out, "--backend", "gpu", "--no-progress"), "GPU backend")
    assert not out.exists()
    empty = tmp_path / "given"
    empty.mkdir()
    one_line_error(dl4py("train", config, "--output", empty, "--backend", "gpu", "--no-progress"), "GPU backend")
    assert empty.is_dir() and list(empty.iterdir()) == []  # given empty, left empty and usable


@pytest.mark.slow
def test_debug_shows_the_traceback_on_purpose(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    config = write_config(tmp_path)
    proc = dl4py("train", config, "--output", a_file, "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "dl4py", "train", str(config), "--output", str(a_file)],
                          capture_output=True, text=True, env={**child_env(), "DL4PY_DEBUG": "1"}, timeout=60)
    assert "Traceback" in proc.stderr
