"""The prepared GPU check (benchmarks/gpu_check.py): its CPU rehearsal end to end, and a step
that raises, fails a target, hangs or is skipped is recorded as such while the rest still run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
from gpu_check import STEPS, VERDICTS, Step, run_check  # noqa: E402
from gpu_steps.resume import tensor_pairs  # noqa: E402

from dl4py import Adam, ArrayDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer  # noqa: E402

FAKES = "gpu_check_fakes"
HANG_BUDGET_S = 10.0  # room for the step process to start (torch imported) and record its child


def fake(name: str, function: str, budget: float = 30.0) -> Step:
    return Step(name, f"{FAKES}:{function}", budget, budget, f"the fake step {function}")


@pytest.fixture
def fakes_importable(monkeypatch):
    """The step processes import the fakes from tests/."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")])))


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped (an orphan's reaper may be slow in a container)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.soak  # long for make test's budget: make soak runs it (DEVELOPERS.md)
@pytest.mark.timeout(240)  # a broken step timeout must fail this test, not hang the suite
def test_each_outcome_is_recorded_and_the_next_step_still_runs(tmp_path, fakes_importable):
    steps = [fake("raises", "raises"), fake("hangs", "hangs", HANG_BUDGET_S), fake("misses", "misses_a_target"),
             fake("part", "breaks_one_part"), fake("skips", "skips"), fake("missed", "misses_then_skips"),
             fake("passes", "passes")]
    status = run_check(steps, "cpu", quick=True, out=tmp_path)
    record = json.loads((tmp_path / "gpu-check-cpu.json").read_text())
    by_name = {s["name"]: s for s in record["steps"]}
    assert [s["name"] for s in record["steps"]] == [s.name for s in steps]
    assert status == 1  # a step failed

    assert by_name["raises"]["verdict"] == "failed"
    assert by_name["raises"]["error"] == "ValueError: a planted failure"
    assert by_name["raises"]["figures"] == {"before_the_error": 1}  # what it measured before is kept
    assert any("a planted failure" in line for line in by_name["raises"]["log_tail"])

    hang = by_name["hangs"]
    assert hang["verdict"] == "timed_out"
    assert hang["seconds"] < HANG_BUDGET_S + 2 * gpu_check.KILL_GRACE_S
    for pid in (hang["figures"]["child_pid"], hang["figures"]["step_pid"]):
        assert not alive(pid), f"process {pid} of the hung step outlived it"

    assert by_name["misses"]["verdict"] == "failed"
    assert by_name["misses"]["unmet"] == ["10 samples/s is under the target"]
    assert by_name["misses"]["figures"]["after_the_miss"] is True  # a missed target does not stop the step

    assert by_name["part"]["verdict"] == "failed"
    assert by_name["part"]["unmet"] == ["first: RuntimeError: the first part broke"]
    assert by_name["part"]["figures"]["second_part_ran"] is True

    assert by_name["skips"]["verdict"] == "skipped" and by_name["skips"]["error"] == "no GPU"
    assert by_name["missed"]["verdict"] == "failed"  # a skip does not hide a missed target
    assert by_name["passes"]["verdict"] == "passed" and by_name["passes"]["figures"] == {"answer": 42}

    markdown = (tmp_path / "gpu-check-cpu.md").read_text()
    for name, verdict in [("raises", "failed"), ("hangs", "timed_out"), ("skips", "skipped"), ("passes", "passed")]:
        assert f"| {name} | **{verdict}** |" in markdown


@pytest.mark.soak  # long for make test's budget: make soak runs it (DEVELOPERS.md)
@pytest.mark.timeout(120)
def test_a_spent_budget_leaves_the_last_steps_not_run(tmp_path, fakes_importable):
    steps = [fake("hangs", "hangs", HANG_BUDGET_S), fake("passes", "passes", 30)]
    status = run_check(steps, "cpu", quick=True, out=tmp_path, budget=HANG_BUDGET_S + 3)
    record = json.loads((tmp_path / "gpu-check-cpu.json").read_text())
    assert [s["verdict"] for s in record["steps"]] == ["timed_out", "not_run"]
    assert "budget was spent" in record["steps"][1]["error"]
    assert status == 1


def test_only_names_unknown_steps(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "precision,warp-drive"])
    assert "no step named warp-drive" in capsys.readouterr().err


# make test rehearses the steps whose code nothing else runs; speed and resume (a minute
# between them on 2 cores) rehearse with the rest under make soak.
IN_MAKE_TEST = [s.name for s in STEPS if s.name not in ("speed", "resume")]


def rehearse(tmp_path, steps: list[str]) -> None:
    """make gpu-check DEVICE=cpu QUICK=1 (ONLY=steps), end to end: each step has a verdict, none failed."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--only", ",".join(steps), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    record = json.loads((tmp_path / "gpu-check-cpu.json").read_text())
    verdicts = {s["name"]: s["verdict"] for s in record["steps"]}
    assert list(verdicts) == steps
    assert set(verdicts.values()) <= set(VERDICTS)
    broken = {s["name"]: s.get("error") for s in record["steps"] if s["verdict"] not in ("passed", "skipped")}
    assert not broken, f"{broken}\n{done.stdout[-3000:]}"
    assert verdicts["gpu-tests"] == "skipped"  # no CUDA here: skipped, never passed
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("torch", "python", "device_name"):
        assert record[name]
    assert (tmp_path / "gpu-check-cpu.md").read_text().startswith("# GPU check: CPU")


@pytest.mark.soak  # 80 s of make test's 20-minute budget: make soak runs it, and the full one below
def test_the_cpu_rehearsal_gives_each_step_a_verdict(tmp_path):
    rehearse(tmp_path, IN_MAKE_TEST)


@pytest.mark.soak  # long for make test's budget: make soak runs it (DEVELOPERS.md)
def test_the_cpu_rehearsal_runs_every_step_with_a_verdict(tmp_path):
    rehearse(tmp_path, [s.name for s in STEPS])


def test_the_gpu_tests_step_records_each_outcome_as_pytest_prints_it(tmp_path):
    """A run cut short keeps what it saw: the failure is in the result file before pytest ends
    (here pytest "crashes" right after it, exiting 3)."""
    from gpu_steps import gpu_tests
    from gpu_steps._check import Check

    check = Check(torch.device("cpu"), quick=True, result_path=tmp_path / "result.json", work_dir=tmp_path)
    lines = ["tests/test_a.py::test_b[cuda] PASSED   [ 33%]", "tests/test_a.py::test_c[cuda] SKIPPED  [ 66%]",
             "tests/test_a.py::test_d[cuda] FAILED   [100%]", "INTERNALERROR> boom"]
    script = f"import sys; print({chr(10).join(lines)!r}, flush=True); sys.exit(3)"
    with pytest.raises(RuntimeError, match="exited 3"):
        gpu_tests.run_streamed([sys.executable, "-c", script], check)
    saved = json.loads((tmp_path / "result.json").read_text())["figures"]
    assert saved["counts"] == {"passed": 1, "skipped": 1, "failed": 1}
    assert saved["failures"] == ["tests/test_a.py::test_d[cuda]"]


def test_the_gpu_tests_step_records_why_each_failure_failed_as_it_happens(tmp_path, monkeypatch):
    """A real pytest run with the step's plugin: each failure's own line (its exception, a
    fixture's in setup) is in the result file with the outcome, not only in pytest's summary."""
    from gpu_steps import gpu_tests
    from gpu_steps._check import Check

    (tmp_path / "test_cases.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_raises(): raise RuntimeError('CUDA error: an illegal memory access')\n"
        "@pytest.fixture\n"
        "def broken(): raise ValueError('no device')\n"
        "def test_setup(broken): pass\n")
    check = Check(torch.device("cpu"), quick=True, result_path=tmp_path / "result.json", work_dir=tmp_path)
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "gpu_steps.failure_lines",
               "-o", "addopts=", "--rootdir", str(tmp_path), "test_cases.py"]
    monkeypatch.chdir(tmp_path)  # as the step runs from the repository's root: one spelling of each test's id
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")])))
    counts, failures = gpu_tests.run_streamed(command, check)
    assert counts == {"passed": 1, "failed": 1, "errors": 1}
    saved = json.loads((tmp_path / "result.json").read_text())["figures"]
    assert saved["reasons"] == {
        failures[0]: "RuntimeError: CUDA error: an illegal memory access",
        failures[1]: "in setup: ValueError: no device"}


def test_gpu_test_files_include_those_parametrized_over_devices():
    from gpu_steps import gpu_tests

    names = {Path(f).name for f in gpu_tests.gpu_test_files()}
    assert "test_fast_path.py" in names  # marks a test gpu itself
    assert any("from devices import" in (ROOT / "tests" / n).read_text() for n in names)


@pytest.mark.parametrize("precision", ["float", "half"])  # half: float32 masters and a loss scale
def test_the_resume_step_compares_parameters_updater_state_and_masters(precision):
    """The resume step's comparison reads the model's public state (the redesign moved the
    masters and the loss scale into ``precision_state``, and its rehearsal runs only under
    make soak): every tensor is paired, and one changed value is found."""
    def trained():
        conf = (NetworkConfig.builder().seed(1).updater(Adam(learning_rate=0.01)).layer(DenseLayer(n_out=4))
                .layer(OutputLayer(n_out=2)).input_type(InputType.feed_forward(3)).build())
        net = MultiLayerNetwork(conf, precision=precision).init()
        net.fit(ArrayDataSetIterator(np.ones((2, 3), np.float32), np.array([0, 1]), batch_size=2), verbose=0)
        return net

    a, b = trained(), trained()
    pairs = {name: torch.equal(x, y) for name, x, y in tensor_pairs(a, b)}
    extra = {"float": [], "half": ["loss scale"] + [f"master {n}" for n in ("0.op.weight", "0.op.bias", "1.op.weight", "1.op.bias")]}
    assert all(pairs.values()) and len(pairs) == 4 + 3 * 4 + len(extra[precision])  # Adam: step, exp_avg, exp_avg_sq
    assert set(extra[precision]) <= set(pairs)
    with torch.no_grad():
        next(iter(b.precision_state.stepped_module.parameters()))[0, 0] += 1
    assert not all(equal for _, x, y in tensor_pairs(a, b) for equal in [torch.equal(x, y)])
