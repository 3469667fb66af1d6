"""Inference passes leave the module in eval mode between calls and check each kind of input
once (``nn.predict.InferenceState``): outputs stay those of eval mode whatever a user or a
fit did to the module since, training switches back, and bad input is still one error."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch import nn

from dl4py import (
    BatchNormalization,
    DataError,
    DataSet,
    DenseLayer,
    DropoutLayer,
    InputType,
    MultiLayerNetwork,
    NetworkConfig,
    OutputLayer,
    Sgd,
)
from dl4py.train.listeners import TrainingListener


def _trained():
    """A small classifier with dropout and batch norm, fitted two epochs (running statistics
    that differ from any one batch's), and 64 rows of its input."""
    config = NetworkConfig(seed=7, updater=Sgd(learning_rate=0.1), input_type=InputType.feed_forward(6), layers=[
        DenseLayer(n_out=16, activation="relu"), DropoutLayer(0.5), BatchNormalization(), DropoutLayer(0.3),
        OutputLayer(n_out=3, activation="softmax")])
    model = MultiLayerNetwork(config, backend="cpu").init()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=generator)
    y = torch.randint(0, 3, (64,), generator=generator)
    model.fit(x.numpy(), y.numpy(), batch_size=16, epochs=2, verbose=0)
    return model, x, y


def _eval_reference(model, x, batch_size=4096):
    """What output() computed before it kept the module in eval mode: eval() for the call,
    no_grad, the same chunks."""
    module = model.module
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return torch.cat([model.activate(module(model.prepare_input(x[s:s + batch_size])))
                              for s in range(0, x.shape[0], batch_size)])
    finally:
        module.train(was_training)


def _all_eval(module) -> bool:
    return not any(part.training for part in module.modules())


def test_outputs_are_bitwise_those_of_eval_mode():
    model, x, _ = _trained()
    assert model.module.training  # fit left it training
    expected = _eval_reference(model, x)
    assert torch.equal(model.output(x), expected)
    assert torch.equal(model.output(x, batch_size=10), _eval_reference(model, x, batch_size=10))
    assert torch.equal(model.output(x[:1]), _eval_reference(model, x[:1]))
    assert np.array_equal(model.predict_proba(x.numpy()), expected.numpy())
    assert np.array_equal(model.predict(x.numpy()), expected.argmax(dim=1).numpy())
    assert model.output(x[:0]).shape == (0,)


def test_module_stays_in_eval_mode_and_fit_trains_in_train_mode():
    model, x, y = _trained()
    first = model.output(x)
    assert _all_eval(model.module)  # left there for the next call
    assert torch.equal(model.output(x), first)

    # A listener asks for outputs in the middle of an epoch; every training forward after it
    # (the one with grad) must still see every part in train mode: dropout on, batch statistics.
    seen = []
    hook = model.module.register_forward_pre_hook(
        lambda module, args: seen.append((torch.is_grad_enabled(), all(p.training for p in module.modules()))))

    class OutputEachStep(TrainingListener):
        def iteration_done(self, model, iteration, epoch, loss, batch_size):
            model.output(x[:4])

    try:
        model.fit(x.numpy(), y.numpy(), batch_size=16, epochs=1, verbose=0, listeners=[OutputEachStep()])
    finally:
        hook.remove()
    training_forwards = [all_training for grad, all_training in seen if grad]
    assert len(training_forwards) == 4 and all(training_forwards)
    assert not any(all_training for grad, all_training in seen if not grad)  # the listener's outputs: eval

    model.module.train()
    with torch.no_grad():  # the module as fit leaves it: dropout draws differ between forwards
        prepared = model.prepare_input(x)
        assert not torch.equal(model.module(prepared), model.module(prepared))
    after = model.output(x)
    assert torch.equal(after, model.output(x))
    assert torch.equal(after, _eval_reference(model, x))


def test_train_step_switches_back_to_training_after_output():
    model, x, y = _trained()
    model.output(x)
    assert _all_eval(model.module)
    model.train_step(*model.prepare_batch(_batch(x, y)))
    assert all(part.training for part in model.module.modules())


def _batch(x, y):
    return DataSet(x[:16], y[:16])


@pytest.mark.parametrize("switch", ["module", "dropout layer", "batch norm layer"])
def test_a_user_switching_to_training_between_calls_still_gets_eval_outputs(switch):
    model, x, _ = _trained()
    first = model.output(x)
    part = {"module": model.module, "dropout layer": model.module[1], "batch norm layer": model.module[2]}[switch]
    part.train()  # the root flag stays False when only a layer is switched
    assert torch.equal(model.output(x), first)
    assert _all_eval(model.module)


def test_a_wrong_shape_after_a_good_one_is_still_refused_in_one_line():
    model, x, _ = _trained()
    model.output(x)
    for _ in range(2):  # a refused kind is not remembered as checked
        with pytest.raises(DataError) as raised:
            model.output(torch.zeros(2, 7))
        message = str(raised.value)
        assert "[2, 7]" in message and "\n" not in message
    with pytest.raises(DataError):
        model.output(torch.zeros(2, 6, 1))
    with pytest.raises(DataError):
        model.predict(np.zeros((2, 5), dtype=np.float32))
    assert torch.equal(model.output(x), _eval_reference(model, x))  # good input still goes through


def test_output_tensors_can_feed_a_network_that_trains():
    """Feature extraction, then a head trained on the features: output()'s tensors must be
    ordinary ones (no_grad), which autograd may save for backward."""
    model, x, y = _trained()
    features = model.output(x)
    head = nn.Linear(3, 3)
    loss = nn.functional.cross_entropy(head(features * 2.0), y)
    loss.backward()
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()
    features.mul_(1.0)  # and may be changed in place


def test_a_pickled_model_leaves_its_inference_state_behind():
    model, x, _ = _trained()
    expected = model.output(x)
    copy = pickle.loads(pickle.dumps(model))  # a parallel worker's recipe: the module is rebuilt there
    assert copy._inference_state is None and copy.module is None
    model.output(x)
    assert torch.equal(model.output(x), expected)
