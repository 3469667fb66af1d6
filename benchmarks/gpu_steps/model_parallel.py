"""Step "model-parallel": the sharded, tensor and hybrid plans on 2 ranks, a GPU each.

These plans all-gather CUDA tensors, which NCCL does with a GPU per rank and gloo (the
transport of ranks sharing a GPU) cannot: on an H200 their workers died of SIGSEGV. dl4py
refuses ranks sharing a GPU (preflight.check_plan_transport), so on a machine with one GPU
the step checks that refusal for each plan and is skipped, saying so. On the CPU both ranks
share the host, joined by gloo.

Each plan trains as tests/test_model_parallel.py does, through the ParallelWrapper: its
network (5 -> 64 -> 17,000 -> 3: the sharded plan gathers the large layer in 2 row blocks),
70 examples in batches of 8 (the last round worker 1 sits out), 2 epochs; then a single
process on the same device trains the same batches as the plan's arithmetic says (sharded,
hybrid: one step a round on the round's batches together; tensor: one step a batch, which
both ranks train), and the largest parameter gap must be within the tests' bound. Only that
configuration: its ReLUs make the gap a matter of luck on longer runs (a unit whose input
sits within rounding of zero takes the other branch: 7e-5 on a CPU after 82 hybrid steps,
where the same run with tanh stays at 6e-8). Then a second fit on the same workers, more
batches, is timed. Figures per plan: ms per step of that fit, the workers' start-up, the
process group's backend as rank 0 sees it, rank 0's peak device memory over the timed fit's
steps beside the single process's on rounds of the same size, the gap and where it is largest.
"""

from __future__ import annotations

import math
import multiprocessing
import time

import torch

from dl4py import ArrayDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.errors import ConfigError
from dl4py.parallel import ParallelWrapper
from gpu_steps._check import Check
from gpu_steps._workers import EXPECTED_BACKEND, WorkerProbe, mib, part, toy_examples

PLANS = ("sharded", "tensor", "hybrid")
# tests/test_model_parallel.py's run, and its bound with SGD (measured there: 3e-8).
WORKERS, BATCH, EXAMPLES, EPOCHS = 2, 8, 70, 2
TOLERANCE = 1e-5
# Any wait on another process: a hang fails its plan, leaving time for the next.
TIMEOUT_S = 20.0


def run(check: Check) -> None:
    check.figure("device", str(check.device))
    if check.gpu and torch.cuda.device_count() < WORKERS:
        refused_on_one_gpu(check)
    x, y = toy_examples(EXAMPLES, seed=3)
    timing = toy_examples(check.steps(BATCH * 80, BATCH * 8), seed=4)
    rows = []
    for plan in PLANS:
        with part(check, plan):
            rows.append(train_plan(check, plan, (x, y), timing))
            check.figure("plans", rows)
    check.expect(multiprocessing.active_children() == [], "worker processes were left behind")


def refused_on_one_gpu(check: Check) -> None:
    """Each plan with its 2 workers on the one GPU: refused before any starts, one line."""
    refusals = {}
    for plan in PLANS:
        net = MultiLayerNetwork(network(), backend=check.backend).init()
        try:
            ParallelWrapper(net, workers=WORKERS, devices=[str(check.device)], parallelism=plan,
                            timeout=TIMEOUT_S).fit(batches(*toy_examples(EXAMPLES, seed=3)), epochs=1, verbose=0)
            refusals[plan] = None
        except ConfigError as error:
            refusals[plan] = str(error)
        check.expect(refusals[plan] is not None and "needs a GPU of its own for each rank" in refusals[plan],
                     f"{plan}: 2 workers on the one GPU were not refused: {refusals[plan]}")
    check.figure("refused_on_one_gpu", refusals)
    check.expect(multiprocessing.active_children() == [], "a refused plan started worker processes")
    if not check.unmet:
        check.skip(f"{torch.cuda.device_count()} GPU: the plans need a GPU for each of their {WORKERS} ranks "
                   f"(their refusal on the one GPU checked)")


def train_plan(check: Check, plan: str, data: tuple, timing: tuple) -> dict:
    net = MultiLayerNetwork(network(), backend=check.backend).init()
    probe = WorkerProbe()
    devices = [f"cuda:{rank}" for rank in range(WORKERS)] if check.gpu else [str(check.device)]
    with ParallelWrapper(net, workers=WORKERS, devices=devices, parallelism=plan,
                         timeout=TIMEOUT_S) as wrapper:
        started = time.perf_counter()
        trained = wrapper.fit(batches(*data), epochs=EPOCHS, listeners=[probe], verbose=0)
        startup = time.perf_counter() - started - sum(s.seconds for s in trained.summaries)
        loss, counters = trained.summaries[-1].mean_loss, (net.epoch_count, net.iteration_count)
        reference, single_peak = single_process(check, plan, *data)
        gap, gap_at = largest_gap(net, reference)  # before the timed fit trains ``net`` on
        timed = wrapper.fit(batches(*timing), epochs=1, listeners=[probe], verbose=0).summaries[-1]
    # Tensor: both ranks train every batch together; sharded and hybrid: one step a round.
    steps = timed.batches if plan == "tensor" else math.ceil(timed.batches / WORKERS)
    backends = sorted({str(r["backend"]) for r in probe.rows})
    row = {"plan": plan, "backend": ", ".join(backends), "ms_per_step": round(1000 * timed.seconds / steps, 2),
           "timed_steps": steps, "startup_s": round(startup, 2), "rank0_peak_mib": probe.rows[-1]["steps_peak_mib"],
           "single_peak_mib": single_peak, "gap": gap, "gap_at": gap_at, "loss": round(loss, 5)}
    expected = (EPOCHS, EPOCHS * math.ceil(EXAMPLES / BATCH))
    expected_backend = "nccl" if check.gpu else EXPECTED_BACKEND  # a GPU each; on the CPU, the host shared
    check.expect(backends == [expected_backend],
                 f"{plan}: process group backend {backends}, expected {expected_backend}")
    check.expect(counters == expected, f"{plan}: epochs and iterations {counters}, expected {expected}")
    check.expect(math.isfinite(loss) and math.isfinite(timed.mean_loss), f"{plan}: a loss is not finite")
    check.expect(gap < TOLERANCE, f"{plan}: largest gap to the single process {gap:.3g} (at {gap_at}), "
                                  f"bound {TOLERANCE:g}")
    return row


def batches(x: torch.Tensor, y: torch.Tensor) -> ArrayDataSetIterator:
    return ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False)


def network() -> NetworkConfig:
    """tests/test_model_parallel.py's: 64 -> 17,000 holds over 1/16 of the weights and over 2**20."""
    return NetworkConfig(layers=[DenseLayer(n_out=64, activation="tanh"), DenseLayer(n_out=17_000, activation="relu"),
                                 OutputLayer(n_out=3)],
                         input_type=InputType.feed_forward(5), updater=Sgd(0.1), seed=7)


def single_process(check: Check, plan: str, x: torch.Tensor, y: torch.Tensor):
    """The plan's arithmetic in one process on the same device: returns the model and its
    peak device memory (MiB above what this process held before; None on a CPU)."""
    if check.gpu:
        torch.cuda.synchronize(check.device)
        before = torch.cuda.memory_allocated(check.device)
        torch.cuda.reset_peak_memory_stats(check.device)
    net = MultiLayerNetwork(network(), backend=check.backend).init()
    starts = list(range(0, len(x), BATCH))
    if plan == "tensor":
        steps = [(s, s + BATCH) for s in starts]
    else:  # each round's batches together; the last round may be one rank's batch alone
        steps = [(starts[r], starts[min(r + WORKERS, len(starts)) - 1] + BATCH) for r in range(0, len(starts), WORKERS)]
    features, labels = x.to(check.device), y.to(check.device)
    for _ in range(EPOCHS):
        for first, end in steps:
            net.train_step(net.prepare_input(features[first:end]), labels[first:end])
    peak = None
    if check.gpu:
        torch.cuda.synchronize(check.device)
        peak = mib(torch.cuda.max_memory_allocated(check.device) - before)
    return net, peak


def largest_gap(a, b) -> tuple[float, str]:
    """The largest absolute difference between the two models' tensors, and which tensor."""
    gaps = {name: (p - q).abs().max().item()
            for (name, p), q in zip(a.module.state_dict().items(), b.module.state_dict().values())}
    name = max(gaps, key=gaps.get)
    return gaps[name], name
