"""Epoch, batch and round numbers as a person reads them: counted from 1.

Inside, dl4py counts from 0: ``model.epoch_count`` is the number of completed epochs, so
while the first epoch runs it is 0, and History, ``metrics.jsonl``, ``result.json``,
``best_model_epoch`` (DL4J's EarlyStoppingResult) and TensorBoard or MLflow steps keep those
0-based numbers, as Keras' History does. Every message, log line and error a person reads
names the same epoch from 1, as the console's "epoch 1/3" does: "epoch 2, batch 4" is the
fourth batch of the second epoch, whichever message says it. A count of what was done
needs no conversion: "after batch 3" (``batch_in_epoch`` = 3) is the third batch's end.
Worker numbers stay ranks (from 0) and iteration numbers stay counts (the n-th minibatch).

Data modules below ``dl4py.train`` (``data/batch_stream.py``) add the 1 themselves: importing
this module there would close an import cycle.
"""

from __future__ import annotations

__all__ = ["batch_location", "epoch_name", "round_name", "stop_point"]


def epoch_name(epoch: int) -> str:
    """The epoch of 0-based index ``epoch`` in words: ``epoch_name(0)`` is "epoch 1"."""
    return f"epoch {epoch + 1}"


def batch_location(epoch: int, index: int) -> str:
    """A batch in words, from 0-based indices: ``batch_location(1, 3)`` is "epoch 2, batch 4"."""
    return f"{epoch_name(epoch)}, batch {index + 1}"


def round_name(round_index: int) -> str:
    """A parallel round of an epoch in words, from its 0-based index: "round 1" first."""
    return f"round {round_index + 1}"


def stop_point(epoch_count: int, batch_in_epoch: int) -> str:
    """Where a stopped model stands, from its counters: "epoch 2, batch 4" names the last
    batch trained (the same words as that batch's data error), "the end of epoch 1" an
    epoch boundary, "the start of epoch 1" a model that trained nothing."""
    if batch_in_epoch:
        return batch_location(epoch_count, batch_in_epoch - 1)
    if epoch_count:
        return f"the end of {epoch_name(epoch_count - 1)}"
    return f"the start of {epoch_name(0)}"
