"""``dl4py doctor``: bounded self-checks of a machine before training on it.

Who does what:
- ``runner.py``: the list of checks, a timeout around each, the report (text or JSON)
  and the exit status;
- ``checks.py``: backend choice, CUDA devices, gloo and NCCL, allocator settings, /dev/shm;
- ``data_check.py``: the MNIST files where dl4py looks for them;
- ``rendezvous.py``: ranks meeting at an address and an all-reduce whose sum is checked;
- ``rank.py``: the program each of those ranks runs; ``children.py``: the processes,
  killed at a deadline, so no hang in torch.distributed hangs the doctor;
- ``result.py``: a verdict (passed, warning, skipped, failed), a detail and a fix.
"""

from dl4py.doctor.result import FAILED, PASSED, SKIPPED, WARNING, Result
from dl4py.doctor.runner import (
    DEFAULT_TIMEOUT_S,
    Check,
    CheckReport,
    DoctorOptions,
    exit_status,
    format_report,
    report_dict,
    run_checks,
)

__all__ = [
    "DEFAULT_TIMEOUT_S", "FAILED", "PASSED", "SKIPPED", "WARNING", "Check", "CheckReport", "DoctorOptions",
    "Result", "exit_status", "format_report", "report_dict", "run_checks",
]
