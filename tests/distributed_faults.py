"""Faults of one rank, for tests/test_reliability_distributed.py: a toy data source that
makes rank 1 signal itself, stop answering or die, and the program torchrun runs.

    python -m torch.distributed.run --nproc-per-node=2 distributed_faults.py FAULT MODE TIMEOUT OUT

trains the toy network for one epoch with a ParallelWrapper (rank 0 keeps a checkpoint in
OUT) and prints, on each rank, one line ``rank R: STATUS epoch E iteration I batch B``.
FAULT: ``sigterm`` (rank 1 sends itself SIGTERM reading its 5th batch), ``sleep`` (rank 1
sleeps a minute before its 3rd batch), ``exit`` (rank 1 exits before its fit starts).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from dl4py import ArrayDataSetIterator, MultiLayerNetwork
from dl4py.train import TrainingInterrupted
from dl4py.train.listeners import CheckpointListener

from toy import mlp, toy

BATCH, BATCHES = 8, 32  # 16 rounds of two workers an epoch
FAULTY_RANK = 1
SLEEP_SECONDS = 60.0  # far longer than the watchdog's bound in the tests


class RankFault(ArrayDataSetIterator):
    """Toy batches; rank 1 (of the process group) meets ``fault`` as it reads its ``at``-th
    batch of this copy: ``sigterm`` (a signal to this rank alone), ``sleep`` (it stops
    answering), ``kill`` (SIGKILL). With ``fault="kill in setup"`` rank 1 dies as a pool's
    worker unpacks its job, before the fit's first collective."""

    def __init__(self, features, labels, fault: str, at: int = 1, **kwargs):
        super().__init__(features, labels, BATCH, **kwargs)
        self.fault, self.at, self._read = fault, at, 0

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.fault == "kill in setup" and _is_faulty_rank():
            os.kill(os.getpid(), signal.SIGKILL)

    def _batch(self, indices):
        if _is_faulty_rank():
            self._read += 1
            if self._read == self.at:
                if self.fault == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                elif self.fault == "sleep":
                    time.sleep(SLEEP_SECONDS)
                elif self.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
        return super()._batch(indices)


def _is_faulty_rank() -> bool:
    return dist.is_initialized() and dist.get_rank() == FAULTY_RANK


def toy_data(fault: str | None = None, at: int = 1):
    x, y = toy(BATCH * BATCHES)
    if fault is None:
        return ArrayDataSetIterator(x, y, BATCH, shuffle=True, seed=1)
    return RankFault(x, y, fault, at, shuffle=True, seed=1)


def main(fault: str, mode: str, timeout: float, out: str) -> int:
    from dl4py.parallel import ParallelPlan, ParallelWrapper

    rank = int(os.environ["RANK"])
    if fault == "exit" and rank == FAULTY_RANK:
        sys.exit(3)  # dies before its fit: it never reaches the process group
    net = MultiLayerNetwork(mlp(), backend="cpu")
    options = {"averaging_frequency": 2} if mode == "averaging" else {}
    at = {"sigterm": 5, "sleep": 3}.get(fault, 1)
    plan = ParallelPlan.from_training_mode(mode)
    wrapper = ParallelWrapper(net, parallelism=plan, prefetch_buffer=0, timeout=timeout, **options)
    status = "completed"
    try:
        wrapper.fit(toy_data(fault, at), listeners=[CheckpointListener(os.path.join(out, "checkpoint.dl4py"))],
                    verbose=0)
    except TrainingInterrupted as exc:
        status = f"interrupted ({exc})"
    # One write, newline included: the ranks share torchrun's stdout, and print's two writes
    # (the text, then the newline) interleave with the other rank's under PYTHONUNBUFFERED.
    sys.stdout.write(f"rank {rank}: {status} epoch {net.epoch_count} iteration {net.iteration_count} "
                     f"batch {net.batch_in_epoch}\n")
    sys.stdout.flush()
    return 130 if status != "completed" else 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]))
