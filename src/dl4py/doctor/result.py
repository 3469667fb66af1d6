"""What one check says: a verdict, what it saw, and what to do about it."""

from __future__ import annotations

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
