"""``dl4py plan``'s answer: the plans as a table, and the one to use with its reason in a sentence."""

from __future__ import annotations

from dl4py.memory.capacity import max_parameters
from dl4py.plan.model import Prediction
from dl4py.plan.work import StepWork

# A plan must beat one device by this much to be worth its devices: below it, the devices
# serve better as separate experiments (the forum thread's advice for most users).
WORTH_IT = 1.2
THREAD_RESERVE = "400MiB"  # the forum thread's buffer, kept free of parameters


def recommend(predictions: list[Prediction], work: StepWork) -> tuple[Prediction, str]:
    """The plan to train with and why, in one sentence."""
    single = predictions[0]
    trainable = [p for p in predictions if p.admitted and p.plan != "experiments"]
    # Known to fit first; a plan whose memory is not estimated (a graph sharded) only where none is.
    candidates = [p for p in trainable if p.fits is True or p.fits is None and single.fits is None] or \
                 [p for p in trainable if p.fits is None]
    if not candidates:
        return single, "no plan fits the device memory given: a smaller batch or a lower precision would"
    best = max(candidates, key=lambda p: p.samples_per_second)
    if single.fits is False and best is not single:
        held = (f"holds {_size(best.peak_bytes)} on each" if best.peak_bytes is not None
                else "splits it, though its memory per device is not estimated yet")
        return best, (f"one device cannot hold a step ({_size(single.peak_bytes)} needed); {best.plan} over "
                      f"{best.workers} devices {held}")
    if len(predictions) == 1:
        return single, "one device: nothing to split"
    reason = _traffic(predictions, work)
    speedup = best.samples_per_second / single.samples_per_second if single.samples_per_second else 0.0
    if best is single or speedup < WORTH_IT:
        experiments = next((p for p in predictions if p.plan == "experiments"), None)
        chosen = experiments if experiments is not None and experiments.fits is not False else single
        return chosen, (f"no plan trains one network much faster than one device (the best, {best.plan}, "
                        f"{speedup:.2f}x): {reason}; run a separate experiment on each device instead")
    return best, f"{best.plan} trains {speedup:.2f}x as many examples a second as one device: {reason}"


def capacity(work: StepWork, device_memory: int, updater, devices: int) -> str:
    """The seed thread's arithmetic for this network: how many parameters one device holds by
    its rule (a float and its momentum, 4 bytes each, 400 MiB kept free, activations aside),
    how many training really holds (gradients too), and the plan and device count past it."""
    thread = max_parameters(device_memory, "float", updater, reserved_bytes=THREAD_RESERVE, gradients=False)
    training = max_parameters(device_memory, "float", updater, reserved_bytes=THREAD_RESERVE)
    parameters = work.parameters
    said = (f"by the seed thread's rule (a value and its momentum, 4 bytes each, 400 MiB kept free) a "
            f"{_size(device_memory)} device holds {thread:,} parameters ({training:,} with the gradients "
            f"training keeps too); this network has {parameters:,}")
    if parameters <= training:
        return f"{said}: one device holds it {training / parameters:,.1f} times over"
    needed = next((n for n in range(2, 4097) if max_parameters(
        device_memory, "float", updater, reserved_bytes=THREAD_RESERVE, shards=n) >= parameters), None)
    if needed is None:
        return f"{said}: more than 4,096 such devices, even sharded"
    more = "" if needed <= devices else f" (more than the {devices} planned for)"
    return f"{said}: past one device; sharded over {needed} devices{more} it fits"


def _traffic(predictions: list[Prediction], work: StepWork) -> str:
    """What the network's shape means for the exchange: dense layers' share of the parameters
    and the bytes each plan moves a step."""
    dense = sum(layer.parameters for layer in work.layers if layer.kind == "matmul")
    share = dense / work.parameters if work.parameters else 0.0
    moved = {p.plan: p.moved_bytes for p in predictions if p.admitted and p.plan not in ("single", "experiments")}
    parts = [f"dense layers hold {share:.0%} of the parameters"]
    if "tensor" in moved and "data-shared" in moved:
        parts.append(f"tensor parallelism moves {_size(moved['tensor'])} of activations a step where data "
                     f"parallelism moves {_size(moved['data-shared'])} of gradients")
    elif "data-shared" in moved:
        parts.append(f"data parallelism moves {_size(moved['data-shared'])} of gradients a step")
    return ", and ".join(parts)


def table(predictions: list[Prediction]) -> str:
    rows = [("plan", "devices", "fits", "peak / device", "step", "of it exchange", "samples/s", "largest batch",
             "note")]
    for p in predictions:
        if not p.admitted:
            rows.append((p.plan, str(p.workers), "-", "-", "-", "-", "-", "-", p.why_not))
            continue
        fits = {True: "yes", False: "NO", None: "?"}[p.fits]
        note = "separate runs, one per device" if p.plan == "experiments" else (
            f"{p.samples_per_step:,} examples a step" if p.samples_per_step != p.batch_per_rank else "")
        rows.append((p.plan, str(p.workers), fits, _size(p.peak_bytes) if p.peak_bytes is not None else "not estimated",
                     f"{p.step_s * 1e3:,.2f} ms", f"{p.communication_s * 1e3:,.2f} ms", f"{p.samples_per_second:,.0f}",
                     "-" if p.largest_batch is None else f"{p.largest_batch:,}", note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def to_dict(prediction: Prediction) -> dict:
    return {"plan": prediction.plan, "workers": prediction.workers, "admitted": prediction.admitted,
            "why_not": prediction.why_not or None, "batch_per_rank": prediction.batch_per_rank,
            "samples_per_step": prediction.samples_per_step, "compute_s": prediction.compute_s,
            "communication_s": prediction.communication_s, "step_s": prediction.step_s,
            "samples_per_second": prediction.samples_per_second, "moved_bytes": prediction.moved_bytes,
            "peak_bytes": prediction.peak_bytes, "fits": prediction.fits, "largest_batch": prediction.largest_batch}


def _size(nbytes: int | float | None) -> str:
    if nbytes is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.1f} {unit}"
    return f"{nbytes:,.0f} B"
