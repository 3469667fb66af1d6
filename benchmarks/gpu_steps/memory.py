"""Step 4: the memory estimate against what the device counts, and ``batch_size: auto``.

Estimate: the networks of benchmarks/memory.py (the seed LeNet, the MLP 784-4000-4000-10,
the small VGG) at two batch sizes, each a fresh network measured from before its first step
through a few training steps (the first makes the updater's state), an evaluation and a
checkpoint save, each phase's peak read on its own. On a GPU a peak is
``torch.cuda.max_memory_allocated`` less what the allocator holds beside the model and the
batch once the phases are done: cuBLAS' workspaces, made in the first step and kept, which
the estimate counts among its fixed costs rather than in its peak. On a CPU it is the live
tensor bytes ``LiveTensorBytes`` follows, as tests/test_memory.py measures.

Two targets per row. The estimate is of a training step, and docs/memory.md and
tests/test_memory.py claim it within ``TOLERANCE`` of the measured one: the training
phase's peak must be. Evaluation after training and the save are not in the estimate (the
gradients stay alive beside the evaluation's activations: a wide MLP at a small batch needs
more there than in its step); the whole life must fit what ``batch_size: auto`` leaves room
for, the estimate and its margin (``AUTO_MARGIN``).

``batch_size: auto``: the seed LeNet config trains one epoch at the batch auto chooses, with
validation, its checkpoint, the test set and the saved model: no out-of-memory error. On the
whole device the training set decides the batch (MNIST is small); on a GPU, once more under
a ``max_device_cache`` cap, which the allocator enforces, so that memory decides and a
batch too large for the cap is an out-of-memory error.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from pathlib import Path

import torch

import memory as memory_benchmark  # benchmarks/memory.py, on the path; this module is gpu_steps.memory
from dl4py import DataSet, MultiLayerNetwork, RunConfig
from dl4py.data.mnist import EXAMPLES
from dl4py.memory import LiveTensorBytes, estimate
from dl4py.memory.auto import AUTO_MARGIN
from dl4py.memory.measure import cuda_allocated_besides, resident_tensors
from dl4py.runner import train_run
from gpu_steps._check import Check

ROOT = Path(__file__).resolve().parents[2]
LENET_YAML = ROOT / "examples" / "lenet_mnist.yaml"
# What docs/memory.md claims and tests/test_memory.py asserts (its TOLERANCE) for these networks.
TOLERANCE = 0.01
# The docs' table has both. On a GPU the larger also keeps the allocator's rounding of the
# largest tensors (up to 1 MiB each, docs/memory.md) small beside LeNet's peak. --quick takes
# the first: on a CPU the MLP's 19 million parameters cost seconds a case, whatever the batch.
BATCHES = {"gpu": (128, 1024), "cpu": (32, 128)}
# LeNet's auto batch under it: about 600 (1 GiB gave 5,277 in the H200 run), below the 54,000 / 64
# = 843 that the updates-per-epoch rule allows, so the cap decides and is what the step checks.
AUTO_CAP = "128MiB"
MiB = 2**20


def run(check: Check) -> None:
    if check.gpu:
        torch.cuda.init()  # the peak statistics need the allocator started, whichever part runs first
    rows = []
    for name, file in memory_benchmark.MODELS.items():
        config = RunConfig.from_file(ROOT / "examples" / file).network
        for batch in BATCHES[check.backend][:check.steps(2, 1)]:
            with check.part(f"{name} at batch {batch}"):
                rows.append(compare(check, name, config, batch))
                check.figure("estimate_against_measured", rows)
                expect_close(check, rows[-1])
    check.figure("measured_as", "torch.cuda.max_memory_allocated less what the allocator holds beside the model "
                                "and the batch afterwards" if check.gpu else "live tensor bytes (LiveTensorBytes)")
    for case, overrides in auto_cases(check).items():
        with check.part(case):
            auto_fit(check, case, overrides)


def expect_close(check: Check, row: dict) -> None:
    case = f"{row['network']} at batch {row['batch']}"
    check.expect(abs(row["ratio"] - 1) <= TOLERANCE,
                 f"{case}: its training steps peaked at {row['measured_mib']:.2f} MiB, estimated "
                 f"{row['estimated_mib']:.2f} MiB ({row['ratio'] - 1:+.2%}; within {TOLERANCE:.0%} claimed)")
    check.expect(row["life_ratio"] >= 1 - AUTO_MARGIN,
                 f"{case}: with evaluation and save it peaked at {row['life_mib']:.2f} MiB, more than the estimate "
                 f"of {row['estimated_mib']:.2f} MiB and batch_size auto's {AUTO_MARGIN:.0%} margin allow")


# -- the estimate against a network's first steps, evaluation and save ---------------------

def compare(check: Check, name: str, config, batch: int) -> dict:
    """A row: the estimate, each phase's measured peak, and their ratios (estimate / measured)."""
    memory_benchmark.release(check.device)  # a collected, emptied allocator; cuBLAS' workspaces let go
    net = MultiLayerNetwork(config, backend=check.backend, precision="float").init()
    generator = torch.Generator().manual_seed(0)
    host = (torch.rand(batch, *config.input_type.example_shape(), generator=generator),
            torch.randint(0, 10, (batch,), generator=generator))
    features, labels = (t.to(check.device) for t in host)  # on a CPU the same tensors
    checkpoint = check.work_dir / f"{name}-{batch}.dl4py"

    def train():
        for _ in range(check.steps(3, 2)):  # the first step, then steady ones: the estimate is of those
            net.train_step(net.prepare_input(features), labels)

    phases = {"train": train, "evaluation": lambda: net.evaluate(DataSet(*host), batch_size=batch),
              "save": lambda: net.save(checkpoint)}
    peaks = {phase: peak_of(check.device, work, resident_tensors(net) + [features, labels])
             for phase, work in phases.items()}
    checkpoint.unlink()
    # Held beside the model and the batch now, so through the phases: cuBLAS' workspaces.
    outside = cuda_allocated_besides(resident_tensors(net) + [features, labels], check.device) if check.gpu else 0
    # A CPU's checkpoint copies the weights for the file into the memory it trains in; a
    # GPU's copies go to the host, outside the device the estimate is for.
    life = ("train", "evaluation", "save") if check.gpu else ("train", "evaluation")
    estimated = estimate(config, batch, "float", device=check.device.type).peak_bytes
    measured = peaks["train"] - outside
    row = {"network": name, "batch": batch, "estimated_mib": mib(estimated), "measured_mib": mib(measured),
           "ratio": round(estimated / measured, 5)}
    row.update({f"{phase}_mib": mib(peaks[phase] - outside) for phase in ("evaluation", "save")})
    whole = max(peaks[phase] for phase in life) - outside
    row.update(life_mib=mib(whole), life_ratio=round(estimated / whole, 5))
    if check.gpu:
        row["outside_mib"] = mib(outside)
    return row


def peak_of(device: torch.device, work, resident: list[torch.Tensor]) -> int:
    """The most bytes alive at once while ``work`` runs: all that the CUDA allocator holds,
    or on a CPU the ``resident`` tensors and every tensor made meanwhile."""
    if device.type == "cuda":
        del resident  # the allocator counts everything; held here, a freed gradient would stay alive
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    tracker = LiveTensorBytes()
    tracker.track(resident)
    del resident  # followed by the tracker from here: what the phase frees counts as freed
    with tracker:
        work()
    return tracker.peak


def mib(nbytes: int) -> float:
    return round(nbytes / MiB, 3)


# -- batch_size: auto --------------------------------------------------------------------

def auto_cases(check: Check) -> dict[str, list[str]]:
    """Overrides of the seed LeNet config, by case. A CPU's RAM holds far more than the small
    training set of --quick; a cap would not apply there (it bounds the CUDA allocator)."""
    limit = [] if check.gpu and not check.quick else ["data.limit_train=256", "data.limit_test=64"]
    common = ["training.batch_size=auto", "training.epochs=1", "training.score_every=0",
              f"training.backend={check.backend}", "training.precision=float", "data.validation={split: 0.1}",
              *limit]
    cases = {"auto": common}
    if check.gpu:
        cases[f"auto under max_device_cache {AUTO_CAP}"] = common + [f"environment.max_device_cache={AUTO_CAP}"]
    return cases


def auto_fit(check: Check, case: str, overrides: list[str]) -> None:
    """Train as ``dl4py train --batch-size auto`` does; an out-of-memory error is a result."""
    memory_benchmark.release(check.device)
    config = RunConfig.from_file(LENET_YAML).with_overrides(overrides)
    run_dir = check.work_dir / case.replace(" ", "-")
    if check.gpu:
        torch.cuda.reset_peak_memory_stats(check.device)
    record, error = {"completed": False}, None
    with log_lines("dl4py", "batch_size auto") as why:
        try:
            result = train_run(config, output=run_dir, progress=False)
            record.update({key: result.get(key) for key in ("iterations", "final_score", "val_accuracy",
                                                            "test_accuracy", "wall_seconds")},
                          completed=result["status"] == "completed")
        except torch.cuda.OutOfMemoryError as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    recorded = run_dir / "config.yaml"  # written with the chosen batch before training starts
    record["batch_size"] = RunConfig.from_file(recorded).training.batch_size if recorded.is_file() else None
    record.update(why=why[0] if why else None, checkpoint_saved=(run_dir / "checkpoint.dl4py").is_file(), error=error)
    if check.gpu:
        record.update(max_allocated_mib=mib(torch.cuda.max_memory_allocated(check.device)),
                      max_reserved_mib=mib(torch.cuda.max_memory_reserved(check.device)))
    check.figure(case, record)
    if error is not None:
        check.expect(False, f"{case}: out of memory at batch {record['batch_size']}: {error}")
    else:
        check.expect(record["completed"] and record["checkpoint_saved"] and _finite(record.get("final_score")),
                     f"{case}: no completed fit with a checkpoint and a finite loss: {record}")
    if "max_device_cache" in case:
        examples = config.data.limit_train or EXAMPLES["train"]
        decided = record["why"] is not None and "updates)" not in record["why"]  # memory, not the update rule
        check.expect(record["batch_size"] is not None and record["batch_size"] < examples and decided,
                     f"{case}: batch {record['batch_size']} of {examples} training examples: the cap did not decide "
                     f"({record['why']})")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@contextmanager
def log_lines(logger_name: str, prefix: str):
    """The messages starting with ``prefix`` that ``logger_name`` logs in the block, info included."""
    lines: list[str] = []
    logger, handler = logging.getLogger(logger_name), _Collect(lines, prefix)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # auto's choice is logged at info
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _Collect(logging.Handler):
    def __init__(self, lines: list[str], prefix: str):
        super().__init__(logging.INFO)
        self.lines, self.prefix = lines, prefix

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix):
            self.lines.append(record.getMessage())
