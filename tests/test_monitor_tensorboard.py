"""DL4J's training diagnostics in TensorBoard, read back from real event files: the log10
update:parameter ratio per layer with the -3 guide, overlaid in one Custom Scalars chart, and
per-layer histograms of parameters, gradients and updates every few stats records."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from dl4py import DenseLayer, InputType, MultiLayerNetwork, NetworkConfig, OutputLayer, Sgd
from dl4py.monitor import FileStatsStorage, InMemoryStatsStorage, StatsListener, TensorBoardStatsStorage
from dl4py.train import TrainingListener

LR, BATCH, EXAMPLES, EPOCHS = 0.1, 8, 64, 3  # 8 iterations an epoch, 24 in all
FREQUENCY, HISTOGRAM_EVERY = 2, 3  # stats at 2, 4, ..., 24; histograms at 6, 12, 18, 24
STATS_STEPS = list(range(FREQUENCY, EPOCHS * EXAMPLES // BATCH + 1, FREQUENCY))
HISTOGRAM_STEPS = [6, 12, 18, 24]
LAYERS = ["0_DenseLayer", "1_DenseLayer", "2_OutputLayer"]
GUIDE = "update_ratio_log10_guide"
LAYOUT_TAG = "custom_scalars__config__"


def mlp() -> MultiLayerNetwork:
    config = NetworkConfig(seed=7, updater=Sgd(learning_rate=LR), input_type=InputType.feed_forward(12),
                           layers=[DenseLayer(n_out=16, activation="tanh"), DenseLayer(n_out=8, activation="relu"),
                                   OutputLayer(n_out=3)])
    return MultiLayerNetwork(config, backend="cpu").init()


def random_data(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(EXAMPLES, 12, generator=generator), torch.randint(0, 3, (EXAMPLES,), generator=generator)


class TensorsByHand(TrainingListener):
    """Each layer's parameters, gradients and updates at the iterations ``at``, by hand."""

    def __init__(self, at):
        self.at, self.previous, self.seen = set(at), None, {}

    def iteration_done(self, model, iteration, epoch, loss, batch_size):
        layers = [list(layer.parameters()) for layer in model.module]
        now = [[p.detach().clone() for p in params] for params in layers]
        if iteration in self.at:
            self.seen[iteration] = {
                name: {"parameters": torch.cat([p.reshape(-1) for p in current]),
                       "gradients": torch.cat([p.grad.reshape(-1) for p in params]),
                       "updates": torch.cat([(a - b).reshape(-1) for a, b in zip(current, before)])}
                for name, params, current, before in zip(LAYERS, layers, now, self.previous)}
        self.previous = now


def event_accumulator(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    events.Reload()
    return events


def layouts_in(event_file):
    """The Custom Scalars layouts written to one event file."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.custom_scalar import layout_pb2

    found = []
    for event in EventFileLoader(str(event_file)).Load():
        for value in event.summary.value:
            if value.tag == LAYOUT_TAG:
                found.append(layout_pb2.Layout.FromString(value.tensor.string_val[0]))
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One short fit of an MLP on random data, to TensorBoard, metrics.jsonl and memory."""
    tmp = tmp_path_factory.mktemp("tb")
    memory, board = InMemoryStatsStorage(), TensorBoardStatsStorage(tmp / "tb")
    by_hand = TensorsByHand(HISTOGRAM_STEPS)
    stats = StatsListener([memory, board, FileStatsStorage(tmp / "metrics.jsonl")], frequency=FREQUENCY,
                          histogram_every=HISTOGRAM_EVERY)
    try:
        mlp().fit(random_data(), epochs=EPOCHS, batch_size=BATCH, listeners=[stats, by_hand])
    finally:
        board.close()  # its writer's thread ends here
    return {"tmp": tmp, "records": memory.updates, "by_hand": by_hand.seen, "events": event_accumulator(tmp / "tb")}


def points(events, tag):
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_each_layer_has_its_log10_ratio_and_the_guide_at_minus_3_at_the_same_steps(run):
    events, records = run["events"], run["records"]
    assert [r["iteration"] for r in records] == STATS_STEPS
    for layer in LAYERS:
        expected = [(r["iteration"], pytest.approx(math.log10(r["layers"][layer]["update_ratio"]), abs=1e-6))
                    for r in records]
        assert points(events, f"update_ratio_log10/{layer}") == expected, layer
        # the raw ratios stay, for the tools and tests that read them
        assert points(events, f"update_ratio/{layer}") == [
            (r["iteration"], pytest.approx(r["layers"][layer]["update_ratio"], rel=1e-6)) for r in records]
    assert points(events, GUIDE) == [(step, -3.0) for step in STATS_STEPS]


def test_the_custom_scalars_layout_overlays_every_layers_log10_ratio_and_the_guide_once(run):
    (event_file,) = (run["tmp"] / "tb").glob("events.out.tfevents.*")
    (layout,) = layouts_in(event_file)  # once per event file, not once per stats record
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    (ratio_chart,) = [regexes for title, regexes in charts.items() if "log10" in title]
    scalar_tags = run["events"].Tags()["scalars"]
    # TensorBoard matches each regex from a tag's start: every layer's tag and the guide, nothing else
    overlaid = sorted(tag for tag in scalar_tags if any(re.match(regex, tag) for regex in ratio_chart))
    assert overlaid == sorted([f"update_ratio_log10/{layer}" for layer in LAYERS] + [GUIDE])
    assert len(ratio_chart) == len(LAYERS) + 1
    (score_chart,) = [regexes for title, regexes in charts.items() if title.startswith("score")]
    assert [tag for tag in scalar_tags if any(re.match(regex, tag) for regex in score_chart)] == ["train/score"]


def test_histograms_every_third_stats_record_have_the_tensors_counts_and_range(run):
    events, records, by_hand = run["events"], run["records"], run["by_hand"]
    assert [r["iteration"] for r in records if "histograms" in r] == HISTOGRAM_STEPS
    for kind in ("parameters", "gradients", "updates"):
        for layer in LAYERS:
            histograms = events.Histograms(f"histogram/{kind}/{layer}")
            assert [h.step for h in histograms] == HISTOGRAM_STEPS, (kind, layer)
            for event in histograms:
                tensor = by_hand[event.step][layer][kind]
                value = event.histogram_value
                low, high = float(tensor.min()), float(tensor.max())
                assert value.num == sum(value.bucket) == tensor.numel(), (kind, layer, event.step)
                assert (value.min, value.max) == (pytest.approx(low, abs=1e-7), pytest.approx(high, abs=1e-7))
                assert value.bucket_limit[-1] == pytest.approx(high, abs=1e-6)
                assert value.sum == pytest.approx(float(tensor.sum()), abs=1e-4)
                # 20 equal bins from min to max; a value on an edge may round either way
                reference = torch.histc(tensor, 20, low, high)
                assert sum(abs(a - b) for a, b in zip(value.bucket, reference.tolist())) <= 2, (kind, layer)


def test_the_histograms_travel_as_json_in_metrics_jsonl(run):
    lines = (run["tmp"] / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if '"kind": "stats"' in line]
    carried = [r for r in records if "histograms" in r]
    assert [r["iteration"] for r in carried] == HISTOGRAM_STEPS
    for record in carried:
        assert list(record["histograms"]) == LAYERS
        for layer, kinds in record["histograms"].items():
            size = run["by_hand"][record["iteration"]][layer]["parameters"].numel()
            for kind, histogram in kinds.items():
                assert len(histogram["counts"]) == 20 and sum(histogram["counts"]) == size, (layer, kind)
                assert histogram["min"] <= histogram["max"]


def test_histogram_every_0_writes_none_and_a_bad_value_is_named(tmp_path):
    memory = InMemoryStatsStorage()
    mlp().fit(random_data(), epochs=1, batch_size=BATCH, listeners=[StatsListener(memory, frequency=1,
                                                                                    histogram_every=0)])
    assert len(memory.updates) == 8 and not any("histograms" in r for r in memory.updates)
    with pytest.raises(ValueError, match="histogram_every must be a whole number of stats records"):
        StatsListener(memory, histogram_every=-1)


def test_a_layer_without_updates_has_no_log10_point_and_a_resumed_storage_writes_its_own_layout(tmp_path):
    """A zero ratio (a frozen step: no update) has no logarithm: no point, not -inf. A second
    storage on the same folder (a resumed run) is a second event file with its own layout."""
    for iteration, ratio in ((1, 0.0), (2, 1e-2)):
        board = TensorBoardStatsStorage(tmp_path)
        board.put_update({"kind": "stats", "iteration": iteration, "score": 1.0,
                          "layers": {"a.b": {"parameters": 1.0, "update_ratio": ratio},
                                     "pool": {"parameters": None, "update_ratio": None}}})
        board.close()
    events = event_accumulator(tmp_path)
    assert points(events, "update_ratio_log10/a.b") == [(2, pytest.approx(-2.0))]
    assert points(events, GUIDE) == [(2, -3.0)]
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 2
    for event_file in files:
        (layout,) = layouts_in(event_file)
        (chart,) = [c for c in layout.category[0].chart if "log10" in c.title]
        # the dot is escaped: "a.b" alone, and the layer without parameters left out
        assert list(chart.multiline.tag) == [r"update_ratio_log10/a\.b$", GUIDE + "$"]


def test_a_histogram_spans_min_to_max_over_a_layers_tensors_and_a_diverged_one_is_left_out():
    from dl4py.monitor.collector import _histogram, histogram_record

    values = torch.tensor([-1.0, 3.0, 1.0, 2.9, -0.9, 1.1])
    histogram = histogram_record(_histogram([values[:2], values[2:]]).tolist(), 0)
    assert (histogram["min"], histogram["max"]) == (-1.0, 3.0)
    assert histogram["sum"] == pytest.approx(6.1) and histogram["sum_squares"] == pytest.approx(21.43)
    # bins 0.2 wide from -1: -1 and -0.9 in the first, 1 and 1.1 in the 11th, 2.9 and 3 in the last
    assert histogram["counts"] == [2] + [0] * 9 + [2] + [0] * 8 + [2]
    constant = histogram_record(_histogram([torch.full((5,), 0.5)]).tolist(), 0)
    assert constant["counts"] == [5] + [0] * 19 and constant["min"] == constant["max"] == 0.5
    for bad in (float("nan"), float("inf")):
        assert histogram_record(_histogram([torch.tensor([1.0, bad])]).tolist(), 0) is None
    assert _histogram([torch.zeros(0)]) is None
