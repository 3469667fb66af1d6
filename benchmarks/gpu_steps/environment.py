"""Step 1: what the machine is, and which backend dl4py picks on it and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from gpu_steps._check import Check

# The backend each setting of ND4J's variables must select, when a GPU is usable.
PRIORITY_CASES = {
    "defaults": ({}, "gpu"),
    "BACKEND_PRIORITY_CPU=200": ({"BACKEND_PRIORITY_CPU": "200"}, "cpu"),
    "BACKEND_PRIORITY_GPU=300,CPU=200": ({"BACKEND_PRIORITY_GPU": "300", "BACKEND_PRIORITY_CPU": "200"}, "gpu"),
}


def run(check: Check) -> None:
    infos = dl4py_infos({case: variables for case, (variables, _) in PRIORITY_CASES.items()})
    info = infos["defaults"]
    check.figure("dl4py_info", info)
    check.expect(info.get("backend") == check.backend,
                 f"dl4py info picked {info.get('backend')!r} ({info.get('backend_reason')}), expected {check.backend!r}")
    picks = {}
    for case, (_, expected) in PRIORITY_CASES.items():
        chosen = infos[case]
        picks[case] = f"{chosen.get('backend')}: {chosen.get('backend_reason')}"
        if check.gpu:
            check.expect(chosen.get("backend") == expected, f"{case} picked {chosen.get('backend')!r}, expected {expected!r}")
    check.figure("backend_by_priority", picks)
    if not check.gpu:
        return
    props = torch.cuda.get_device_properties(check.device)
    free, total = torch.cuda.mem_get_info(check.device)
    check.figure("capability", f"{props.major}.{props.minor}")
    check.figure("memory_total_gib", round(total / 2**30, 2))
    check.figure("memory_free_gib", round(free / 2**30, 2))
    check.figure("multiprocessors", props.multi_processor_count)
    check.figure("bf16_supported", torch.cuda.is_bf16_supported())
    check.figure("nccl_available", torch.distributed.is_nccl_available())
    check.figure("devices_visible", torch.cuda.device_count())
    x = torch.randn(1024, 1024, device=check.device)
    check.expect(torch.allclose((x @ x).cpu(), x.cpu() @ x.cpu(), rtol=1e-2, atol=1e-2),
                 "a 1024x1024 matrix product on the GPU differs from the CPU's")


def dl4py_infos(cases: dict[str, dict]) -> dict[str, dict]:
    """`dl4py info --json` for each case, in fresh processes (at once) with its ND4J variables and no others."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("BACKEND_PRIORITY_")}
    running = {case: subprocess.Popen([sys.executable, "-m", "dl4py", "info", "--json"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env={**base, **variables})
               for case, variables in cases.items()}
    infos = {}
    for case, process in running.items():
        out, err = process.communicate(timeout=60)
        if process.returncode != 0:
            raise RuntimeError(f"dl4py info --json ({case}) exited {process.returncode}: {err.strip()[-300:]}")
        infos[case] = json.loads(out)
    return infos
