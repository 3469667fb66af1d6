"""A run directory: created or reopened, locked for one writer, and told how the run ended.

``prepare_run_dir`` makes or reopens the directory and takes its lock (refusing a second
writer); ``RunRecord`` writes ``result.json`` for a run that failed once training had
started (the reason, and which of its files were kept); ``remove_new_run`` undoes a run
that failed before it trained, so the corrected command can use the same ``--output``.
"""

from __future__ import annotations

import logging
import shutil
from datetime import datetime
from pathlib import Path

from dl4py.errors import ConfigError, DL4PyError, StorageError
from dl4py.folders import FolderLock, claim_new_folder
from dl4py.io import atomic_write_json
from dl4py.train.early_stopping import LocalFileModelSaver

log = logging.getLogger("dl4py")

CHECKPOINT = "checkpoint.dl4py"
MODEL = "model.dl4py"


def new_run_dir(config_name: str, root: Path = Path("runs")) -> Path:
    """A fresh directory; exclusive creation, so two runs never share one."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError("create", root, exc) from None
    for n in range(1, 1000):
        path = root / (f"{config_name}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise StorageError("create", path, exc) from None
    raise RuntimeError(f"cannot create a new run directory under {root}")


def prepare_run_dir(output, resume: bool, config_name: str) -> tuple[Path, FolderLock, bool]:
    """The run directory, locked for this process, and whether this call created it."""
    if output is None:
        if resume:
            raise ConfigError("--resume", "needs --output: the run directory to continue")
        run_dir = new_run_dir(config_name)
        return run_dir, FolderLock(run_dir).acquire(), True
    run_dir = Path(output)
    if resume:
        if not run_dir.is_dir():
            raise ConfigError("--resume", f"{run_dir} is not a run directory to continue")
        lock = FolderLock(run_dir, where="--resume").acquire()  # refused beside a running training
        if not (run_dir / CHECKPOINT).is_file():
            lock.release()
            raise ConfigError("--resume", f"{run_dir} holds no {CHECKPOINT} to resume from")
        return run_dir, lock, False
    lock, created = claim_new_folder(run_dir, "run directory",
                                     "choose another directory or pass --resume to continue it")
    return run_dir, lock, created


class RunRecord:
    """What ``result.json`` says of a run that failed once training had started: the
    reason, and which files it kept (the checkpoint, the best model) for a look or a resume."""

    def __init__(self, run_dir: Path, config, started: float):
        self.run_dir, self.config, self.started = run_dir, config, started
        self.model = None
        self.early_stopping = None
        self.training_started = False
        self.logging = None  # the run's RunLogging (TensorBoard, MLflow), ended however the run ends
        self.plan_choice = None  # the planner's choice where the config left it the plan (plan/auto.py)

    def failed(self, exc: BaseException, fields: dict) -> None:
        """Write ``result.json``: status failed, the reason, ``fields`` (what is known of the
        training), and the files kept."""
        reason = str(exc) if isinstance(exc, DL4PyError) else f"{type(exc).__name__}: {exc}"
        result = {"status": "failed", "run_dir": str(self.run_dir), "reason": reason, **fields}
        if self.early_stopping is not None:
            result["early_stopping"] = self.early_stopping
        if self.plan_choice is not None:
            result["plan"] = self.plan_choice.to_dict()
        result["saved"] = saved_files(self.run_dir)
        try:
            atomic_write_json(self.run_dir / "result.json", result)
        except DL4PyError as write_error:  # e.g. the disk is full: the first error is the one to tell
            log.warning("could not record the failure in %s: %s", self.run_dir / "result.json", write_error)


def saved_files(run_dir: Path) -> list[str]:
    names = (CHECKPOINT, MODEL, LocalFileModelSaver.BEST, LocalFileModelSaver.LATEST)
    return [name for name in names if (run_dir / name).is_file()]


def remove_new_run(run_dir: Path, created: bool) -> None:
    """Undo a run that failed before training: the directory it created (or, in an empty
    directory it was given, the files it wrote), so a corrected command can use it again."""
    for entry in run_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if created:
        try:
            run_dir.rmdir()
        except OSError:
            pass
