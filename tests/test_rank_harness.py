"""The bound on ranks a test starts itself (``ranks.run_ranks``): ranks put out of step on
purpose, a rank that raises, and a test process killed while its ranks wait.

A bug that desynchronises ranks leaves each waiting in a collective the others never join;
gloo waits 30 minutes before it gives up. The harness must instead fail within its own
bound, name every rank that did not finish, and leave no process behind, whether the test
process lives on (the ranks are killed) or is killed itself (they die with it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from descendants import living, started_processes  # noqa: E402
from ranks import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
# The harness's bound on the desynchronised ranks, counted once they are forked (the forkserver
# has imported torch and dl4py by then): they are out of step within a second or two; the rest
# is the wait.
HANG_TIMEOUT = 10
# The bound on the whole desynchronisation test (a loaded machine included).
WHOLE_TEST_BOUND = 60


def _joined(rank: int, rendezvous: str, folder: str) -> None:
    """Record this rank's process id, then join the group of 2."""
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)


def _one_all_reduce_too_many(rank: int, rendezvous: str, folder: str) -> None:
    """Rank 0 makes one all-reduce more than rank 1, which then waits for a message rank 0
    never sends: each waits for the other."""
    _joined(rank, rendezvous, folder)
    total = torch.ones(1)
    dist.all_reduce(total)  # in step
    Path(folder, f"rank{rank}.out-of-step").touch()
    if rank == 0:
        dist.all_reduce(total)  # the one too many
    else:
        dist.recv(torch.empty(1), src=0)
    dist.destroy_process_group()


def _rank_1_raises(rank: int, rendezvous: str, folder: str) -> None:
    _joined(rank, rendezvous, folder)
    if rank == 1:
        raise ValueError("rank 1 planted this")
    dist.all_reduce(torch.ones(1))  # waits for rank 1, which has gone
    dist.destroy_process_group()


def _wait_for_ever(rank: int, folder: str) -> None:
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def rank_pids(folder: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(folder.glob("rank*.pid"))]


@pytest.mark.slow
def test_ranks_out_of_step_are_named_within_the_bound_and_none_is_left(tmp_path):
    started = time.monotonic()
    before = started_processes()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_one_all_reduce_too_many, (str(tmp_path / "rendezvous"), str(tmp_path)), 2, timeout=HANG_TIMEOUT)
    message = str(failed.value)
    for rank in (0, 1):
        assert f"rank {rank} did not finish within {HANG_TIMEOUT} s (killed)" in message, message
        assert (tmp_path / f"rank{rank}.out-of-step").exists()  # it waited out of step, not to start
    pids = rank_pids(tmp_path)
    assert len(pids) == 2 and living(pids) == []
    assert started_processes() == before
    assert time.monotonic() - started < WHOLE_TEST_BOUND


def test_a_rank_that_raises_is_named_with_its_traceback_and_none_is_left(tmp_path):
    before = started_processes()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_rank_1_raises, (str(tmp_path / "rendezvous"), str(tmp_path)), 2, timeout=120)
    message = str(failed.value)
    assert "rank 1 exited with code 1:\nTraceback (most recent call last):" in message, message
    assert "in _rank_1_raises" in message and "ValueError: rank 1 planted this" in message
    assert "rank 0 " in message  # its peer gone: it failed or was killed, and says so
    assert living(rank_pids(tmp_path)) == []
    assert started_processes() == before


@pytest.mark.soak  # two fresh interpreters import torch: 8 s on a quiet 2-core machine, 25 s on a busy one
def test_ranks_die_with_a_test_process_that_is_killed(tmp_path):
    """As when pytest is killed mid-test: its ranks and its forkserver end with it."""
    program = ("import sys; from ranks import run_ranks; from test_rank_harness import _wait_for_ever; "
               "run_ranks(_wait_for_ever, (sys.argv[1],), 2, timeout=300)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "src")])}
    test_process = subprocess.Popen([sys.executable, "-c", program, str(tmp_path)], env=env)
    started = []  # the ranks and the forkserver, once known
    try:
        deadline = time.monotonic() + 120
        while len(rank_pids(tmp_path)) < 2 and test_process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        started = rank_pids(tmp_path)
        assert len(started) == 2, f"the ranks did not start (the test process ended with {test_process.poll()})"
        started.append(psutil.Process(started[0]).ppid())  # the forkserver they were forked from
        test_process.kill()  # SIGKILL: nothing of the test process runs any more
        test_process.wait(10)
        assert living(started) == [], "left behind"
    finally:
        test_process.kill()
        test_process.wait(10)
        for pid in living(started):  # a failed check leaves nothing behind either
            os.kill(pid, signal.SIGKILL)
