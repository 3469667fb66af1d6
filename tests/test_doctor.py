"""dl4py doctor: every check has a verdict, a broken rendezvous fails within its timeout.

The end-to-end tests run ``python -m dl4py doctor`` as a process with a ``timeout=``, so a
hang is a test failure rather than a stuck suite; each starts two ranks (seconds each).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import mnist_dir
from dl4py.backend.cuda_environment import _reset_environment_for_tests
from dl4py.cli import main
from dl4py.doctor import (
    FAILED, PASSED, SKIPPED, WARNING, Check, CheckReport, DoctorOptions, Result, exit_status, format_report,
    run_checks,
)
from dl4py.doctor import checks, data_check, runner
from dl4py.doctor.children import DEADLINE, Exit, run_bounded
from dl4py.doctor.rendezvous import Address, _verdict
from ranks import commands_running

NAMES = ["backend", "cuda_devices", "allocator", "dev_shm", "data", "gloo", "nccl", "rendezvous_gloo",
         "rendezvous_nccl"]
GPU_CHECKS = {"cuda_devices", "nccl", "rendezvous_nccl"}
TIMEOUT_S = 20  # per check, given to the doctor
STARTUP_S = 40  # on top: the doctor's own start (torch's import) and its other checks, on a busy machine


def doctor(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dl4py", "doctor", "--timeout", str(TIMEOUT_S), *args],
                          capture_output=True, text=True, timeout=TIMEOUT_S + STARTUP_S)
    return done, time.monotonic() - start


def ranks_left(*words: str) -> list[str]:
    """Command lines of the doctor's rank processes still running (that mention ``words``)."""
    return commands_running("dl4py.doctor.rank", *words)


@pytest.mark.slow
def test_every_check_has_a_verdict_and_gpu_checks_are_skipped_without_one():
    done, _ = doctor("--json")
    report = json.loads(done.stdout)
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    assert list(verdicts) == NAMES, done.stdout
    assert set(verdicts.values()) <= {PASSED, WARNING, SKIPPED, FAILED}
    assert all(c["detail"] for c in report["checks"])
    if not torch.cuda.is_available():
        for check in report["checks"]:
            if check["name"] in GPU_CHECKS:
                assert check["verdict"] == SKIPPED and check["detail"].startswith("no GPU"), check
    assert verdicts["backend"] == verdicts["gloo"] == verdicts["rendezvous_gloo"] == PASSED, done.stdout
    assert "all_reduce gave 3 on each" in next(c["detail"] for c in report["checks"] if c["name"] == "rendezvous_gloo")
    assert verdicts["data"] == (PASSED if mnist_dir() else SKIPPED)
    assert report["ok"] == (FAILED not in verdicts.values()) and done.returncode == (0 if report["ok"] else 1)
    assert report["counts"][PASSED] == list(verdicts.values()).count(PASSED)


@pytest.mark.slow
def test_a_port_already_taken_is_a_failed_rendezvous_within_the_timeout():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()  # accepts connections and never answers: rank 1 would wait on it forever
        port = taken.getsockname()[1]
        done, seconds = doctor("--json", "--port", str(port))
        left = ranks_left(f":{port}")
    assert done.returncode == 1
    check = next(c for c in json.loads(done.stdout)["checks"] if c["name"] == "rendezvous_gloo")
    assert check["verdict"] == FAILED and str(port) in check["detail"] and "in use" in check["detail"], check
    assert "--port" in check["fix"]
    assert check["seconds"] <= TIMEOUT_S + runner.GRACE_S  # given up at its own deadline
    assert left == []
    print(f"taken port: rendezvous check {check['seconds']:.1f} s, doctor {seconds:.1f} s")


def test_an_address_not_of_this_machine_is_a_failed_rendezvous_within_the_timeout():
    done, seconds = doctor("--master-addr", "10.255.255.1")
    assert done.returncode == 1
    failed = [line for line in done.stdout.splitlines() if line.startswith("[FAIL]")]
    assert len(failed) == 1 and failed[0].startswith("[FAIL] rendezvous_gloo: 10.255.255.1 is not an address "
                                                     "of this machine"), done.stdout
    assert " -> give an address of this machine" in failed[0]
    assert done.stdout.splitlines()[-1].startswith("dl4py doctor: ") and "1 failed" in done.stdout
    assert ranks_left("10.255.255.1") == []
    print(f"wrong address: doctor {seconds:.1f} s")


@pytest.mark.slow
def test_a_rank_stuck_past_torchs_own_timeout_is_killed_at_the_deadline():
    # A client whose server accepts and never answers ignores torch.distributed's timeout:
    # only the deadline ends it.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        command = [sys.executable, "-m", "dl4py.doctor.rank", "1", "2", "gloo", f"tcp://127.0.0.1:{port}",
                   repr(time.time())]  # torch's own timeout: its floor, 1 s
        bound = 12.0
        start = time.monotonic()
        exits = _in_thread(lambda: run_bounded([command], time.monotonic() + bound), bound + 30)
        seconds = time.monotonic() - start
        left = ranks_left(f":{port}")
    assert [e.killed for e in exits] == [DEADLINE] and exits[0].returncode is None
    assert left == []  # ended by the deadline (above), with nothing left
    verdict = _verdict(exits, 2, Address("127.0.0.1", port), bound, seconds)
    assert verdict.verdict == FAILED and f"127.0.0.1:{port} within 12 s" in verdict.detail, verdict
    assert "(rank 0 in rendezvous; killed)" in verdict.detail  # it got past start-up and waited there


def _in_thread(call, bound: float):
    """``call()``, failing the test (not hanging it) when it does not return within ``bound``."""
    answer = []
    thread = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    thread.start()
    thread.join(bound)
    assert answer, f"did not return within {bound:g} s"
    return answer[0]


def test_the_sum_is_checked_by_the_doctor_not_trusted_from_the_ranks():
    ranks = [Exit(0, None, json.dumps({"rank": r, "stage": "done", "value": v}), "") for r, v in ((0, 3.0), (1, 2.0))]
    verdict = _verdict(ranks, 2, Address("127.0.0.1", 29500), 30, 1.0)
    assert verdict.verdict == FAILED and "all_reduce gave 2.0 on rank 1, expected 3" in verdict.detail
    crashed = [Exit(-11, None, json.dumps({"rank": 0, "stage": "rendezvous"}), "Segmentation fault\n"),
               Exit(None, "a peer failed", "", "")]
    verdict = _verdict(crashed, 2, Address("127.0.0.1", 29500), 30, 1.0)
    assert verdict.verdict == FAILED and "rank 0 died before reporting (Segmentation fault)" in verdict.detail


def test_a_stuck_check_fails_at_its_timeout_and_a_broken_one_fails_and_the_rest_run(monkeypatch):
    monkeypatch.setattr(runner, "GRACE_S", 0.0)
    release = threading.Event()

    def broken():
        raise RuntimeError("boom\n  C++ frames")

    selected = [Check("stuck", lambda: release.wait() and Result(PASSED, "late"), hang_fix="unstick it"),
                Check("broken", broken), Check("fine", lambda: Result(PASSED, "ok"))]
    try:
        reports = _in_thread(lambda: run_checks(DoctorOptions(timeout=0.5), selected), 30)
    finally:
        release.set()  # the stuck thread ends too
    assert [(r.name, r.verdict) for r in reports] == [("stuck", FAILED), ("broken", FAILED), ("fine", PASSED)]
    assert reports[0].detail == "no answer within 0.5 s" and reports[0].fix == "unstick it"
    assert reports[1].detail == "the check itself failed: RuntimeError: boom"
    assert exit_status(reports) == 1 and exit_status(reports[2:]) == 0


def test_gpu_checks_are_skipped_never_passed_without_a_gpu(monkeypatch):
    monkeypatch.setattr(runner, "cuda_unavailable_reason", lambda: "no CUDA device is visible")
    ran = []
    selected = [Check("gpu_thing", lambda: ran.append(1) or Result(PASSED, "fine"), needs_gpu=True)]
    [report] = run_checks(DoctorOptions(timeout=5), selected)
    assert (report.verdict, report.detail, ran) == (SKIPPED, "no GPU (no CUDA device is visible)", [])


def test_text_output_is_one_line_per_check_with_the_fix_and_a_summary():
    reports = [CheckReport("a", PASSED, "fine", "", 0.1), CheckReport("b", FAILED, "broken", "mend it", 0.2),
               CheckReport("c", SKIPPED, "no GPU (none here)", "", 0.0), CheckReport("d", WARNING, "low", "raise", 0.0)]
    assert format_report(reports).splitlines() == [
        "[PASS] a: fine", "[FAIL] b: broken -> mend it", "[SKIP] c: no GPU (none here)", "[WARN] d: low -> raise",
        "dl4py doctor: 1 passed, 1 warning, 1 skipped, 1 failed in 0.3 s"]


def test_the_data_check_verifies_what_it_finds(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # an empty cache, not this machine's
    monkeypatch.delenv("DL4PY_DATA", raising=False)
    result = data_check.mnist_files()
    assert result.verdict == SKIPPED and "downloaded on first use" in result.detail and "DL4PY_DATA" in result.fix
    monkeypatch.setenv("DL4PY_DATA", str(tmp_path / "nowhere"))
    assert data_check.mnist_files().verdict == WARNING
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    (tmp_path / "data" / "mnist" / "t10k-labels-idx1-ubyte").write_bytes(b"not mnist")
    monkeypatch.setenv("DL4PY_DATA", str(tmp_path / "data"))
    result = data_check.mnist_files()
    assert result.verdict == FAILED and "t10k-labels-idx1-ubyte: SHA-256 mismatch" in result.detail


def test_a_small_dev_shm_is_a_warning_with_the_docker_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(checks, "SHM", str(tmp_path))
    monkeypatch.setattr(checks, "SHM_WARN_BYTES", 2**70)
    result = checks.dev_shm()
    assert result.verdict == WARNING and "--shm-size" in result.fix


@pytest.fixture
def fresh_environment():
    _reset_environment_for_tests()
    yield
    _reset_environment_for_tests()


def test_the_allocator_check_names_what_is_in_force(monkeypatch, fresh_environment):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    result = checks.allocator()
    assert result.verdict == PASSED and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in result.detail
    _reset_environment_for_tests()
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    result = checks.allocator()
    assert result.verdict == WARNING and "unset PYTORCH_NO_CUDA_MEMORY_CACHING" in result.fix


@pytest.mark.parametrize("args", [["--port", "70000"], ["--timeout", "0"], ["--timeout", "soon"]])
def test_bad_options_are_refused(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", *args])
    assert exit_info.value.code == 2 and "must be" in capsys.readouterr().err
