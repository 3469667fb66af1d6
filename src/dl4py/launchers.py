"""Who starts the ranks of a run's training: ``dl4py train --launcher spawn|torchrun|spark``.

- ``spawn`` (the default): the ParallelWrapper starts its workers on this machine.
- ``torchrun``: this process is one rank that torchrun started (``RANK``, ``WORLD_SIZE``
  and ``LOCAL_RANK`` are set; the default there). ``training.workers`` is the world size;
  rank 0 writes the run directory, the other ranks train beside it and write nothing.
- ``spark``: the ranks are Spark tasks (``dl4py.spark``) on ``spark_master`` (default
  ``local[workers]``); this process is the driver and writes the run directory.

Every launcher runs the same rank program; the run directory is the same whichever did.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dl4py.config.parallel import AUTO, ParallelOptions
from dl4py.errors import ConfigError
from dl4py.parallel import launched_by_torchrun

LAUNCHERS = ("spawn", "torchrun", "spark")


@dataclass(frozen=True)
class Launcher:
    name: str = "spawn"
    spark_master: str | None = None

    @property
    def rank(self) -> int:
        """This process's rank: torchrun's ``RANK``, else 0 (the only process that writes)."""
        return int(os.environ["RANK"]) if self.name == "torchrun" else 0

    @property
    def world(self) -> int | None:
        """The ranks torchrun started (``WORLD_SIZE``); None where dl4py starts them."""
        return int(os.environ["WORLD_SIZE"]) if self.name == "torchrun" else None


def choose_launcher(name: str | None, spark_master: str | None, config):
    """``(Launcher, config)``: the launcher asked for (None: torchrun when this process was
    started by it, else spawn), checked against how this process was started and what the
    config asks; under torchrun, ``training.workers`` left at 1 becomes the world size."""
    launched = launched_by_torchrun()
    name = name or ("torchrun" if launched else "spawn")
    if name not in LAUNCHERS:
        raise ConfigError("launcher", f"must be one of {', '.join(LAUNCHERS)}, got {name!r}")
    if spark_master is not None and name != "spark":
        raise ConfigError("spark_master", "applies to launcher spark only")
    if name == "torchrun" and not launched:
        raise ConfigError("launcher", "torchrun means torchrun started this process, but RANK, WORLD_SIZE and "
                                      "LOCAL_RANK are not set: start it as `torchrun --nproc-per-node=N -m dl4py "
                                      "train CONFIG ...` (on each machine; see docs/multi-node.md), or leave "
                                      "--launcher out to spawn the workers here")
    if name != "torchrun" and launched:
        raise ConfigError("launcher", f"is {name} but torchrun started this process (RANK is set): leave "
                                      "--launcher out (or give torchrun), or run dl4py without torchrun")
    training = config.training
    if name == "torchrun":
        world = int(os.environ["WORLD_SIZE"])
        if training.workers == AUTO or (training.workers == 1 and world > 1):
            config = config.with_overrides([f"training.workers={world}"])
        elif training.workers != world:
            raise ConfigError("training.workers", f"is {training.workers} but torchrun started {world} "
                                                  "processes; leave it out under torchrun")
    if name == "spark":
        try:
            import dl4py.spark  # noqa: F401  # optional: pyspark (extra spark), tried before any run directory exists
        except ImportError as exc:
            raise ConfigError("launcher", f"spark: {exc}") from None
        if training.early_stopping is not None:
            raise ConfigError("training.early_stopping", "is not supported with launcher spark: rank 0 would score "
                                                         "and keep the best model on an executor; use spawn or "
                                                         "torchrun for early stopping")
        if training.batch_size == "auto":
            raise ConfigError("training.batch_size", "auto measures this machine's device, but with launcher spark "
                                                     "the ranks train on the executors: give a number")
    return Launcher(name, spark_master), config


def fit_on_spark(launcher: Launcher, model, options: ParallelOptions, train, epochs: int, listeners: list,
                 validation, use_gpu: bool = False):
    """The run's fit with Spark tasks as its ranks (one GPU each with ``use_gpu``: the run's
    backend is ``gpu``); this process is the driver, and each task receives ``options``."""
    from dl4py.spark import SparkTrainer, spark_session  # optional: pyspark (extra spark)

    with spark_session(launcher.spark_master, workers=options.workers) as spark:
        trainer = SparkTrainer(model, spark=spark, use_gpu=use_gpu, options=options)
        return trainer.fit(train, epochs, listeners, validation=validation, verbose=0)  # the runner's own
