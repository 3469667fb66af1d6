"""Data from anywhere: every source fit/evaluate/score/output accept trains the same network
the same way, and every wrong source is one clear DataError."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from dl4py import (
    ArrayDataSetIterator,
    DenseLayer,
    InputType,
    MnistDataSetIterator,
    MultiLayerNetwork,
    Nesterovs,
    NetworkConfig,
    OutputLayer,
)
from dl4py.data import UnknownLengthError, as_iterator
from dl4py.errors import DataError, DL4PyError
from dl4py.train import ProgressBar, TrainingListener

SEED = 7


def mlp() -> NetworkConfig:
    return NetworkConfig(seed=SEED, updater=Nesterovs(learning_rate=0.05, momentum=0.9),
                         layers=[DenseLayer(n_out=32, activation="relu"), OutputLayer(n_out=10)],
                         input_type=InputType.feed_forward(784))


@pytest.fixture(scope="module")
def digits():
    import os

    from conftest import require_mnist

    require_mnist()
    assert os.environ.get("DL4PY_DATA")
    train = MnistDataSetIterator(100, train=True, seed=1, limit=2000, shuffle=False)
    test = MnistDataSetIterator(100, train=False, seed=1, limit=500, shuffle=False)
    return train.features, train.labels, test.features, test.labels


def trained(data, epochs=1, **options):
    net = MultiLayerNetwork(mlp())
    net.fit(data, epochs=epochs, **options)
    return net


def same_params(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.module.state_dict().values(), b.module.state_dict().values()))


def frame(x, y):
    import pandas as pd

    df = pd.DataFrame(x.numpy(), columns=[f"p{i}" for i in range(x.shape[1])])
    df["y"] = y.numpy()
    return df


def hf_dataset(x, y):
    import datasets

    return datasets.Dataset.from_dict({"pixels": list(x.numpy()), "label": y.numpy()})


def test_every_source_in_the_same_order_trains_bit_for_bit_alike(digits):
    x, y, tx, ty = digits
    reference = trained(ArrayDataSetIterator(x, y, batch_size=32, shuffle=False))
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, len(x), 32)]
    sources = {
        "DataLoader": (DataLoader(TensorDataset(x, y), batch_size=32), {}),
        "Dataset": (TensorDataset(x, y), dict(shuffle=False)),
        "tensors": ((x, y), dict(shuffle=False)),
        "numpy": ((x.numpy(), y.numpy()), dict(shuffle=False)),
        "DataFrame": (frame(x, y), dict(label="y", shuffle=False)),
        "HF Dataset": (hf_dataset(x, y), dict(shuffle=False)),
        "list of batches": (batches, {}),
        "function": (lambda: iter(batches), {}),
    }
    accuracy = reference.evaluate((tx, ty)).accuracy()
    assert accuracy > 0.75
    for name, (data, options) in sources.items():
        net = trained(data, **options)
        assert same_params(net, reference), name
        assert net.evaluate((tx, ty)).accuracy() == accuracy, name


def test_shuffled_sources_share_the_models_seed_and_a_dataloader_comes_close(digits):
    x, y, tx, ty = digits
    reference = trained(ArrayDataSetIterator(x, y, batch_size=32, shuffle=True, seed=SEED), epochs=2)
    for name, (data, options) in {
        "(X, y)": ((x, y), {}),
        "Dataset": (TensorDataset(x, y), {}),
        "DataFrame": (frame(x, y), dict(label="y")),
        "HF Dataset": (hf_dataset(x, y), {}),
    }.items():
        assert same_params(trained(data, epochs=2, **options), reference), name
    accuracy = reference.evaluate((tx, ty)).accuracy()
    torch.manual_seed(0)
    loader = trained(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True), epochs=2)
    assert not same_params(loader, reference)  # another order...
    assert abs(loader.evaluate((tx, ty)).accuracy() - accuracy) < 0.04  # ...about as good


class Seen(TrainingListener):
    """Records each step's first feature column (the example's id) and batch size."""

    def __init__(self, net, scale=1):
        self.epochs: list[list[int]] = []
        prepare = net.prepare_batch

        def recording(batch):
            if not self.epochs or net.batch_in_epoch == 0:
                self.epochs.append([])
            self.epochs[-1] += (batch.features[:, 0] * scale).round().long().tolist()
            return prepare(batch)

        net.prepare_batch = recording


def test_arrays_default_to_batches_of_32_shuffled_by_the_models_seed():
    x = torch.rand(100, 784)
    x[:, 0] = torch.arange(100).float()
    y = torch.randint(0, 10, (100,))

    def orders(seed):
        net = MultiLayerNetwork(mlp().replace(seed=seed))
        seen = Seen(net)
        summaries = net.fit((x, y), epochs=2)
        assert list(summaries.history["batches"]) == [4, 4]  # 32, 32, 32, 4
        return seen.epochs

    first, second = orders(SEED)
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != second and first != list(range(100))
    assert orders(SEED) == [first, second]
    assert orders(SEED + 1) != [first, second]
    assert first == ArrayDataSetIterator(x, y, 32, seed=SEED).epoch_order(0).tolist()
    assert len(as_iterator((x, y), training=True)) == 4


def test_evaluate_score_and_output_take_the_same_sources_unshuffled(digits):
    x, y, tx, ty = digits
    net = trained((x, y))
    accuracy, score, out = net.evaluate((tx, ty)).accuracy(), net.score((tx, ty)), net.output(tx)
    df = frame(tx, ty)
    assert net.evaluate(df, label="y").accuracy() == accuracy
    assert net.evaluate(DataLoader(TensorDataset(tx, ty), batch_size=50)).accuracy() == accuracy
    assert net.evaluate(hf_dataset(tx, ty)).accuracy() == accuracy
    assert net.score(df, label="y") == pytest.approx(score, rel=1e-6)
    assert net.score(TensorDataset(tx, ty), batch_size=100) == pytest.approx(score, rel=1e-6)
    assert torch.equal(net.output(df.drop(columns="y")), out)
    assert torch.equal(net.output(df, label="y"), out)
    assert torch.equal(net.output(TensorDataset(tx, ty)), out)


class Counting(IterableDataset):
    """Examples made on demand; ``produced`` says how many so far."""

    def __init__(self, n):
        self.n, self.produced = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.produced += 1
            yield torch.full((784,), i / 1024), i % 10


def test_an_iterable_dataset_streams_without_a_length_and_the_progress_bar_copes():
    data = Counting(200)
    iterator = as_iterator(data, 16)
    with pytest.raises(UnknownLengthError, match="does not know how many batches") as caught:
        len(iterator)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, DL4PyError)

    ahead = []

    class Lazy(TrainingListener):
        def iteration_done(self, model, iteration, epoch, loss, batch_size):
            ahead.append(data.produced - 16 * iteration)

    shown = io.StringIO()
    net, bar = MultiLayerNetwork(mlp()), ProgressBar(1, None, stream=shown, interval=0)
    seen = Seen(net, scale=1024)
    history = net.fit(iterator, listeners=[Lazy(), bar])
    assert list(history.history["examples"]) == [200]
    assert seen.epochs[0] == list(range(200))
    assert max(ahead) <= 16  # read batch by batch, never the whole stream
    assert "13 batches" in shown.getvalue()
    assert len(iterator) == 13 and iterator.total_examples() == 200  # known after a pass


def test_a_generator_is_one_pass_and_a_function_is_many():
    x, y = torch.rand(64, 784), torch.randint(0, 10, (64,))
    net = MultiLayerNetwork(mlp())
    with pytest.raises(DataError, match=r"read once.*epoch 2 found it used up.*lambda"):
        net.fit(((x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)), epochs=2)
    history = net.fit(lambda: ((x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)), epochs=2)
    assert list(history.history["batches"]) == [4, 4]


def test_unknown_types_and_wrong_columns_are_one_clear_error():
    net = MultiLayerNetwork(mlp())
    with pytest.raises(DataError, match=r"cannot train on int: expected .*DataFrame.*DataLoader"):
        net.fit(42)
    with pytest.raises(DataError, match=r"each batch must be a \(features, labels\) pair.*got a 3-element tuple"):
        net.fit([(torch.rand(4, 784), torch.zeros(4, dtype=torch.long), 1)])
    df = frame(torch.rand(8, 784), torch.zeros(8, dtype=torch.long))
    with pytest.raises(DataError, match=r"the DataFrame has no column 'label'; its columns are 'p0'"):
        net.fit(df, label="label")
    with pytest.raises(DataError, match=r"name the label column, e.g. fit\(df, label=\"y\"\)"):
        net.fit(df)
    df["y"] = "cat"
    with pytest.raises(DataError, match=r"label column 'y' holds .* not numbers"):
        net.fit(df, label="y")
    with pytest.raises(ValueError, match=r"batch_size applies to arrays.*DataLoader has its own batch size"):
        net.fit(DataLoader(TensorDataset(torch.rand(4, 784))), batch_size=8)
    with pytest.raises(DataError, match=r"no column 'target'.*'pixels', 'label'"):
        net.fit(hf_dataset(torch.rand(4, 784), torch.zeros(4, dtype=torch.long)), label="target")


def test_a_missing_optional_dependency_names_the_extra(monkeypatch, tmp_path):
    from dl4py import TableDirectoryIterator

    (tmp_path / "a.csv").write_text("x,y\n1,0\n")
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(DataError, match=r"needs the 'pandas' package: pip install \"dl4py\[data\]\""):
        TableDirectoryIterator(tmp_path, label="y")


def test_a_bad_label_in_a_later_batch_of_a_dataloader_is_named_before_the_loss_sees_it():
    from torch.utils.data import DataLoader, TensorDataset

    from dl4py.errors import DataError

    x = torch.rand(96, 784)
    y = torch.arange(96) % 10
    y[70] = 12  # the 5th of 6 batches (16 a batch)
    net = MultiLayerNetwork(NetworkConfig(seed=1, input_type=InputType.feed_forward(784),
                                          layers=[DenseLayer(n_out=8), OutputLayer(n_out=10)]), backend="cpu")
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    with pytest.raises(DataError, match=r"epoch 1, batch 5: label 12 is outside the output layer's 10 classes"):
        net.fit(loader, epochs=1)


def test_a_bad_label_in_a_later_batch_reaches_no_parallel_worker_s_loss():
    from torch.utils.data import DataLoader, TensorDataset

    from dl4py.errors import WorkerError
    from dl4py.parallel import ParallelWrapper

    x = torch.rand(128, 784)
    y = torch.arange(128) % 10
    y[100] = 12  # the 7th of 8 batches: dealt to a worker in round 4
    net = MultiLayerNetwork(NetworkConfig(seed=1, input_type=InputType.feed_forward(784),
                                          layers=[DenseLayer(n_out=8), OutputLayer(n_out=10)]), backend="cpu")
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    with pytest.raises(WorkerError, match=r"round 4: label 12 is outside the output layer's 10 classes") as caught:
        ParallelWrapper(net, workers=2, prefetch_buffer=2).fit(loader, epochs=1)
    assert "Traceback" not in str(caught.value)  # the worker's sentence, not its stack
