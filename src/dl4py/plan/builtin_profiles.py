"""Profiles from published figures: ``builtin_profile("h100")``, scaled by an efficiency
until ``calibrate`` replaces them with a measured run's; ``cluster_profile`` for the links
between machines, from their bandwidth and latency.

Peaks are dense (no 2:4 sparsity) and in FLOP/s, per dl4py precision name:

- ``float`` *matrix multiply* is FP32 on the CUDA cores, not TF32: dl4py leaves PyTorch's
  flags alone unless ``environment.tf32`` is set (``backend/cuda_environment.py``), and
  PyTorch's default is ``torch.backends.cuda.matmul.allow_tf32 = False``.
- ``float`` *convolution* is TF32 on the tensor cores where the GPU has them (Ampere and
  later): PyTorch's default is ``torch.backends.cudnn.allow_tf32 = True``.
- ``bfloat16`` and ``half`` are tensor-core figures with FP32 accumulation (what PyTorch
  asks cuBLAS and cuDNN for). A precision the GPU has no hardware for is left out (T4: no
  bfloat16).

Memory bandwidth is the datasheet's device-memory figure. Link bandwidth is *per direction*
(datasheets quote both directions added: NVLink 900 GB/s on an H100 is 450 GB/s each way;
PCIe 4.0 x16 "64 GB/s" is about 32 GB/s each way): a ring collective sends and receives at
once, so one direction is what limits it. Link latency is not on any datasheet: the figure
is NCCL's typical small-message cost per ring step, an assumption until a measured run
replaces it.

A published peak is never reached: a builtin profile's compute rates are the peak times
``DEFAULT_EFFICIENCY`` (what large dense layers typically reach in PyTorch), its memory and
link bandwidths times ``BANDWIDTH_EFFICIENCY``; both are recorded in ``source.efficiency``.
Small calls are slower: a builtin curve adds a launch, ``GPU_OVERHEAD_S``, to each call's
time (``flops / peak``), which a measured curve shows directly.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import replace

from dl4py.backend.environment_settings import parse_size
from dl4py.errors import ConfigError
from dl4py.plan.profile import BUILTIN, CALIBRATED, COLLECTIVES, KINDS, LOCAL, MEASURED, NETWORK, Curve, \
    DeviceProfile, Link, Source

TERA, GIGA = 1e12, 1e9
GB = 10**9

DEFAULT_EFFICIENCY = 0.6  # of peak FLOP/s
BANDWIDTH_EFFICIENCY = 0.8  # of peak memory and link bandwidth
GPU_OVERHEAD_S = 10e-6  # PyTorch's eager dispatch and a kernel launch: 5-10 us; small layers are bound by it
CURVE_FLOPS = (1e6, 1e8, 1e10)  # where a builtin curve has points; the peak from 1e12 FLOPs on
PLATEAU_FLOPS = 1e12
LINK_RANKS = (2, 4, 8)

NVLINK_STEP_LATENCY_S = 5e-6  # assumption: NCCL per ring step within a node over NVLink
PCIE_STEP_LATENCY_S = 10e-6  # assumption: NCCL per ring step through PCIe (and host memory)

# name: hardware, memory, memory bandwidth (B/s), matmul and conv peaks (FLOP/s), link
# bandwidth per direction (B/s) and its per-step latency.
PUBLISHED = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP32 67 TFLOPS, TF32 tensor core
    # 989 TFLOPS with sparsity (494.7 dense), BF16/FP16 1,979 with sparsity (989.4 dense),
    # 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s.
    "h100": {"hardware": "NVIDIA H100 SXM5 80GB", "memory_bytes": 80 * GB, "memory_bandwidth": 3.35 * TERA,
             "matmul": {"float": 67 * TERA, "bfloat16": 989.4 * TERA, "half": 989.4 * TERA},
             "conv": {"float": 494.7 * TERA, "bfloat16": 989.4 * TERA, "half": 989.4 * TERA},
             "link": "NVLink 4", "link_bandwidth": 450 * GIGA, "link_latency_s": NVLINK_STEP_LATENCY_S},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: the H100's compute figures,
    # 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    "h200": {"hardware": "NVIDIA H200 SXM 141GB", "memory_bytes": 141 * GB, "memory_bandwidth": 4.8 * TERA,
             "matmul": {"float": 67 * TERA, "bfloat16": 989.4 * TERA, "half": 989.4 * TERA},
             "conv": {"float": 494.7 * TERA, "bfloat16": 989.4 * TERA, "half": 989.4 * TERA},
             "link": "NVLink 4", "link_bandwidth": 450 * GIGA, "link_latency_s": NVLINK_STEP_LATENCY_S},
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: FP32 19.5 TFLOPS, TF32 156
    # (312 with sparsity), BF16/FP16 312 (624 with sparsity), HBM2e at 2,039 GB/s, NVLink 600 GB/s.
    "a100": {"hardware": "NVIDIA A100 SXM4 80GB", "memory_bytes": 80 * GB, "memory_bandwidth": 2039 * GIGA,
             "matmul": {"float": 19.5 * TERA, "bfloat16": 312 * TERA, "half": 312 * TERA},
             "conv": {"float": 156 * TERA, "bfloat16": 312 * TERA, "half": 312 * TERA},
             "link": "NVLink 3", "link_bandwidth": 300 * GIGA, "link_latency_s": NVLINK_STEP_LATENCY_S},
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS, TF32 120 with sparsity (60 dense),
    # BF16/FP16 242 with sparsity (121 dense), 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16 64 GB/s.
    "l4": {"hardware": "NVIDIA L4 24GB", "memory_bytes": 24 * GB, "memory_bandwidth": 300 * GIGA,
           "matmul": {"float": 30.3 * TERA, "bfloat16": 121 * TERA, "half": 121 * TERA},
           "conv": {"float": 60 * TERA, "bfloat16": 121 * TERA, "half": 121 * TERA},
           "link": "PCIe 4.0 x16", "link_bandwidth": 32 * GIGA, "link_latency_s": PCIE_STEP_LATENCY_S},
    # NVIDIA Ada Lovelace GPU Architecture whitepaper, GeForce RTX 4090 column: FP32 82.6 TFLOPS,
    # TF32 tensor 82.6 (165.2 with sparsity), FP16/BF16 tensor with FP32 accumulate 165.2
    # (330.4 with sparsity; GeForce runs FP32 accumulation at half the FP16-accumulate rate),
    # 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4 x16, no NVLink.
    "rtx4090": {"hardware": "NVIDIA GeForce RTX 4090 24GB", "memory_bytes": 24 * GB,
                "memory_bandwidth": 1008 * GIGA,
                "matmul": {"float": 82.6 * TERA, "bfloat16": 165.2 * TERA, "half": 165.2 * TERA},
                "conv": {"float": 82.6 * TERA, "bfloat16": 165.2 * TERA, "half": 165.2 * TERA},
                "link": "PCIe 4.0 x16", "link_bandwidth": 32 * GIGA, "link_latency_s": PCIE_STEP_LATENCY_S},
    # NVIDIA T4 Tensor Core GPU datasheet: FP32 8.1 TFLOPS, mixed FP16/FP32 65 TFLOPS, no TF32
    # nor BF16 in hardware (Turing), 16 GB GDDR6 at 320 GB/s, PCIe Gen3 x16 32 GB/s.
    "t4": {"hardware": "NVIDIA T4 16GB", "memory_bytes": 16 * GB, "memory_bandwidth": 320 * GIGA,
           "matmul": {"float": 8.1 * TERA, "half": 65 * TERA},
           "conv": {"float": 8.1 * TERA, "half": 65 * TERA},
           "link": "PCIe 3.0 x16", "link_bandwidth": 16 * GIGA, "link_latency_s": PCIE_STEP_LATENCY_S},
}


def builtin_profile(name: str, efficiency: float = DEFAULT_EFFICIENCY) -> DeviceProfile:
    """The published profile of ``name`` (h100, h200, a100, l4, rtx4090, t4), compute rates
    scaled by ``efficiency``; its links are NCCL rings among 2, 4 and 8 GPUs."""
    if name not in PUBLISHED:
        raise ConfigError("profile", f"no built-in profile {name!r}; choices: {', '.join(PUBLISHED)}")
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ConfigError("efficiency", f"must be a fraction in (0, 1], got {efficiency!r}")
    gpu = PUBLISHED[name]

    def curves(kind: str) -> dict[str, Curve]:
        return {precision: _launch_bound(peak * efficiency) for precision, peak in gpu[kind].items()}

    links = tuple(ring_link(collective, "nccl", ranks, gpu["link_latency_s"],
                            gpu["link_bandwidth"] * BANDWIDTH_EFFICIENCY, LOCAL)
                  for ranks in LINK_RANKS for collective in COLLECTIVES)
    source = Source(BUILTIN, f"{gpu['hardware']}, {gpu['link']}",
                    efficiency={"compute": efficiency, "bandwidth": BANDWIDTH_EFFICIENCY})
    return DeviceProfile(name, "cuda", gpu["memory_bytes"], curves("matmul"), curves("conv"),
                         gpu["memory_bandwidth"] * BANDWIDTH_EFFICIENCY, GPU_OVERHEAD_S, source, links=links)


def _launch_bound(peak: float) -> Curve:
    points = [(flops, flops / (GPU_OVERHEAD_S + flops / peak)) for flops in CURVE_FLOPS]
    return Curve(tuple(points) + ((PLATEAU_FLOPS, peak),))


def calibrate(builtin: DeviceProfile, measured: DeviceProfile) -> DeviceProfile:
    """``builtin`` with ``measured``'s figures in place of its own: each measured rate
    replaces the published one, and ``source.efficiency`` records the fraction of the
    published peak each reached (``matmul/bfloat16``, ``memory_bandwidth``...). A precision the run
    did not measure keeps its published peak, scaled by the efficiency found for its kind.
    Links measured replace those of the same collective and ranks; the others stay."""
    if builtin.source.kind != BUILTIN:
        raise ConfigError("builtin", f"profile {builtin.name!r} is {builtin.source.kind}, not built-in")
    if measured.source.kind != MEASURED or measured.kind != builtin.kind:
        raise ConfigError("measured", f"must be a profile measured on {builtin.kind}; {measured.name!r} is "
                                      f"{measured.source.kind} on {measured.kind}")
    assumed = builtin.source.efficiency
    found: dict[str, float] = {}
    rates = {}
    for kind in KINDS:
        published = {p: curve.peak / assumed["compute"] for p, curve in getattr(builtin, kind).items()}
        reached = {p: curve.peak / published[p] for p, curve in getattr(measured, kind).items() if p in published}
        found.update({f"{kind}/{p}": value for p, value in reached.items()})
        typical = statistics.median(reached.values()) if reached else assumed["compute"]
        rates[kind] = {p: getattr(builtin, kind)[p].scaled(typical / assumed["compute"]) for p in published}
        rates[kind].update(getattr(measured, kind))
    published_bandwidth = builtin.memory_bandwidth / assumed["bandwidth"]
    found["memory_bandwidth"] = measured.memory_bandwidth / published_bandwidth
    replaced = {(link.collective, link.backend, link.ranks, link.scope) for link in measured.links}
    links = measured.links + tuple(link for link in builtin.links
                                   if (link.collective, link.backend, link.ranks, link.scope) not in replaced)
    source = Source(CALIBRATED, measured.source.hardware, measured.source.date, measured.source.torch, found)
    return replace(builtin, memory_bytes=measured.memory_bytes, matmul=rates["matmul"], conv=rates["conv"],
                   memory_bandwidth=measured.memory_bandwidth, overhead_s=measured.overhead_s, source=source, links=links,
                   sharded=measured.sharded)


def cluster_profile(base: DeviceProfile, bandwidth="25GB/s", latency="10us", ranks=LINK_RANKS,
                    backend: str | None = None) -> DeviceProfile:
    """``base`` with links between machines: ring collectives over a network of ``bandwidth``
    per direction (``"25GB/s"``, ``"100Gbit/s"``; the default is a 200 Gb/s InfiniBand port)
    and ``latency`` per message (``"10us"``: RDMA; plain TCP is nearer ``"50us"``), among each
    count of ``ranks`` machines. Its own links within a machine stay."""
    rate, seconds = parse_rate(bandwidth, "bandwidth"), parse_seconds(latency, "latency")
    backend = backend or ("nccl" if base.kind == "cuda" else "gloo")
    if isinstance(ranks, int) or any(isinstance(r, bool) or not isinstance(r, int) or r < 2 for r in ranks):
        raise ConfigError("ranks", f"must be counts of machines, each 2 or more, got {ranks!r}")
    network = tuple(ring_link(collective, backend, count, seconds, rate, NETWORK)
                    for count in ranks for collective in COLLECTIVES)
    return replace(base, links=tuple(link for link in base.links if link.scope != NETWORK) + network)


def ring_link(collective: str, backend: str, ranks: int, step_latency_s: float, bandwidth: float,
              scope: str) -> Link:
    """A collective's ``Link`` from one link's figures, as a ring runs it (NCCL's and gloo's
    algorithm for large messages): all_reduce moves 2(p-1)/p of the buffer in 2(p-1) steps;
    all_gather (p-1) parts in p-1 steps; a pipelined broadcast the buffer once, in log2(p) steps."""
    steps, share = {"all_reduce": (2 * (ranks - 1), 2 * (ranks - 1) / ranks),
                    "all_gather": (ranks - 1, ranks - 1),
                    "broadcast": (math.ceil(math.log2(ranks)), 1)}[collective]
    return Link(collective, backend, ranks, steps * step_latency_s, bandwidth / share, scope)


_BITS = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:bit/s|bps)\s*$", re.IGNORECASE)
_SECONDS = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e-?\d+)?|\.\d+)\s*(s|ms|us|µs|ns)\s*$")
_DECIMAL = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_PER_SECOND = {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_rate(value, where: str) -> float:
    """Bytes/s from a number or a size per second as dl4py writes sizes (``"25GB/s"``,
    ``"3.2GiB/s"``), or bits (``"100Gbit/s"``, ``"100Gbps"``). ``"25Gb/s"`` is refused:
    bits or bytes, it does not say."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
        return float(value)
    if isinstance(value, str) and re.fullmatch(r"\s*\d+(\.\d*)?\s*", value) and float(value) > 0:
        return float(value)  # bytes/s, as a command line gives a number
    if isinstance(value, str):
        bits = _BITS.match(value)
        if bits:
            return float(bits.group(1)) * _DECIMAL[bits.group(2).lower()] / 8
        size = value.strip()[:-2] if value.strip().endswith("/s") else None
        if size and re.search(r"[A-Za-z]", size) and size.rstrip()[-1] != "B":
            raise ConfigError(where, f"{value!r} is ambiguous: write bytes with a capital B (25GB/s) or bits "
                                     "as bit/s (200Gbit/s)")
        if size:
            return float(parse_size(size, where))
    raise ConfigError(where, f"is not a rate: {value!r}; write bytes per second, e.g. 25GB/s, 3.2GiB/s or 200Gbit/s")


def parse_seconds(value, where: str) -> float:
    """Seconds from a number or a string with a unit: ``"10us"``, ``"0.5ms"``, ``"2e-5s"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf:
        return float(value)
    match = _SECONDS.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(where, f"is not a duration: {value!r}; write e.g. 10us, 0.5ms or 2e-5s")
    return float(match.group(1)) * _PER_SECOND[match.group(2)]
