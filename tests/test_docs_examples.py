"""Every ```python block of README.md and docs/*.md runs, so a docs example cannot rot.

One test per block, named ``docs/data.md:25`` (the block's first code line). Each block runs in
a fresh process of its own, forked from one interpreter that has imported torch and dl4py (a new
``sys.executable`` where there is no fork), in its own process group, killed afterwards; its
working directory is a folder of the test's tmp_path holding a copy of ``examples/``. A failure
shows the block's output, and its traceback names the Markdown file and line, as the code is
compiled under the Markdown file's name at its own line numbers.

A block may be preceded by one HTML comment, invisible on the rendered page, that tells this
test how to run it::

    <!-- docs-test: slow, continues
    x, y = make_some_data()      # hidden set-up lines, run before the block
    -->

- ``continues``: first run the file's previous block (and what it continued), in the same
  namespace: the block uses names an earlier block defined.
- ``slow``: the test carries ``pytest.mark.slow`` (make test-quick leaves it out); ``spark``:
  ``slow`` and ``spark`` (it starts a SparkSession); ``soak``: a block that trains (seconds to
  tens of seconds even on cut data; other tests of make test cover what it uses): only make
  soak runs it, keeping make test in its budget.
- ``timeout N``: seconds the block may take (default ``BLOCK_TIMEOUT_S``).
- ``skip REASON``: not run, and pytest prints the reason (a GPU, a cluster, a Spark master).
  Keep these few; a block that needs an installed optional package runs.
- Lines after the first, up to ``-->``: set-up code run before the block, e.g. a small model.
  Set-up code may call ``docs_skip("reason")`` to skip at run time (Java absent, no network).

Data sizes: with ``DL4PY_DOCS_QUICK=1`` (the default here; ``DL4PY_DOCS_QUICK=0`` runs the
blocks on the full data) every Python process the block starts (``ParallelWrapper``'s workers,
``dl4py.sweep``'s runs) reads only the first ``QUICK_MNIST`` examples of each MNIST split. A
``sitecustomize`` module on ``PYTHONPATH`` does it by wrapping ``dl4py.data.mnist._load_arrays``
when that module is imported, so the library carries no test-only branch.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import mnist_dir

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 120
# Examples per MNIST split under DL4PY_DOCS_QUICK: enough for every block's batch sizes and splits.
QUICK_MNIST = {"train": 2048, "test": 512}
SKIP_EXIT = 77  # the block's process asked to be skipped (docs_skip); its last line is the reason
DIRECTIVE = "<!-- docs-test:"
FLAGS = ("slow", "spark", "soak", "continues", "timeout", "skip")


@dataclass
class Block:
    """One fenced ```python block and how its test runs it."""

    path: str           # relative to the repository: README.md, docs/data.md
    line: int           # the first code line, 1-based
    code: str
    setup: str = ""
    setup_line: int = 0
    slow: bool = False
    spark: bool = False
    soak: bool = False
    continues: bool = False
    timeout: int = BLOCK_TIMEOUT_S
    skip: str | None = None
    previous: Block | None = field(default=None, repr=False)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def chunks(self) -> list[tuple[str, int, str]]:
        """(file, first line, code) to run in order: what it continues, its set-up, itself."""
        earlier = self.previous.chunks() if self.continues and self.previous else []
        # Compiled under the file's full path: a traceback then quotes the Markdown line too.
        path = str(REPO / self.path)
        own = [(path, self.setup_line, self.setup)] if self.setup else []
        return earlier + own + [(path, self.line, self.code)]

    def skip_reason(self) -> str | None:
        if self.skip:
            return self.skip
        if self.continues and self.previous is not None and self.previous.skip_reason():
            return f"continues {self.previous.id}, skipped: {self.previous.skip_reason()}"
        return None


def _directive(lines: list[str], fence: int, where: str) -> tuple[str, str, int]:
    """The docs-test comment right above the fence at index ``fence``: (flags, set-up, set-up line)."""
    end = fence - 1
    while end >= 0 and not lines[end].strip():
        end -= 1
    if end < 0 or not lines[end].rstrip().endswith("-->"):
        return "", "", 0
    start = end
    while start > 0 and not lines[start].lstrip().startswith("<!--"):
        start -= 1
    if not lines[start].lstrip().startswith(DIRECTIVE):
        return "", "", 0
    head = lines[start].strip()[len(DIRECTIVE):]
    if start == end:
        return head.removesuffix("-->").strip(), "", 0
    body = lines[start + 1:end + 1]
    body[-1] = body[-1].rstrip().removesuffix("-->")
    assert not head.endswith("-->"), f"{where}: set-up lines follow the first line of a docs-test comment"
    return head.strip(), "\n".join(body), start + 2


def _apply_flags(block: Block, flags: str, where: str) -> None:
    flags, skip, reason = flags.partition("skip")  # skip comes last: its reason may hold commas
    if skip:
        if not reason.strip():
            raise ValueError(f"{where}: docs-test skip needs a reason")
        block.skip = reason.strip()
    for flag in filter(None, (f.strip() for f in flags.split(","))):
        name, _, value = flag.partition(" ")
        if name == "slow":
            block.slow = True
        elif name == "spark":
            block.slow = block.spark = True
        elif name == "soak":
            block.soak = True
        elif name == "continues":
            block.continues = True
        elif name == "timeout":
            block.timeout = int(value)
        else:
            raise ValueError(f"{where}: docs-test flag {flag!r}: expected one of {', '.join(FLAGS)}")


def collect_blocks(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, in order, each linked to the one before."""
    relative = path.relative_to(REPO).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            close = next((j for j in range(index + 1, len(lines)) if lines[j].strip() == "```"), None)
            where = f"{relative}:{index + 2}"
            if close is None:
                raise ValueError(f"{where}: ```python block never closed")
            flags, setup, setup_line = _directive(lines, index, where)
            block = Block(relative, index + 2, textwrap.dedent("\n".join(lines[index + 1:close])),
                          setup=textwrap.dedent(setup), setup_line=setup_line,
                          previous=blocks[-1] if blocks else None)
            _apply_flags(block, flags, where)
            blocks.append(block)
            index = close
        index += 1
    return blocks


def _params():
    for path in DOC_FILES:
        for block in collect_blocks(path):
            marks = [pytest.mark.slow] if block.slow else []
            marks += [pytest.mark.spark] if block.spark else []
            marks += [pytest.mark.soak] if block.soak else []
            yield pytest.param(block, id=block.id, marks=marks)


# Runs in the block's process: each chunk compiled under its Markdown file's name and padded to its
# line, so a traceback points at the docs; one namespace, named __main__ as a script's would be.
# The blocks run as a script's guarded code: ParallelWrapper refuses a fit from a script's top level.
DRIVER = '''\
import json, sys

def docs_skip(reason):
    print(reason, flush=True)
    raise SystemExit({skip_exit})

if __name__ == "__main__":
    namespace = {{"__name__": "__main__", "docs_skip": docs_skip}}
    for path, line, code in json.load(open(sys.argv[1])):
        exec(compile("\\n" * (line - 1) + code, path, "exec"), namespace)
'''.format(skip_exit=SKIP_EXIT)

# Imported by every Python process of the block (PYTHONPATH): cuts MNIST when dl4py reads it.
QUICK_SITECUSTOMIZE = '''\
"""Test-only (tests/test_docs_examples.py): MNIST cut to the first examples of each split."""
import importlib.abc
import importlib.machinery
import os
import sys

_LIMITS = {{True: {train}, False: {test}}}


def _cut(load_arrays):
    def cut(train, data_dir):
        images, labels = load_arrays(train, data_dir)
        return images[:_LIMITS[bool(train)]], labels[:_LIMITS[bool(train)]]
    return cut


class _CutMnist(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "dl4py.data.mnist":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def exec_then_cut(module):
            exec_module(module)
            module._load_arrays = _cut(module._load_arrays)
        spec.loader.exec_module = exec_then_cut
        return spec


if os.environ.get("DL4PY_DOCS_QUICK", "1") != "0":
    sys.meta_path.insert(0, _CutMnist())
'''.format(**QUICK_MNIST)


# One interpreter imports torch and dl4py once and forks a child per block: each block still runs
# in a fresh process of its own (own memory, own process group, killed afterwards) without paying
# the seconds of imports again. Where there is no fork, each block starts its own interpreter.
ZYGOTE = '''\
import json, os, runpy, sys, traceback
import numpy, torch, dl4py  # what every block would import again


def run_block(job):
    os.setsid()  # its own process group: the workers and servers it starts die with it
    os.chdir(job["cwd"])
    output = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = [job["driver"], job["chunks"]]
    try:
        runpy.run_path(job["driver"], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            run_block(json.loads(line))
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
'''
ZYGOTE_START_S = 300  # its imports, on a busy machine


def _environment(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DL4PY_DOCS_QUICK", "1")
    # sitecustomize (the MNIST cut) for every Python process; the set-up lines import this
    # module's helpers (tests/ on the path).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(REPO / "tests"), env.get("PYTHONPATH")]))
    env.update(MPLBACKEND="Agg", WANDB_MODE="offline", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


class _Runner:
    """Runs a block's chunks in a fresh process: forked from the zygote, or a new interpreter."""

    def __init__(self, site: Path):
        self.site = site
        self.env = _environment(site)
        for name, text in (("sitecustomize.py", QUICK_SITECUSTOMIZE), ("driver.py", DRIVER), ("zygote.py", ZYGOTE)):
            (site / name).write_text(text)
        self.zygote = None
        self._pending = b""
        if hasattr(os, "fork"):
            self.zygote = subprocess.Popen([sys.executable, str(site / "zygote.py")], cwd=site, env=self.env,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.stdin.close()
            try:
                self.zygote.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.zygote.kill()
                self.zygote.wait()

    def run(self, block: Block, folder: Path) -> tuple[int, str]:
        """(exit code, output); fails the test when the block runs past its timeout."""
        (folder / "chunks.json").write_text(json.dumps(block.chunks()))
        work = folder / "work"
        shutil.copytree(REPO / "examples", work / "examples")
        output = folder / "output.txt"
        if self.zygote is None:
            return self._run_interpreter(block, folder, work)
        job = dict(cwd=str(work), output=str(output), driver=str(self.site / "driver.py"),
                   chunks=str(folder / "chunks.json"))
        self.zygote.stdin.write((json.dumps(job) + "\n").encode())
        forked = self._line(ZYGOTE_START_S)
        if forked is None:
            pytest.fail(f"the docs blocks' zygote did not fork within {ZYGOTE_START_S} s", pytrace=False)
        pid = int(forked)
        try:
            status = self._line(block.timeout)
            if status is None:
                _kill_group(pid)
                self._line(60)
                pytest.fail(f"{block.id}: the block ran past {block.timeout} s\n{_tail(output.read_text())}",
                            pytrace=False)
        finally:
            _kill_group(pid)
        return int(status), output.read_text()

    def _line(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.zygote.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.zygote.stdout.fileno(), 4096)
            if not chunk:
                pytest.fail(f"the docs blocks' zygote exited ({self.zygote.wait()})", pytrace=False)
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode()

    def _run_interpreter(self, block: Block, folder: Path, work: Path) -> tuple[int, str]:
        process = subprocess.Popen(
            [sys.executable, str(self.site / "driver.py"), str(folder / "chunks.json")], cwd=work, env=self.env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=block.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            output, _ = process.communicate()
            pytest.fail(f"{block.id}: the block ran past {block.timeout} s\n{_tail(output)}", pytrace=False)
        finally:
            _kill_group(process.pid)
        return process.returncode, output


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    runner = _Runner(tmp_path_factory.mktemp("docs-site"))
    yield runner
    runner.close()


def _tail(output: str, lines: int = 60) -> str:
    return "\n".join(output.splitlines()[-lines:])


def _needs_mnist(block: Block) -> bool:
    return any(re.search(r"Mnist|_mnist\.yaml", code) for _, _, code in block.chunks())


@pytest.mark.parametrize("block", _params())
def test_docs_block_runs(block: Block, tmp_path: Path, runner: _Runner):
    reason = block.skip_reason()
    if reason:
        pytest.skip(f"{block.id}: {reason}")
    if _needs_mnist(block) and mnist_dir() is None:
        pytest.skip(f"{block.id}: MNIST files not found: set DL4PY_DATA to a folder holding mnist/")
    code, output = runner.run(block, tmp_path)
    if code == SKIP_EXIT:
        pytest.skip(f"{block.id}: {output.strip().splitlines()[-1]}")
    if code != 0:
        pytest.fail(f"{block.id}: the docs example exits {code}:\n{_tail(output)}", pytrace=False)


def test_every_block_is_collected():
    """The collector sees the blocks a reader sees: each ```python fence is one test."""
    for path in DOC_FILES:
        fences = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip() == "```python")
        assert len(collect_blocks(path)) == fences, path


# -- What the docs' hidden set-up lines import (``from test_docs_examples import toy_classifier``):
# small stand-ins for "your data" and "your model", so each block runs in seconds.


def toy_arrays(n: int = 240, features: int = 4, classes: int = 3, seed: int = 0):
    """Features float32 ``[n, features]`` and labels int64 ``[n]``: the first feature's bucket."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = np.digitize(x[:, 0], np.quantile(x[:, 0], np.linspace(0, 1, classes + 1)[1:-1])).astype("int64")
    return x, y


def toy_classifier(features: int = 4, classes: int = 3):
    """A two-layer MultiLayerNetwork for ``toy_arrays``."""
    from dl4py import Adam, DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer

    return MultiLayerNetwork(NetworkConfig(
        layers=[DenseLayer(n_out=16, activation="relu"), OutputLayer(n_out=classes)],
        input_type=InputType.feed_forward(features), updater=Adam(0.01), seed=1)).init()


def toy_iterators(features: int = 4, classes: int = 3, batch_size: int = 32):
    """Training, validation and test ArrayDataSetIterators over ``toy_arrays``."""
    from dl4py import ArrayDataSetIterator

    return tuple(ArrayDataSetIterator(*toy_arrays(n, features, classes, seed), batch_size=batch_size, seed=seed)
                 for n, seed in ((240, 0), (60, 1), (60, 2)))


def toy_loaders(features: int = 4, classes: int = 3):
    """Training and validation torch DataLoaders over ``toy_arrays``."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return tuple(DataLoader(TensorDataset(*map(torch.as_tensor, toy_arrays(n, features, classes, seed))),
                            batch_size=32, shuffle=seed == 0) for n, seed in ((240, 0), (60, 1)))


def toy_frame(n: int = 240, label: str = "y", seed: int = 0):
    """A DataFrame of ``toy_arrays``: feature columns f0..f3 and the label column."""
    import pandas as pd

    x, y = toy_arrays(n, seed=seed)
    return pd.DataFrame(x, columns=[f"f{i}" for i in range(x.shape[1])]).assign(**{label: y})


def write_csv_parts(folder: str, frame, parts: int = 2) -> None:
    """``frame`` as ``parts`` CSV files in ``folder``."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    for part in range(parts):
        frame.iloc[part::parts].to_csv(Path(folder) / f"part-{part}.csv", index=False)


def lenet():
    """The README's LeNet (examples/lenet_mnist.yaml's network), untrained."""
    from dl4py import MultiLayerNetwork, RunConfig

    return MultiLayerNetwork(RunConfig.from_file(REPO / "examples" / "lenet_mnist.yaml").network).init()


def lenet_run(output: str = "runs/lenet") -> str:
    """What ``dl4py train examples/lenet_mnist.yaml --output runs/lenet`` writes (one epoch)."""
    from dl4py import RunConfig
    from dl4py.runner import train_run

    train_run(RunConfig.from_file(REPO / "examples" / "lenet_mnist.yaml"), output=output, progress=0)
    return output


def shapes_folders(root: str = "shapes", per_class: int = 8) -> None:
    """``root/{train,test}/{circle,square,stripes}/NNN.png``: small RGB images, a class a folder."""
    import numpy as np
    from PIL import Image

    grid_y, grid_x = np.mgrid[:40, :40]
    shapes = {"circle": (grid_x - 20) ** 2 + (grid_y - 20) ** 2 < 144,
              "square": (abs(grid_x - 20) < 11) & (abs(grid_y - 20) < 11),
              "stripes": grid_x % 8 < 4}
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for name, mask in shapes.items():
            folder = Path(root) / split / name
            folder.mkdir(parents=True)
            for index in range(per_class):
                pixels = rng.integers(0, 60, size=(40, 40, 3)).astype("uint8")
                pixels[mask] = rng.integers(180, 256, size=3)
                Image.fromarray(pixels).save(folder / f"{index:03d}.png")


def custom_layer_zip(path: str = "model.zip") -> None:
    """A DL4J ModelSerializer zip (written by dl4py) whose first layer is a user's own class,
    ``org.example.CustomLayer``, with a dense layer's fields."""
    import json
    import zipfile

    toy_classifier().save_dl4j(path)
    with zipfile.ZipFile(path) as source:
        entries = {name: source.read(name) for name in source.namelist()}
    config = json.loads(entries["configuration.json"])
    config["confs"][0]["layer"]["@class"] = "org.example.CustomLayer"
    entries["configuration.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as target:
        for name, data in entries.items():
            target.writestr(name, data)


def toy_regressor(features: int = 4, targets: int = 2):
    """A MultiLayerNetwork with a regression loss (mse): ``predict`` gives its output values."""
    from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer

    return MultiLayerNetwork(NetworkConfig(
        layers=[DenseLayer(n_out=8, activation="relu"), OutputLayer(n_out=targets, loss="mse", activation="identity")],
        input_type=InputType.feed_forward(features))).init()


def mnist_digits_below(limit: int, batch_size: int = 64):
    """An iterator over the MNIST training digits below ``limit`` (a new task for a trained LeNet)."""
    from dl4py import ArrayDataSetIterator
    from dl4py.data import load_mnist

    images, labels = load_mnist(train=True)
    keep = labels < limit
    return ArrayDataSetIterator(images[keep].reshape(-1, 784).float() / 255, labels[keep], batch_size=batch_size)


def stop_when_serving() -> None:
    """SIGTERM this process once a server has installed its SIGTERM handler: a block's
    ``serve_forever()`` then returns, as it would under ``kill``."""
    import signal
    import threading
    import time

    default = signal.getsignal(signal.SIGTERM)

    def wait_then_stop():
        while signal.getsignal(signal.SIGTERM) is default:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait_then_stop, daemon=True).start()


def port_in_use(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def two_input_graph():
    """A ComputationGraph of two inputs (a digit's top and bottom halves, 392 pixels each) merged."""
    from dl4py import ComputationGraph, GraphConfig

    return ComputationGraph(GraphConfig.from_dict({
        "inputs": {"top": {"type": "feed_forward", "size": 392}, "bottom": {"type": "feed_forward", "size": 392}},
        "vertices": {"merge": {"inputs": ["top", "bottom"], "vertex": {"type": "merge"}},
                     "out": {"inputs": ["merge"], "layer": {"type": "output", "n_out": 10}}},
        "outputs": ["out"]})).init()


def test_quick_mode_cuts_mnist(runner: _Runner, tmp_path: Path):
    """With DL4PY_DOCS_QUICK the blocks' processes, and the processes they start, read MNIST cut."""
    if runner.env["DL4PY_DOCS_QUICK"] == "0" or mnist_dir() is None:
        pytest.skip("DL4PY_DOCS_QUICK=0, or no MNIST files")
    code = ("import subprocess, sys\n"
            "from dl4py.data import load_mnist\n"
            f"assert len(load_mnist(train=True)[1]) == {QUICK_MNIST['train']}\n"
            "child = 'from dl4py.data import load_mnist; print(len(load_mnist(train=False)[1]))'\n"
            "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True, check=True).stdout)\n")
    status, output = runner.run(Block("tests/test_docs_examples.py", 1, code), tmp_path)
    assert status == 0, output
    assert output.split() == [str(QUICK_MNIST["test"])], output
