"""Where this rank is, for its watchdog (``watchdog.py``): a phase, the round it trains, and
the collectives it has entered.

One rank runs per process (a pool's worker, a process torchrun started), so the rank
program writes the process's ``PHASE``; the watchdog thread reads it. Nothing here costs
the hot path more than an attribute write a round: the collectives are counted by torch
itself (each process group's sequence number, which every collective advances when it is
issued), and read only by the watchdog thread.

    PHASE.start_fit()                 # setup: the process group, the replica, the first broadcast
    PHASE.at_round(epoch, round)      # each round: "first batch", then "training"
    PHASE.enter("end of epoch")       # rank 0's listeners (a checkpoint, validation) and the gather
"""

from __future__ import annotations

import torch.distributed as dist

from dl4py.train.numbering import epoch_name, round_name

# A phase is sent as its index in this tuple (the pool's shared board holds numbers only).
PHASES = ("setup", "first batch", "training", "end of epoch", "end of fit", "between fits")
ROUND_PHASES = ("first batch", "training")
UNPLACED = ("setup", "between fits")  # no epoch or round to tell


class Phase:
    """This rank's phase, and with ``first batch`` and ``training`` the epoch and round."""

    def __init__(self):
        self.name = "setup"  # from the process's start: joining the process group is setup too
        self.epoch: int | None = None
        self.round: int | None = None
        self._rounds = 0  # rounds begun in this fit

    def enter(self, name: str) -> None:
        self.name = name

    def start_fit(self) -> None:
        self.name, self.epoch, self.round, self._rounds = "setup", None, None, 0

    def at_round(self, epoch: int, round_index: int) -> None:
        """The start of round ``round_index`` (0-based) of ``epoch``. The fit's first round
        reads and trains the first batch, which is where a slow or broken source shows."""
        self.name = "training" if self._rounds else "first batch"
        self._rounds += 1
        self.epoch, self.round = epoch, round_index

    def snapshot(self) -> tuple[int, int, int]:
        """(phase index, epoch, round), -1 for none: what the watchdog publishes. The phases
        after training keep the epoch and round it reached."""
        name, epoch, round_index = self.name, self.epoch, self.round
        if name in UNPLACED or epoch is None or round_index is None:
            return PHASES.index(name), -1, -1
        return PHASES.index(name), epoch, round_index


def describe(phase: int, epoch: int, round_index: int) -> str:
    """A published phase in words, epochs and rounds counted from 1 (``train/numbering.py``):
    ``'training' (epoch 1, round 3)``, ``'end of epoch' (epoch 1)``, ``'setup'``."""
    name = PHASES[phase] if 0 <= phase < len(PHASES) else "unknown"
    if epoch < 0:
        return f"'{name}'"
    if name in ROUND_PHASES:
        return f"'{name}' ({epoch_name(epoch)}, {round_name(round_index)})"
    return f"'{name}' ({epoch_name(epoch)})"


def collectives_entered() -> int | None:
    """How many collectives this process has issued on the process groups it belongs to
    (every rank issues the same ones, so the counts compare across ranks); None where this
    torch does not say. Read by the watchdog thread: torch's private bookkeeping, guarded."""
    try:
        if not dist.is_initialized():
            return 0
        groups = list(dist.distributed_c10d._world.pg_map)  # the groups this rank is a member of
        return sum(group._get_sequence_number_for_group() for group in groups)
    except (AttributeError, RuntimeError, ValueError):  # another torch, or a group being torn down
        return None


PHASE = Phase()  # this process's rank
