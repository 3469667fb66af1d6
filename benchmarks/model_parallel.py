"""Step time and per-rank memory of the parallel plans: data, sharded, tensor, hybrid.

    python benchmarks/model_parallel.py [--device auto|cpu|gpu] [--quick] [--steps 10] [--repeats 3]
                                        [--global-batch 128]

Two ranks (gloo on a CPU, NCCL on GPUs) train two networks under each plan, converted as
the rank program converts them (``parallel/rank.py``): ``data`` (shared gradients, every
parameter whole on every rank), ``sharded`` (FSDP2), ``tensor`` (dense pairs split; both
ranks train the same batch), ``hybrid`` (data-parallel convolutions, tensor-parallel
dense layers on the gathered batch).

- ``mlp``: the seed's MLP 784-4000-4000-10 (examples/mlp_4000.yaml), 19.2M parameters;
- ``hybrid-net``: a LeNet whose dense part is large (conv 20, pool, conv 50, pool, dense
  2048, dense 2048, output 10; 5.4M parameters, 95% of them dense).

Each step is one update on ``--global-batch`` examples: half on each rank, but the whole
batch on both in the tensor plan. Per-rank peak: ``LiveTensorBytes`` over one step (rank
0's), against a single process training the global batch. Step time: the plans run in
turn (A, B, C, D, A, ...), ``--steps`` steps each, ``--repeats`` rounds, in the same two
processes; the figure is the median round's time per step, and the ratio is to the data
plan's. Writes model-parallel-<cpu|gpu>.json and .md to --out.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import device_of, heading, label, machine, parser, write
from dl4py import MultiLayerNetwork, NetworkConfig, RunConfig
from dl4py.nn.loading import network_model

ROOT = Path(__file__).resolve().parents[1]
PLANS = ("data", "sharded", "tensor", "hybrid")


def networks() -> dict[str, NetworkConfig]:
    mlp = RunConfig.from_file(ROOT / "examples" / "mlp_4000.yaml").network
    hybrid = RunConfig.from_file(ROOT / "examples" / "lenet_dense_head.yaml").network
    return {"mlp": mlp, "hybrid-net": hybrid}


def batch(config: NetworkConfig, size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(size, *config.input_type.example_shape(), generator=generator),
            torch.randint(0, 10, (size,), generator=generator))


def converted(config, plan: str, device: torch.device):
    """A replica as the rank program makes it for ``plan`` (data: shared gradients), a network
    or a graph (benchmarks/plan.py's residual graph)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dl4py.parallel.averaging import share_gradients, stepped_parameters
    from dl4py.parallel.sharding import shard_replica
    from dl4py.parallel.tensor_parallel import apply_tensor_parallel

    backend = "gpu" if device.type == "cuda" else "cpu"
    model = network_model(config, backend=backend).init()
    model.module.train()
    if plan == "data":
        params = stepped_parameters(model)
        model.share_gradients(lambda took_part: share_gradients(params, took_part))
        return model
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if plan == "sharded":
        shard_replica(model, mesh)
        return model
    layout = apply_tensor_parallel(model, mesh, hybrid=plan == "hybrid")
    model.share_gradients(layout.gradient_hook)
    return model


def rank_main(rank: int, world: int, port: int, device_choice: str, args, out: str) -> None:
    from dl4py.memory.measure import measure_training_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank}") if device_choice == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    results = {}
    for name, config in networks().items():
        models = {plan: converted(config, plan, device) for plan in PLANS}
        data = {}
        for plan, model in models.items():
            size = args.global_batch if plan == "tensor" else args.global_batch // world
            features, labels = batch(config, size, seed=rank if plan != "tensor" else 0)
            data[plan] = (model.prepare_input(features.to(device)), labels.to(device))
            for _ in range(2):  # warm-up: updater state, kernels
                model.train_step(*data[plan])
        times = {plan: [] for plan in PLANS}
        for _ in range(args.repeats):
            for plan, model in models.items():
                dist.barrier()
                started = time.perf_counter()
                for _ in range(args.steps):
                    loss = model.train_step(*data[plan])
                float(loss)  # the last step done, on a GPU too
                dist.barrier()
                times[plan].append((time.perf_counter() - started) / args.steps)
        peaks = {}
        for plan, model in models.items():
            measured = measure_training_step(model, *data[plan])
            peaks[plan] = measured.peak_bytes
        results[name] = {"seconds_per_step": times, "rank_peak_bytes": peaks}
        del models
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def single_process_peaks(global_batch: int, device: torch.device) -> dict[str, int]:
    from dl4py.memory.measure import measure_training_step

    peaks = {}
    for name, config in networks().items():
        model = MultiLayerNetwork(config, backend="gpu" if device.type == "cuda" else "cpu").init()
        peaks[name] = measure_training_step(model, *batch(config, global_batch, seed=0)).peak_bytes
    return peaks


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=128)
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats = 2, 1
    device = device_of(args.device)
    world = 2
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise SystemExit(f"model_parallel: needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    single = single_process_peaks(args.global_batch, device)
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "ranks.pt")
        mp.spawn(rank_main, args=(world, free_port(), device.type, args, out), nprocs=world)
        ranks = torch.load(out)
    figures = {}
    for name in networks():
        seconds = {plan: statistics.median(ranks[0][name]["seconds_per_step"][plan]) for plan in PLANS}
        peaks = {plan: max(r[name]["rank_peak_bytes"][plan] for r in ranks) for plan in PLANS}
        figures[name] = {
            plan: {"seconds_per_step": seconds[plan], "time_vs_data": seconds[plan] / seconds["data"],
                   "rank_peak_bytes": peaks[plan], "peak_vs_single_process": peaks[plan] / single[name],
                   "rounds": ranks[0][name]["seconds_per_step"][plan]}
            for plan in PLANS
        }
    record = machine(device)
    result = {"benchmark": "model_parallel", **record, "quick": args.quick, "ranks": world,
              "global_batch": args.global_batch, "steps": args.steps, "repeats": args.repeats,
              "single_process_peak_bytes": single, "results": figures,
              "load_average_before": load_before, "load_average_after": list(os.getloadavg())}
    lines = heading(f"Model parallelism: 2 ranks, global batch {args.global_batch}, {label(device).upper()}",
                    record, args.quick)
    for name, plans in figures.items():
        lines += ["", f"**{name}** (single process, whole batch: {single[name] / 2**20:,.1f} MiB peak)", "",
                  "| plan | time per step (ms) | time / data | rank peak (MiB) | rank peak / single process |",
                  "|---|---|---|---|---|"]
        lines += [f"| {plan} | {v['seconds_per_step'] * 1000:,.1f} | **{v['time_vs_data']:.2f}** | "
                  f"{v['rank_peak_bytes'] / 2**20:,.1f} | **{v['peak_vs_single_process']:.2f}** |"
                  for plan, v in plans.items()]
    lines += ["", f"Median of {args.repeats} interleaved round(s) of {args.steps} steps per plan, in the same two "
                  f"processes. Load average (1 min) before and after: {load_before[0]:.2f}, "
                  f"{result['load_average_after'][0]:.2f}."]
    write(args.out, f"model-parallel-{label(device)}", result, lines)


if __name__ == "__main__":
    main()
