"""ParallelOptions: one set of checks for the wrapper and the run config's training section,
one object validated once and handed on as it is (to the wrapper, to each Spark task), and
DL4J's builder options that have no effect, noted instead of refused. No processes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from dl4py import ArrayDataSetIterator, MultiLayerNetwork
from dl4py.config.run import TrainingConfig
from dl4py.errors import ConfigError
from dl4py.config.parallel import ParallelPlan, _noted
from dl4py.parallel import ParallelOptions, ParallelWrapper
from dl4py.parallel.dl4j_options import WITHOUT_EFFECT
from dl4py.train.history import History

from toy import mlp, toy  # noqa: E402


@pytest.mark.parametrize("values, message", [
    ({"workers": 2, "prefetch_buffer": -1}, "prefetch_buffer: must be an integer >= 0, got -1"),
    ({"workers": 2, "averaging_frequency": 0}, "averaging_frequency: must be a positive integer, got 0"),
    ({"workers": 2, "parallelism": {"kind": "data", "sync": "shared_gradients"}, "report_score_after_averaging": True},
     "report_score_after_averaging: applies to the data plan with averaging only"),
    ({"workers": 4, "parallelism": {"kind": "tensor", "tensor_size": 3}},
     "parallelism.tensor_size: is 3, which does not divide the 4 workers into tensor-parallel groups"),
    ({"workers": 2, "parallelism": {"kind": "hybrid", "tensor_size": 0}},
     "parallelism.tensor_size: must be a positive integer, got 0"),
    ({"workers": 4, "parallelism": {"kind": "data", "tensor_size": 2}},
     "parallelism.tensor_size: applies to the tensor and hybrid plans only, not 'data'"),
    ({"workers": 2, "parallelism": {"kind": "data", "sync": "gradients"}},
     "parallelism.sync: must be one of averaging, shared_gradients; got 'gradients'"),
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


@pytest.fixture
def validations(monkeypatch) -> list:
    """Every ParallelOptions.validate call from here on, as the options it was called on."""
    calls = []
    validate = ParallelOptions.validate

    def counted(self, where=""):
        calls.append(self)
        return validate(self, where)
    monkeypatch.setattr(ParallelOptions, "validate", counted)
    return calls


def test_one_options_object_is_taken_as_it_is_once_validated(validations):
    net = MultiLayerNetwork(mlp())
    options = TrainingConfig.from_dict({"workers": 2, "averaging_frequency": 3}, "training").parallel_options()
    assert options.validated and len(validations) == 2  # the section's own check, then the object the runner hands on
    assert ParallelWrapper(net, options=options).options is options
    assert len(validations) == 2
    made = ParallelOptions(workers=2, averaging_frequency=0)  # not validated: the wrapper does it, once
    with pytest.raises(ConfigError, match="^averaging_frequency: must be a positive integer, got 0$"):
        ParallelWrapper(net, options=made)
    assert validations[2:] == [made]
    with pytest.raises(ConfigError, match="^workers: is given to ParallelWrapper twice, as a keyword and in options"):
        ParallelWrapper(net, workers=4, options=options)
    with pytest.raises(TypeError, match="options must be a ParallelOptions, got dict"):
        ParallelWrapper(net, options={"workers": 2})


class FakeSession:
    """What SparkTrainer.fit asks of a SparkSession, without a JVM: a local[2] master."""

    def __init__(self):
        self.sparkContext = SimpleNamespace(master="local[2]", _gateway=None, defaultParallelism=2,
                                            setJobGroup=lambda *args, **kwargs: None,
                                            cancelJobGroup=lambda group: None)
        settings = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
        self.conf = SimpleNamespace(get=lambda key, default=None: settings.get(key, default))


def test_a_spark_task_receives_the_drivers_options_object_validated_once_at_the_driver(monkeypatch, validations):
    """The job crosses to the executors by cloudpickle (as TorchDistributor sends it); rank 0's
    task builds its wrapper on what arrived. Its fit is the launched rank's, run by the Spark
    tests: here it only notes the options it got."""
    pytest.importorskip("pyspark.ml.torch.distributor")
    from pyspark import cloudpickle

    from dl4py.spark import SparkTrainer, task

    arrived, fitted = [], []

    class Distributor:  # TorchDistributor's run: the job pickled to a task, rank 0's result back
        def __init__(self, num_processes, local_mode, use_gpu):
            assert num_processes == 2

        def run(self, train_task, job):
            assert train_task is task.train_task
            arrived.append(cloudpickle.loads(cloudpickle.dumps(job)))
            return task._train(arrived[0], 0, None)

    def fit(wrapper, *args, **kwargs):
        fitted.append(wrapper.options)
        return History()
    monkeypatch.setattr("pyspark.ml.torch.distributor.TorchDistributor", Distributor)
    monkeypatch.setattr(task.ParallelWrapper, "fit", fit)

    trainer = SparkTrainer(MultiLayerNetwork(mlp()), 2, spark=FakeSession(), averaging_frequency=2)
    assert len(validations) == 1 and trainer.options.validated
    x, y = toy(64)
    trainer.fit(ArrayDataSetIterator(x, y, batch_size=16), verbose=0)
    received = arrived[0].options
    assert type(received) is ParallelOptions and received == trainer.options and received.validated
    assert fitted == [received] and fitted[0] is received  # the task's wrapper took it as it is
    assert len(validations) == 1  # nothing validated it again, at the driver or in the task


def test_options_that_cannot_apply_to_spark_tasks_fail_at_the_driver_in_one_line(validations):
    """Before any session is asked for, so before any task starts."""
    pytest.importorskip("pyspark")
    from dl4py.spark import SparkTrainer

    no_session = SimpleNamespace()  # any use would be an AttributeError
    with pytest.raises(ConfigError) as refused:
        SparkTrainer(MultiLayerNetwork(mlp()), 2, spark=no_session, averaging_frequency=3,
                     parallelism={"kind": "data", "sync": "shared_gradients"})
    assert str(refused.value) == ("averaging_frequency: applies to the data plan with averaging only: parallelism "
                                  "{kind: data, sync: shared_gradients} keeps every replica identical")
    assert len(validations) == 1
    with pytest.raises(ConfigError, match="^devices: applies to the ParallelWrapper, not to Spark tasks"):
        SparkTrainer(MultiLayerNetwork(mlp()), spark=no_session, options=ParallelOptions(workers=2, devices=["cpu"]))


@pytest.mark.parametrize("earlier, plan", [
    ({"training_mode": "shared_gradients"}, ParallelPlan("data", sync="shared_gradients")),
    ({"training_mode": "hybrid", "tensor_parallel_size": 2}, ParallelPlan("hybrid", tensor_size=2)),
    ({"training_mode": "sharded"}, ParallelPlan("sharded")),
])
def test_an_earlier_spelling_of_the_plan_still_works_and_says_once_what_to_write(caplog, earlier, plan):
    """``training_mode`` and ``tensor_parallel_size``, as the wrapper's keywords and
    attributes and as config keys: the same options as ``parallelism``, and one line each."""
    caplog.set_level(logging.WARNING, logger="dl4py")
    _noted.clear()
    net = MultiLayerNetwork(mlp())
    wanted = ParallelWrapper(net, workers=4, parallelism=plan).options
    assert ParallelWrapper(net, workers=4, **earlier).options == wanted
    assert ParallelWrapper(net, workers=4, **earlier).options == wanted  # noted once, not per use
    assert TrainingConfig.from_dict({"workers": 4, **earlier}, "training").parallel_options() == wanted
    wrapper = ParallelWrapper(net, workers=4)
    for name, value in earlier.items():
        setattr(wrapper, name, value)
    assert wrapper.options == wanted and wrapper.training_mode == plan.mode
    notes = [r.getMessage() for r in caplog.records]
    shown = ", ".join(f"{name}={value!r}" for name, value in earlier.items())
    assert notes[0] == (f"ParallelWrapper({shown}) is deprecated (it still works): "
                        f"write ParallelWrapper(parallelism={plan.to_dict()!r})")
    assert notes[1].startswith("training.training_mode: ") and notes[1].endswith(f"write training.parallelism: {plan}")
    assert len(notes) == len(set(notes)) and all(r.levelno == logging.WARNING for r in caplog.records)
    with pytest.raises(ConfigError, match="^parallelism: and training_mode='sharded' both choose the plan"):
        ParallelWrapper(net, parallelism="data", training_mode="sharded")


def test_a_plan_reads_back_in_the_spelling_it_was_written():
    for spelling in ("data", "sharded", "tensor", "hybrid", {"kind": "data", "sync": "shared_gradients"},
                     {"kind": "hybrid", "tensor_size": 2}):
        config = TrainingConfig.from_dict({"workers": 4, "parallelism": spelling}, "training")
        assert config.to_dict()["parallelism"] == spelling
        assert TrainingConfig.from_dict(config.to_dict(), "training") == config
