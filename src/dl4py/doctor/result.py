"""What one check says: a verdict, what it saw, and what to do about it."""

from __future__ import annotations

import json
from dataclasses import dataclass

PASSED, FAILED, SKIPPED, WARNING = "passed", "failed", "skipped", "warning"
VERDICTS = (PASSED, WARNING, SKIPPED, FAILED)


@dataclass(frozen=True)
class Result:
    verdict: str
    detail: str
    fix: str = ""  # empty for passed and skipped

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}; got {self.verdict!r}")


def first_line(exc: BaseException) -> str:
    """An exception as one line: torch's errors carry C++ frames after the first."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0].strip()}" if text else type(exc).__name__


# A rank process reports as it goes: its report, one JSON line a stage, so that the line last
# printed says how far it got when it failed or was killed (doctor/rank.py, plan/measure.py).

def report_stage(report: dict, stage: str) -> None:
    """Record ``stage`` in ``report`` and print the report as one JSON line."""
    report["stage"] = stage
    print(json.dumps(report), flush=True)


def last_report(stdout: str) -> dict:
    """The last JSON object a rank printed (``report_stage``'s), or {} when there is none."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict):
            return report
    return {}
