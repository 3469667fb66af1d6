"""Ranks a test starts itself, bounded: they cannot hang the suite or outlive it.

``run_ranks(program, args, ranks, timeout)`` runs ``program(rank, *args)`` in ``ranks``
processes, forked from the forkserver the ParallelWrapper uses (it has imported torch and
dl4py, so a rank starts in a fraction of a second). Each rank first arranges to die with the
test process (``process_guard.die_with_parent``: the kernel's parent-death signal and a
watchdog thread), so a pytest killed mid-test leaves no rank behind. The test process waits at
most ``timeout`` seconds once the ranks are forked (a forkserver's own first start, importing
torch, comes before); a rank that fails or does not finish is named in the AssertionError,
with the last lines of its traceback, and every rank still running is killed before it returns.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dl4py.parallel.processes import worker_context
from dl4py.process_guard import die_with_parent

POLL_S = 0.05
# After one rank fails, how long the others may take to notice (a peer's lost connection) and
# end by themselves before they are killed: their own errors then name the cause less well.
GRACE_S = 5.0
TRACE_LINES = 25


def run_ranks(program, args: tuple, ranks: int, timeout: float, errors: Path | None = None) -> None:
    """Run ``program(rank, *args)`` on ``ranks`` ranks within ``timeout`` seconds, or fail
    naming the ranks that failed or hung. ``errors``: a folder for the ranks' tracebacks (a
    temporary one by default)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dl4py-ranks-") as scratch:
        folder = Path(errors or scratch)
        context, forker = worker_context()
        parent = os.getpid()
        processes = [context.Process(target=_guarded, args=(program, rank, args, parent, forker, str(folder)),
                                     name=f"rank {rank}", daemon=True) for rank in range(ranks)]
        try:
            for process in processes:
                process.start()
            problems = _wait(processes, timeout, folder)
        finally:
            _kill(processes)
    assert not problems, "; ".join(problems)


def commands_running(*words: str) -> list[str]:
    """Command lines of the processes still running, this one aside, that mention every one of
    ``words``: a test's check that no rank it started outlived it. Skips without /proc."""
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc to list processes")
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.name != str(os.getpid()) and all(word in command for word in words):
            found.append(command)
    return found


def join_group(rank: int, world: int, rendezvous: str, device: str = "cpu") -> None:
    """This rank in a group of ``world`` met at the file ``rendezvous``: gloo on the CPU; on
    CUDA a GPU for each rank, joined by NCCL, as dl4py's sharded, tensor and hybrid plans
    require (the callers skip on fewer GPUs: devices.gpu_per_rank). One thread each."""
    faulthandler.enable()  # a crash below Python (the GPU check saw SIGSEGV) shows where
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        os.environ["LOCAL_RANK"] = str(rank)  # dl4py's gpu backend takes the GPU of its local rank
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def _guarded(program, rank: int, args: tuple, parent: int, forker: int, errors: str) -> None:
    """One rank: dies with the test process, writes its traceback where the test reads it."""
    # Forked from the forkserver (then its parent); the test process is the one not to outlive.
    die_with_parent(forker, watch_also=None if forker == parent else parent)
    try:
        program(rank, *args)
    except BaseException:
        Path(errors, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _wait(processes, timeout: float, folder: Path) -> list[str]:
    """Wait for every rank; the problems found, each naming its rank (empty: all ended well)."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in processes]
        if all(code is not None for code in codes):
            break
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            break
        time.sleep(POLL_S)
    problems = []
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code == 0:
            continue
        if code is None:
            waited = "after a rank failed" if failed_at is not None else f"within {timeout:g} s"
            problems.append(f"rank {rank} did not finish {waited} (killed)")
            continue
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        trace = folder / f"rank{rank}.error"
        tail = "\n".join(trace.read_text().splitlines()[-TRACE_LINES:]) if trace.exists() else "(no traceback)"
        problems.append(f"rank {rank} {how}:\n{tail}")
    return problems


def _kill(processes) -> None:
    for process in processes:
        if process.pid is not None and process.exitcode is None:
            process.kill()
    for process in processes:
        if process.pid is not None:
            process.join(10)
