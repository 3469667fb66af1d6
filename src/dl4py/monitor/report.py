"""``dl4py report``: one self-contained HTML file of a run or a sweep, for sharing.

Learning curves, the score, the per-layer update:parameter ratios and magnitudes,
throughput and memory over time, the confusion matrix as a heat map with per-class
precision and recall, the model and the environment; for a sweep, the ranked table of
experiments and the metric against each swept value. The file carries its styles,
Chart.js, the drawing code and the data: it opens offline, anywhere. ``dl4py train``
writes one as ``report.html`` at the end of each run.

    from dl4py.monitor.report import write_report
    write_report("runs/lenet")            # -> runs/lenet/report.html
"""

from __future__ import annotations

from pathlib import Path

from dl4py.io import atomic_write_text
from dl4py.monitor.page import report_page, title_for
from dl4py.monitor.runs import open_folders

REPORT = "report.html"


def write_report(run_dir_or_sweep_dir: str | Path, output: str | Path | None = None) -> Path:
    """Write the report of a run directory or sweep folder to ``output`` (default: ``report.html``
    inside it), atomically; returns its path. A path that is neither is a ConfigError naming it."""
    folder = Path(run_dir_or_sweep_dir)
    runs, sweep = open_folders([folder])
    output = Path(output) if output is not None else folder / REPORT
    atomic_write_text(output, report_page(runs, sweep, f"dl4py report: {title_for(runs, sweep)}"))
    return output
