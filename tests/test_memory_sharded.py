"""One rank's memory in sharded training (FSDP2), measured and estimated.

Two gloo ranks (``tests/ranks.py``: bounded, named when one fails), started once for the
module on each device, each shard a model with ``shard_replica`` and measure one training
step: on the CPU with ``LiveTensorBytes`` (a DTensor counted by its local shard, storages
FSDP2 resizes re-read after each operator), on a GPU with ``torch.cuda.max_memory_allocated``
(both ranks share it; each process keeps its own allocator statistics). The test process
measures the plain model's step on rank 0's batch: the single-process figure.

What is asserted is what docs/memory.md says ("Sharded training: one rank's memory").
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dl4py import MultiLayerNetwork, Nesterovs, RunConfig
from dl4py.cli import main
from dl4py.config.parallel import ParallelPlan
from dl4py.errors import ConfigError
from dl4py.memory import estimate, max_parameters, measure_training_step
from dl4py.memory.measure import cuda_allocated_besides, resident_tensors
from dl4py.parallel.sharding import UNIT_FRACTION, shard_replica
from dl4py.train.step import make_train_step

from devices import DEVICES, backend_for, gpu_per_rank
from ranks import join_group, run_ranks
from test_memory_data_parallel import BUDGET, next_power_of_two, plans_at_the_budget
from step_peak import release_cuda, step_peak

ROOT = Path(__file__).resolve().parents[1]
MLP_YAML = ROOT / "examples" / "mlp_4000.yaml"
MLP = RunConfig.from_file(MLP_YAML).network  # 784-4000-4000-10, Nesterovs with L2
LENET = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml").network
NETWORKS = {"mlp": MLP, "lenet": LENET}
CASES = [("mlp", 64), ("lenet", 256)]  # (network, batch per rank), measured on 2 ranks of each device
# docs/memory.md's other rows, and 3 ranks: measured on a GPU only, where a step's peak is read
# off the allocator in no time (LiveTensorBytes follows every storage: a minute on the CPU).
GPU_CASES = {2: [("mlp", 128), ("mlp", 256), ("lenet", 128)], 3: [("mlp", 128)]}
WORKERS = 2
RANKS_TIMEOUT_S = 300  # both ranks measure both cases; about a minute on a loaded 2-core CPU
# docs/memory.md: on the CPU the estimate is rank 0's measured peak to 8 bytes, but for gloo's
# reduce-scatter copy, which a rank now and then keeps past the peak (a race between gloo's
# thread and the step, so no run can be told to avoid it): one gathered unit more at most.
EXACT_BYTES = 8
# On a GPU, max_memory_allocated counts allocator blocks (a block over 1 MiB may be up to 1 MiB
# larger than the request it serves) and cuDNN's workspaces, which the estimate leaves out: its
# claim there is 15% (docs/memory.md), the single process's measured gap (up to +14%).
GPU_TOLERANCE = 0.15


def _batch(config, batch: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    features = torch.rand(batch, *config.input_type.example_shape(), generator=generator)
    return features, torch.randint(0, 10, (batch,), generator=generator)


def _local(tensors) -> list[torch.Tensor]:
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def rank_step(net, features, labels) -> dict:
    """One rank's bytes in a training step of its sharded ``net`` (after a warm-up step on two
    examples, so the updater's state exists): {"peak", "resident": what it held before the
    step}. Live tensors on a CPU; on a GPU the allocator's peak, less what it held at the start
    for anything but the rank's shards, their updater state and the batch (cuBLAS'
    workspaces), as ``step_peak`` measures; no resident figure there."""
    if net.device.type != "cuda":
        step = measure_training_step(net, features, labels)
        return {"peak": step.peak_bytes, "resident": step.resident_bytes}
    release_cuda()
    step = make_train_step(net)
    features, labels = features.to(net.device), labels.to(net.device)
    step(features[:2], labels[:2])
    torch.cuda.synchronize(net.device)
    torch.cuda.reset_peak_memory_stats(net.device)
    outside = cuda_allocated_besides(_local(resident_tensors(net)) + [features, labels], net.device)
    step(features, labels)
    torch.cuda.synchronize(net.device)
    return {"peak": torch.cuda.max_memory_allocated(net.device) - outside, "resident": None}


def case_id(network: str, batch: int) -> str:
    return f"{network}-{batch}"


def _rank(rank: int, folder: str, device: str, workers: int, cases: list) -> None:
    """One rank: each case's network sharded over ``workers`` ranks, a step measured on a batch
    of its own; the peaks written to ``peaks{rank}.json`` by case."""
    join_group(rank, workers, str(Path(folder) / "rendezvous"), device)
    try:
        mesh = init_device_mesh(device, (workers,))
        peaks = {}
        for network, batch in cases:
            config = NETWORKS[network]
            features, labels = _batch(config, batch, seed=rank)
            net = MultiLayerNetwork(config, backend=backend_for(device)).init()
            shard_replica(net, mesh)
            peaks[case_id(network, batch)] = rank_step(net, features, labels)
            del net
        Path(folder, f"peaks{rank}.json").write_text(json.dumps(peaks))
    finally:
        dist.destroy_process_group()


def measure_ranks(device: str, workers: int, cases: list) -> list[dict]:
    """Each rank's measured bytes by case id (``rank_step``'s)."""
    gpu_per_rank(device, workers)
    with tempfile.TemporaryDirectory(prefix="dl4py-sharded-memory-") as folder:
        run_ranks(_rank, (folder, device, workers, cases), workers, RANKS_TIMEOUT_S)
        return [json.loads(Path(folder, f"peaks{rank}.json").read_text()) for rank in range(workers)]


@pytest.fixture(scope="module", params=DEVICES)
def measured(request) -> dict:
    """{"device", "ranks": each rank's ``rank_step`` by case id, "single": the plain model's
    peak on rank 0's batch of the MLP}."""
    device = request.param
    plain = MultiLayerNetwork(MLP, backend=backend_for(device)).init()
    single = step_peak(plain, *_batch(MLP, 64, seed=0))
    del plain
    return {"device": device, "ranks": measure_ranks(device, WORKERS, CASES), "single": single}


@pytest.fixture(scope="module")
def measured_on_the_gpu() -> dict:
    """{workers: each rank's ``rank_step`` by case id} for GPU_CASES."""
    return {workers: measure_ranks("cuda", workers, cases) for workers, cases in GPU_CASES.items()}


@pytest.mark.slow
def test_a_rank_of_two_holds_at_most_60_percent_of_the_single_process_peak(measured):
    single = measured["single"]
    for rank, steps in enumerate(measured["ranks"]):
        peak = steps["mlp-64"]["peak"]
        assert peak <= 0.60 * single, f"rank {rank}: {peak:,} of {single:,}"


def check_on_the_gpu(network: str, batch: int, workers: int, ranks: list[dict]) -> None:
    """The fullest rank's measured peak within GPU_TOLERANCE of the estimate (docs/memory.md)."""
    report = estimate(NETWORKS[network], batch, device="cuda", parallelism="sharded", workers=workers)
    peak = max(steps[case_id(network, batch)]["peak"] for steps in ranks)
    error = report.peak_bytes / peak - 1
    assert abs(error) <= GPU_TOLERANCE, (f"estimated {report.peak_bytes:,} B, measured {peak:,} B ({error:+.2%}) "
                                         f"at {report.peak_phase}")


@pytest.mark.parametrize("network, batch", CASES, ids=[case_id(*case) for case in CASES])
def test_the_sharded_estimate_is_the_fullest_ranks_measured_peak(measured, network, batch):
    device = measured["device"]
    report = estimate(NETWORKS[network], batch, device=device, parallelism="sharded", workers=WORKERS)
    assert report.parallelism == "sharded" and report.workers == WORKERS
    if device == "cuda":
        check_on_the_gpu(network, batch, WORKERS, measured["ranks"])
        return
    steps = [ranks[case_id(network, batch)] for ranks in measured["ranks"]]
    # Rank 0 holds the most rows (torch.chunk rounds up): the estimate is its figure. Between
    # steps, to the byte: its shards of the parameters, their gradients and updater state, and
    # its batch (no collective is running then, so gloo's copy plays no part).
    held = report.parameter_bytes + report.gradient_bytes + report.updater_bytes + report.input_bytes
    assert steps[0]["resident"] == held, f"rank 0 held {steps[0]['resident']:,} B between steps, estimated {held:,}"
    peaks = [step["peak"] for step in steps]
    where = (report.peak_bytes, peaks, report.peak_phase)
    over = [peak - report.peak_bytes for peak in peaks]
    kept_copy = report.gathered_unit_bytes  # the largest reduce-scatter input gloo may hold on to
    assert abs(over[0]) <= EXACT_BYTES or 0 < over[0] <= kept_copy, where
    assert all(excess <= kept_copy for excess in over), where


@pytest.mark.gpu
@pytest.mark.parametrize("workers, network, batch", [(w, *case) for w, cases in GPU_CASES.items() for case in cases],
                         ids=[f"{w}-ranks-{case_id(*case)}" for w, cases in GPU_CASES.items() for case in cases])
def test_the_sharded_estimate_holds_on_a_gpu_at_more_batch_sizes_and_ranks(measured_on_the_gpu, workers, network,
                                                                            batch):
    check_on_the_gpu(network, batch, workers, measured_on_the_gpu[workers])


def test_the_sharded_estimate_splits_state_by_rank_and_gathers_row_blocks():
    single = estimate(MLP, 64, device="cpu")
    sharded = estimate(MLP, 64, device="cpu", parallelism="sharded", workers=4)
    # ceil(rows / 4) of each tensor's rows (286-row blocks: 72 rows, 0.7% over a quarter).
    assert single.updater_bytes / 4 * 1.005 < sharded.updater_bytes < single.updater_bytes / 4 * 1.01
    # 784-4000 holds 3,136,000 of 19,184,010 weights: more than 1/16, so 3 blocks of ~1334 rows;
    # 4000-4000 is in 14 blocks of 286 or 285 rows: the largest unit is 286 rows of 4000, and bias.
    assert sharded.gathered_unit_bytes == 4 * (4 * (-(-286 // 4)) * (4000 + 1))
    with pytest.raises(ConfigError, match="workers"):
        estimate(MLP, 64, parallelism="sharded", workers=1)
    with pytest.raises(ConfigError, match="workers"):
        estimate(MLP, 64, parallelism="tensor")
    with pytest.raises(ConfigError, match="precision"):
        estimate(MLP, 64, precision="bfloat16", parallelism="sharded", workers=2)


def test_the_estimate_names_plans_in_the_plan_vocabulary():
    """``parallelism`` takes ParallelPlan's words or the plan itself; ``single``, an earlier
    word for ``data``, still gives the whole replica's step."""
    whole = estimate(MLP, 64, device="cpu")
    assert whole.parallelism == "data"
    assert estimate(MLP, 64, device="cpu", parallelism="single").to_dict() == whole.to_dict()
    plan = estimate(MLP, 64, device="cpu", parallelism=ParallelPlan("sharded"), workers=4)
    assert plan.to_dict() == estimate(MLP, 64, device="cpu", parallelism="sharded", workers=4).to_dict()
    tensor = estimate(MLP, 64, device="cpu", parallelism=ParallelPlan("tensor"), workers=2)
    assert tensor.to_dict() == estimate(MLP, 64, device="cpu", parallelism="tensor", workers=2).to_dict()
    with pytest.raises(ConfigError, match="^parallelism: hybrid: the hybrid needs layers before the first dense"):
        estimate(MLP, 64, parallelism=ParallelPlan("hybrid"), workers=2)
    with pytest.raises(ConfigError, match="^parallelism: must be data, sharded, tensor or hybrid, got 'pipeline'"):
        estimate(MLP, 64, parallelism="pipeline")


# -- max_parameters over N devices -------------------------------------------------------

def test_max_parameters_over_n_shards_follows_its_formula():
    seed = dict(precision="float", updater=Nesterovs(), reserved_bytes="400MiB", gradients=False)
    assert max_parameters("6GiB", **seed, shards=1) == 752_877_568  # the seed's single card
    budget = 6 * 2**30 - 400 * 2**20
    for shards in (2, 3, 8):
        # 8 bytes a parameter (value and momentum) over N; 3 gathered units of 4-byte values,
        # each at most 1/16 of the parameters.
        expected = budget * UNIT_FRACTION * shards // (UNIT_FRACTION * 8 + 3 * 4 * shards)
        assert max_parameters("6GiB", **seed, shards=shards) == expected
    assert max_parameters("6GiB", **seed, shards=2) == 1_268_004_325
    # Training with gradients: 12 bytes a parameter; 4 units of 4 bytes gathered.
    assert max_parameters("6GiB", "float", Nesterovs(), reserved_bytes="400MiB", shards=2) == \
        budget * 16 * 2 // (16 * 12 + 16 * 2)
    # About N times one card, less the gathered units, and never over the units' own bound.
    counts = [max_parameters("6GiB", **seed, shards=n) for n in (1, 2, 4, 64)]
    assert counts == sorted(counts)
    assert 1.6 * counts[0] < counts[1] < 2 * counts[0]
    assert counts[-1] < budget * UNIT_FRACTION // (3 * 4)
    with pytest.raises(ConfigError, match="shards"):
        max_parameters("6GiB", shards=0)


# -- the command -------------------------------------------------------------------------

def test_memory_command_gives_one_ranks_peak_when_sharded(tmp_path, capsys):
    # A config that trains sharded is reported per rank without being told.
    config = tmp_path / "sharded.yaml"
    config.write_text(RunConfig.from_file(MLP_YAML).with_overrides(
        ["training.workers=3", "training.parallelism=sharded"]).to_yaml())
    assert main(["memory", str(config), "--device", "cpu", "--batch-size", "64", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["parallelism"] == "sharded" and answer["workers"] == 3
    args = ["memory", str(MLP_YAML), "--device", "cpu", "--batch-size", "64"]
    assert main(args + ["--parallelism", "sharded", "--workers", "2", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    expected = estimate(MLP, 64, device="cpu", parallelism="sharded", workers=2)
    assert answer["peak_bytes"] == expected.peak_bytes and answer["workers"] == 2
    assert answer["parallelism"] == "sharded" and answer["fits"] is True
    assert main(args + ["--parallelism", "sharded", "--workers", "2"]) == 0
    text = capsys.readouterr().out
    assert "one rank of 2 in a sharded training step" in text and "per device" in text
    assert main(args + ["--parallelism", "sharded", "--workers", "1"]) == 2
    assert "--workers" in capsys.readouterr().err
    assert main(args + ["--workers", "2"]) == 2  # --workers means nothing to a single process
    assert "--workers" in capsys.readouterr().err


def test_memory_command_names_the_sharded_plan_that_fits(capsys):
    # 600 MiB of GPU, 544 MiB of it CUDA context and cuBLAS workspace: the MLP's 222 MiB step
    # does not fit one; sharded, each device holds its share and a few row blocks.
    args = ["memory", str(MLP_YAML), "--device-memory", "600MiB", "--batch-size", "128"]
    assert main(args + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["sharded_plan"]
    budget = 600 * 2**20
    fewest = plan["workers"]
    assert estimate(MLP, 128, parallelism="sharded", workers=fewest).needed_bytes() == \
        plan["needed_bytes_per_device"] <= budget
    fewer = (estimate(MLP, 128, parallelism="sharded", workers=fewest - 1) if fewest > 2
             else estimate(MLP, 128))
    assert fewer.needed_bytes() > budget
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"sharded over {fewest} devices" in text and "DOES NOT FIT" in text
    assert main(args + ["--batch-size", "2000000"]) == 0  # a rank's own activations cannot fit
    assert "nor sharded over any number" in capsys.readouterr().out
    assert main(args + ["--precision", "bfloat16"]) == 0  # not modelled sharded: no plan offered
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "sharded over" not in text


@pytest.mark.slow  # two ranks measure two large steps with LiveTensorBytes
@pytest.mark.timeout(RANKS_TIMEOUT_S + 60)
def test_the_sharded_plans_largest_batch_trains_within_the_budget_and_the_next_power_of_two_does_not():
    """The issue's memory line for the sharded plan on a CPU (``dl4py plan`` at the 350 MiB budget
    of tests/test_memory_data_parallel.py): its "fits" holds, each rank's step at the largest
    batch it reports stays within the budget, and at the next power of two it does not. The
    plan counts gloo's kept reduce-scatter input, so that this holds however its race goes, and
    the split layer's gradient parts added out of place, as measured here (LiveTensorBytes, a
    dispatch mode, makes autograd add them so); a plain step adds them in place, less: at the
    next power of two even that estimate is over the budget."""
    plan = plans_at_the_budget()["sharded"]
    largest, over = plan.largest_batch, next_power_of_two(plan.largest_batch)
    ranks = measure_ranks("cpu", WORKERS, [("mlp", largest), ("mlp", over)])
    peak = {batch: max(rank[case_id("mlp", batch)]["peak"] for rank in ranks) for batch in (largest, over)}
    assert plan.fits and largest >= 128 and peak[largest] <= BUDGET < peak[over], (largest, peak)
    in_place = estimate(MLP, over, device="cpu", parallelism="sharded", workers=WORKERS).needed_bytes(True)
    assert in_place > BUDGET, (over, in_place)
