"""The rendezvous check: ranks in processes of their own meet at an address and all-reduce.

Rank ``r`` contributes ``r + 1``; every rank must get ``world * (world + 1) / 2``, which is
checked here, not in the ranks. The ranks are child processes killed at the check's
deadline (``children.py``), so no hang in torch.distributed can hang the doctor. The
address must be one of this machine's: rank 0 listens there, and all ranks run here.
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass

import torch

from dl4py.doctor.children import DEADLINE, PEER_FAILED, Exit, run_bounded
from dl4py.doctor.result import FAILED, PASSED, SKIPPED, Result, last_report

IFNAME_HINT = "set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for NCCL) to the interface the nodes share"


@dataclass(frozen=True)
class Address:
    host: str  # as the user gave it: its name is resolved as torch.distributed resolves it
    port: int  # 0: any free port

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def rendezvous(backend: str, world: int, address: Address, timeout: float) -> Result:
    """``world`` ranks of ``backend`` meet at ``address`` and all-reduce, within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    port, problem = _local_port(address)
    if problem is not None:
        return problem
    where = Address(address.host, port)
    remaining = deadline - time.monotonic()
    commands = [[sys.executable, "-m", "dl4py.doctor.rank", str(rank), str(world), backend, f"tcp://{where}",
                 repr(time.time() + remaining)] for rank in range(world)]
    started = time.monotonic()
    exits = run_bounded(commands, deadline)
    return _verdict(exits, world, where, timeout, time.monotonic() - started)


def _local_port(address: Address) -> tuple[int, Result | None]:
    """The port to meet at (a free one for port 0), or why ``address`` cannot serve: a name
    that does not resolve, or an address not of this machine (rank 0 could never listen)."""
    try:
        infos = socket.getaddrinfo(address.host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        return 0, Result(FAILED, f"{address.host!r} does not resolve: {exc.strerror or exc}",
                         "give an address or a host name of this machine (--master-addr)")
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((sockaddr[0], 0))
            except OSError:
                continue
            return address.port or probe.getsockname()[1], None
    shown = ", ".join(sorted({info[4][0] for info in infos}))
    named = "" if shown == address.host else f" ({shown})"
    return 0, Result(FAILED, f"{address.host}{named} is not an address of this machine, so rank 0 cannot listen "
                             "there", "give an address of this machine (--master-addr), e.g. the one the other "
                                      "nodes reach; to test another node, run dl4py doctor on it")


def _verdict(exits: list[Exit], world: int, where: Address, timeout: float, seconds: float) -> Result:
    reports = [last_report(e.stdout) for e in exits]
    expected = world * (world + 1) / 2
    for rank, (end, report) in enumerate(zip(exits, reports)):
        if end.killed is None and report.get("error"):
            return _rank_error(rank, report, where)
        if end.killed is None and end.returncode != 0:
            tail = (end.stderr.strip().splitlines() or [f"exit status {end.returncode}"])[-1]
            return Result(FAILED, f"rank {rank} died before reporting ({tail.strip()})",
                          "its last line of error is shown; `dl4py info` shows the PyTorch build, which may be broken")
    if any(e.killed == DEADLINE for e in exits):
        waiting = [f"rank {r} in {rep.get('stage', 'start-up')}" for r, (e, rep) in enumerate(zip(exits, reports))
                   if e.killed == DEADLINE]
        return Result(FAILED, f"no rendezvous and all-reduce at {where} within {timeout:g} s ({', '.join(waiting)}; "
                              "killed)", f"a firewall dropping port {where.port}, or an address the ranks cannot "
                                         f"reach; {IFNAME_HINT}; or raise --timeout on a slow machine")
    if any(e.killed == PEER_FAILED for e in exits):  # a peer failed without saying why
        return Result(FAILED, f"a rank failed at {where} without a report", "rerun dl4py doctor")
    wrong = [(r, rep.get("value")) for r, rep in enumerate(reports) if rep.get("value") != expected]
    if wrong:
        rank, value = wrong[0]
        return Result(FAILED, f"all_reduce gave {value} on rank {rank}, expected {expected:g}",
                      "the collective returns wrong sums: check the interconnect (NCCL_DEBUG=INFO shows its "
                      "transport) and report it with the output of `dl4py info --json`")
    return Result(PASSED, f"{world} ranks met at {where} and all_reduce gave {expected:g} on each, "
                          f"as expected ({seconds:.1f} s)")


def _rank_error(rank: int, report: dict, where: Address) -> Result:
    error, stage = report["error"], report.get("stage", "start-up")
    if "EADDRINUSE" in error or "address already in use" in error.lower():
        return Result(FAILED, f"port {where.port} on {where.host} is already in use, so rank 0 cannot listen there",
                      "choose a free port with --port, or leave --port out for any free one (a training job "
                      "still running may hold MASTER_PORT)")
    return Result(FAILED, f"rank {rank} failed in {stage} at {where}: {error}",
                  f"check that the address is this machine's and the port is open; {IFNAME_HINT}")


def nccl_rendezvous(address: Address, timeout: float) -> Result:
    """One NCCL rank per visible GPU; with one GPU there is nothing to meet (the nccl check
    reports NCCL itself)."""
    count = torch.cuda.device_count()
    if count < 2:
        return Result(SKIPPED, "one GPU: NCCL takes one rank per GPU, so only its availability is checked (nccl)")
    return rendezvous("nccl", count, address, timeout)
