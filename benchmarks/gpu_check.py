"""The prepared GPU check: every CUDA path of dl4py in one bounded command (``make gpu-check``).

    python benchmarks/gpu_check.py [--device gpu|cpu|auto] [--quick] [--budget SECONDS]
                                   [--only step,step] [--out DIR] [--logs DIR]

Each step runs in a process (and process group) of its own under a hard timeout; a step that
raises, fails a target or hangs is recorded as such and the next one starts. After every step
the results so far are written, atomically, to ``<out>/gpu-check-<device>.json`` and ``.md``
(device, driver, torch/CUDA/cuDNN/NCCL versions, then each step's verdict, seconds and
figures), so a run cut short still leaves what it measured. ``--budget`` bounds the whole run:
a step gets at most what is left, and steps with no time left are recorded as not run
(reading the versions first takes a few seconds more).
``--quick`` is the CPU rehearsal CI runs: the same steps with tiny counts, under three minutes.
Exit status 0 when no step failed or timed out. docs/gpu-check.md says how to read the results.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from dl4py.io import atomic_write_json, atomic_write_text  # noqa: E402
from gpu_steps._check import Check, Skipped  # noqa: E402


@dataclass(frozen=True)
class Step:
    name: str
    target: str  # "module:function", imported in the step's own process
    budget_s: float  # the hard timeout of a full run (one H100)
    quick_budget_s: float  # the hard timeout of --quick
    what: str


# In order of value: what a GPU session learns first if it is cut short.
STEPS = [
    Step("environment", "gpu_steps.environment:run", 40, 30,
         "dl4py info, the backend BACKEND_PRIORITY_* picks, capability, memory, versions"),
    Step("gpu-tests", "gpu_steps.gpu_tests:run", 240, 90, "pytest -m gpu, 90 s a test, each outcome recorded as it comes"),
    Step("precision", "gpu_steps.precision:run", 100, 30,
         "seed LeNet, each precision eager / compiled / CUDA graphs: samples/s, peak memory, loss, skipped steps"),
    Step("speed", "gpu_steps.speed:run", 110, 45,
         "fastest dl4py LeNet against an eager DataLoader loop (target 3x); time to 99.0% test accuracy"),
    Step("memory", "gpu_steps.memory:run", 50, 30,
         "estimate against max_memory_allocated (3 networks x 2 batches); batch_size: auto then a short fit"),
    Step("resume", "gpu_steps.resume:run", 50, 45, "2N steps against N, save, a fresh process, N more: equal"),
    Step("parallel", "gpu_steps.parallel:run", 60, 45,
         "ParallelWrapper, 2 workers on one device: averaging, shared gradients, flat memory, a killed worker named"),
    Step("model-parallel", "gpu_steps.model_parallel:run", 50, 40, "sharded, tensor, hybrid on 2 ranks"),
    Step("inference", "gpu_steps.inference:run", 45, 30,
         "ParallelInference and dl4py serve under loopback load: requests/s, p99, answers equal output()"),
    Step("plan", "gpu_steps.plan:run", 120, 60,
         "dl4py plan: this GPU's profile, its built-in one calibrated, one device's predicted step against measured "
         "(from the profiles, and with the network timed here)"),
]
VERDICTS = ("passed", "failed", "timed_out", "skipped", "not_run")
LOG_TAIL_LINES = 40
KILL_GRACE_S = 5.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--quick", action="store_true", help="the CPU rehearsal: tiny counts, short budgets")
    p.add_argument("--budget", type=float, help="seconds for all the steps (default: their budgets summed)")
    p.add_argument("--only", help="comma-separated step names (default: all, in order)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--logs", type=Path, help="keep each step's full output here (default: a temporary folder)")
    p.add_argument("--run-step", help=argparse.SUPPRESS)  # internal: run one step's target in this process
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_step:
        return run_one(args.run_step, args.device, args.quick, args.result, args.work)
    # Stopped from outside (a caller's timeout): unwind, so that the running step's group is killed too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    steps = select(STEPS, args.only, p)
    device = resolve_device(args.device, p)
    return run_check(steps, device, args.quick, args.out, budget=args.budget, logs=args.logs)


def select(steps: list[Step], only: str | None, p: argparse.ArgumentParser) -> list[Step]:
    if not only:
        return list(steps)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in {s.name for s in steps}]
    if unknown:
        p.error(f"--only: no step named {', '.join(unknown)}; the steps: {', '.join(s.name for s in steps)}")
    return [s for s in steps if s.name in names]


def resolve_device(choice: str, p: argparse.ArgumentParser) -> str:
    """cpu or gpu, decided without starting CUDA in this process (the steps start it)."""
    if choice == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "gpu"
    if choice == "gpu":
        p.error("--device gpu: no CUDA device is usable here (torch.cuda.is_available() is False); "
                "run `dl4py doctor` to see why, or use --device cpu for the rehearsal")
    return "cpu"


def run_check(steps: list[Step], device: str, quick: bool, out: Path, budget: float | None = None,
              logs: Path | None = None) -> int:
    """Run the steps in order, each bounded; write the results after each. 0 if none failed."""
    budgets = [s.quick_budget_s if quick else s.budget_s for s in steps]
    header = machine_header(device)  # bounded on its own (60 s); the budget is the steps'
    deadline = time.monotonic() + (budget if budget is not None else sum(budgets))
    stem = f"gpu-check-{slug(header['device_name']) if device == 'gpu' else 'cpu'}"
    record = {"check": "gpu-check", "quick": quick, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              **header, "steps": []}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        log_dir = logs or Path(scratch) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        for step, step_budget in zip(steps, budgets):
            left = deadline - time.monotonic()
            if left < min(step_budget, 5.0):
                outcome = {"verdict": "not_run", "seconds": 0.0, "figures": {}, "unmet": [],
                           "error": f"the check's budget was spent ({left:.0f} s left, the step needs {step_budget:.0f} s)"}
            else:
                print(f"gpu-check: {step.name} ({min(step_budget, left):.0f} s at most): {step.what}", flush=True)
                outcome = run_step(step, device, quick, min(step_budget, left), Path(scratch), log_dir)
            record["steps"].append({"name": step.name, "what": step.what, "budget_s": step_budget, **outcome})
            print(f"gpu-check: {step.name}: {outcome['verdict']} in {outcome['seconds']:.1f} s"
                  + (f" ({outcome['error']})" if outcome.get("error") else ""), flush=True)
            write_results(out, stem, record)
    counts = {v: sum(s["verdict"] == v for s in record["steps"]) for v in VERDICTS}
    print("gpu-check: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)
          + f"; written: {out / stem}.json, .md", flush=True)
    return 1 if counts["failed"] or counts["timed_out"] else 0


def run_step(step: Step, device: str, quick: bool, timeout: float, scratch: Path, log_dir: Path) -> dict:
    """One step in its own process group, killed whole at ``timeout``."""
    result_path = scratch / f"{step.name}.json"
    work = scratch / f"{step.name}-work"
    work.mkdir()
    log_path = log_dir / f"{step.name}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--run-step", step.target, "--device", device,
               "--result", str(result_path), "--work", str(work)] + (["--quick"] if quick else [])
    start = time.monotonic()
    with open(log_path, "wb") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_environment(),
                                 cwd=ROOT, start_new_session=True)
        try:
            child.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            stop_group(child)
    seconds = time.monotonic() - start
    shutil.rmtree(work, ignore_errors=True)
    reported = read_json(result_path)
    outcome = {"seconds": round(seconds, 2), "figures": reported.get("figures", {}),
               "unmet": reported.get("unmet", []), "log_tail": tail(log_path, scratch)}
    if timed_out:
        return {**outcome, "verdict": "timed_out", "error": f"no result within {timeout:.0f} s: killed"}
    if child.returncode != 0 or "error" in reported:
        error = reported.get("error") or f"exited with status {child.returncode} before reporting"
        return {**outcome, "verdict": "failed", "error": "; ".join([error, *outcome["unmet"]])}
    if outcome["unmet"]:  # before skipped: a target missed on the way to a skip is still missed
        return {**outcome, "verdict": "failed", "error": "; ".join(outcome["unmet"])}
    if "skipped" in reported:
        return {**outcome, "verdict": "skipped", "error": reported["skipped"]}
    return {**outcome, "verdict": "passed"}


def stop_group(child: subprocess.Popen) -> None:
    """Stop the step and whatever it started in its group: SIGTERM, a grace period, then SIGKILL."""
    try:
        os.killpg(child.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the step ended and left nothing behind
    try:
        child.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def child_environment() -> dict:
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(ROOT / "benchmarks")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash in native code (a worker's SIGSEGV) leaves its Python stack in the log
    return env


def run_one(target: str, device: str, quick: bool, result_path: Path, work: Path) -> int:
    """The step's own process: run the target, report figures, targets and errors."""
    check = Check(device=torch.device("cuda", 0) if device == "gpu" else torch.device("cpu"), quick=quick,
                  result_path=result_path, work_dir=work)
    check.save()
    try:
        module_name, function_name = target.split(":")
        getattr(importlib.import_module(module_name), function_name)(check)
    except Skipped as skipped:
        check.save(skipped=str(skipped))
        return 0
    except BaseException as exc:  # noqa: BLE001: the step's failure is the report
        traceback.print_exc()
        check.save(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        return 1
    return 0


def machine_header(device: str) -> dict:
    """Device, driver and library versions, read in a child so that CUDA starts there, not here."""
    code = (
        "import json, platform, torch\n"
        "gpu = torch.cuda.is_available()\n"
        "nccl = torch.cuda.nccl.version() if gpu and torch.distributed.is_nccl_available() else None\n"
        "print(json.dumps({'device_name': torch.cuda.get_device_name(0) if gpu else 'CPU',\n"
        "  'capability': '.'.join(map(str, torch.cuda.get_device_capability(0))) if gpu else None,\n"
        "  'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "  'cudnn': torch.backends.cudnn.version() if gpu else None,\n"
        "  'nccl': '.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,\n"
        "  'python': platform.python_version(), 'platform': platform.platform(),\n"
        "  'cpu_threads': torch.get_num_threads()}))\n"
    )
    header = {"device_name": "CPU" if device == "cpu" else "unknown GPU"}
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env={**child_environment(), **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})})
        header.update(json.loads(done.stdout) if done.returncode == 0 else {"header_error": done.stderr[-500:]})
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        header["header_error"] = f"{type(exc).__name__}: {exc}"
    header["driver"] = nvidia_driver() if device == "gpu" else None
    return header


def nvidia_driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else None


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def tail(path: Path, scratch: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The log's last lines, with the checkout's and the scratch folder's paths cut (the results are committed)."""
    try:
        text = path.read_bytes()[-64_000:].decode("utf-8", "replace")
    except OSError:
        return []
    text = text.replace(f"{ROOT}{os.sep}", "").replace(f"{scratch}{os.sep}", "<scratch>/")
    return text.splitlines()[-lines:]


def write_results(out: Path, stem: str, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{stem}.json", record)
    atomic_write_text(out / f"{stem}.md", markdown(record))


def markdown(record: dict) -> str:
    versions = ", ".join(f"{k} {record.get(k)}" for k in ("torch", "cuda", "cudnn", "nccl", "driver", "python")
                         if record.get(k) is not None)
    lines = [f"# GPU check: {record['device_name']}", "",
             f"{versions}; capability {record.get('capability')}; {record.get('platform', '')}; started "
             f"{record['started']}.", ""]
    if record["quick"]:
        lines += ["**--quick rehearsal: tiny counts; the figures check the code path, not the machine.**", ""]
    lines += ["| step | verdict | seconds | budget (s) | why |", "|---|---|---|---|---|"]
    for s in record["steps"]:
        why = (s.get("error") or "").replace("|", "/")[:300]
        lines.append(f"| {s['name']} | **{s['verdict']}** | {s['seconds']:.1f} | {s['budget_s']:.0f} | {why} |")
    for s in record["steps"]:
        lines += ["", f"## {s['name']}: {s['verdict']}", "", s["what"] + ".", ""]
        lines += figure_lines(s["figures"])
        if s["verdict"] in ("failed", "timed_out") and s.get("log_tail"):
            lines += ["", "Last lines of its output:", "", "```", *s["log_tail"][-15:], "```"]
    return "\n".join(lines) + "\n"


def figure_lines(figures: dict) -> list[str]:
    """Scalars as a list; a list of rows (dicts) as a table."""
    lines = []
    for name, value in figures.items():
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            columns = list(dict.fromkeys(k for r in value for k in r))
            lines += ["", f"{name}:", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(shown(r.get(c)) for c in columns) + " |" for r in value]
            lines.append("")
        else:
            lines.append(f"- {name}: {shown(value)}")
    return lines


def shown(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)[:400].replace("|", "/")
    return str(value).replace("|", "/")


if __name__ == "__main__":
    sys.exit(main())
