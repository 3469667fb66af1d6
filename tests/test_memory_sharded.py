"""One rank's memory in sharded training (FSDP2), measured and estimated.

Two gloo ranks, spawned once for the module, each shard a model with ``shard_replica``
and measure one training step with ``LiveTensorBytes`` (a DTensor counted by its local
shard, storages FSDP2 resizes re-read after each operator). Meanwhile the test process
measures the plain model's step on rank 0's batch: the single-process figure.
"""

from __future__ import annotations

import json
import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch

from dl4py import MultiLayerNetwork, Nesterovs, RunConfig
from dl4py.cli import main
from dl4py.errors import ConfigError
from dl4py.memory import estimate, max_parameters
from dl4py.parallel.sharding import UNIT_FRACTION

ROOT = Path(__file__).resolve().parents[1]
MLP_YAML = ROOT / "examples" / "mlp_4000.yaml"
MLP = RunConfig.from_file(MLP_YAML).network  # 784-4000-4000-10, Nesterovs with L2
LENET = RunConfig.from_file(ROOT / "examples" / "lenet_mnist.yaml").network
CASES = {"mlp": (MLP, 64), "lenet": (LENET, 256)}
WORKERS = 2
# The bound. The estimate has agreed to 8 bytes on every case measured, but on the
# CPU gloo's reduce-scatter copy is now and then kept by a rank until its next collective
# (docs/memory.md): LeNet at 256, whose peak is in its first pooling's backward, is clear of it.
TOLERANCE = 0.05


def _batch(config, batch: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    features = torch.rand(batch, *config.input_type.example_shape(), generator=generator)
    return features, torch.randint(0, 10, (batch,), generator=generator)


def _rank(rank: int, folder: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dl4py.memory import measure_training_step
    from dl4py.parallel.sharding import shard_replica

    folder = Path(folder)
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank,
                                world_size=WORKERS)
        mesh = init_device_mesh("cpu", (WORKERS,))
        peaks = {}
        for name, (config, batch) in CASES.items():
            features, labels = _batch(config, batch, seed=rank)
            net = MultiLayerNetwork(config, backend="cpu").init()
            shard_replica(net, mesh)
            peaks[name] = measure_training_step(net, features, labels).peak_bytes
        gathered = [None] * WORKERS
        dist.all_gather_object(gathered, peaks)
        if rank == 0:
            (folder / "peaks.json").write_text(json.dumps(gathered))
        dist.destroy_process_group()
    except BaseException:
        (folder / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    """Each rank's measured peaks; rank 0's also the plain model's on its batch ("single"),
    measured here while the ranks start."""
    from dl4py.memory import measure_training_step

    folder = tmp_path_factory.mktemp("sharded")
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank, args=(rank, str(folder))) for rank in range(WORKERS)]
    for process in ranks:
        process.start()
    try:
        config, batch = CASES["mlp"]
        plain = MultiLayerNetwork(config, backend="cpu").init()
        single = measure_training_step(plain, *_batch(config, batch, seed=0)).peak_bytes
        del plain
        for process in ranks:
            process.join(120)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    errors = [path.read_text() for path in sorted(folder.glob("rank*.error"))]
    assert not errors, errors[0]
    assert all(process.exitcode == 0 for process in ranks), [process.exitcode for process in ranks]
    peaks = json.loads((folder / "peaks.json").read_text())
    peaks[0]["single"] = single
    return peaks


def test_a_rank_of_two_holds_at_most_60_percent_of_the_single_process_peak(measured):
    single = measured[0]["single"]
    for rank, peaks in enumerate(measured):
        assert peaks["mlp"] <= 0.60 * single, f"rank {rank}: {peaks['mlp']:,} of {single:,}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_sharded_estimate_is_within_5_percent_of_the_measured_rank_peak(measured, name):
    config, batch = CASES[name]
    peak = max(peaks[name] for peaks in measured)  # the fullest rank (as a rule rank 0: most rows)
    report = estimate(config, batch, device="cpu", parallelism="sharded", workers=WORKERS)
    assert report.parallelism == "sharded" and report.workers == WORKERS
    assert abs(report.peak_bytes - peak) <= TOLERANCE * peak, (report.peak_bytes, peak, report.peak_phase)


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
    with pytest.raises(ConfigError, match="parallelism"):
        estimate(MLP, 64, parallelism="tensor")
    with pytest.raises(ConfigError, match="precision"):
        estimate(MLP, 64, precision="bfloat16", parallelism="sharded", workers=2)


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
