"""DL4J's updaterState.bin split per parameter and joined back (``dl4py.dl4j.updater_state``), on
the real files in ``../shared/dl4j-models``: DL4J 0.8 wrote state 1..N (the readme beside the
zips gives the Java code), so every value's destination is asserted; DL4J 1.0's untrained models
hold their updaters' initial state (Nesterovs and Adam 0, RmsProp its epsilon), in float, double
and half. Adam's block layout is asserted on crafted state against DL4J's Java, and the torch
mapping table's "exact"/"approximate" claims against DL4J's update rules, step by step."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dl4py.dl4j import DL4JFileError, read_array, write_array
from dl4py.dl4j.updater_state import (BLOCKS, PER_PARAMETER, TORCH_STATE, UpdaterSlot, from_torch_state, join_state,
                                      split_state, state_size, to_torch_state)

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "dl4j-models"
V080, B4, IT = MODELS / "regression_testing" / "080", MODELS / "regression_testing" / "100b4", \
    MODELS / "dl4j-integration-tests"
needs_files = pytest.mark.skipif(not MODELS.is_dir(), reason=f"needs DL4J's files in {MODELS}")


def _slots(updater: str, settings, *layers) -> list[UpdaterSlot]:
    """Slots in DL4J's flat order from ``(layer, [(key, count), ...])``, one updater for all."""
    return [UpdaterSlot(layer, key, count, updater, settings) for layer, params in layers for key, count in params]


def _entry(path: Path, name: str) -> np.ndarray:
    with zipfile.ZipFile(path) as archive:
        return read_array(archive.read(name), name=f"{path.name}/{name}")


# Counts from DL4J's parameter initializers (dense: W nIn*nOut then b; convolution: b then W;
# GravesLSTM: W nIn*4n, RW n*(4n+3), b 4n; the bidirectional one: forward then backward).
GRAVES_LSTM = [("W", 3 * 16), ("RW", 4 * 19), ("b", 16)]
GRAVES_BIDIRECTIONAL = [("WF", 4 * 16), ("RWF", 4 * 19), ("bF", 16), ("WB", 4 * 16), ("RWB", 4 * 19), ("bB", 16)]
MODELS_080 = {
    "MLP_1": ("NESTEROVS", [(0, [("W", 12), ("b", 4)]), (1, [("W", 20), ("b", 5)])]),
    "MLP_2": ("RMSPROP", [(0, [("W", 12), ("b", 4)]), (1, [("W", 20), ("b", 5)])]),
    "CNN_1": ("RMSPROP", [(0, [("b", 3), ("W", 3 * 3 * 2 * 2)]), (2, [("W", 26 * 26 * 3 * 5), ("b", 5)])]),
    "LSTM_1": ("RMSPROP", [(0, GRAVES_LSTM), (1, GRAVES_BIDIRECTIONAL), (2, [("W", 20), ("b", 5)])]),
    "CG_LSTM_1": ("RMSPROP", [("0", GRAVES_LSTM), ("1", GRAVES_BIDIRECTIONAL), ("2", [("W", 20), ("b", 5)])]),
}


@needs_files
@pytest.mark.parametrize("model", sorted(MODELS_080))
def test_dl4j_0_8_state_lands_beside_its_parameter_value_for_value(model):
    """DL4J 0.8 set parameters and state both to 1..N, so each parameter's state must equal its
    own segment of coefficients.bin: element i of the state belongs to element i of the weights.
    With one-state updaters the 0.8 per-parameter layout and 1.0's blocks agree (DL4J's
    RegressionTest080 loads these files into 1.0's blocks unchanged)."""
    path = V080 / f"080_ModelSerializer_Regression_{model}.zip"
    updater, layers = MODELS_080[model]
    slots = _slots(updater, ("lr", 0.15), *layers)
    state, params = _entry(path, "updaterState.bin"), _entry(path, "coefficients.bin").reshape(-1)
    assert state.size == params.size == state_size(slots)
    name = "v" if updater == "NESTEROVS" else "lastGradient"
    for layout in (BLOCKS, PER_PARAMETER):
        split = split_state(state, slots, layout)
        offset = 0
        for slot, got in zip(slots, split):
            assert list(got) == [name] and np.array_equal(got[name], params[offset:offset + slot.count]), slot
            offset += slot.count


@needs_files
def test_mlp_1_state_destinations_written_out():
    """MLP_1 (dense 3->4, output 4->5, Nesterovs): v of W0 is 1..12, of b0 13..16, and so on."""
    updater, layers = MODELS_080["MLP_1"]
    split = split_state(_entry(V080 / "080_ModelSerializer_Regression_MLP_1.zip", "updaterState.bin"),
                        _slots(updater, (), *layers))
    assert [s["v"].tolist() for s in split] == [list(range(1, 13)), [13, 14, 15, 16], list(range(17, 37)),
                                                [37, 38, 39, 40, 41]]


# DL4J 1.0-era models: the updater from configuration.json, the counts from the initializers.
NESTEROVS_LENET = ("Nesterovs", (0.01, 0.9), (0, [("b", 20), ("W", 20 * 1 * 5 * 5)]),
                   (2, [("b", 50), ("W", 50 * 20 * 5 * 5)]), (4, [("W", 800 * 500), ("b", 500)]),
                   (5, [("W", 500 * 10), ("b", 10)]))
MODELS_100 = {
    "LenetMnist": (IT / "LenetMnist" / "Model_RANDOM_INIT_UNTRAINED.zip", NESTEROVS_LENET, 0.0),
    "MLPMoon": (IT / "MLPMoon" / "Model_RANDOM_INIT_UNTRAINED.zip",
                ("Nesterovs", (0.005, 0.9), (0, [("W", 2 * 20), ("b", 20)]), (1, [("W", 20 * 2), ("b", 2)])), 0.0),
    # Convolution1DLayer 77->32, kernel 3 (b, then W), RnnOutputLayer 32->77: Adam, 2 x 9965.
    "CNN1dCharacter": (IT / "CNN1dCharacterTestCase" / "Model_RANDOM_INIT_UNTRAINED.zip",
                       ("Adam", (0.01, 0.9, 0.999, 1e-8), ("0", [("b", 32), ("W", 32 * 77 * 3)]),
                        ("out", [("W", 32 * 77), ("b", 77)])), 0.0),
    # RmsProp starts at its epsilon, 1e-8; in half, DL4J stored the smallest subnormal, 2**-24
    # (IEEE rounding to nearest would give 0): what libnd4j's float-to-half conversion made of it.
    **{f"CustomLayerExample_{kind}": (B4 / f"CustomLayerExample_100b4_{kind}.bin",
                                      ("RmsProp", (0.95, 0.95, 1e-8), (0, [("W", 30), ("b", 6)]),
                                       (1, [("W", 42), ("b", 7)]), (2, [("W", 56), ("b", 8)])), initial)
       for kind, initial in (("float", 1e-8), ("double", 1e-8), ("half", 2.0**-24))},
}


@needs_files
@pytest.mark.parametrize("model", sorted(MODELS_100))
def test_dl4j_1_0_state_splits_into_the_updaters_initial_values(model):
    """Lengths explained exactly (CNN1dCharacter's state is twice its parameters: Adam's m and v),
    every value DL4J's setStateViewArray(initialize=true) put there (RmsProp: its epsilon, in the
    model's own float, double or half), and split -> join gives DL4J's row back, value for value."""
    path, (updater, settings, *layers), initial = MODELS_100[model]
    slots = _slots(updater, settings, *layers)
    state = _entry(path, "updaterState.bin")
    assert state.size == state_size(slots) == {"Adam": 2, "Nesterovs": 1, "RmsProp": 1}[updater] * sum(
        s.count for s in slots)
    split = split_state(state, slots)
    for slot, got in zip(slots, split):
        for values in got.values():
            assert values.dtype == state.dtype and values.shape == (slot.count,)
            assert np.array_equal(values, np.full(slot.count, initial, dtype=state.dtype)), slot
    again = join_state(split, slots)
    assert again.dtype == state.dtype and again.shape == state.shape and np.array_equal(again, state)


@needs_files
def test_the_wrong_updater_is_one_line_naming_the_entry_and_the_need():
    """CNN1dCharacter read as if it were Nesterovs: its state is Adam's, twice as long."""
    path, (_, settings, *layers), _ = MODELS_100["CNN1dCharacter"]
    with pytest.raises(DL4JFileError) as refused:
        split_state(_entry(path, "updaterState.bin"), _slots("Nesterovs", settings, *layers),
                    where="CNN1dCharacterTestCase.zip/updaterState.bin")
    assert str(refused.value) == ("CNN1dCharacterTestCase.zip/updaterState.bin: holds 19930 values, but the "
                                  "updaters of the 4 parameters need 9965 (Nesterovs 1 x 9965 values)")


@needs_files
def test_a_truncated_state_file_is_one_line():
    """MLP_1's state less its last value, written as DL4J writes arrays and read back."""
    updater, layers = MODELS_080["MLP_1"]
    short = read_array(write_array(_entry(V080 / "080_ModelSerializer_Regression_MLP_1.zip",
                                          "updaterState.bin")[:, :-1]))
    with pytest.raises(DL4JFileError, match=r"^updaterState.bin: holds 40 values, but the updaters of the 4 "
                                            r"parameters need 41 \(Nesterovs 1 x 41 values\)$"):
        split_state(short, _slots(updater, (), *layers))


# ---- the block layout on crafted state, against DL4J's Java ------------------------------

ADAM_A, ADAM_B = ("Adam", (1e-3,)), ("Adam", (5e-3,))  # equal updaters share a block; lr differs
CRAFTED = [
    UpdaterSlot(0, "W", 3, *ADAM_A), UpdaterSlot(0, "b", 2, *ADAM_A),   # block 1: Adam over 5 values
    UpdaterSlot(1, "W", 4, "Nesterovs", (0.1, 0.9)),                   # block 2
    UpdaterSlot(3, "W", 2, *ADAM_A),                                   # block 3: after another updater
    UpdaterSlot(3, "b", 1, *ADAM_B),                                   # block 4: another learning rate
]


def test_adam_blocks_hold_m_over_the_block_then_v():
    """BaseMultiLayerUpdater: [m_W0 m_b0 | v_W0 v_b0] (AdamUpdater cuts its block view in halves),
    then Nesterovs' v, then each later Adam block on its own. Layer 2 has no parameters."""
    split = split_state(np.arange(20, dtype=np.float32).reshape(1, 20), CRAFTED)
    assert [{k: v.tolist() for k, v in s.items()} for s in split] == [
        {"m": [0, 1, 2], "v": [5, 6, 7]}, {"m": [3, 4], "v": [8, 9]}, {"v": [10, 11, 12, 13]},
        {"m": [14, 15], "v": [16, 17]}, {"m": [18], "v": [19]}]


def test_dl4j_0_8_keeps_each_parameters_state_together():
    """0.8's LayerUpdater gives every parameter its own view: [m_W0 v_W0 | m_b0 v_b0 | ...]."""
    split = split_state(np.arange(20, dtype=np.float32), CRAFTED, PER_PARAMETER)
    assert [{k: v.tolist() for k, v in s.items()} for s in split] == [
        {"m": [0, 1, 2], "v": [3, 4, 5]}, {"m": [6, 7], "v": [8, 9]}, {"v": [10, 11, 12, 13]},
        {"m": [14, 15], "v": [16, 17]}, {"m": [18], "v": [19]}]


def test_a_stateless_updater_and_pretraining_parameters_split_blocks():
    """Sgd keeps no state but still ends the Adam block before it; a pretraining-only parameter
    (a VAE's decoder, an autoencoder's visible bias) shares only with its own layer's pretraining
    parameters (UpdaterUtils.updaterConfigurationsEquals)."""
    slots = [UpdaterSlot(0, "W", 2, *ADAM_A), UpdaterSlot(1, "W", 1, "Sgd"), UpdaterSlot(2, "W", 1, *ADAM_A),
             UpdaterSlot(2, "d1", 1, *ADAM_A, pretrain=True), UpdaterSlot(2, "d2", 1, *ADAM_A, pretrain=True),
             UpdaterSlot(3, "W", 1, *ADAM_A)]
    split = split_state(np.arange(12, dtype=np.float64), slots)
    assert [{k: v.tolist() for k, v in s.items()} for s in split] == [
        {"m": [0, 1], "v": [2, 3]}, {}, {"m": [4], "v": [5]}, {"m": [6], "v": [8]}, {"m": [7], "v": [9]},
        {"m": [10], "v": [11]}]


@pytest.mark.parametrize("layout", [BLOCKS, PER_PARAMETER])
def test_join_is_the_exact_inverse_of_split(layout):
    slots = CRAFTED + [UpdaterSlot(4, "W", 3, "AMSGrad", ()), UpdaterSlot(4, "b", 2, "AdaDelta", ())]
    state = np.random.default_rng(0).standard_normal((1, state_size(slots))).astype(np.float16)
    again = join_state(split_state(state, slots, layout), slots, layout)
    assert again.dtype == np.float16 and again.tobytes() == state.tobytes()


def test_an_unknown_updater_or_a_bad_shape_is_one_line():
    with pytest.raises(DL4JFileError, match=r"^layer 2 parameter 'W': updater 'Adagrad2' is not one dl4py reads"):
        split_state(np.zeros(4), [UpdaterSlot(2, "W", 4, "Adagrad2")])
    with pytest.raises(DL4JFileError, match=r"^updaterState.bin: is shaped \[2, 2\], not a row of updater state$"):
        split_state(np.zeros((2, 2)), [UpdaterSlot(0, "W", 4, "Nesterovs")])
    with pytest.raises(ValueError, match="parameter 'b' state 'v' has 3 values, the parameter 2"):
        join_state([{"m": np.zeros(3), "v": np.zeros(3)}, {"m": np.zeros(2), "v": np.zeros(3)}], CRAFTED[:2])


# ---- the torch table's claims, against DL4J's update rules --------------------------------

def _dl4j_step(kind, p, g, s, t, lr=0.05, mu=0.9, decay=0.95, b1=0.9, b2=0.999, eps=1e-8):
    """One DL4J update, from its GradientUpdater.applyUpdater (and libnd4j's updater helpers),
    then params -= update (DL4J's negative-gradient step function). ``t`` is the iteration."""
    if kind == "Nesterovs":
        previous = s["v"].copy()
        s["v"] = mu * s["v"] - lr * g
        return p - (mu * previous - (1 + mu) * s["v"])
    if kind == "RmsProp":
        s["lastGradient"] = decay * s["lastGradient"] + (1 - decay) * g * g
        return p - lr * g / (np.sqrt(s["lastGradient"]) + eps)
    if kind == "AdaGrad":
        s["historicalGradient"] = s["historicalGradient"] + g * g
        return p - lr * g / (np.sqrt(s["historicalGradient"]) + eps)
    if kind == "AdaDelta":
        s["msg"] = decay * s["msg"] + (1 - decay) * g * g
        update = g * np.sqrt(s["msdx"] + eps) / np.sqrt(s["msg"] + eps)
        s["msdx"] = decay * s["msdx"] + (1 - decay) * update * update
        return p - update
    s["m"] = b1 * s["m"] + (1 - b1) * g
    if kind == "AdaMax":
        s["u"] = np.maximum(b2 * s["u"], np.abs(g)) + 1e-32
        return p - lr / (1 - b1 ** (t + 1)) * s["m"] / s["u"]
    s["v"] = b2 * s["v"] + (1 - b2) * g * g  # Adam
    return p - lr * np.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1)) * s["m"] / (np.sqrt(s["v"]) + eps)


def _torch_optimizer(kind, param, lr=0.05, mu=0.9, decay=0.95, b1=0.9, b2=0.999, eps=1e-8):
    if kind == "Nesterovs":
        return torch.optim.SGD([param], lr=lr, momentum=mu, nesterov=True, foreach=False)
    if kind == "RmsProp":
        return torch.optim.RMSprop([param], lr=lr, alpha=decay, eps=eps, foreach=False)
    if kind == "AdaGrad":
        return torch.optim.Adagrad([param], lr=lr, eps=eps, foreach=False)
    if kind == "AdaDelta":
        return torch.optim.Adadelta([param], lr=1.0, rho=decay, eps=eps, foreach=False)
    optimizer = torch.optim.Adamax if kind == "AdaMax" else torch.optim.Adam
    return optimizer([param], lr=lr, betas=(b1, b2), eps=eps, foreach=False)


def _both_ways(kind, scale, steps=4, iteration=7):
    """Parameters after ``steps`` updates from the same DL4J state: DL4J's rule, and torch's
    optimizer started from the mapped state."""
    rng = np.random.default_rng(1)
    p0, grads = rng.standard_normal(6), scale * rng.standard_normal((steps, 6))
    state = {name: np.abs(rng.standard_normal(6)) * scale for name in {
        "Nesterovs": ("v",), "RmsProp": ("lastGradient",), "AdaGrad": ("historicalGradient",),
        "AdaDelta": ("msg", "msdx"), "Adam": ("m", "v"), "AdaMax": ("m", "u")}[kind]}
    if "v" in state and kind != "Nesterovs":
        state["v"] = state["v"] * scale  # a second moment: the square of the gradients' scale
    mapped = to_torch_state(kind, state, learning_rate=0.05, iteration=iteration)
    param = torch.nn.Parameter(torch.tensor(p0))
    optimizer = _torch_optimizer(kind, param)
    optimizer.state[param] = {k: torch.tensor(v, dtype=torch.float32 if k == "step" else torch.float64)
                              for k, v in mapped.items()}
    dl4j = p0
    for t, g in enumerate(grads):
        dl4j = _dl4j_step(kind, dl4j, g, state, iteration + t)
        param.grad = torch.tensor(g)
        optimizer.step()
    back = from_torch_state(kind, {k: v.numpy() for k, v in optimizer.state[param].items()}, 6, learning_rate=0.05)
    return p0, dl4j, param.detach().numpy(), state, back


@pytest.mark.parametrize("kind", ["Nesterovs", "RmsProp", "AdaGrad", "AdaDelta"])
def test_exact_updaters_continue_in_torch_as_in_dl4j(kind):
    assert TORCH_STATE[kind].continuation == "exact"
    _, dl4j, torch_params, state, back = _both_ways(kind, scale=0.1)
    np.testing.assert_allclose(torch_params, dl4j, rtol=1e-12, atol=1e-15)
    for name in state:  # and the state torch ends with maps back onto DL4J's
        np.testing.assert_allclose(back[name], state[name], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", ["Adam", "AdaMax"])
def test_approximate_updaters_differ_only_by_epsilon_placement(kind):
    """Gradients of 0.1: the steps agree within eps / sqrt(v) (1e-6) relative. Gradients near
    eps (1e-8): torch's epsilon placement shows, so the table does not call them exact."""
    assert TORCH_STATE[kind].continuation == "approximate"
    p0, dl4j, torch_params, state, back = _both_ways(kind, scale=0.1)
    np.testing.assert_allclose(torch_params - p0, dl4j - p0, rtol=1e-5)
    for name in state:  # AdaMax's u carries torch's eps too
        np.testing.assert_allclose(back[name], state[name], rtol=1e-6)
    p0, dl4j, torch_params, _, _ = _both_ways(kind, scale=1e-8)
    assert not np.allclose(torch_params - p0, dl4j - p0, rtol=1e-2)


@pytest.mark.parametrize("kind", ["Nadam", "AdaBelief"])
def test_updaters_torch_cannot_continue_are_refused_by_name(kind):
    assert TORCH_STATE[kind].continuation == "refused"
    with pytest.raises(ValueError, match=f"DL4J's {kind} state cannot continue in torch"):
        to_torch_state(kind, {"m": np.zeros(2), "v": np.zeros(2), "s": np.zeros(2)})
