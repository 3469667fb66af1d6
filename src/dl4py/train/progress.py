"""What training shows on the console: a progress bar, or one line per epoch.

``verbose`` (Keras' argument of ``fit``) chooses, through ``console_listeners``:

- 0: nothing;
- 1: a ``ProgressBar``: a tqdm bar for each epoch, left on screen when the epoch ends;
- 2: ``EpochLines``: one flushed line per epoch, made for logs and pipes;
- "auto" (the default): 1 on a terminal or in a notebook, else 2; 2 also where tqdm is
  missing (a dependency of dl4py, absent only from an install without dependencies), as the
  lines need no library.

Epochs are numbered as the model counts them, out of the run's total: the second of two
epochs is "epoch 2/2" however many fits (a resume, early stopping's one epoch at a time)
it took to get there. Both write to stderr, where log records go too, so that stdout
keeps what a command prints as its result.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from contextlib import ExitStack, contextmanager

from dl4py.errors import ConfigError, MissingDependencyError
from dl4py.train.listeners import TrainingListener, _Count
from dl4py.train.numbering import epoch_name

VERBOSE = (0, 1, 2, "auto")


class ProgressBar(TrainingListener):
    """A tqdm bar per epoch: epoch N/TOTAL, batch k/n, loss, the last validation scores,
    samples/s and the time left, redrawn at most every ``interval`` seconds.

    ``total_epochs``: the epoch the run ends after, in the model's numbering (None: not
    shown); ``batches_per_epoch``: n (None, a stream of unknown length: the count, no ETA).
    Speed and ETA count this fit's batches only: a run resumed mid-epoch starts its bar
    at the batch it resumed at. The loss is the latest batch's while the epoch runs and the
    epoch's mean (as ``History`` records it) once it ends. While the bar is drawn, records
    that the "dl4py" logger sends to the console are written above it, not across it.
    ``stream``: where to draw (default: stderr; in a notebook, a widget)."""

    def __init__(self, total_epochs: int | None = None, batches_per_epoch: int | None = None, stream=None,
                 interval: float = 0.25):
        self.tqdm = _tqdm_class(stream)  # here, so that a missing tqdm is said before training starts
        self.total_epochs, self.batches = total_epochs, batches_per_epoch
        self._stream = stream
        self.interval = interval
        self._bar = None
        self._logging: ExitStack | None = None
        self._validation: dict = {}  # the last epoch's, shown until the next scores come
        self._count = _Count()

    def __getstate__(self):  # a bar on the screen does not travel
        return {**self.__dict__, "_bar": None, "_logging": None, "tqdm": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.tqdm = _tqdm_class(self._stream)

    def on_epoch_start(self, model, epoch):
        self._close()  # an epoch a listener stopped part-way has no end of its own
        self._count.start(model)
        self._pending, self._samples, self._loss = 0, 0, None
        self._started = self._drawn = time.perf_counter()
        self._logging = ExitStack()
        self._logging.enter_context(_logging_above(self.tqdm.write))
        stream = self._stream if self._stream is not None else sys.stderr
        self._bar = self.tqdm(
            total=self.batches, initial=model.batch_in_epoch, desc=_epoch_name(epoch, self.total_epochs),
            file=stream, leave=True, unit="batch", mininterval=0, miniters=1,  # this class decides when to draw
            smoothing=0, bar_format=_BAR if self.batches is not None else _COUNT, **_width(stream),
        )

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        if self._bar is None:
            return
        # A parallel fit calls once a round, for every worker's batches: the count moves by more than one.
        self._pending += iteration - self._count.advance(iteration)
        self._samples += batch_size
        now = time.perf_counter()
        last = self.batches is not None and self._bar.n + self._pending >= self.batches
        if now - self._drawn >= self.interval or last:
            self._drawn = now
            self._loss = float(loss)  # read only when drawn: no wait for the device on the other steps
            self._draw(self._samples / max(now - self._started, 1e-9))

    def on_epoch_end(self, model, summary):
        if summary.validation:
            self._validation = dict(summary.validation)
        if summary.skipped_steps:
            self._validation["skipped"] = summary.skipped_steps
        if summary.accuracy is not None:  # the epoch's training accuracy, shown beside its loss
            self._validation = {"accuracy": summary.accuracy, **self._validation}
        if self._bar is not None:
            self._loss = summary.mean_loss
            self._draw(summary.samples_per_second)
        self._close()

    def on_fit_end(self, model, interrupted):
        if self._bar is not None and self._pending:
            self._draw(self._samples / max(time.perf_counter() - self._started, 1e-9))
        self._close()  # an interrupted epoch stays on screen where it stopped

    def _draw(self, samples_per_second: float) -> None:
        # Beside the time, as tqdm puts its rate; the scores short, for the line to fit 100 columns.
        parts = [f"{self.tqdm.format_sizeof(samples_per_second)} samples/s"] if samples_per_second else []
        scores = {} if self._loss is None else {"loss": self._loss}
        parts += [f"{name} {value:.4g}" for name, value in {**scores, **self._validation}.items()
                  if isinstance(value, (int, float))]
        self._bar.set_postfix_str(", ".join(parts), refresh=False)
        self._bar.update(self._pending)  # tqdm's rate: this fit's batches over the bar's time
        self._pending = 0

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._logging is not None:
            self._logging.close()  # the console handlers back as they were
            self._logging = None


_BAR = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
_COUNT = "{desc} {n_fmt} batches [{elapsed}{postfix}]"


class EpochLines(TrainingListener):
    """One line per epoch, flushed as soon as the epoch ends (``verbose=2``): for a log file,
    a pipe or a CI log, where a bar's redraws would be noise.

        epoch 2/3: loss 0.2134, accuracy 0.9388, val_loss 0.1987, val_accuracy 0.9412, 3.1 s, 18934 samples/s

    The training ``accuracy`` is the epoch's (its batches as they were met), where the fit counts it.
    """

    def __init__(self, total_epochs: int | None = None, stream=None):
        self.total_epochs = total_epochs
        self._stream = stream  # None: stderr when writing (keeps the listener picklable)

    def on_epoch_end(self, model, summary):
        stream = self._stream if self._stream is not None else sys.stderr
        training = {"loss": summary.mean_loss, **({} if summary.accuracy is None else {"accuracy": summary.accuracy})}
        scores = {**training, **(summary.validation or {})}
        parts = [f"{name} {value:.4f}" for name, value in scores.items() if isinstance(value, (int, float))]
        parts += [f"{summary.seconds:.1f} s", f"{summary.samples_per_second:.0f} samples/s"]
        if summary.skipped_steps:  # the loss scaler's: a run that skips must not look healthy
            parts.append(f"{summary.skipped_steps} updates skipped (fp16 overflow)")
        stream.write(f"{_epoch_name(summary.epoch, self.total_epochs)}: {', '.join(parts)}\n")
        stream.flush()


def console_listeners(verbose, total_epochs: int | None, batches_per_epoch: int | None,
                      listeners=()) -> list[TrainingListener]:
    """The console listener ``verbose`` asks for, as a list to add to a fit's listeners.
    "auto" adds none where ``listeners`` already show progress (a ProgressBar of one's own)."""
    level = _level(verbose)
    if level == "auto" and any(isinstance(l, (ProgressBar, EpochLines)) for l in listeners):
        return []
    if level == "auto":
        level = 1 if (_interactive() and _has_tqdm()) else 2
    if level == 1:
        return [ProgressBar(total_epochs, batches_per_epoch)]
    if level == 2:
        return [EpochLines(total_epochs)]
    return []


def batches_of(iterator) -> int | None:
    """Batches in an epoch of ``iterator``; None for a source of unknown length."""
    try:
        return len(iterator)
    except (TypeError, NotImplementedError):  # a stream, a user's iterator
        return None


def _level(verbose):
    if isinstance(verbose, str):
        verbose = verbose.strip().lower()
        verbose = int(verbose) if verbose in ("0", "1", "2") else verbose
    if verbose not in VERBOSE or (isinstance(verbose, float)):
        raise ConfigError("verbose", f"must be 0 (silent), 1 (a progress bar), 2 (a line per epoch) or 'auto', "
                                     f"got {verbose!r}")
    return int(verbose) if verbose != "auto" else "auto"


def _interactive() -> bool:
    """Whether a person watches the output as it is drawn: stderr is a terminal, or this
    runs in a Jupyter (IPython kernel) notebook."""
    try:
        if sys.stderr.isatty():
            return True
    except (AttributeError, ValueError):  # replaced by an object without one, or closed
        pass
    ipython = sys.modules.get("IPython")  # never imported here: a script that did not is no notebook
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _has_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401  # optional: tqdm (extra progress)
    except ImportError:
        return False
    return True


def _tqdm_class(stream):
    """tqdm's bar class: its notebook widget in a notebook (tqdm.auto), its text bar when
    drawing on a given stream."""
    try:
        if stream is not None:
            from tqdm.std import tqdm  # optional: tqdm (extra progress)
        else:
            from tqdm.auto import tqdm  # optional: tqdm (extra progress)
    except ImportError:
        raise MissingDependencyError("The progress bar (verbose=1)", "tqdm", "progress") from None
    return tqdm


def _width(stream) -> dict:
    """tqdm's size options: the terminal's width as it changes. A terminal that tells a size
    of 0 (a pseudo-terminal nobody sized, some CI consoles) would get no bar at all from
    tqdm, so it gets $COLUMNS and $LINES, else 80 by 24."""
    try:
        if 0 in os.get_terminal_size(stream.fileno()):
            size = shutil.get_terminal_size()
            return {"ncols": size.columns, "nrows": size.lines}
    except (AttributeError, OSError, ValueError):  # not a terminal, no file (a notebook's stream)
        pass
    return {"dynamic_ncols": True}


def _epoch_name(epoch: int, total: int | None) -> str:
    return f"{epoch_name(epoch)}/{total}" if total else epoch_name(epoch)


# ---- log records above the bar ------------------------------------------------------------
class _AboveTheBar(logging.Handler):
    """Stands in for a console handler while a bar is drawn: formats the record as that
    handler would and writes it through tqdm, which clears the bar, prints the line and
    draws the bar again below it."""

    def __init__(self, handler: logging.Handler, write):
        super().__init__(handler.level)
        self.handler, self._write = handler, write
        self.filters = list(handler.filters)

    def emit(self, record):
        try:
            self._write(self.handler.format(record), file=self.handler.stream)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


@contextmanager
def _logging_above(write):
    """Console handlers of the "dl4py" logger and the loggers it passes records to (the
    root's, set by ``logging.basicConfig``; Python's last resort where there is none)
    write through ``write`` until the block ends; handlers to files are left alone. Only
    handlers already there are replaced, so no record is shown twice."""
    chain, logger = [], logging.getLogger("dl4py")
    while logger is not None:
        chain.append(logger)
        logger = logger.parent if logger.propagate else None
    for logger in chain:
        logger.handlers = [_AboveTheBar(h, write) if _is_console(h) else h for h in logger.handlers]
    last_resort = logging.lastResort
    if last_resort is not None:
        logging.lastResort = _AboveTheBar(last_resort, write)
    try:
        yield
    finally:
        logging.lastResort = last_resort
        for logger in chain:  # handlers added meanwhile stay
            logger.handlers = [h.handler if isinstance(h, _AboveTheBar) else h for h in logger.handlers]


def _is_console(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and any(stream is s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)))
