"""Multi-node training on torchrun: two launchers on localhost ("2 nodes x 1 process", gloo)
train to the same parameters as the same job run on one node by the ParallelWrapper."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dl4py

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["averaging", "shared_gradients", "sharded"])
def test_two_torchrun_nodes_match_the_single_node_run(tmp_path, mode):
    from torchrun_train import main as train_and_save

    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    single = tmp_path / "single.dl4py"
    train_and_save(str(single), mode)  # the same job on one node: spawned workers, in this process

    port = free_port()
    multi = tmp_path / "multi.dl4py"
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
             str(HERE / "torchrun_train.py"), str(multi), mode],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
    for p, out in zip(launchers, outputs):
        assert p.returncode == 0, out[-3000:]

    a, b = dl4py.load(single), dl4py.load(multi)
    assert (a.epoch_count, a.iteration_count) == (b.epoch_count, b.iteration_count) == (2, 26)
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name
