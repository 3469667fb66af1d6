"""Streaming tables: CSV and Parquet directories larger than the reader's cap train with
every row seen once, shards split them exactly, and DataLoader workers read in background."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DataLoader

from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, TableDirectoryIterator
from dl4py.data import UnknownLengthError
from dl4py.data.adapters import as_iterator
from dl4py.errors import DataError

ROWS, FILES = 1150, 5


def write_tables(folder, fmt: str, row_group: int = 50):
    """ROWS rows over FILES files: id (as id/1024, exact in float32), two features, label y."""
    import pandas as pd

    folder.mkdir()
    ids = np.arange(ROWS)
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"id": ids / 1024, "a": rng.normal(size=ROWS), "b": rng.normal(size=ROWS),
                       "y": ids % 3})
    for i, part in enumerate(np.array_split(np.arange(ROWS), FILES)):
        chunk = df.iloc[part]
        if fmt == "csv":
            chunk.to_csv(folder / f"part-{i}.csv", index=False)
        else:
            chunk.to_parquet(folder / f"part-{i}.parquet", index=False, row_group_size=row_group)
    return folder


def ids_of(batches) -> list[int]:
    return [int(v) for b in batches for v in (b.features[:, 0] * 1024).round().long()]


def mlp() -> NetworkConfig:
    return NetworkConfig(seed=3, layers=[DenseLayer(n_out=8), OutputLayer(n_out=3)],
                         input_type=InputType.feed_forward(3))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_directory_larger_than_the_cap_trains_one_epoch_seeing_every_row_once(tmp_path, fmt):
    table = TableDirectoryIterator(write_tables(tmp_path / "t", fmt), label="y", batch_size=16,
                                   chunk_rows=40, shuffle_buffer=60, seed=1)
    assert table.rows_cap < ROWS / 5  # the reader may hold a fifth of the data at most
    seen = []
    net = MultiLayerNetwork(mlp())
    prepare = net.prepare_batch
    net.prepare_batch = lambda batch: (seen.append(batch), prepare(batch))[1]
    history = net.fit(table, epochs=1)
    assert sorted(ids_of(seen)) == list(range(ROWS))
    assert list(history.history["examples"]) == [ROWS]
    assert 40 <= table.max_rows_held <= table.rows_cap
    first = ids_of(seen)
    assert first != sorted(first)  # shuffled within the buffer...
    assert ids_of(table) != first  # ...and differently in the next epoch
    assert sorted(ids_of(table)) == list(range(ROWS))


def test_parquet_knows_its_length_from_metadata_csv_after_one_pass(tmp_path):
    parquet = TableDirectoryIterator(write_tables(tmp_path / "p", "parquet"), label="y", batch_size=32)
    assert len(parquet) == -(-ROWS // 32) and parquet.total_examples() == ROWS
    assert len(list(parquet)) == len(parquet)
    csv = TableDirectoryIterator(write_tables(tmp_path / "c", "csv"), label="y", batch_size=32)
    with pytest.raises(UnknownLengthError, match="known after one full pass"):
        len(csv)
    assert [b.num_examples() for b in csv][-1] == ROWS % 32  # unshuffled: batches span files
    assert len(csv) == -(-ROWS // 32) and csv.total_examples() == ROWS
    assert csv.input_shape() == (3,) and csv.batch_size == 32


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_shards_are_disjoint_and_cover_every_row_once_per_epoch(tmp_path, fmt):
    table = TableDirectoryIterator(write_tables(tmp_path / "t", fmt), label="y", batch_size=16,
                                   chunk_rows=40, shuffle_buffer=30, seed=5)
    for epoch in (0, 1):
        shards = [ids_of(b for _, b in table.batches(epoch, rank, 2)) for rank in (0, 1)]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(ROWS))
        assert min(map(len, shards)) > ROWS / 4  # both ranks get a real share
    one = table.shard(1, 2)
    one.set_epoch(1)
    assert ids_of(one) == ids_of(b for _, b in table.batches(1, 1, 2))
    rounds = [i for i, _ in table.batches(0, 0, 2, start=3)]
    assert rounds[:2] == [0, 1] and len(rounds) == len(list(table.batches(0, 0, 2))) - 3


def test_dataloader_workers_read_their_own_shards_in_background(tmp_path):
    table = TableDirectoryIterator(write_tables(tmp_path / "t", "csv"), label="y", batch_size=16, chunk_rows=64)
    loader = DataLoader(table.as_dataset(), batch_size=None, num_workers=2)
    seen = []
    net = MultiLayerNetwork(mlp())
    prepare = net.prepare_batch
    net.prepare_batch = lambda batch: (seen.append(batch), prepare(batch))[1]
    net.fit(loader, epochs=1)
    assert sorted(ids_of(seen)) == list(range(ROWS))


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_two_ranks_with_two_loader_workers_each_read_every_row_once_per_epoch(tmp_path, fmt):
    """Rank r of 2 (``shard(r, 2)``, as a rank program gets its share) reads through a DataLoader
    with 2 workers, so 4 readers share 5 CSV files or 25 row groups, neither evenly: every row
    once per epoch over ranks and workers, and each rank only the rows of its own shard."""
    table = TableDirectoryIterator(write_tables(tmp_path / "t", fmt), label="y", batch_size=32,
                                   chunk_rows=100, shuffle_buffer=50, seed=7)
    epoch = 1  # not the first: the loader workers must follow set_epoch's piece order
    per_rank = []
    for rank in (0, 1):
        loader = as_iterator(DataLoader(table.shard(rank, 2).as_dataset(), batch_size=None, num_workers=2))
        loader.set_epoch(epoch)  # as fit does each epoch
        per_rank.append(ids_of(loader))
        assert sorted(per_rank[rank]) == sorted(ids_of(b for _, b in table.batches(epoch, rank, 2)))
    assert sorted(per_rank[0] + per_rank[1]) == list(range(ROWS))


def test_wrong_tables_are_one_clear_error(tmp_path, monkeypatch):
    folder = write_tables(tmp_path / "t", "csv")
    with pytest.raises(DataError, match=r"part-0.csv has no column 'label'; its columns are 'id', 'a', 'b', 'y'"):
        TableDirectoryIterator(folder, label="label")
    with pytest.raises(DataError, match=r"no parquet files"):
        TableDirectoryIterator(folder, label="y", format="parquet")
    (folder / "part-9.csv").write_text("id,a,b,y\n0.5,1.0,x,1\n")
    with pytest.raises(DataError, match=r"part-9.csv: line 2, column 'b': 'x' is not a number"):
        list(TableDirectoryIterator(folder, label="y"))
    write_tables(tmp_path / "p", "parquet")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"needs the 'pyarrow.parquet' package: pip install \"dl4py\[data\]\""):
        TableDirectoryIterator(tmp_path / "p", label="y")


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_data(tmp_path):
    """Peak RSS growth streaming 2, then 8 Parquet files (8 and 32 MB as float32) with a
    4,096-row cap, each in a fresh process, must not follow the data: a reader that held
    its rows would need 24 MB more for the 6 extra files."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("psutil")
    import pandas as pd

    folder = tmp_path / "big"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):  # 8 x 20,000 rows x 50 columns: 4 MB of float32 per file
        df = pd.DataFrame(rng.normal(size=(20_000, 50)), columns=[f"c{j}" for j in range(50)])
        df["y"] = rng.integers(0, 3, 20_000)
        df.to_parquet(folder / f"p{i}.parquet", row_group_size=4096)
    files = sorted(str(f) for f in folder.iterdir())

    def peak(paths):
        script = textwrap.dedent(f"""
            import psutil, dl4py
            it = dl4py.TableDirectoryIterator({paths!r}, label="y", batch_size=256, chunk_rows=4096)
            next(iter(it))  # libraries loaded and warmed up before the baseline
            base = psutil.Process().memory_info().rss
            peak, rows = 0, 0
            for b in it:
                rows += b.num_examples()
                peak = max(peak, psutil.Process().memory_info().rss - base)
            print(rows, peak, it.max_rows_held)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        rows, grown, held = map(int, out.stdout.split())
        assert rows == 20_000 * len(paths) and held <= 4096 + 255
        return grown

    small, large = peak(files[:2]), peak(files)
    assert large - small < 12e6, (small, large)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_two_parallel_workers_each_read_their_own_shard_every_row_once(tmp_path, fmt):
    from dl4py.parallel import ParallelWrapper
    from dl4py.parallel.sources import StreamShardSource
    from dl4py.parallel.preflight import own_source as _own_source

    table = TableDirectoryIterator(write_tables(tmp_path / "t", fmt, row_group=100), label="y", batch_size=32,
                                   chunk_rows=64, shuffle_buffer=32, seed=2)
    assert isinstance(_own_source(table), StreamShardSource)  # read by the workers, not dealt by a queue
    wrapper = ParallelWrapper(MultiLayerNetwork(mlp(), backend="cpu"), workers=2, prefetch_buffer=2)
    history = wrapper.fit(table, epochs=2, _record_examples=True)
    assert history.epoch == [0, 1] and history.history["examples"] == [ROWS, ROWS]
    per_worker = [[round(v * 1024) for v in wrapper.last_records[rank]] for rank in (0, 1)]
    assert sorted(per_worker[0] + per_worker[1]) == sorted(list(range(ROWS)) * 2)  # each row once an epoch
    assert per_worker[0] and per_worker[1]  # both read
    # Each worker read only its own shard of each epoch: the rows of its own pieces.
    for rank in (0, 1):
        shards = [sorted(ids_of(b for _, b in table.batches(epoch, rank, 2))) for epoch in (0, 1)]
        assert sorted(per_worker[rank][:len(shards[0])]) == shards[0]
        assert sorted(per_worker[rank][len(shards[0]):]) == shards[1]
