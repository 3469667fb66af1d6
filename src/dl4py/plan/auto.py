"""``training.parallelism: auto`` and ``training.workers: auto``: the run trains as the planner
says, and records why.

``choose`` asks ``predict`` for every plan the network admits (on every device count from 1
to what this machine has, for ``workers: auto``; on the count given, otherwise) and takes
the one with the most samples a second among those known to fit. With ``workers: auto`` a
plan over several devices must beat one device by ``WORTH_IT`` (the recommendation's rule):
else one device trains, as the planner would advise. ``experiments`` is no way to train one
run and is never chosen.

The speeds are this machine's measured profile (``dl4py plan --profile`` saves it); where
there is none, a GPU with a built-in profile uses that, anything else is measured now (about a
minute, once: the profile is saved for the next run). Under torchrun rank 0 chooses and puts
the choice in the rendezvous store, and every other rank trains by it: ranks that chose apart
would not meet. The record (``PlanChoice.to_dict``) goes into ``result.json`` as ``plan``,
with the run's measured samples a second beside the prediction once it has trained.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dl4py.config.parallel import AUTO, ParallelPlan
from dl4py.errors import ConfigError
from dl4py.parallel.threads import usable_cores
from dl4py.plan.builtin_profiles import PUBLISHED, builtin_profile
from dl4py.plan.measure import measure_profile
from dl4py.plan.model import Prediction, predict
from dl4py.plan.profile import DeviceProfile, default_profile_path, load_profile, save_profile
from dl4py.plan.report import WORTH_IT

log = logging.getLogger("dl4py")

# The planner's names for the plans a run can train by, as the config spells them.
PLAN_SETTINGS = {"data-averaging": ParallelPlan("data"), "data-shared": ParallelPlan("data", sync="shared_gradients"),
                 "sharded": ParallelPlan("sharded"), "tensor": ParallelPlan("tensor"),
                 "hybrid": ParallelPlan("hybrid")}
MOST_CPU_RANKS = 8  # CPU ranks share one machine's cores: more than a few only divide them
PROFILE_BUDGET_S = 60.0
STORE_KEY = "dl4py-plan/choice"


@dataclass
class PlanChoice:
    """What the planner chose for a run and why (``with_measured`` adds, once the run has
    trained, its measured throughput to the record)."""

    asked: dict  # the config's workers and parallelism as given ("auto" where asked)
    plan: str  # the planner's name: single, data-averaging, data-shared, sharded, tensor, hybrid
    workers: int
    why: str
    profile: str  # where the speeds came from
    predicted: dict  # the chosen plan's step time, samples/s, peak per device
    candidates: list = field(default_factory=list)  # every plan weighed: name, workers, samples/s, fits

    def overrides(self) -> list[str]:
        """The config assignments that train this choice."""
        setting = PLAN_SETTINGS.get(self.plan)
        parallelism = "null" if setting is None else json.dumps(setting.to_dict())
        return [f"training.workers={self.workers}", f"training.parallelism={parallelism}"]

    def with_measured(self, samples_per_second: float | None) -> dict:
        """The record for ``result.json``: the choice, and the run's throughput beside the prediction."""
        record = self.to_dict()
        if samples_per_second:
            predicted = self.predicted["samples_per_second"]
            record["measured"] = {"samples_per_second": samples_per_second,
                                  "over_predicted": samples_per_second / predicted if predicted else None}
        return record

    def to_dict(self) -> dict:
        return {"asked": self.asked, "plan": self.plan, "workers": self.workers, "why": self.why,
                "profile": self.profile, "predicted": self.predicted, "candidates": self.candidates}

    @classmethod
    def from_dict(cls, data: dict) -> "PlanChoice":
        """The choice a record holds (``to_dict``'s or ``with_measured``'s: a run's measured
        figures are its own, not the choice's)."""
        return cls(**{key: value for key, value in data.items() if key != "measured"})


def choose(config, device: torch.device, launcher: str, world: int | None = None,
           profile: tuple[DeviceProfile, str] | None = None) -> PlanChoice:
    """The plan and worker count to train ``config`` by on ``device`` (its kind: every GPU of
    the machine, or CPU ranks on it). ``world``: the ranks a launcher already started
    (torchrun), the only count then. ``profile``: (profile, where it came from); default
    ``profile_for``."""
    training = config.training
    if training.batch_size == AUTO:
        raise ConfigError("training.batch_size", "is auto, and so is the plan: the largest batch depends on the "
                                                 "plan and the plan on the batch; give the batch size a number "
                                                 "(dl4py plan CONFIG --batch-size B reports each plan's largest)")
    plan_auto = training.plan_is_auto
    # parallelism: auto with the workers left at 1 (their default) chooses the count too.
    workers_auto = world is None and (training.workers == AUTO or plan_auto and training.workers == 1)
    if workers_auto and launcher == "spark":
        raise ConfigError("training.workers", f"is {training.workers}: with launcher spark the ranks run on the "
                                              "executors, whose devices this machine cannot count; give the "
                                              "number of ranks (the planner then chooses the plan for them)")
    counts = _counts(workers_auto, training.workers, device, world)
    speeds, source = profile or profile_for(device)
    memory = _device_memory(device, speeds)
    names = None if plan_auto else _names_of(training.parallelism)
    weighed = {}  # each count's predictions start with the same one-device plan: weighed once
    for workers in counts:
        for prediction in predict(config, speeds, workers, device_memory=memory,
                                  averaging_frequency=training.averaging_frequency or 1):
            weighed.setdefault((prediction.plan, prediction.workers), prediction)
    weighed = list(weighed.values())
    fits_known = any(p.fits is not None for p in weighed)
    single_allowed = workers_auto or counts == [1]
    candidates = [p for p in weighed if _trainable(p, names, single_allowed, fits_known)]
    if not candidates:
        raise _nothing_fits(weighed, counts)
    best = max(candidates, key=lambda p: p.samples_per_second)
    single = next((p for p in candidates if p.plan == "single"), None)
    if single is not None and best is not single and best.samples_per_second < WORTH_IT * single.samples_per_second:
        why = (f"no plan over several devices trains much faster than one (the best, {best.plan} on {best.workers}, "
               f"{best.samples_per_second / single.samples_per_second:.2f}x)")
        best = single
    else:
        why = _why(best, single, candidates)
    asked = {"workers": training.workers, "parallelism": "auto" if plan_auto else
             (training.parallelism.to_dict() if training.parallelism is not None else None)}
    return PlanChoice(asked, best.plan, best.workers, why, source, _figures(best),
                      [_figures(p) for p in candidates])


def profile_for(device: torch.device) -> tuple[DeviceProfile, str]:
    """This machine's saved profile for the device's kind; else a built-in GPU's matching its
    name; else one measured now and saved."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    path = default_profile_path(kind)
    if path.exists():
        return load_profile(path), str(path)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower().replace(" ", "")
        builtin = next((key for key in PUBLISHED if key in name), None)
        if builtin is not None:
            return builtin_profile(builtin), f"the built-in {builtin} profile (published figures)"
    log.warning("dl4py: parallelism auto: this machine has no measured profile yet; measuring it now (about a "
                "minute, once: saved to %s, which `dl4py plan --profile` measures again)", path)
    measured = measure_profile(kind, budget_s=PROFILE_BUDGET_S)
    save_profile(measured, path)
    return measured, str(path)


def agreed_choice(make, rank: int, timeout: float) -> PlanChoice:
    """Under torchrun: rank 0's ``make()``, put in the rendezvous store; every other rank
    reads it there (waiting up to ``timeout`` seconds), so that all train by one choice."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"{STORE_KEY}/{restart}",
                             dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout)))
    if rank == 0:
        try:
            choice = make()
        except Exception as exc:  # the others must not wait for a choice that will never come
            store.set("choice", json.dumps({"error": str(exc)}))
            raise
        store.set("choice", json.dumps(choice.to_dict()))
        return choice
    try:
        data = json.loads(store.get("choice"))
    except RuntimeError as exc:  # the store's own timeout (torch raises DistStoreError, a RuntimeError)
        raise ConfigError("training.parallelism", f"auto: rank {rank} waited {timeout:g} s (training.timeout) for "
                                                  f"rank 0's choice of plan and got none ({exc})") from None
    if "error" in data:
        raise ConfigError("training.parallelism", f"auto: rank 0 could not choose a plan: {data['error']}")
    return PlanChoice.from_dict(data)


def _counts(workers_auto: bool, workers, device: torch.device, world: int | None) -> list[int]:
    if world is not None:
        return [world]
    if not workers_auto:
        return [workers]
    if device.type == "cuda":
        most = max(torch.cuda.device_count(), 1)
    else:
        most = min(usable_cores(), MOST_CPU_RANKS)
    return list(range(1, most + 1))


def _device_memory(device: torch.device, profile: DeviceProfile) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return profile.memory_bytes


def _names_of(plan: ParallelPlan | None) -> set[str]:
    """The planner's names for a plan the config fixed (workers auto, the plan given)."""
    plan = plan or ParallelPlan()
    if plan.kind == "data":
        return {"single", "data-shared" if plan.sync == "shared_gradients" else "data-averaging"}
    return {"single", plan.kind}


def _trainable(prediction: Prediction, names: set[str] | None, single_allowed: bool, fits_known: bool) -> bool:
    """Whether the run may train by ``prediction``: admitted, a way to train one run, asked
    for, and known to fit where the estimator can tell (a plan it cannot estimate, such as a
    16-bit tensor plan, is not chosen beside plans known to fit, since a run that does not fit
    is what auto must avoid)."""
    if not prediction.admitted or prediction.plan == "experiments":
        return False
    if prediction.fits is False or (prediction.fits is None and fits_known):
        return False
    if prediction.plan == "single":
        return single_allowed
    return names is None or prediction.plan in names


def _why(best: Prediction, single: Prediction | None, candidates: list[Prediction]) -> str:
    others = sorted((p for p in candidates if p is not best), key=lambda p: -p.samples_per_second)
    runner_up = f"; next {others[0].plan} on {others[0].workers}, {others[0].samples_per_second:,.0f}" if others else ""
    if single is not None and best is not single:
        return (f"{best.plan} on {best.workers} device(s) is predicted to train "
                f"{best.samples_per_second / single.samples_per_second:.2f}x as many examples a second as one device "
                f"({best.samples_per_second:,.0f}/s{runner_up})")
    return f"{best.plan} on {best.workers} device(s) is predicted fastest ({best.samples_per_second:,.0f}/s{runner_up})"


def _nothing_fits(weighed: list[Prediction], counts: list[int]) -> ConfigError:
    admitted = [p for p in weighed if p.admitted and p.plan != "experiments"]
    shown = ", ".join(f"{p.plan} on {p.workers}" for p in admitted) or "none admitted"
    return ConfigError("training.parallelism", f"auto: no plan for {', '.join(map(str, counts))} device(s) is known "
                                               f"to fit this device's memory ({shown}); give a smaller batch, a lower "
                                               "precision, or more devices")


def _figures(prediction: Prediction) -> dict:
    return {"plan": prediction.plan, "workers": prediction.workers, "step_s": prediction.step_s,
            "samples_per_second": prediction.samples_per_second, "peak_bytes": prediction.peak_bytes,
            "fits": prediction.fits}
