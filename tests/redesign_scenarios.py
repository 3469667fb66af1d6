"""Small, deterministic training runs whose results must not change across issue 30's redesign.

Each scenario trains a tiny network (8 inputs, 3 classes, 96 or 104 fixed rows) for one or two
epochs through the public API only (a config dict as a YAML file holds it, ``fit``,
``ParallelWrapper`` and its options, ``save``/``load``) and returns what it ended with, as
numpy arrays (``trained_state``). ``tests/fixtures/redesign/`` holds each scenario's result
made by the code before the redesign; ``test_redesign_exact.py`` compares them bit for bit.

One intra-op thread in this process (``one_thread``). CPU workers get ``cores / workers``
threads each (docs/parallel.md; no option sets it): 1 on the 2-core machine the fixtures were
made on, and the tensor and hybrid modes end on other bits with other counts (the data-parallel
modes kept theirs at 8). Parallel scenarios start worker processes and are the ``PARALLEL`` ones.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from dl4py import ArrayDataSetIterator, MultiLayerNetwork, NetworkConfig, load
from dl4py.parallel import ParallelWrapper

INPUTS, CLASSES, BATCH = 8, 3, 16
OVERFLOWS = 30.0  # features scaled so: float16 gradients overflow at first (batches(overflow=))
EVERY = "every"  # batches(overflow=EVERY): every batch overflows
COUNTERS = ("epoch_count", "iteration_count", "update_count", "batch_in_epoch")


# ---- what a scenario ends with ---------------------------------------------------------------

def _array(value: torch.Tensor) -> np.ndarray:
    """The tensor's values as numpy holds them exactly: bfloat16, which numpy lacks, widened
    to float32 (every bfloat16 is a float32); its own dtype is kept beside it."""
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.numpy().copy()


def _tensors(prefix: str, tensors: dict) -> dict[str, np.ndarray]:
    out = {}
    for name, value in tensors.items():
        out[f"{prefix}/{name}"] = _array(value)
        out[f"dtype/{prefix}/{name}"] = np.array(str(value.dtype))
    return out


def trained_state(model, precision: str, folder: Path) -> dict[str, np.ndarray]:
    """Every parameter and buffer (``module/<state-dict name>``), the float32 master weights
    of a 16-bit model (``master/<name>``: loading its file as ``float`` gives them, as
    docs/precision.md promises), the updater's state and learning rates, the counters and
    the last score."""
    state = _tensors("module", model.module.state_dict())
    path = folder / "trained.dl4py"
    model.save(path)
    if precision in ("half", "bfloat16"):
        state.update(_tensors("master", load(path, backend="cpu", precision="float").module.state_dict()))
    optimizer = model.optimizer.state_dict()
    for index, entries in optimizer["state"].items():
        state.update(_tensors(f"updater/{index}", {key: torch.as_tensor(value) for key, value in entries.items()}))
    for group, settings in enumerate(optimizer["param_groups"]):
        state[f"learning_rate/{group}"] = np.array(float(settings["lr"]))
    for counter in COUNTERS:
        state[counter] = np.array(int(getattr(model, counter)))
    state["last_score"] = np.array(float(model.last_score))
    return state


def difference(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> str | None:
    """None when ``actual`` holds ``expected``'s entries bit for bit (dtype and shape included;
    -0.0 is not 0.0, a NaN equals the same NaN); else what differs: the entries missing or
    added, the first entry that differs, the largest difference over all of them."""
    missing, added = [k for k in expected if k not in actual], [k for k in actual if k not in expected]
    if missing or added:
        return f"entries missing: {missing}; entries not in the fixture: {added}"
    differing = [k for k in expected if not _same_bits(expected[k], actual[k])]
    if not differing:
        return None
    first = differing[0]
    gaps = {k: _largest_gap(expected[k], actual[k]) for k in differing}
    widest = max(gaps, key=gaps.get)
    return (f"{len(differing)} of {len(expected)} entries differ, first {first} "
            f"(fixture {_show(expected[first])}, now {_show(actual[first])}); "
            f"largest difference {gaps[widest]:.6g} in {widest}")


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _largest_gap(a: np.ndarray, b: np.ndarray) -> float:
    """The largest absolute difference of two numeric entries: inf where their shapes or
    kinds differ or one holds a NaN the other does not; 0 where only the dtype or the bits
    differ (-0.0 and 0.0)."""
    if a.shape != b.shape or a.dtype.kind not in "fiub" or b.dtype.kind not in "fiub":
        return float("inf")
    a, b = a.astype(np.float64), b.astype(np.float64)
    gap = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    return float(np.nan_to_num(gap, nan=np.inf).max()) if gap.size else 0.0


def _show(value: np.ndarray) -> str:
    if value.shape == () or value.dtype.kind == "U":
        return repr(value.item()) if value.shape == () else repr(value)
    return f"{value.dtype}{list(value.shape)}"


@contextlib.contextmanager
def one_thread():
    """One intra-op thread while a scenario runs (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---- data and networks -----------------------------------------------------------------------

def rows(n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, INPUTS, generator=generator)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def batches(n: int = 96, shuffle: bool = False, seed: int = 0, overflow=()) -> ArrayDataSetIterator:
    """``overflow``: the batches (by position before any shuffle; ``EVERY`` batch) whose
    features are scaled by ``OVERFLOWS``: their float16 gradients overflow under the initial
    loss scale (2**16), so such steps are skipped and the scale halved until they fit."""
    x, y = rows(n, seed)
    factor = torch.ones(n, 1)
    for index in range(0, n, BATCH) if overflow is EVERY else (i * BATCH for i in overflow):
        factor[index:index + BATCH] = OVERFLOWS
    return ArrayDataSetIterator(x * factor, y, batch_size=BATCH, shuffle=shuffle, seed=5)


def network(updater: dict, hidden: tuple[dict, ...] = ({"type": "dense", "n_out": 16, "activation": "tanh"},),
            **settings) -> NetworkConfig:
    """The network as a run config's ``network:`` section spells it."""
    return NetworkConfig.from_dict({
        "seed": 7, "updater": updater, "input_type": {"type": "feed_forward", "size": INPUTS},
        "layers": [*hidden, {"type": "output", "n_out": CLASSES}], **settings})


SGD = {"type": "sgd", "learning_rate": 0.1}
ADAM = {"type": "adam", "learning_rate": 0.01}
DROPOUT = {"type": "dropout", "rate": 0.25}
# Tensor and hybrid modes split dense pairs: 16 and 17 units (17 splits unevenly, 9 + 8).
PAIR = ({"type": "dense", "n_out": 16, "activation": "tanh"}, {"type": "dense", "n_out": 17, "activation": "relu"})


def fit_single(config: NetworkConfig, precision: str, data, epochs: int, folder: Path, **fit_options):
    with one_thread():
        model = MultiLayerNetwork(config, backend="cpu", precision=precision).init()
        model.fit(data, epochs=epochs, verbose=0, **fit_options)
    return trained_state(model, precision, folder)


def fit_parallel(config: NetworkConfig, data, epochs: int, folder: Path, precision: str = "float", **options):
    model = MultiLayerNetwork(config, backend="cpu", precision=precision).init()
    with one_thread(), ParallelWrapper(model, **options) as wrapper:
        wrapper.fit(data, epochs=epochs, verbose=0)
    return trained_state(model, precision, folder)


def fit_parallel_resumed(config: NetworkConfig, folder: Path, **options):
    """An epoch on one device (the updater's state made, the weights moved), saved and
    loaded, then an epoch through the plan: each rank must start from the file's weights and
    updater state, not from a fresh build."""
    with one_thread():
        model = MultiLayerNetwork(config, backend="cpu").init()
        model.fit(batches(96, seed=1), epochs=1, verbose=0)
    model.save(folder / "first.dl4py")
    model = load(folder / "first.dl4py", backend="cpu")
    with one_thread(), ParallelWrapper(model, **options) as wrapper:
        wrapper.fit(batches(104), epochs=1, verbose=0)
    return trained_state(model, "float", folder)


# ---- single device: one per precision, each with its own part of the step --------------------

def single_float(folder: Path):
    """Dropout (the per-batch seeded randomness), a shuffled epoch order."""
    return fit_single(network(SGD, ({"type": "dense", "n_out": 16, "activation": "tanh"}, DROPOUT)), "float",
                      batches(shuffle=True), epochs=2, folder=folder)


def single_double(folder: Path):
    """A learning rate scheduled by updates (Nesterov momentum)."""
    updater = {"type": "nesterovs", "learning_rate": 0.05, "momentum": 0.9,
               "schedule": {"type": "step", "decay_rate": 0.5, "step": 4}}
    return fit_single(network(updater), "double", batches(), epochs=2, folder=folder)


def single_half(folder: Path):
    """float16 with float32 masters and loss scaling (2 of 12 steps overflow and are
    skipped); gradients clipped per layer."""
    return fit_single(network(SGD, gradient_normalization="clip_l2_per_layer", gradient_normalization_threshold=0.5),
                      "half", batches(overflow=EVERY), epochs=2, folder=folder)


def single_bfloat16(folder: Path):
    """Two batches to an update; 7 batches an epoch, so each epoch ends on an open window."""
    return fit_single(network(ADAM), "bfloat16", batches(104), epochs=2, folder=folder, accumulate_batches=2)


def single_mixed_fp16(folder: Path):
    """Autocast to float16 with loss scaling (steps skipped on overflow), Adam, L2, dropout."""
    config = network(ADAM, ({"type": "dense", "n_out": 16, "activation": "relu"}, DROPOUT), l2=1e-3)
    return fit_single(config, "mixed-fp16", batches(shuffle=True, overflow=EVERY), epochs=2, folder=folder)


def single_mixed_bf16(folder: Path):
    """Autocast to bfloat16, RMSprop scheduled by epochs, elementwise clipping (a threshold
    that clips gradients on both sides)."""
    updater = {"type": "rmsprop", "learning_rate": 0.01,
               "schedule": {"type": "exponential", "gamma": 0.5, "unit": "epoch"}}
    config = network(updater, gradient_normalization="clip_element_wise_absolute_value",
                     gradient_normalization_threshold=0.05)
    return fit_single(config, "mixed-bf16", batches(), epochs=2, folder=folder)


# ---- parallel: each starts worker processes on the CPU ---------------------------------------
# The plans are spelt as the code before the redesign spelt them (training_mode=, which the
# redesigned code still reads, noting it as deprecated), so make_fixtures.py runs these
# scenarios on commit 0b0d295 as they are.

def averaging(folder: Path):
    """2 workers averaging every 2 rounds (parameters and Adam's moments); 7 batches an epoch."""
    return fit_parallel(network(ADAM), batches(104, shuffle=True), 2, folder, workers=2, averaging_frequency=2)


def shared_gradients(folder: Path):
    """2 workers sharing gradients every step, dropout in each (its own stream per worker)."""
    config = network(SGD, ({"type": "dense", "n_out": 16, "activation": "tanh"}, DROPOUT))
    return fit_parallel(config, batches(104), 2, folder, workers=2, training_mode="shared_gradients")


def sharded(folder: Path):
    """FSDP over 2 workers, Adam; the last round one worker sits out."""
    return fit_parallel(network(ADAM), batches(104), 2, folder, workers=2, training_mode="sharded")


def sharded_mixed_fp16(folder: Path):
    """FSDP with autocast to float16 and loss scaling, steps skipped on overflow."""
    return fit_parallel(network(SGD), batches(104, overflow=EVERY), 1, folder, precision="mixed-fp16", workers=2,
                        training_mode="sharded")


def averaging_mixed_fp16(folder: Path):
    """Each worker's loss scale follows its own overflows (worker 0's batches in rounds 1 and 2,
    worker 1's in round 3), and the workers agree on the smallest at each average: worker 1's
    third step fits under worker 0's scale, not under its own."""
    return fit_parallel(network(SGD), batches(104, overflow=(0, 2, 5)), 2, folder, precision="mixed-fp16",
                        workers=2, averaging_frequency=2)


def tensor(folder: Path):
    """The dense pair split over 2 ranks, both training every batch."""
    return fit_parallel(network(SGD, PAIR), batches(104), 2, folder, workers=2, training_mode="tensor")


def hybrid(folder: Path):
    """Each of 2 ranks its own batch, gathered at the split dense pair."""
    return fit_parallel(network(SGD, PAIR), batches(104), 2, folder, workers=2, training_mode="hybrid")


def hybrid_2x2(folder: Path):
    """4 ranks as 2 data groups of 2 tensor ranks (``tensor_parallel_size=2``)."""
    return fit_parallel(network(ADAM, PAIR), batches(104), 1, folder, workers=4, training_mode="hybrid",
                        tensor_parallel_size=2)


def sharded_resumed(folder: Path):
    """FSDP over 2 workers from a file with Adam's moments and step."""
    return fit_parallel_resumed(network(ADAM), folder, workers=2, training_mode="sharded")


def tensor_resumed(folder: Path):
    """The dense pair split over 2 ranks from a file with Adam's moments and step."""
    return fit_parallel_resumed(network(ADAM, PAIR), folder, workers=2, training_mode="tensor")


SINGLE = {f.__name__: f for f in (single_float, single_double, single_half, single_bfloat16, single_mixed_fp16,
                                  single_mixed_bf16)}
PARALLEL = {f.__name__: f for f in (averaging, averaging_mixed_fp16, shared_gradients, sharded, sharded_mixed_fp16,
                                    tensor, hybrid, hybrid_2x2, sharded_resumed, tensor_resumed)}
SCENARIOS = {**SINGLE, **PARALLEL}
