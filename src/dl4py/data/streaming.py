"""Tables larger than memory: a directory of CSV or Parquet files read chunk by chunk.

``TableDirectoryIterator`` never holds more than about ``chunk_rows + shuffle_buffer +
batch_size`` rows (``rows_cap``; ``max_rows_held`` is what it actually held): pandas
reads CSV in ``chunksize`` pieces, pyarrow reads Parquet ``iter_batches`` of a row group.

Shuffling is bounded: the file (and row-group) order is permuted each epoch, and rows mix
within a pool of ``shuffle_buffer`` rows, all seeded by ``seed + epoch``.

Shards: a *piece* is one CSV file or one Parquet row group. Rank ``r`` of ``world`` reads
the pieces ``i`` with ``i % world == r`` of the epoch's piece order, so the ranks' shards
are disjoint and together hold every row once per epoch (``batches(epoch, rank, world)``,
``shard(rank, world)``, and ``as_dataset()`` for DataLoader workers).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator

import torch

from dl4py.data.batch_stream import UnknownLengthError
from dl4py.data.columns import cell_explainer, frame_arrays, optional_import, split_columns
from dl4py.data.csv_stream import csv_frames, csv_header
from dl4py.data.dataset import DataSet
from dl4py.data.iterators import DataSetIterator, _int, _non_negative_int, _positive_int
from dl4py.errors import DataError

__all__ = ["TableDirectoryIterator", "TableDataset"]

FORMATS = {"csv": (".csv",), "parquet": (".parquet", ".pq")}


class TableDirectoryIterator(DataSetIterator):
    """Batches of a directory (or list) of CSV or Parquet files, streamed.

    ``label``: the label column(s); ``features``: the feature columns (default: all others,
    numeric). ``format``: "csv" or "parquet" (default: from the file names).

    >>> train = TableDirectoryIterator("data/train/", label="y", batch_size=64,
    ...                                chunk_rows=50_000, shuffle_buffer=10_000)   # doctest: +SKIP
    >>> model.fit(train, epochs=3)                                                  # doctest: +SKIP
    """

    def __init__(self, path, label, batch_size: int = 32, *, format: str | None = None, features=None,
                 chunk_rows: int = 65_536, shuffle_buffer: int = 0, seed: int = 0, drop_last: bool = False,
                 rank: int = 0, world: int = 1):
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.chunk_rows = _positive_int(chunk_rows, "chunk_rows")
        self.shuffle_buffer = _non_negative_int(shuffle_buffer, "shuffle_buffer")
        self.seed, self.drop_last = _int(seed, "seed"), bool(drop_last)
        self.rank, self.world = _shard_args(rank, world)
        self.files, self.format = _find_files(path, format)
        self.label = label
        columns = self._columns()
        self.feature_columns, self.label_columns = split_columns(columns, label, features, str(self.files[0]))
        if self.label_columns is None:
            raise DataError(f"{self.files[0]}: name the label column, e.g. label=\"y\"")
        self.max_rows_held = 0
        self._pieces = None  # [(file, row group or None, rows or None)], read lazily
        self._known = {}  # (rank, world) -> (batches, examples) from a full pass (CSV)

    @property
    def shuffle(self) -> bool:
        return self.shuffle_buffer > 0

    @property
    def rows_cap(self) -> int:
        """Most rows held at once: a chunk, the shuffle pool, a partial batch."""
        return self.chunk_rows + self.shuffle_buffer + self.batch_size - 1

    # -- protocol ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[DataSet]:
        epoch = self._take_epoch()  # now, not at the first next()
        return (batch for _, batch in self.batches(epoch, self.rank, self.world))

    def batches_per_epoch(self) -> int | None:
        """Batches this shard yields per epoch: from Parquet metadata, or after one CSV pass."""
        rows = self._shard_rows(self.rank, self.world)
        if rows is None:
            known = self._known.get((self.rank, self.world))
            return None if known is None else known[0]
        full, rest = divmod(rows, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def __len__(self) -> int:
        n = self.batches_per_epoch()
        if n is None:
            raise UnknownLengthError(
                f"{self!r}: a CSV directory's length is known after one full pass; "
                "fit() and ProgressBar(batches_per_epoch=None) work without it"
            )
        return n

    def total_examples(self) -> int:
        rows = self._shard_rows(self.rank, self.world)
        if rows is None:
            known = self._known.get((self.rank, self.world))
            if known is None:
                raise UnknownLengthError(f"{self!r}: the row count of CSV files is known after one full pass")
            return known[1]
        return rows - rows % self.batch_size if self.drop_last else rows

    def num_classes(self) -> int | None:
        return None  # unknown without reading every label; the model checks the first batch

    def input_shape(self) -> tuple[int, ...]:
        return (len(self.feature_columns),)

    # -- shards -----------------------------------------------------------------------
    def shard(self, rank: int, world: int) -> "TableDirectoryIterator":
        """A copy that reads only shard ``rank`` of ``world`` (see the module docstring)."""
        twin = copy.copy(self)
        twin.rank, twin.world = _shard_args(rank, world)
        twin._known, twin.max_rows_held = dict(self._known), 0
        return twin

    def as_dataset(self) -> "TableDataset":
        """This table as an iterable torch Dataset of whole batches; under a DataLoader with
        ``num_workers`` each worker reads its own shard, in the background:
        ``DataLoader(it.as_dataset(), batch_size=None, num_workers=2)``."""
        return TableDataset(self)

    def batches(self, epoch: int, rank: int = 0, world: int = 1, start: int = 0) -> Iterator[tuple[int, DataSet]]:
        """``(index, batch)`` for shard ``rank`` of ``world`` in epoch ``epoch`` (the parallel
        sources' interface); the shard's first ``start`` batches are skipped and the rest
        numbered from 0."""
        rank, world = _shard_args(rank, world)
        generator = torch.Generator().manual_seed(self.seed + _non_negative_int(epoch, "epoch"))
        pieces = self._ordered_pieces(generator)[rank::world]
        count = examples = 0
        for batch in self._batched(self._chunks(pieces), generator):
            if count >= start:
                yield count - start, batch
            count += 1
            examples += batch.num_examples()
        self._known[(rank, world)] = (count, examples)

    # -- reading ----------------------------------------------------------------------
    def _columns(self) -> list[str]:
        first = self.files[0]
        if self.format == "csv":
            return csv_header(first)
        pq = optional_import("pyarrow.parquet", "data", "reading Parquet files")
        return list(pq.ParquetFile(first).schema_arrow.names)

    def pieces(self) -> list[tuple[Path, int | None, int | None]]:
        """``(file, row group, rows)`` per piece; CSV files are one piece of unknown rows."""
        if self._pieces is None:
            if self.format == "csv":
                self._pieces = [(f, None, None) for f in self.files]
            else:
                pq = optional_import("pyarrow.parquet", "data", "reading Parquet files")
                self._pieces = []
                for f in self.files:
                    meta = pq.ParquetFile(f).metadata
                    self._pieces += [(f, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        return self._pieces

    def _ordered_pieces(self, generator: torch.Generator):
        pieces = self.pieces()
        if not self.shuffle:
            return pieces
        return [pieces[i] for i in torch.randperm(len(pieces), generator=generator).tolist()]

    def _shard_rows(self, rank: int, world: int) -> int | None:
        if self.format == "csv":
            return None
        # Which pieces a shard gets depends on the epoch's order, so this is exact only for
        # one shard, or for every row group of equal size (the common case); else known after a pass.
        rows = [n for _, _, n in self.pieces()]
        if world == 1 or len(set(rows)) == 1:
            return sum(rows[rank::world])
        known = self._known.get((rank, world))
        return None if known is None else known[1]

    def _chunks(self, pieces) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        columns = self.feature_columns + self.label_columns
        for path, group, _ in pieces:
            if self.format == "csv":
                frames = csv_frames(path, columns, self.chunk_rows)
            else:
                frames = self._parquet_frames(path, group, columns)
            for frame, explain in frames:
                x, y = frame_arrays(frame, self.label_columns, self.feature_columns, str(path), explain=explain)
                yield torch.from_numpy(x if x.flags.writeable else x.copy()), y

    def _parquet_frames(self, path: Path, group: int, columns: list[str]):
        """``(frame, explain)`` per chunk of row group ``group``; explain names the file's row."""
        pq = optional_import("pyarrow.parquet", "data", "reading Parquet files")
        optional_import("pandas", "data", "reading Parquet files")
        file = pq.ParquetFile(path)
        first = sum(file.metadata.row_group(g).num_rows for g in range(group))  # the file's row of the chunk's first
        for batch in file.iter_batches(batch_size=self.chunk_rows, row_groups=[group], columns=columns):
            frame = batch.to_pandas()
            yield frame, cell_explainer(frame, str(path), lambda row, first=first: f"row {first + row} (counting from 0)")
            first += len(frame)

    def _batched(self, chunks, generator: torch.Generator) -> Iterator[DataSet]:
        """Chunks -> batches of ``batch_size`` across chunk and file boundaries. With a shuffle
        buffer, each new chunk joins the pool, the pool is permuted and all but
        ``shuffle_buffer`` rows leave it as batches."""
        bs, keep = self.batch_size, self.shuffle_buffer
        pool_x = pool_y = None
        for x, y in chunks:
            pool_x = x if pool_x is None else torch.cat([pool_x, x])
            pool_y = y if pool_y is None else torch.cat([pool_y, y])
            self.max_rows_held = max(self.max_rows_held, len(pool_x))
            if keep:
                order = torch.randperm(len(pool_x), generator=generator)
                pool_x, pool_y = pool_x[order], pool_y[order]
            out = max(len(pool_x) - keep, 0) // bs * bs
            for i in range(0, out, bs):
                yield DataSet(pool_x[i : i + bs], pool_y[i : i + bs])
            # A copy: a view would keep the whole chunk's memory alive.
            pool_x, pool_y = pool_x[out:].clone(), pool_y[out:].clone()
        if pool_x is None:
            return
        if keep:
            order = torch.randperm(len(pool_x), generator=generator)
            pool_x, pool_y = pool_x[order], pool_y[order]
        stop = len(pool_x) - len(pool_x) % bs if self.drop_last else len(pool_x)
        for i in range(0, stop, bs):
            yield DataSet(pool_x[i : i + bs], pool_y[i : i + bs])

    def __repr__(self) -> str:
        where = self.files[0].parent if len(self.files) > 1 else self.files[0]
        shard = f", shard {self.rank}/{self.world}" if self.world > 1 else ""
        return f"TableDirectoryIterator({str(where)!r}, {self.format}, {len(self.files)} files{shard})"


class TableDataset(torch.utils.data.IterableDataset):
    """A TableDirectoryIterator as an iterable torch Dataset of whole batches, sharded over
    DataLoader workers (each reads its own pieces). Use ``batch_size=None`` in the loader."""

    def __init__(self, table: TableDirectoryIterator):
        self.table, self.epoch = table, 0

    def set_epoch(self, epoch: int) -> None:  # called by dl4py's LoaderIterator each epoch
        self.epoch = epoch

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rank, world = (0, 1) if info is None else (info.id, info.num_workers)
        # Loader workers split the table's own shard further, so a rank's loader still
        # reads only that rank's pieces.
        world, rank = self.table.world * world, self.table.rank + self.table.world * rank
        for _, batch in self.table.batches(self.epoch, rank, world):
            yield batch.features, batch.labels


def _shard_args(rank, world) -> tuple[int, int]:
    rank, world = _non_negative_int(rank, "rank"), _positive_int(world, "world")
    if rank >= world:
        raise ValueError(f"rank must be < world, got rank={rank}, world={world}")
    return rank, world


def _find_files(path, format: str | None) -> tuple[list[Path], str]:
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    paths = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]
    suffixes = sum(FORMATS.values(), ()) if format is None else FORMATS[format]
    files = []
    for p in paths:
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.suffix.lower() in suffixes and f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    if not files:
        raise DataError(f"{', '.join(map(str, paths))}: no {format or 'CSV or Parquet'} files "
                        f"(looked for names ending {', '.join(suffixes)})")
    if format is None:
        found = {k for f in files for k, ends in FORMATS.items() if f.suffix.lower() in ends}
        if len(found) != 1:
            raise DataError(f"{paths[0]}: {'both CSV and Parquet' if found else 'unrecognised'} files; "
                            "pass format=\"csv\" or format=\"parquet\"")
        format = found.pop()
    return files, format
