"""Per-layer summary table of a MultiLayerNetwork (DL4J's ``summary()``)."""

from __future__ import annotations

import torch

from dl4py.config.frozen import is_frozen, unfrozen
from dl4py.config.network import NetworkConfig
from dl4py.nn.builder import build_module


def summary_table(config: NetworkConfig, module: torch.nn.Sequential | None = None) -> tuple[str, int]:
    """The table and the total parameter count. Without ``module`` the network is built on
    PyTorch's meta device: shapes and counts without allocating any memory."""
    if module is None:
        with torch.device("meta"):
            module = build_module(config, torch.Generator())
    rows = [("#", "layer", "input", "output", "params")]
    total = 0
    for shapes, layer_module in zip(config.layer_shapes(), module):
        count = sum(p.numel() for p in layer_module.parameters())
        total += count
        name = shapes.layer.type_name
        if is_frozen(shapes.layer):
            name = f"{unfrozen(shapes.layer).type_name} (frozen)"
        rows.append((str(shapes.index), name, str(shapes.input), str(shapes.output), f"{count:,}"))
    return ruled_table(rows, total), total


def ruled_table(rows: list[tuple[str, ...]], total: int) -> str:
    """``rows`` (a header first) in aligned columns, the first and last right-aligned (the
    index and the parameter count), between rules, then the total of parameters."""
    last = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.rjust(w) if i in (0, last) else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    rule = "-" * len(lines[0])
    return "\n".join([lines[0], rule, *lines[1:], rule, f"Total parameters: {total:,}"])
