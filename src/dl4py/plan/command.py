"""``dl4py plan``: measure this machine (``--profile`` alone), or answer for a config which plan
to train it with on how many devices (docs/plan.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dl4py.config import RunConfig
from dl4py.errors import ConfigError
from dl4py.memory.capacity import parse_size
from dl4py.plan.builtin_profiles import PUBLISHED, builtin_profile
from dl4py.plan.layer_times import LayerTimes, measure_layers
from dl4py.plan.measure import measure_profile
from dl4py.plan.model import predict
from dl4py.plan.profile import DeviceProfile, default_profile_path, load_profile, save_profile
from dl4py.plan.report import capacity, recommend, table, to_dict
from dl4py.plan.work import step_work

MEASURE = "measure"  # --profile given without a value (cli.py's const for it)


def run(args) -> int:
    if args.config is None:
        if args.profile != MEASURE:
            raise ConfigError("config", "give a run config to plan for, or --profile alone to measure this machine")
        return _measure(args)
    config = RunConfig.from_file(args.config)
    profile, source = _profile(args)
    memory = parse_size(args.device_memory, "--device-memory") if args.device_memory else profile.memory_bytes
    layer_times = _layer_times(args, config, profile)
    predictions = predict(config, profile, args.devices, batch_size=args.batch_size, precision=args.precision,
                          device_memory=memory, averaging_frequency=config.training.averaging_frequency or 1,
                          layer_times=layer_times)
    if layer_times is not None:
        source += f"; the network's layers timed here at batch {layer_times.batch_size}"
    work = step_work(config, predictions[0].batch_per_rank, args.precision, device=profile.kind)
    chosen, why = recommend(predictions, work)
    holds = capacity(work, memory, config.network.updater, args.devices)
    if args.json:
        print(json.dumps({"config": str(args.config), "devices": args.devices, "device_memory_bytes": memory,
                          "profile": source, "plans": [to_dict(p) for p in predictions],
                          "recommended": chosen.plan, "why": why, "capacity": holds}, indent=2))
        return 0
    print(f"{args.config}: {args.devices} device(s) of {memory / 2**30:,.1f} GiB, speeds from {source}\n")
    print(table(predictions))
    print(f"\nrecommended: {chosen.plan} on {chosen.workers} device(s): {why}")
    print(f"capacity: {holds}")
    return 0


def _layer_times(args, config, profile: DeviceProfile) -> LayerTimes | None:
    """``--measure-layers``: the network timed on this machine's device of the profile's kind.
    By default on where the plan is for this machine (its own saved profile, no ``--profile``)
    and there is a batch size to time at: seconds, for predictions within 30% of the measured
    steps where the profile's curves alone missed a third of them (benchmarks/results/plan-cpu.md)."""
    asked = args.measure_layers
    batch = args.batch_size if args.batch_size is not None else config.training.batch_size
    if asked is None:
        asked = args.profile is None and isinstance(batch, int)
    if not asked:
        return None
    if profile.kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--measure-layers", f"times the network on this machine, which has no CUDA device; "
                                              f"the profile is of one ({profile.name}): leave it out there")
    if not isinstance(batch, int):
        raise ConfigError("--batch-size", f"the config's batch size is {batch!r}: give a number to time the layers at")
    print(f"dl4py plan: timing the network on this machine at batch {batch} (seconds; --no-measure-layers "
          "skips it)", file=sys.stderr, flush=True)
    return measure_layers(config, batch, args.precision, device=args.device or profile.kind)


def _measure(args) -> int:
    device = args.device or "cpu"
    print(f"dl4py plan: measuring {device} (about a minute)...", flush=True)
    # the collectives among as many ranks as the plans will have (default: 2 CPU ranks, every GPU)
    profile = measure_profile(device, ranks=(args.devices,) if args.devices > 1 else None, budget_s=args.budget)
    path = save_profile(profile, Path(args.output) if args.output else default_profile_path(device))
    links = ", ".join([f"{link.collective} over {link.ranks} ranks {link.latency_s * 1e6:,.0f} us + "
                       f"{link.bandwidth / 1e9:,.2f} GB/s" for link in profile.links]
                      + [f"a collective in a sharded step of {item.ranks} ranks {item.seconds * 1e6:,.0f} us"
                         for item in profile.sharded])
    rates = ", ".join(f"{kind} {precision} {curve.peak / 1e9:,.1f} GFLOP/s" for kind in ("matmul", "conv")
                      for precision, curve in getattr(profile, kind).items())
    print(f"{profile.name}: {rates}; memory {profile.memory_bandwidth / 1e9:,.1f} GB/s; {links}")
    print(f"saved: {path}")
    return 0


def _profile(args) -> tuple[DeviceProfile, str]:
    """The profile ``--profile`` names (a file or a built-in GPU), else this machine's saved one."""
    if args.profile not in (None, MEASURE):
        if args.profile.lower() in PUBLISHED:
            return builtin_profile(args.profile.lower()), f"the built-in {args.profile} profile (published figures)"
        return load_profile(args.profile), args.profile
    path = default_profile_path(args.device or "cpu")
    if not path.exists():
        raise ConfigError("--profile", f"this machine has no measured profile yet ({path}): run `dl4py plan "
                                       f"--profile` (about a minute), or name a file or a built-in GPU "
                                       f"({', '.join(sorted(PUBLISHED))})")
    return load_profile(path), str(path)
