"""The ``dl4py`` command: a thin layer over RunConfig, train_run, load and Evaluation.

    dl4py train CONFIG.yaml [--epochs N] [--batch-size N] [--backend auto|cpu|gpu]
                            [--precision P] [--workers N|auto] [--averaging-frequency K]
                            [--parallelism data|sharded|tensor|hybrid|auto] [--accumulate-batches K]
                            [--launcher spawn|torchrun|spark] [--spark-master URL]
                            [--output DIR] [--resume] [--set key=value ...]
                            [--verbose 0|1|2 | --no-progress] [--ui [--ui-port N] [--ui-keep]]
    dl4py evaluate MODEL [--config CONFIG] [--limit N] [--backend B] [--precision P] [--json]
    dl4py summary CONFIG
    dl4py schema [--output FILE]
    dl4py completion bash|zsh
    dl4py --version
    dl4py info [--json]
    dl4py doctor [--json] [--timeout S] [--master-addr ADDR] [--port N]
    dl4py memory CONFIG.yaml [--batch-size N] [--precision P] [--inference]
                             [--parallelism data|sharded --workers N]
                             [--device-memory 80GB | --device cuda:0|cpu] [--json]
    dl4py plan CONFIG.yaml --devices N [--device-memory 24GiB] [--batch-size N] [--precision P]
                           [--profile FILE|GPU] [--[no-]measure-layers] [--json]
    dl4py plan --profile [--device cpu|cuda] [--devices N] [--budget S] [--output FILE]
    dl4py sweep CONFIG.yaml --grid key=v1,v2,... [--random N --range key=lo:hi[:log]]
                            [--sampler grid|random|tpe --trials N --prune median|none]
                            [--devices all|cpu|0,1] [--per-device K] [--metric M]
                            [--output DIR] [--resume] [--set key=value ...]
    dl4py bench [overhead|throughput|time-to-accuracy|all] [--device auto|cpu|gpu] [--quick]
    dl4py ui RUN_DIR... | SWEEP_DIR [--host 127.0.0.1] [--port 9000]
    dl4py report RUN_DIR | SWEEP_DIR [--output FILE]
    dl4py predict RUN_DIR|MODEL INPUT [--output FILE] [--format csv|json] [--proba]
    dl4py export RUN_DIR|MODEL [--format onnx|torchscript|safetensors] [--output FILE]
    dl4py serve RUN_DIR|MODEL [--host 127.0.0.1] [--port 8000] [--workers N] [--batch-limit N]
                              [--queue-limit N] [--max-body-bytes N] [--inference-mode M]
                              [--max-connections N] [--header-timeout S] [--keep-alive-timeout S]

Flags are shorthands for ``--set`` on the same keys, so every value is type-checked by
the config schema. Errors print one line naming the key, layer or file at fault
(``--debug`` or ``DL4PY_DEBUG=1``: the full traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

from dl4py.console_logging import configure_console_logging
from dl4py.errors import DL4PyError
from dl4py.version import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dl4py", description="Deeplearning4j-style training on PyTorch")
    parser.add_argument("--version", action="version", version=f"dl4py {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a network from a run config (YAML or JSON)")
    train.add_argument("config", type=Path)
    train.add_argument("--epochs", type=int, help="training.epochs")
    train.add_argument("--batch-size", type=_number_or_auto, help="training.batch_size: a number, or auto (the largest that fits)")
    train.add_argument("--backend", choices=["auto", "cpu", "gpu"], help="training.backend")
    train.add_argument("--precision", help="training.precision (float, double, half, bfloat16, mixed-fp16, mixed-bf16)")
    train.add_argument("--workers", type=_number_or_auto,
                       help="training.workers: > 1 trains in parallel with a ParallelWrapper; auto: as many as the "
                            "planner finds fastest (docs/plan.md)")
    train.add_argument("--averaging-frequency", type=int, help="training.averaging_frequency (rounds between averages)")
    train.add_argument("--parallelism",
                       help="training.parallelism: data, sharded, tensor or hybrid, or a mapping such as "
                            "'{kind: data, sync: shared_gradients}' or '{kind: hybrid, tensor_size: 2}'; auto: the "
                            "planner's choice (docs/plan.md)")
    train.add_argument("--training-mode", help=argparse.SUPPRESS)  # deprecated: --parallelism
    train.add_argument("--accumulate-batches", type=int,
                       help="training.accumulate_batches: batches whose summed gradients make one update")
    train.add_argument("--launcher", choices=["spawn", "torchrun", "spark"],
                       help="who starts the workers: spawn (here; the default), torchrun (this process is one "
                            "of torchrun's; the default under it) or spark (Spark tasks; needs dl4py[spark])")
    train.add_argument("--spark-master", metavar="URL",
                       help="with --launcher spark: the Spark master (default local[WORKERS])")
    train.add_argument("--output", type=Path, help="run directory (default: runs/<config>-<time>)")
    train.add_argument("--resume", action="store_true", help="continue the run in --output from its checkpoint")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override any config key, e.g. --set network.updater.learning_rate=0.02")
    train.add_argument("--ui", action="store_true",
                       help="serve the training UI (dl4py ui) on the run while it trains; it stops when training ends")
    train.add_argument("--ui-port", type=_port, metavar="N",
                       help="with --ui: its port (default 9000, or a free one when 9000 is taken; 0: any free port)")
    train.add_argument("--ui-keep", action="store_true",
                       help="with --ui: once training completes, keep serving the page until Ctrl-C")
    shown = train.add_mutually_exclusive_group()
    shown.add_argument("--verbose", type=int, choices=[0, 1, 2],
                       help="what the console shows: 0 nothing, 1 a progress bar, 2 a line per epoch "
                            "(default: a bar on a terminal, else a line per epoch)")
    shown.add_argument("--no-progress", action="store_true", help="show no progress (--verbose 0)")

    evaluate = sub.add_parser("evaluate", help="evaluate a saved model on its test data")
    evaluate.add_argument("model", type=Path, help="a model file, or a run directory")
    evaluate.add_argument("--config", type=Path, help="run config naming the data (default: the run's config.yaml, else MNIST)")
    evaluate.add_argument("--limit", type=int, help="evaluate on the first N test examples only")
    evaluate.add_argument("--batch-size", type=int, default=1024)
    evaluate.add_argument("--backend", choices=["auto", "cpu", "gpu"])
    evaluate.add_argument("--precision", help="evaluate in another precision than the model was saved in "
                                              "(e.g. float where the device lacks bfloat16)")
    evaluate.add_argument("--json", action="store_true", help="print the statistics as JSON")

    summary = sub.add_parser("summary", help="per-layer shapes and parameter counts of a config")
    summary.add_argument("config", type=Path)

    schema = sub.add_parser("schema", help="the run config's JSON Schema, for editors that complete and check YAML")
    schema.add_argument("--output", type=Path, help="write it to FILE (default: print it)")

    completion = sub.add_parser("completion", help="a shell completion script: eval \"$(dl4py completion bash)\"")
    completion.add_argument("shell", choices=["bash", "zsh"])

    info = sub.add_parser("info", help="backend, devices and versions")
    info.add_argument("--json", action="store_true")

    doctor = sub.add_parser("doctor", help="self-test this machine before training: devices, backend, rendezvous "
                                           "and all-reduce, gloo/NCCL, /dev/shm, allocator, data; exit 1 if a check fails")
    doctor.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    doctor.add_argument("--timeout", type=_positive_seconds, default=30.0, help="seconds each check may take (default 30)")
    doctor.add_argument("--master-addr", default="127.0.0.1",
                        help="address of this machine the rendezvous ranks meet at (default 127.0.0.1)")
    doctor.add_argument("--port", type=_port, default=0, help="port they meet at (default 0: any free port)")

    memory = sub.add_parser("memory", help="estimate the memory of a training step; does it fit, with which batch?")
    memory.add_argument("config", type=Path)
    memory.add_argument("--batch-size", type=int, help="default: training.batch_size of the config")
    memory.add_argument("--precision", help="default: training.precision of the config")
    memory.add_argument("--device-memory", metavar="SIZE", help="the GPU's memory, e.g. 80GB or 24GiB")
    memory.add_argument("--device", help="cuda (default), cuda:N or cpu; with no --device-memory, "
                                         "its free memory is read when it is present")
    memory.add_argument("--inference", action="store_true", help="inference only: no gradients, no updater")
    memory.add_argument("--parallelism", choices=["data", "sharded", "tensor", "hybrid", "single"],
                        help="the plan whose one rank is estimated (default: the config's training.parallelism): "
                             "data, a whole replica; sharded, one of --workers ranks training sharded (FSDP2), "
                             "each on its own batch; tensor, one of --workers ranks, its dense pairs split; "
                             "hybrid, one of --workers ranks, each on its own batch, gathered at the first "
                             "dense layer")
    memory.add_argument("--workers", type=int, help="ranks a sharded, tensor or hybrid step is split over (default: "
                                                    "training.workers)")
    memory.add_argument("--json", action="store_true")

    plan = sub.add_parser("plan", help="which parallelism, on how many devices: each plan's memory and time "
                                       "per step; --profile alone measures this machine")
    plan.add_argument("config", type=Path, nargs="?", help="run config (leave out with --profile to measure)")
    plan.add_argument("--devices", type=int, default=1, help="devices to plan for (default 1)")
    plan.add_argument("--device-memory", metavar="SIZE", help="each device's memory, e.g. 24GiB (default: the "
                                                             "profile's)")
    plan.add_argument("--batch-size", type=int, help="default: training.batch_size of the config")
    plan.add_argument("--precision", help="default: training.precision of the config")
    plan.add_argument("--profile", nargs="?", const="measure", metavar="FILE|GPU",
                      help="speeds from FILE or a built-in GPU (h100, h200, a100, l4, rtx4090, t4); default: this "
                           "machine's measured profile. Alone (no config): measure this machine and save it")
    plan.add_argument("--device", help="cpu (default) or cuda[:N]: the device --profile measures, and whose "
                                       "measured profile a plan reads by default")
    plan.add_argument("--budget", type=float, default=60.0, help="seconds --profile may take (default 60)")
    plan.add_argument("--output", help="where --profile saves (default: dl4py's cache folder)")
    plan.add_argument("--measure-layers", action=argparse.BooleanOptionalAction, default=None,
                      help="time the network itself on this machine's device of the profile's kind (seconds) "
                           "and predict from its measured step in place of the profile's curves (default: on "
                           "with this machine's own profile, off with --profile)")
    plan.add_argument("--json", action="store_true")

    sweep = sub.add_parser("sweep", help="run a grid (or random sample) of configs, several processes per device")
    sweep.add_argument("config", type=Path, nargs="?", help="run config (may be left out with --resume)")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                       help="values of one config key; several --grid give their product")
    sweep.add_argument("--random", type=int, metavar="N", help="draw N points instead of the whole grid")
    sweep.add_argument("--range", dest="ranges", action="append", default=[], metavar="KEY=LO:HI[:log]",
                       help="with --random or --sampler tpe: an interval to sample, log-uniformly with :log")
    sweep.add_argument("--seed", type=int, default=0, help="seed of --random, or of --sampler tpe")
    sweep.add_argument("--sampler", choices=("grid", "random", "tpe"),
                       help="grid: every point (default); random: --random N points; tpe: an Optuna study "
                            "choosing --trials N points from the results so far (pip install \"dl4py[optuna]\")")
    sweep.add_argument("--trials", type=int, metavar="N", help="with --sampler tpe: the number of experiments")
    sweep.add_argument("--prune", choices=("median", "none"),
                       help="with --sampler tpe: stop an experiment whose validation score, epoch by epoch, is "
                            "below the median of the other trials' (Optuna's MedianPruner)")
    sweep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key in every experiment")
    sweep.add_argument("--devices", default="all", help="all (the GPUs, else the CPU), cpu, or GPU indices 0,1")
    sweep.add_argument("--per-device", type=int, default=1, metavar="K", help="experiments at a time on each device")
    sweep.add_argument("--metric", help="result.json key to rank by (default: val_accuracy when the config "
                                        "has data.validation, else test_accuracy)")
    sweep.add_argument("--output", type=Path, help="sweep folder (default: sweeps/<config>-<time>)")
    sweep.add_argument("--resume", action="store_true", help="run what is unfinished in the sweep in --output")

    ui = sub.add_parser("ui", help="DL4J's training UI: a local web page of runs or a sweep, live while they train")
    ui.add_argument("paths", type=Path, nargs="+", metavar="RUN_DIR", help="run directories, or one sweep folder")
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    ui.add_argument("--port", type=int, default=9000, help="port (default 9000, as DL4J; 0: any free port)")

    report = sub.add_parser("report", help="one self-contained HTML file of a run or a sweep (charts inside)")
    report.add_argument("path", type=Path, metavar="RUN_DIR", help="a run directory or a sweep folder")
    report.add_argument("--output", type=Path, help="the HTML file (default: report.html in RUN_DIR)")

    predict = sub.add_parser("predict", help="predictions of a saved model for a CSV file, a .npy array or an image folder")
    predict.add_argument("model", type=Path, help="a model file, or a run directory")
    predict.add_argument("input", type=Path, help="a CSV file (features, or features and a label column), "
                                                  "a .npy array [n, ...], or a folder of images")
    predict.add_argument("--output", type=Path, help="write here (default: print)")
    predict.add_argument("--format", choices=["csv", "json"],
                         help="default: json for an --output ending in .json, else csv")
    predict.add_argument("--proba", action="store_true", help="class probabilities instead of class indices")
    predict.add_argument("--label-index", type=int, default=-1,
                         help="a CSV with one column more than the features: the label column to drop (default: last)")
    predict.add_argument("--skip-lines", type=int, default=0, help="CSV lines to skip first (a header)")
    predict.add_argument("--delimiter", default=",", help="CSV delimiter")
    predict.add_argument("--batch-size", type=int, default=1024)
    predict.add_argument("--backend", choices=["auto", "cpu", "gpu"])

    export = sub.add_parser("export", help="a saved model as ONNX, TorchScript, a weights-only model file or a DL4J zip")
    export.add_argument("model", type=Path, help="a model file, or a run directory")
    export.add_argument("--format", default="onnx", choices=["onnx", "torchscript", "safetensors", "dl4j"],
                        help="onnx (needs dl4py[export]), torchscript, safetensors: a dl4py model file "
                             "without updater state, for inference, or dl4j: a ModelSerializer zip DL4J "
                             "loads (docs/dl4j-import.md) (default onnx)")
    export.add_argument("--output", type=Path, help="default: beside the model, model.onnx, model.pt, "
                                                    "model.weights.dl4py or model.zip")

    dl4j = sub.add_parser("import-dl4j", help="a model DL4J saved (ModelSerializer zip) as a dl4py model file, "
                                             "parameters exact (docs/dl4j-import.md)")
    dl4j.add_argument("model", type=Path, help="the zip DL4J's ModelSerializer.writeModel wrote")
    dl4j.add_argument("--output", type=Path, help="default: beside the zip, with the suffix .dl4py")
    dl4j.add_argument("--summary", action="store_true", help="print the imported network's layers and parameters")
    dl4j.add_argument("--strict", action="store_true",
                      help="refuse the file when anything would be left out (training settings dl4py lacks, ...)")

    serve = sub.add_parser("serve", help="an HTTP/JSON prediction server: POST /predict, GET /health, GET /metadata "
                                         "(needs dl4py[serve])")
    serve.add_argument("model", type=Path, help="a model file, or a run directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    serve.add_argument("--workers", type=int, default=1, help="model replicas answering requests (ParallelInference)")
    serve.add_argument("--batch-limit", type=int, default=32, help="most examples merged into one forward pass")
    serve.add_argument("--queue-limit", type=int, default=64,
                       help="most requests answered at once; one more waits up to --queue-timeout, then gets 503")
    serve.add_argument("--queue-timeout", type=float, default=10.0, help="seconds a request waits for a place (default 10)")
    serve.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                       help="largest request body; a larger one gets 413 (default 8 MiB)")
    serve.add_argument("--body-timeout", type=float, default=10.0,
                       help="longest pause while a request's body arrives, in seconds; then 408 (default 10)")
    serve.add_argument("--max-connections", type=int,
                       help="connections served at once; one more gets 503 (default 256, fewer under a low ulimit -n)")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a request's line and headers may take to arrive; then 408 and closed (default 10)")
    serve.add_argument("--keep-alive-timeout", type=float, default=5.0,
                       help="seconds an idle connection stays open between requests (default 5)")
    serve.add_argument("--max-header-bytes", type=int, default=16 * 1024,
                       help="largest request line and headers; larger gets 431 (default 16384)")
    serve.add_argument("--inference-mode", default="batched", choices=["batched", "sequential", "inplace"])
    serve.add_argument("--runtime", default="auto", choices=["auto", "torch", "onnx", "torchscript"],
                       help="what runs the model: ONNX Runtime on the exported network, TorchScript, or torch "
                            "(default auto: onnx where dl4py[export] is installed and the network exports, else torch)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds to finish the requests received before giving up on them")
    serve.add_argument("--backend", choices=["auto", "cpu", "gpu"])

    bench = sub.add_parser("bench", help="speed benchmarks (from a source checkout): JSON + markdown in benchmarks/results")
    bench.add_argument("which", nargs="?", default="all", choices=["overhead", "throughput", "time-to-accuracy", "all"])
    bench.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    bench.add_argument("--quick", action="store_true", help="a short smoke run; its figures are not for the record")
    bench.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    bench.add_argument("--benchmarks", type=Path, help="the benchmarks/ folder (default: the checkout's)")
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true",
                             help="show the full traceback of any error (also DL4PY_DEBUG=1)")
    return parser


def _number_or_auto(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number or auto, got {text!r}") from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: this process's arguments); its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here rather than at exit, where a reader gone away could not be caught
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The reader of our output went away (``dl4py info | head -1``): end quietly, with
    141, the status of a tool that SIGPIPE ended (``yes`` in ``yes | head -1``). A script
    with ``set -o pipefail`` sees what it sees of any such tool, and output cut short is
    not taken for whole output. The broken stream points at /dev/null, so that what is
    still buffered for it goes nowhere instead of into a second error at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # closed, or no file behind it
            pass
    os.close(devnull)
    return 141


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    args.argv = argv  # the command as typed, for the one that continues an interrupted run
    configure_console_logging(sys.stderr)
    debug = args.debug or os.environ.get("DL4PY_DEBUG", "") not in ("", "0")
    commands = {"train": _train, "evaluate": _evaluate, "summary": _summary, "schema": _schema, "completion": _completion, "info": _info, "doctor": _doctor,
                "sweep": _sweep, "memory": _memory, "plan": _plan, "bench": _bench, "ui": _ui, "report": _report,
                "predict": _predict, "export": _export, "serve": _serve, "import-dl4j": _import_dl4j}
    # A problem with the user's input or machine is one line; a bug of dl4py's own keeps
    # its traceback. --debug (or DL4PY_DEBUG=1) shows the traceback of everything.
    # SIGTERM outside a fit (reading data, evaluating) stops as Ctrl-C does; a fit defers
    # both to a step boundary and keeps a checkpoint.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"dl4py {args.command}: stopped", file=sys.stderr)
        return 130
    except DL4PyError as exc:
        if debug:
            raise
        print(f"dl4py {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # not an error of the command's: main ends quietly
    except OSError as exc:
        if debug:
            raise
        print(f"dl4py {args.command}: error: {_os_error_text(exc)}", file=sys.stderr)
        return 1


def _terminate(signum, frame):
    raise KeyboardInterrupt


def _os_error_text(exc: OSError) -> str:
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{exc.filename}: {reason}" if exc.filename else reason


def _train(args) -> int:
    from dl4py.config import RunConfig
    from dl4py.run_dir import CHECKPOINT
    from dl4py.runner import train_run
    from dl4py.train import TrainingInterrupted

    config = RunConfig.from_file(args.config)
    flags = {
        "training.epochs": args.epochs, "training.batch_size": args.batch_size,
        "training.backend": args.backend, "training.precision": args.precision,
        "training.workers": args.workers, "training.averaging_frequency": args.averaging_frequency,
        "training.parallelism": args.parallelism, "training.training_mode": args.training_mode,
        "training.accumulate_batches": args.accumulate_batches,
    }
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + args.overrides
    config = config.with_overrides(overrides)
    with _training_ui(args) as ui:  # None without --ui
        try:
            result = train_run(
                config, output=args.output, resume=args.resume, config_name=args.config.stem,
                progress=0 if args.no_progress else args.verbose, launcher=args.launcher,
                spark_master=args.spark_master, on_run_dir=None if ui is None else ui.show,
            )
        except TrainingInterrupted as exc:
            print(f"dl4py train: {exc}", file=sys.stderr)
            if exc.run_dir is not None and (Path(exc.run_dir) / CHECKPOINT).is_file():
                print(f"dl4py train: to continue: {_resume_command(args.argv, exc.run_dir)}", file=sys.stderr)
            return 130
        if os.environ.get("RANK", "0") != "0" and result.get("launcher") == "torchrun":
            return 0  # rank 0 tells of the run it wrote
        accuracy = result.get("test_accuracy")
        print(json.dumps({k: result[k] for k in ("run_dir", "test_accuracy", "epochs", "train_samples_per_second", "wall_seconds")}), flush=True)
        if accuracy is not None:
            epochs = result["epochs"]
            print(f"test accuracy {accuracy:.4f} after {epochs} epoch{'' if epochs == 1 else 's'}; "
                  f"run directory {result['run_dir']}", file=sys.stderr)
        if ui is not None:
            ui.completed()  # with --ui-keep: serves on until Ctrl-C
    return 0


def _training_ui(args):
    """``--ui``'s server (``monitor/training_ui.py``), bound before training starts; a
    ``with`` of None without ``--ui`` and on a torchrun rank other than 0 (rank 0 serves)."""
    from dl4py.errors import ConfigError
    from dl4py.monitor.training_ui import TrainingUI

    if not args.ui:
        for flag, given in (("--ui-port", args.ui_port is not None), ("--ui-keep", args.ui_keep)):
            if given:
                raise ConfigError(flag, "applies with --ui only (dl4py train CONFIG --ui ...)")
        return nullcontext()
    if os.environ.get("RANK", "0") != "0":
        return nullcontext()
    return TrainingUI(args.ui_port, args.ui_keep, announce=lambda line: print(line, file=sys.stderr, flush=True))


def _resume_command(argv: list[str], run_dir) -> str:
    """The command that continues an interrupted run: this one's words as typed (its config,
    flags and --set overrides), quoted for a shell, with ``--output RUN_DIR --resume``."""
    words, skip_value = [], False
    for word in map(str, argv):
        if skip_value:
            skip_value = False
            continue
        name = word.split("=", 1)[0]
        if len(name) > 2 and name.startswith("--") and "--output".startswith(name):  # argparse takes a prefix
            skip_value = "=" not in word
        elif not (len(name) > 2 and name.startswith("--") and "--resume".startswith(name)):
            words.append(word)
    return shlex.join(["dl4py", *words, "--output", str(run_dir), "--resume"])


def _sweep(args) -> int:
    from dl4py import sweep

    try:
        result = sweep.run(
            args.config, grid=args.grid, ranges=args.ranges, random=args.random, seed=args.seed,
            overrides=args.overrides, devices=args.devices, per_device=args.per_device, metric=args.metric,
            output=args.output, resume=args.resume, sampler=args.sampler, trials=args.trials, prune=args.prune,
        )
    except sweep.SweepInterrupted as exc:
        print(f"dl4py sweep: {exc}", file=sys.stderr)
        return 130
    best = result.best
    print(json.dumps({"sweep_dir": str(result.sweep_dir), "metric": result.metric, **result.counts,
                      "ran": result.ran, "skipped": result.skipped, "continued": result.continued,
                      "restarted": result.restarted,
                      "best": best and best["experiment"], "best_value": best and best[result.metric]}))
    print(f"{result.counts['completed']} completed, {result.counts['failed']} failed; "
          f"table in {result.sweep_dir / 'results.md'}", file=sys.stderr)
    return 1 if result.failed else 0  # the sweep ran, but not every experiment did


def _memory(args) -> int:
    from dl4py.config import RunConfig
    from dl4py.memory import estimate, max_batch_size
    from dl4py.memory.report import format_report, verdict

    from dl4py.backend.cuda_environment import environment
    from dl4py.errors import ConfigError

    config = RunConfig.from_file(args.config)
    environment().update_from_config(config.environment)  # e.g. fused_optimizer decides the update's scratch
    device, memory = _memory_device(args)
    batch = args.batch_size if args.batch_size is not None else config.training.batch_size
    if batch == "auto":
        batch = None
    precision = args.precision or config.training.precision
    options = dict(precision=precision, device=device.type, training=not args.inference,
                   **_memory_plan(args, config))
    largest = None
    if memory is not None:
        largest = max_batch_size(config, memory.bytes, context=memory.context_included, **options)
    if batch is None and memory is None:
        raise ConfigError("--batch-size", "training.batch_size is auto, and with no device memory to fit "
                                          "it to there is no batch to report on: give --batch-size N, "
                                          "--device-memory (e.g. 80GB) or --device")
    if batch is None:  # batch_size: auto in the config: report at the largest that fits
        batch = largest or 1  # nothing fits: the report of one sample says by how much
    report = estimate(config, batch, **options)
    offer = None
    if memory is not None and "workers" not in options and not args.inference \
            and report.needed_bytes(memory.context_included) > memory.bytes:
        offer = _sharded_offer(config, batch, memory, precision, device)
    answer = verdict(report, memory, largest, offer)
    if args.json:
        print(json.dumps({**report.to_dict(), **answer}, indent=2))
    else:
        print(format_report(report, answer))
        if memory is None:
            print("\n(no device memory to compare with: give --device-memory, e.g. 80GB)")
    return 0


def _plan(args) -> int:
    from dl4py.plan.command import run

    return run(args)


def _memory_device(args):
    """``(device, memory)`` for ``dl4py memory``: the device asked for, and the memory to
    fit in (``--device-memory``, else the device's free memory where it is present, else None)."""
    import torch

    from dl4py.errors import ConfigError
    from dl4py.memory.capacity import device_memory, fixed_budget

    try:
        device = torch.device(args.device or "cuda")
    except RuntimeError:
        raise ConfigError("--device", f"must be cpu, cuda or cuda:N, got {args.device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError("--device", f"must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.device_memory:
        return device, fixed_budget(args.device_memory, device.type)
    if args.device or (device.type == "cuda" and torch.cuda.is_available()):
        return device, device_memory(device)
    return device, None  # nothing to compare with: the report alone


def _memory_plan(args, config) -> dict:
    """The estimator's options for the plan ``dl4py memory`` answers for: ``--parallelism``,
    else the config's plan. Sharded, tensor and hybrid: one of ``--workers`` ranks; the config's
    data plan over several workers, one worker (its replica's step and the flat buffer it meets
    the others in); else a whole replica, as on one device."""
    from dl4py.config.parallel import note_deprecated
    from dl4py.errors import ConfigError

    kind = args.parallelism or config.training.plan().kind
    if kind == "single":
        note_deprecated("--parallelism single", "--parallelism data")
    if kind not in ("sharded", "tensor", "hybrid"):
        if args.workers is not None:
            raise ConfigError("--workers", "applies to --parallelism sharded, tensor and hybrid only")
        workers = config.training.workers
        if kind == "data" and args.parallelism is None and isinstance(workers, int) and workers > 1:
            # the config's data-parallel worker: its step and the flat buffer its replica meets in
            return {"parallelism": config.training.plan(), "workers": workers}
        return {}
    workers = args.workers if args.workers is not None else config.training.workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
        raise ConfigError("--workers", f"--parallelism {kind} needs 2 or more workers, got {workers!r}")
    return {"parallelism": kind, "workers": workers}


def _sharded_offer(config, batch, memory, precision, device):
    """The fewest sharded ranks a step that does not fit one device would fit over (() for
    none), or None where the sharded estimate does not model the network or precision."""
    from dl4py.errors import ConfigError
    from dl4py.memory.sharded import fewest_workers

    try:
        return fewest_workers(config, batch, memory.bytes, memory.context_included, precision=precision,
                              device=device.type) or ()
    except ConfigError:
        return None  # a network or precision the sharded estimate does not model: no plan to offer


def _evaluate(args) -> int:
    from dl4py.config import RunConfig
    from dl4py.config.run import DataConfig
    from dl4py.config.graph import example_shape
    from dl4py.nn import load
    from dl4py.runner import MODEL, make_iterators

    model_path, config_path = args.model, args.config
    if model_path.is_dir():
        if config_path is None and (model_path / "config.yaml").exists():
            config_path = model_path / "config.yaml"
        model_path = model_path / MODEL
    elif config_path is None and (model_path.parent / "config.yaml").exists():
        config_path = model_path.parent / "config.yaml"
    model = load(model_path, backend=args.backend, precision=args.precision)
    data = RunConfig.from_file(config_path).data if config_path else DataConfig()
    if args.limit is not None:
        data = DataConfig.from_dict({**data.to_dict(), "limit_test": args.limit}, "--limit")
    _, test = make_iterators(data, args.batch_size, example_shape(model.config))
    if test is None:
        print("dl4py evaluate: error: the config's data section has no test set (data.test_path)", file=sys.stderr)
        return 2
    evaluation = model.evaluate(test)
    print(json.dumps(evaluation.to_dict(), indent=2) if args.json else evaluation.stats())
    return 0


def _summary(args) -> int:
    from dl4py.config import GraphConfig, RunConfig
    from dl4py.nn.graph import graph_summary_table
    from dl4py.nn.summary import summary_table

    config = RunConfig.from_file(args.config)
    table, _ = (graph_summary_table if isinstance(config.network, GraphConfig) else summary_table)(config.network)
    print(table)
    return 0


def _completion(args) -> int:
    from dl4py.completion import completion_script

    print(completion_script(_parser(), args.shell), end="")
    return 0


def _schema(args) -> int:
    from dl4py.config.json_schema import run_config_schema
    from dl4py.io import atomic_write_bytes

    text = json.dumps(run_config_schema(), indent=2) + "\n"
    if args.output is None:
        print(text, end="")
    else:
        atomic_write_bytes(args.output, text.encode("utf-8"))
        print(f"wrote {args.output}: first line of a config, for the YAML language server: "
              f"# yaml-language-server: $schema={args.output}", file=sys.stderr)
    return 0


def _bench(args) -> int:
    from dl4py import bench

    names = list(bench.BENCHMARKS) if args.which == "all" else [args.which]
    statuses = bench.run(names, args.device, args.quick, out=args.out, folder=args.benchmarks)
    failed = [name for name, status in statuses if status != 0]
    if failed:
        print(f"dl4py bench: error: {', '.join(failed)} failed (its output is above)", file=sys.stderr)
    return 1 if failed else 0


def _ui(args) -> int:
    from dl4py.monitor.server import serve

    serve(args.paths, host=args.host, port=args.port, announce=lambda line: print(line, flush=True))
    return 0


def _report(args) -> int:
    from dl4py.monitor.report import write_report

    print(write_report(args.path, args.output))
    return 0


def _saved_model(path: Path) -> Path:
    """A model file, or a run directory's model."""
    from dl4py.runner import MODEL

    return path / MODEL if path.is_dir() else path


def _predict(args) -> int:
    from dl4py.errors import ConfigError
    from dl4py.export.predict_files import format_predictions, predictions, read_input
    from dl4py.export.wrapper import example_shape
    from dl4py.io import atomic_write_bytes
    from dl4py.nn import load

    if args.batch_size < 1:
        raise ConfigError("--batch-size", f"must be at least 1, got {args.batch_size}")
    model = load(_saved_model(args.model), backend=args.backend)
    data = read_input(args.input, example_shape(model), model.config.input_type, label_index=args.label_index,
                      skip_lines=args.skip_lines, delimiter=args.delimiter)
    values, kind = predictions(model, data.features, args.proba, args.input, batch_size=args.batch_size)
    fmt = args.format or ("json" if args.output is not None and args.output.suffix.lower() == ".json" else "csv")
    text = format_predictions(values, kind, fmt, data.names)
    if args.output is None:
        sys.stdout.write(text)
    else:
        atomic_write_bytes(args.output, text.encode("utf-8"))
        print(f"{len(values)} predictions written to {args.output}", file=sys.stderr)
    return 0


def _export(args) -> int:
    from dl4py.errors import DataError
    from dl4py.export import default_path, export
    from dl4py.nn import load

    model_path = _saved_model(args.model)
    # ONNX and TorchScript files compute in float32 whatever the training precision (the
    # float32 master weights are read where the file has them); the weights-only file keeps it.
    model = load(model_path, backend="cpu", precision=None if args.format in ("safetensors", "dl4j") else "float")
    output = args.output or default_path(model_path, args.format)
    if output.resolve() == model_path.resolve():
        raise DataError(f"{output}: is the model file itself; give another --output")
    export(model, output, args.format)
    print(output)
    return 0


def _import_dl4j(args) -> int:
    from dl4py.dl4j import import_dl4j
    from dl4py.errors import DataError

    output = args.output or args.model.with_suffix(".dl4py")
    if output.resolve() == args.model.resolve():
        raise DataError(f"{output}: is the DL4J file itself; give another --output")
    model = import_dl4j(args.model, strict=args.strict)  # what it leaves out: one warning line
    if args.summary:
        print(model.summary())
    model.save(output)
    print(output)
    return 0


def _serve(args) -> int:
    from dl4py.serve import PredictionServer

    server = PredictionServer(
        _saved_model(args.model), host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
        log_level="info", backend=args.backend, workers=args.workers, batch_limit=args.batch_limit,
        queue_limit=args.queue_limit, queue_timeout=args.queue_timeout, max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout, inference_mode=args.inference_mode, runtime=args.runtime,
        max_connections=args.max_connections,
        header_timeout=args.header_timeout, keep_alive_timeout=args.keep_alive_timeout,
        max_header_bytes=args.max_header_bytes)
    print(f"dl4py serve: {server.service.metadata['model']} (version {server.service.model_version}, runtime "
          f"{server.service.inference.runtime}) on "
          f"{server.url}: POST /predict, GET /health, GET /metadata; Ctrl-C or SIGTERM stops", flush=True)
    server.serve_forever()
    print("dl4py serve: stopped", file=sys.stderr)
    return 0


def _info(args) -> int:
    from dl4py.backend.info import collect_info, format_info

    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _doctor(args) -> int:
    from dl4py.doctor import DoctorOptions, exit_status, format_report, report_dict, run_checks

    options = DoctorOptions(timeout=args.timeout, master_addr=args.master_addr, port=args.port)
    reports = run_checks(options)
    print(json.dumps(report_dict(reports, options), indent=2) if args.json else format_report(reports))
    return exit_status(reports)


if __name__ == "__main__":
    sys.exit(main())
