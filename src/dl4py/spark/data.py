"""What the ranks read: a Spark DataFrame staged as Parquet, a table directory, or an iterator.

- A Spark DataFrame is written by Spark as a Parquet directory in a staging folder, with
  at least one file per worker; each rank then streams its own files
  (``TableDirectoryIterator``, sharded by the ParallelWrapper), so every example is read
  once per epoch and no rank holds the whole data. A feature column of arrays or ML
  vectors becomes one column per element.
- A directory (or file) path of Parquet or CSV tables is read the same way, in place.
- Any other source ``fit`` accepts (an in-memory iterator, arrays) becomes an iterator here
  and travels to the ranks by pickle.

Ranks open local paths: on a cluster the staging folder and a table directory must be
on a file system mounted at the same path on the driver and every executor (NFS, or
HDFS/S3 through a FUSE mount).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from dl4py.data.adapters import as_iterator
from dl4py.data.streaming import TableDirectoryIterator
from dl4py.errors import ConfigError, DataError
from dl4py.eval.select import is_regression_loss, output_loss


def is_spark_dataframe(data) -> bool:
    from pyspark.sql import DataFrame  # optional: pyspark (extra spark)

    return isinstance(data, DataFrame)


@contextlib.contextmanager
def rank_source(data, model, workers: int, *, label=None, features=None, batch_size=None, shuffle_buffer=None,
                seed=None, staging_dir=None):
    """The source each rank builds its iterator from; a staged copy of a DataFrame is
    removed on leaving."""
    table_options = {"label": label, "batch_size": batch_size}
    if is_spark_dataframe(data) or isinstance(data, (str, os.PathLike)):
        for name, value in table_options.items():
            if value is None:
                raise ConfigError(name, f"is required to train on a {_what(data)}")
        common = dict(batch_size=batch_size, shuffle_buffer=shuffle_buffer or 0, seed=seed or 0)
        if is_spark_dataframe(data):
            with _staged(data, model, workers, label, features, staging_dir) as (folder, names):
                yield _table(folder, label, names, workers, "the DataFrame", **common)
        else:
            yield _table(data, label, features, workers, str(data), **common)
        return
    if shuffle_buffer is not None:
        raise ConfigError("shuffle_buffer", f"applies to a Spark DataFrame or a table directory, not a "
                                            f"{type(data).__name__}")

    # As the ranks' ParallelWrapper will see it (arrays, a pandas DataFrame: as fit batches
    # them); every label of in-memory data is checked here, before any task starts.
    source = as_iterator(data, batch_size, label=label, features=features, training=True,
                         seed=getattr(model, "seed", 0) if seed is None else seed)
    model.check_data(source)
    yield source


def _what(data) -> str:
    return "Spark DataFrame" if is_spark_dataframe(data) else "table directory"


def _table(path, label, features, workers: int, what: str, **options):

    table = TableDirectoryIterator(path, label=label, features=features, **options)
    pieces = len(table.pieces())
    if pieces < workers:
        raise ConfigError("workers", f"is {workers} but {what} has {pieces} piece{'' if pieces == 1 else 's'} "
                                     f"(files or Parquet row groups) to share out, and each rank reads whole "
                                     f"pieces: use at most {pieces} workers, or more (or larger) partitions")
    return table


@contextlib.contextmanager
def _staged(df, model, workers: int, label: str, features, staging_dir):
    """``df`` written as Parquet, one folder per fit, with at least ``workers`` partitions
    (a DataFrame with more keeps its own, and their order)."""
    flat, names = _flat_columns(df, model, label, features)
    if flat.rdd.getNumPartitions() < workers:
        flat = flat.repartition(workers)
    root = Path(staging_dir) if staging_dir is not None else Path(tempfile.gettempdir())
    folder = root.resolve() / f"dl4py-staged-{uuid.uuid4().hex[:12]}"
    try:
        # A file: URI: on a cluster whose default file system is HDFS a bare path would land
        # there, where the ranks' readers, which open local paths, would not find it.
        flat.write.mode("errorifexists").parquet(folder.as_uri())
        yield folder, names
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _flat_columns(df, model, label: str, features):
    """The label column and numeric feature columns, arrays and vectors spread into one
    column per element (``name_0``, ``name_1``, ...); their names."""
    from pyspark.ml.functions import vector_to_array  # optional: pyspark (extra spark)
    from pyspark.ml.linalg import VectorUDT  # optional: pyspark (extra spark)
    from pyspark.sql import functions as F  # optional: pyspark (extra spark)
    from pyspark.sql import types as T  # optional: pyspark (extra spark)

    types = {f.name: f.dataType for f in df.schema.fields}
    names = [features] if isinstance(features, str) else list(features) if features is not None else None
    for name in [label, *(names or [])]:
        if name not in types:
            raise DataError(f"the DataFrame has no column {name!r}; its columns are {', '.join(types)}")
    names = names if names is not None else [n for n in types if n != label]
    if not names:
        raise DataError(f"the DataFrame has no feature columns besides the label {label!r}")
    _check_label(model, label, types[label])
    columns, flat_names = [], []
    for name in names:
        kind = types[name]
        if isinstance(kind, (T.NumericType, T.BooleanType)):
            columns.append(F.col(name).cast("double") if isinstance(kind, T.BooleanType) else F.col(name))
            flat_names.append(name)
            continue
        if isinstance(kind, VectorUDT):
            array = vector_to_array(F.col(name))
        elif isinstance(kind, T.ArrayType) and isinstance(kind.elementType, T.NumericType):
            array = F.col(name)
        else:
            raise DataError(f"DataFrame column {name!r} is {kind.simpleString()}: features must be numbers, arrays "
                            "of numbers or ML vectors (encode the others first, e.g. with a StringIndexer)")
        first = df.select(F.size(array).alias("n")).first()
        width = 0 if first is None else first["n"]
        columns += [array[i].alias(f"{name}_{i}") for i in range(width)]
        flat_names += [f"{name}_{i}" for i in range(width)]
    return df.select(*columns, F.col(label)), flat_names


def _check_label(model, label: str, kind) -> None:
    """A classifier needs class indices; Spark ML keeps them as doubles. Say so before
    staging anything rather than let every rank fail on its first batch."""
    from pyspark.sql import types as T  # optional: pyspark (extra spark)

    loss = output_loss(model)
    if loss is None or is_regression_loss(loss):
        return
    if isinstance(kind, (T.FloatType, T.DoubleType, T.DecimalType)):
        raise DataError(f"label column {label!r} is {kind.simpleString()} but the model classifies: its labels "
                        f"must be class indices; cast them, e.g. df.withColumn({label!r}, "
                        f"F.col({label!r}).cast('int'))")
    if not isinstance(kind, (T.IntegralType, T.BooleanType)):
        raise DataError(f"label column {label!r} is {kind.simpleString()}: class indices must be integers "
                        "(map the classes first, e.g. with a StringIndexer and a cast to int)")
