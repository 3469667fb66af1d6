"""ParallelOptions: one set of checks for the wrapper and the run config's training section,
and DL4J's builder options that have no effect, noted instead of refused. No processes."""

from __future__ import annotations

import logging

import pytest

from dl4py import MultiLayerNetwork
from dl4py.config.run import TrainingConfig
from dl4py.errors import ConfigError
from dl4py.parallel import ParallelOptions, ParallelWrapper
from dl4py.parallel.dl4j_options import WITHOUT_EFFECT

from toy import mlp  # noqa: E402


@pytest.mark.parametrize("values, message", [
    ({"workers": 2, "prefetch_buffer": -1}, "prefetch_buffer: must be an integer >= 0, got -1"),
    ({"workers": 2, "averaging_frequency": 0}, "averaging_frequency: must be a positive integer, got 0"),
    ({"workers": 2, "training_mode": "shared_gradients", "report_score_after_averaging": True},
     "report_score_after_averaging: applies to training_mode 'averaging' only"),
    ({"workers": 4, "training_mode": "tensor", "tensor_parallel_size": 3},
     "tensor_parallel_size: is 3, which does not divide the 4 workers into tensor-parallel groups"),
    ({"workers": 2, "training_mode": "hybrid", "tensor_parallel_size": 0},
     "tensor_parallel_size: must be a positive integer, got 0"),
    ({"workers": 4, "training_mode": "shared_gradients", "tensor_parallel_size": 2},
     "tensor_parallel_size: applies to training_mode 'tensor' or 'hybrid' only, not 'shared_gradients'"),
])
def test_the_wrapper_and_the_training_section_refuse_a_value_in_the_same_words(values, message):
    net = MultiLayerNetwork(mlp())
    with pytest.raises(ConfigError) as wrapper_error:
        ParallelWrapper(net, **values)
    with pytest.raises(ConfigError) as config_error:
        TrainingConfig.from_dict(values, "training")
    assert str(wrapper_error.value).startswith(message)
    assert str(config_error.value) == f"training.{wrapper_error.value}"


def test_options_read_as_attributes_and_are_checked_when_set():
    wrapper = ParallelWrapper(MultiLayerNetwork(mlp()), workers=2, devices=["cpu:0"])
    shown = wrapper.workers, wrapper.devices, wrapper.averaging_frequency, wrapper.average_updaters
    assert shown == (2, ["cpu"], 1, True)  # the defaults in effect
    wrapper.averaging_frequency = 3
    assert wrapper.options == ParallelOptions(workers=2, averaging_frequency=3, devices=("cpu",))
    with pytest.raises(ConfigError, match="workers: must be a positive integer, got 0"):
        wrapper.workers = 0
    assert wrapper.workers == 2  # a refused value leaves the options as they were


def test_dl4j_builder_options_without_effect_are_noted_and_unknown_ones_refused(caplog):
    caplog.set_level(logging.INFO, logger="dl4py")
    net = MultiLayerNetwork(mlp())
    wrapper = ParallelWrapper(net, workers=2, use_legacy_averaging=True, workspace_mode="ENABLED",
                              threshold_algorithm=object())
    notes = [r.getMessage() for r in caplog.records if "has no effect in dl4py" in r.getMessage()]
    assert notes == [f"ParallelWrapper: {name} has no effect in dl4py: {WITHOUT_EFFECT[name]}"
                     for name in ("use_legacy_averaging", "workspace_mode", "threshold_algorithm")]
    assert all(r.levelno == logging.INFO for r in caplog.records if "has no effect" in r.getMessage())
    assert wrapper.options == ParallelOptions(workers=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'averaging_freq'; its options are workers, "
                                        r"prefetch_buffer, averaging_frequency, .* \(and DL4J's use_legacy_averaging"):
        ParallelWrapper(net, averaging_freq=3)
