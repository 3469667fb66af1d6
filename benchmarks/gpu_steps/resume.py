"""Step 5: a resumed run equals the uninterrupted one, on the device.

2N steps straight, against N steps, save, a fresh process that loads the checkpoint and
trains N more: every parameter and every tensor of the updater state must be equal, bit for
bit, in deterministic mode. Float, and a policy with float32 masters and loss scaling.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import dl4py
from _common import seed_lenet
from dl4py import MnistDataSetIterator, MultiLayerNetwork
from gpu_steps._check import Check

PRECISIONS = {"gpu": ["float", "mixed-fp16"], "cpu": ["float", "mixed-bf16"]}
BATCH = 64

# The fresh process: load the checkpoint onto the device, train the second half, save.
SECOND_HALF = textwrap.dedent("""
    import sys
    import dl4py
    from dl4py import MnistDataSetIterator
    checkpoint, resumed, backend, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dl4py.environment().update(deterministic=True)
    model = dl4py.load(checkpoint, backend=backend)
    model.fit(MnistDataSetIterator({batch}, train=True, seed=7, limit=limit), epochs=1, verbose=0)
    model.save(resumed)
""").format(batch=BATCH)


def run(check: Check) -> None:
    dl4py.environment().update(deterministic=True)  # before CUDA starts: cuBLAS reads its workspace setting once
    limit = check.steps(20, 4) * BATCH  # N steps: one epoch of N batches
    for precision in PRECISIONS[check.backend]:
        with check.part(precision):
            compare(check, precision, limit)


def compare(check: Check, precision: str, limit: int) -> None:
    data = MnistDataSetIterator(BATCH, train=True, seed=7, limit=limit)
    straight = MultiLayerNetwork(seed_lenet(), backend=check.backend, precision=precision).init()
    straight.fit(data, epochs=2, verbose=0)

    first = MultiLayerNetwork(seed_lenet(), backend=check.backend, precision=precision).init()
    first.fit(data, epochs=1, verbose=0)
    checkpoint, resumed_path = check.work_dir / f"{precision}-half.dl4py", check.work_dir / f"{precision}-resumed.dl4py"
    first.save(checkpoint)
    done = subprocess.run([sys.executable, "-c", SECOND_HALF, str(checkpoint), str(resumed_path), check.backend,
                           str(limit)], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"the resuming process exited {done.returncode}: {done.stderr.strip()[-400:]}")
    resumed = dl4py.load(resumed_path, backend=check.backend)

    differing = [name for name, a, b in tensor_pairs(straight, resumed) if not torch.equal(a, b)]
    check.figure(f"{precision}_compared", {"tensors": len(list(tensor_pairs(straight, resumed))),
                                           "differing": differing[:10],
                                           "iterations": [straight.iteration_count, resumed.iteration_count]})
    check.expect(resumed.iteration_count == straight.iteration_count,
                 f"{precision}: resumed ran {resumed.iteration_count} iterations, straight {straight.iteration_count}")
    check.expect(not differing, f"{precision}: {len(differing)} tensors differ after resuming, e.g. {differing[:3]}")


def tensor_pairs(a, b):
    """(name, tensor of a, tensor of b) for every parameter and updater-state tensor, on the CPU."""
    for (name, pa), pb in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        yield f"parameter {name}", pa.detach().cpu(), pb.detach().cpu()
    state_a, state_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    if state_a.keys() != state_b.keys():
        yield "updater state keys", torch.tensor(sorted(state_a)), torch.tensor(sorted(state_b))
        return
    for pid in state_a:
        for key, value in state_a[pid].items():
            if torch.is_tensor(value):
                yield f"updater {pid}.{key}", value.detach().cpu(), state_b[pid][key].detach().cpu()
    precision_a, precision_b = a.precision_state, b.precision_state
    if precision_a.loss_scale is not None:
        yield "loss scale", torch.tensor(precision_a.loss_scale), torch.tensor(precision_b.loss_scale)
    masters_b = precision_b.named_master_parameters()
    for name, pa in precision_a.named_master_parameters().items():
        yield f"master {name}", pa.detach().cpu(), masters_b[name].detach().cpu()
