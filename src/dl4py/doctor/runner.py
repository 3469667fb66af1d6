"""Run the checks, each bounded by a timeout, and say what they found: text or JSON.

Each check runs in a daemon thread that the runner waits for at most ``timeout`` seconds
(plus a grace for the checks that bound themselves, so their own message comes first):
a check stuck in a driver call or on a dead network mount becomes a failed verdict and
the doctor moves on. The ranks of the rendezvous checks are child processes with a hard
deadline of their own (``rendezvous.py``). GPU checks are skipped, never passed, where no
GPU is usable.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from dl4py.backend.selection import cuda_unavailable_reason
from dl4py.doctor import checks
from dl4py.doctor.data_check import mnist_files
from dl4py.doctor.rendezvous import Address, nccl_rendezvous, rendezvous
from dl4py.doctor.result import FAILED, PASSED, SKIPPED, VERDICTS, WARNING, Result, first_line

DEFAULT_TIMEOUT_S = 30.0
GRACE_S = 5.0  # past the timeout, for a check that bounds itself to report and clean up
TAGS = {PASSED: "PASS", WARNING: "WARN", SKIPPED: "SKIP", FAILED: "FAIL"}


@dataclass(frozen=True)
class DoctorOptions:
    timeout: float = DEFAULT_TIMEOUT_S  # seconds per check
    master_addr: str = "127.0.0.1"
    port: int = 0  # 0: any free port


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[], Result]
    needs_gpu: bool = False
    hang_fix: str = "something it waits for does not answer; rerun with a larger --timeout to tell slow from stuck"


@dataclass(frozen=True)
class CheckReport:
    name: str
    verdict: str
    detail: str
    fix: str
    seconds: float


def default_checks(options: DoctorOptions) -> list[Check]:
    address = Address(options.master_addr, options.port)
    return [
        Check("backend", checks.backend),
        Check("cuda_devices", checks.cuda_devices, needs_gpu=True,
              hang_fix="the CUDA driver does not answer: nvidia-smi should, else the node needs its driver fixed"),
        Check("allocator", checks.allocator),
        Check("dev_shm", checks.dev_shm, hang_fix="/dev/shm does not answer: the node's memory may be exhausted"),
        Check("data", mnist_files, hang_fix="the data folder does not answer: a network file system that hangs?"),
        Check("gloo", checks.gloo),
        Check("nccl", checks.nccl, needs_gpu=True),
        Check("rendezvous_gloo", functools.partial(rendezvous, "gloo", 2, address, options.timeout)),
        Check("rendezvous_nccl", functools.partial(nccl_rendezvous, address, options.timeout), needs_gpu=True),
    ]


def run_checks(options: DoctorOptions, selected: list[Check] | None = None) -> list[CheckReport]:
    """Every check's verdict, in order; each bounded by ``options.timeout``."""
    return [_bounded(check, options.timeout) for check in (default_checks(options) if selected is None else selected)]


def _bounded(check: Check, timeout: float) -> CheckReport:
    answer: list[Result] = []
    thread = threading.Thread(target=lambda: answer.append(_guarded(check)), name=f"dl4py-doctor-{check.name}",
                              daemon=True)  # a stuck one cannot be stopped, only left behind
    start = time.monotonic()
    thread.start()
    thread.join(timeout + GRACE_S)
    result = answer[0] if answer else Result(FAILED, f"no answer within {timeout:g} s", check.hang_fix)
    return CheckReport(check.name, result.verdict, result.detail, result.fix, round(time.monotonic() - start, 3))


def _guarded(check: Check) -> Result:
    try:
        if check.needs_gpu:
            reason = cuda_unavailable_reason()
            if reason is not None:
                return Result(SKIPPED, f"no GPU ({reason})")
        return check.run()
    except Exception as exc:  # a check that breaks is a failed check, and the rest still run
        return Result(FAILED, f"the check itself failed: {first_line(exc)}",
                      "unexpected here: report it with the output of `dl4py info --json`")


def exit_status(reports: list[CheckReport]) -> int:
    return 1 if any(r.verdict == FAILED for r in reports) else 0


def format_report(reports: list[CheckReport]) -> str:
    lines = [f"[{TAGS[r.verdict]}] {r.name}: {r.detail}" + (f" -> {r.fix}" if r.fix else "") for r in reports]
    lines.append(f"dl4py doctor: {_counts_text(reports)} in {sum(r.seconds for r in reports):.1f} s")
    return "\n".join(lines)


def report_dict(reports: list[CheckReport], options: DoctorOptions) -> dict:
    return {"ok": exit_status(reports) == 0, "counts": _counts(reports), "options": asdict(options),
            "checks": [asdict(r) for r in reports]}


def _counts(reports: list[CheckReport]) -> dict[str, int]:
    return {verdict: sum(r.verdict == verdict for r in reports) for verdict in VERDICTS}


def _counts_text(reports: list[CheckReport]) -> str:
    return ", ".join(f"{n} {v}{'s' if v == WARNING and n != 1 else ''}" for v, n in _counts(reports).items())
