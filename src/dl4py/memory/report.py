"""The memory report as text and as JSON, with the plain answer: fits or does not fit."""

from __future__ import annotations

from dl4py.memory.capacity import DeviceMemory
from dl4py.memory.step_report import MemoryReport


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def verdict(report: MemoryReport, memory: DeviceMemory | None, largest_batch: int | None,
            sharded_plan: tuple | None = None) -> dict:
    """The answer for ``memory``. ``sharded_plan``, for a step that does not fit one device:
    (N, one rank's report) for the fewest devices it would fit sharded over
    (``sharded.fewest_workers``), () when none would, None when not looked for."""
    if memory is None:
        return {}
    needed = report.needed_bytes(memory.context_included)
    answer = {"device_memory": memory.bytes, "device_memory_source": memory.source, "needed_bytes": needed,
              "fits": needed <= memory.bytes, "largest_batch_size": largest_batch,
              "largest_batch_is_element_limit": largest_batch == report.max_batch_by_elements}
    if not answer["fits"] and sharded_plan is not None:
        answer["sharded_plan"] = None if not sharded_plan else {
            "workers": sharded_plan[0],
            "needed_bytes_per_device": sharded_plan[1].needed_bytes(memory.context_included)}
    return answer


def format_report(report: MemoryReport, answer: dict) -> str:
    """The report as text: what was estimated, the layers, the totals, then ``answer`` (``verdict``'s)."""
    lines = _heading(report) + _layer_table(report) + [""] + _totals(report)
    if report.batch_size > report.max_batch_by_elements:
        lines.append(f"warning: at batch {report.batch_size:,} a tensor has 2**31 elements or more, which CUDA "
                     f"kernels cannot index (RuntimeError); at most {report.max_batch_by_elements:,}")
    if answer:
        lines += [""] + _answer_lines(report, answer)
    return "\n".join(lines)


def _heading(report: MemoryReport) -> list[str]:
    update = f", {report.optimizer} update" if report.training else ""
    if report.parallelism == "sharded":
        return [f"Memory of one rank of {report.workers:,} in a sharded training step (FSDP2): batch "
                f"{report.batch_size:,} per rank, precision {report.precision}, updater {report.updater}"
                f"{update}, on {report.device_type}",
                "Parameters, gradients and updater state are 1/N per rank; one layer (or row block) "
                "at a time is gathered whole. The table shows whole layers.", ""]
    if report.parallelism == "tensor":
        return [f"Memory of one rank of {report.workers:,} in a tensor-parallel training step: batch "
                f"{report.batch_size:,} (every rank the same), precision {report.precision}, updater "
                f"{report.updater}{update}, on {report.device_type}",
                "Each pair of hidden dense layers is split: the first by output columns, the second by "
                "input rows. The table shows one rank's layers.", ""]
    if report.parallelism == "hybrid":
        return [f"Memory of one rank of {report.workers:,} in a hybrid training step: batch "
                f"{report.batch_size:,} per rank, gathered from all ranks at the first dense layer, "
                f"precision {report.precision}, updater {report.updater}{update}, on {report.device_type}",
                "The layers before it train apart; from there each pair of hidden dense layers is split "
                "as in the tensor plan. The table shows one rank's layers.", ""]
    mode = "training step" if report.training else "inference"
    return [f"Memory of one {mode}: batch {report.batch_size:,}, precision {report.precision}, "
            f"updater {report.updater}{update}, on {report.device_type}", ""]


def _layer_table(report: MemoryReport) -> list[str]:
    """A row per layer, with a rule under the column names."""
    rows = [("#", "layer", "output", "params", "param bytes", "saved for backward")]
    for row in report.layers:
        rows.append((str(row.index), row.type_name, row.output_shape, f"{row.parameters:,}",
                     mib(row.parameter_bytes), mib(row.activation_bytes) if report.training else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i in (1, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("-" * len(lines[-1]))
    return lines


def _totals(report: MemoryReport) -> list[str]:
    """The step's bytes by kind, its peak, the fixed costs and the total, names aligned."""
    masters = ", float32 masters included" if report.training and report.precision in ("half", "bfloat16") else ""
    parts = [("parameters", f"{report.parameters:,} ({mib(report.parameter_bytes)}{masters})")]
    if report.training:
        parts += [("gradients", mib(report.gradient_bytes)), ("updater state", mib(report.updater_bytes))]
    parts += [("input batch", mib(report.input_bytes))]
    if report.training:
        parts += [("activations saved", mib(report.activation_bytes))]
    at_peak = ", ".join(f"{kind} {mib(n)}" for kind, n in report.at_peak.items() if n)
    if report.parallelism == "sharded":
        parts += [("largest unit gathered", mib(report.gathered_unit_bytes))]
    parts += [("peak of the step", f"{mib(report.peak_bytes)} in {report.peak_phase}"),
              ("  alive at the peak", at_peak)]
    for name, n in report.fixed.items():
        parts.append((name.replace("_", " "), mib(n)))
    parts.append(("total", mib(report.total_bytes)))
    width = max(len(name) for name, _ in parts)
    return [f"{name.ljust(width)}  {value}" for name, value in parts]


def _answer_lines(report: MemoryReport, answer: dict) -> list[str]:
    """Whether the step fits the device memory, the sharded plan if it does not, and the largest batch."""
    share = answer["needed_bytes"] / answer["device_memory"]
    word = "FITS" if answer["fits"] else "DOES NOT FIT"
    each = " per device" if report.parallelism == "sharded" else ""
    lines = [f"device memory: {answer['device_memory_source']}",
             f"{word}: needs {mib(answer['needed_bytes'])}{each} of {mib(answer['device_memory'])} ({share:.1%})"]
    if "sharded_plan" in answer:
        lines.append(_sharded_plan_line(report, answer))
    largest = answer["largest_batch_size"]
    if largest is not None:
        at_limit = answer["largest_batch_is_element_limit"]
        bound = " (no larger: a tensor would reach 2**31 elements)" if at_limit else ""
        lines.append(f"largest batch size that fits: {largest:,}{bound}" if largest else
                     "not even a batch of 1 fits")
    return lines


def _sharded_plan_line(report: MemoryReport, answer: dict) -> str:
    plan = answer["sharded_plan"]
    if not plan:
        return (f"does not fit one {mib(answer['device_memory'])} device, nor sharded over any number at batch "
                f"{report.batch_size:,}: a rank's own activations do not fit; lower the batch size")
    return (f"does not fit one {mib(answer['device_memory'])} device; sharded over {plan['workers']:,} devices: "
            f"{mib(plan['needed_bytes_per_device'])} per device (training.parallelism: sharded, "
            f"training.workers: {plan['workers']}; each on a batch of {report.batch_size:,})")
