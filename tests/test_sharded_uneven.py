"""Sharded training (``parallelism="sharded"``) of a layer whose rows do not split evenly.

The 64 -> 40,000 dense layer holds 2,560,000 weights, between 2 and 3 times 2**20, so it is
gathered in 3 row blocks (``sharding.row_blocks``), cut as ``torch.tensor_split`` cuts:
13,334, 13,333 and 13,333 rows. Each block is then sharded over 2 ranks as FSDP2 does
(``torch.chunk``: 6,667 rows and 6,667 or 6,666), so neither cut is even. Where the rows
split evenly (tests/test_model_parallel.py) a block size rounded up or down, or a last block
cut one row short, gives the same blocks; here each puts rows, and their updater state, in
another block than the documented one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from dl4py import Adam, ArrayDataSetIterator, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer
from dl4py.memory.sharded import sharding_layout
from dl4py.parallel import ParallelWrapper
from dl4py.parallel.sharding import RowBlocks, shard_replica, split_large_linears, to_plain

from devices import backend_for, gpu_per_rank, on_devices, tolerance
from ranks import join_group, run_ranks

ROWS = 40_000
BLOCK_ROWS = [13_334, 13_333, 13_333]  # tensor_split's cut: the first ROWS % 3 blocks one row longer
WORKERS, BATCH, EXAMPLES = 2, 8, 40  # 5 batches: the third round is worker 0's batch alone
SPLIT_LAYER = "1.op"
ADAM_TOLERANCE = 1e-4  # tests/test_model_parallel.py's for Adam: float rounding of the mean gradient
RANKS_TIMEOUT_S = 120  # two CPU ranks take a few seconds; a hang fails naming the rank instead


def network() -> NetworkConfig:
    # Adam at 1e-2: every step moves a weight by about 1e-2, far above the tolerance.
    return NetworkConfig(layers=[DenseLayer(n_out=64, activation="tanh"), DenseLayer(n_out=ROWS, activation="relu"),
                                 OutputLayer(n_out=3)],
                         input_type=InputType.feed_forward(5), updater=Adam(1e-2), seed=11)


def toy_data():
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(EXAMPLES, 5, generator=generator)
    return x, (x[:, 0] > 0).long() + (x[:, 2] > 0.5).long()


def step(net, features, labels):
    net.train_step(net.prepare_input(features.to(net.device)), labels.to(net.device))


def plain_piece(name: str) -> tuple[str, slice]:
    """The plain parameter a sharded model's parameter comes from, and its rows there:
    ``1.op.parts.2.weight`` holds rows 26,667 to 39,999 of ``1.op.weight``."""
    layer, blocked, rest = name.partition(".parts.")
    if not blocked:
        return name, slice(None)
    block, _, leaf = rest.partition(".")
    start = sum(BLOCK_ROWS[:int(block)])
    return f"{layer}.{leaf}", slice(start, start + BLOCK_ROWS[int(block)])


def rank_share(full: torch.Tensor, name: str, rank: int) -> torch.Tensor:
    """What ``rank`` should hold of the sharded parameter ``name`` (or of its updater state)
    given the plain model's tensor: its block's rows, then FSDP2's chunk of those."""
    _, rows = plain_piece(name)
    return torch.chunk(full[rows], WORKERS, dim=0)[rank]


def local(tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def plain_state(net) -> dict[str, dict[str, torch.Tensor]]:
    """{plain parameter name: {"param", "exp_avg", "exp_avg_sq"}} on the host."""
    out = {}
    for name, p in net.module.named_parameters():
        moments = net.optimizer.state[p]
        out[name] = {"param": p.detach().cpu().clone(), **{k: moments[k].detach().cpu().clone()
                                                           for k in ("exp_avg", "exp_avg_sq")}}
    return out


def check_shards(net, expected: dict, rank: int, claim: dict) -> None:
    """Every parameter of the sharded ``net`` and its Adam moments on this rank are the rows
    ``rank_share`` names of ``expected`` (a plain model's ``plain_state``)."""
    seen = set()
    for name, p in net.module.named_parameters():
        plain, _ = plain_piece(name)
        seen.add(plain)
        moments = net.optimizer.state[p]
        for key, value in (("param", p), ("exp_avg", moments["exp_avg"]), ("exp_avg_sq", moments["exp_avg_sq"])):
            want = rank_share(expected[plain][key], name, rank)
            got = local(value)
            assert got.shape == want.shape, (rank, name, key, tuple(got.shape), tuple(want.shape))
            assert_close(got, want, **claim, msg=lambda m: f"rank {rank}, {name} {key}: {m}")
    assert seen == set(expected), sorted(set(expected) ^ seen)


def _placement_rank(rank: int, folder: str, device: str) -> None:
    """One of 2 ranks: a plain model after one Adam step is sharded; each rank's shards of
    parameters and moments are the documented rows; one sharded step on each rank's own
    batch ends where the single process ends on both batches; the gathered twin is whole."""
    join_group(rank, WORKERS, str(Path(folder) / "rendezvous"), device)
    try:
        mesh = init_device_mesh(device, (WORKERS,))
        x, y = toy_data()
        first, union = slice(0, BATCH), slice(BATCH, BATCH + WORKERS * BATCH)
        net = MultiLayerNetwork(network(), backend=backend_for(device)).init()
        reference = MultiLayerNetwork(network(), backend=backend_for(device)).init()
        for model in (net, reference):
            step(model, x[first], y[first])  # Adam's moments now differ row by row
        before = plain_state(net)
        twin = MultiLayerNetwork(network(), backend="cpu").init() if rank == 0 else None
        sharded = shard_replica(net, mesh, twin=twin)
        assert sharded.split == {SPLIT_LAYER: len(BLOCK_ROWS)}
        check_shards(net, before, rank, {"rtol": 0, "atol": 0})  # slices copied: the same bits

        mine = slice(union.start + rank * BATCH, union.start + (rank + 1) * BATCH)
        step(net, x[mine], y[mine])
        step(reference, x[union], y[union])
        after = plain_state(reference)
        claim = tolerance(device, cpu=ADAM_TOLERANCE)
        check_shards(net, after, rank, claim)
        gathered = sharded.gather()
        if rank == 0:
            whole = plain_state(gathered)
            for name, entries in after.items():
                for key, value in entries.items():
                    assert_close(whole[name][key], value, **claim, msg=lambda m: f"gathered {name} {key}: {m}")
    finally:
        dist.destroy_process_group()


@on_devices
def test_each_rank_holds_its_blocks_rows_of_parameters_and_adam_moments(device):
    gpu_per_rank(device, WORKERS)
    with tempfile.TemporaryDirectory(prefix="dl4py-uneven-") as folder:
        run_ranks(_placement_rank, (folder, device), WORKERS, RANKS_TIMEOUT_S)


@on_devices
def test_the_uneven_layer_is_cut_as_documented_and_computes_the_same(device):
    net = MultiLayerNetwork(network(), backend=backend_for(device)).init()
    plain = {name: t.detach().clone() for name, t in net.module.state_dict().items()}
    x = toy_data()[0].to(net.device)
    before = net.module(x)
    assert split_large_linears(net.module) == {SPLIT_LAYER: 3}
    parts = net.module[1].op
    assert isinstance(parts, RowBlocks)
    assert [part.out_features for part in parts.parts] == BLOCK_ROWS
    blocked = dict(net.module.state_dict())
    for name, tensor in blocked.items():
        source, rows = plain_piece(name)
        assert torch.equal(tensor, plain[source][rows]), name
    joined = to_plain(blocked, {SPLIT_LAYER: 3})
    assert joined.keys() == plain.keys()
    for name, tensor in joined.items():
        assert torch.equal(tensor, plain[name]), name
    assert_close(net.module(x), before, **tolerance(device, cpu=1e-6))
    # The memory estimate gathers the same blocks as the sharded model.
    assert [unit.block_rows for unit in sharding_layout(network()) if unit.block_rows] == BLOCK_ROWS


def single_process(device: str) -> MultiLayerNetwork:
    """One step per round on the round's batches together (the last round: batch 4 alone)."""
    net = MultiLayerNetwork(network(), backend=backend_for(device)).init()
    x, y = toy_data()
    for start in range(0, EXAMPLES, WORKERS * BATCH):
        step(net, x[start:start + WORKERS * BATCH], y[start:start + WORKERS * BATCH])
    return net


@on_devices
def test_a_sharded_fit_of_the_uneven_layer_ends_with_the_single_process_state(device):
    gpus = gpu_per_rank(device, WORKERS)
    x, y = toy_data()
    net = MultiLayerNetwork(network(), backend=backend_for(device)).init()
    ParallelWrapper(net, workers=WORKERS, parallelism="sharded", devices=gpus).fit(
        ArrayDataSetIterator(x, y, batch_size=BATCH, shuffle=False), epochs=1)
    reference = single_process(device)
    assert (net.epoch_count, net.iteration_count) == (1, EXAMPLES // BATCH)
    claim = tolerance(device, cpu=ADAM_TOLERANCE)
    ours, theirs = plain_state(net), plain_state(reference)
    for name, entries in theirs.items():
        for key, value in entries.items():
            assert_close(ours[name][key], value, **claim, msg=lambda m: f"{name} {key}: {m}")
