"""Multi-node training on torchrun: two launchers on localhost ("2 nodes x 1 process", gloo)
train to the same parameters as the same job run on one node by the ParallelWrapper.

Bounded: the launchers have ``NODES_TIMEOUT`` seconds together, and ``GRACE_AFTER_FAILURE``
once one has failed. A node still running then is named, and killed with its ranks, which
torchrun starts each in a session of its own (killing the launcher's process group alone would
leave them waiting in a collective for ever).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import dl4py

from torchrun_train import main as train_and_save  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
# Both launchers, from start to exit: each imports torch twice (torchrun, then its rank) on a
# 2-core machine; a rank that waits for a peer gives up by itself after torchrun_train's
# RANK_TIMEOUT, well within this.
NODES_TIMEOUT = 300
# Once a node has failed, how long the other may take to notice (its rank's watchdog, a lost
# peer) and end by itself before it is killed.
GRACE_AFTER_FAILURE = 30
POLL_S = 0.2
OUTPUT_TAIL = 3000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(node: int, port: int, args: list[str], env: dict, log: Path) -> subprocess.Popen:
    """torchrun for ``node`` of 2, in a session of its own, its output in ``log``."""
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", *args],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )


def stop_node(launcher: subprocess.Popen) -> None:
    """Kill the launcher, its process group and every process it started, whatever group each
    is in (torchrun's ranks are session leaders), and reap it."""
    try:
        family = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    groups = {launcher.pid}
    for process in family:
        try:
            groups.add(os.getpgid(process.pid))
        except ProcessLookupError:
            continue
    groups.discard(os.getpgrp())  # never this test's own
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in family:  # one in a group of its own making, if any, by its id
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    launcher.wait()


def run_nodes(launchers: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    """Wait for every launcher to end within ``timeout`` s; fail naming each node that did
    not (killed, with its ranks) or that exited with an error, with the end of its output."""
    deadline, failed = time.monotonic() + timeout, False
    try:
        while any(p.poll() is None for p in launchers) and time.monotonic() < deadline:
            if not failed and any(p.returncode not in (None, 0) for p in launchers):
                failed, deadline = True, min(deadline, time.monotonic() + GRACE_AFTER_FAILURE)
            time.sleep(POLL_S)
        hung = [node for node, p in enumerate(launchers) if p.poll() is None]
    finally:
        for launcher in launchers:
            stop_node(launcher)
    waited = f"within {GRACE_AFTER_FAILURE} s of the other's failure" if failed else f"within {timeout:g} s"
    problems = []
    for node, (launcher, log) in enumerate(zip(launchers, logs)):
        if node in hung:
            how = f"did not finish {waited} (killed, with its ranks)"
        elif launcher.returncode != 0:
            how = f"exited with code {launcher.returncode}"
        else:
            continue
        problems.append(f"node {node} (torchrun --node-rank={node}) {how}; its output ends:\n"
                        f"{log.read_text()[-OUTPUT_TAIL:]}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["averaging", "shared_gradients", "sharded"])
def test_two_torchrun_nodes_match_the_single_node_run(tmp_path, mode):
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    single = tmp_path / "single.dl4py"
    train_and_save(str(single), mode)  # the same job on one node: spawned workers, in this process

    port = free_port()
    multi = tmp_path / "multi.dl4py"
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    launchers = []
    try:
        for node in (0, 1):
            launchers.append(start_node(node, port, [str(HERE / "torchrun_train.py"), str(multi), mode], env,
                                        logs[node]))
    except BaseException:
        for launcher in launchers:
            stop_node(launcher)
        raise
    run_nodes(launchers, logs, NODES_TIMEOUT)

    a, b = dl4py.load(single), dl4py.load(multi)
    assert (a.epoch_count, a.iteration_count) == (b.epoch_count, b.iteration_count) == (2, 26)
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name
