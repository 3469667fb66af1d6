"""Accumulation (``training.accumulate_batches`` > 1) with the tensor-parallel plans.

Tensor mode accumulates as the shared-gradients mode does, on a 1-D or 2-D mesh (checked
against a by-hand reference in ``test_tensor_parallel.py``, which reuses its 4-rank start).
The hybrid does not yet: each rank weighs its batch by its own rows while the loss is its
tensor group's, over the gathered rows, so a short or empty batch (an epoch's last) would
weigh the ranks of one group differently. It is refused, naming the setting and the mode,
before any worker starts: through the ParallelWrapper and through ``dl4py train``.
"""

from __future__ import annotations

import pytest

from dl4py import ArrayDataSetIterator, ConfigError, MultiLayerNetwork
from dl4py.cli import main
from dl4py.parallel import ParallelWrapper

from descendants import started_processes  # noqa: E402
from toy import mlp, toy  # noqa: E402

REFUSAL = "training.accumulate_batches: is not supported with parallelism hybrid yet"


@pytest.mark.parametrize("mesh", [{"workers": 2, "parallelism": "hybrid"},
                                  {"workers": 4, "parallelism": {"kind": "hybrid", "tensor_size": 2}}], ids=["1-D", "2-D"])
@pytest.mark.parametrize("given", ["model", "fit"])
def test_the_hybrid_with_accumulation_is_refused_before_any_worker_starts(mesh, given):
    """Whether the model carries the setting or ``fit`` is given it. The data (9 batches of 8,
    the last of 6) would leave worker 1 an empty first batch in the last window."""
    before = started_processes()
    net = MultiLayerNetwork(mlp(), backend="cpu")
    if given == "model":
        net.set_accumulate_batches(2)
    data = ArrayDataSetIterator(*toy(70), batch_size=8, shuffle=False)
    with ParallelWrapper(net, **mesh) as wrapper:
        with pytest.raises(ConfigError, match=REFUSAL):
            wrapper.fit(data, verbose=0, accumulate_batches=2 if given == "fit" else None)
        assert started_processes() == before  # no worker was started (a pool keeps its workers until closed)


def test_dl4py_train_refuses_the_hybrid_with_accumulation_in_one_line(tmp_path, mnist, capsys):
    config = tmp_path / "hybrid.yaml"
    config.write_text(
        "network:\n"
        "  input_type: {type: feed_forward, size: 784}\n"
        "  layers: [{type: dense, n_out: 12}, {type: dense, n_out: 12}, {type: output, n_out: 10}]\n"
        "data: {dataset: mnist, limit_train: 64, limit_test: 16}\n"
        "training:\n"
        "  {epochs: 1, batch_size: 8, workers: 2, parallelism: hybrid, accumulate_batches: 2}\n"
    )
    before = started_processes()
    assert main(["train", str(config), "--output", str(tmp_path / "run"), "--no-progress"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and REFUSAL in error[0], error
    assert started_processes() == before
