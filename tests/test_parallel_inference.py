"""ParallelInference (DL4J's): many threads get model.output's answers, in every mode; the
batched mode merges queued requests up to batch_limit examples and hands each caller its own
rows; a malformed request fails alone; a full queue and close() answer instead of hanging.

What is queued when a replica takes its next batch is decided with a gate in front of the
replica's network (``gates.py``), never by how the threads happen to be scheduled."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch import nn
from devices import backend_for, on_devices, tolerance
from gates import Gate, GatedModule, wait_for

from dl4py import (
    ConfigError,
    DataError,
    InferenceError,
    MnistDataSetIterator,
    MultiLayerNetwork,
    ParallelInference,
)

REQUESTS, THREADS = 1024, 16


@pytest.fixture(scope="module")
def trained_on():
    """``trained_on(device)``: an MLP trained one epoch on 512 MNIST images (standardizing
    normalizer), on ``device``'s backend, ``REQUESTS`` test images and ``model.output``'s answer
    to each, asked one example at a time and kept on the CPU: (model, x, expected)."""
    made = {}

    def get(device):
        if device not in made:
            made[device] = _trained(get("cpu")[0] if device != "cpu" else None, device)
        return made[device]

    return get


def _trained(cpu_model, device):
    from toy import trained_mnist_mlp

    if cpu_model is None:
        model = trained_mnist_mlp(examples=512, batch=64)
    else:  # the CPU model's weights and normalizer on the device's backend
        model = MultiLayerNetwork(cpu_model.config, backend=backend_for(device)).init()
        model.module.load_state_dict(cpu_model.module.state_dict())
        model.set_normalizer(cpu_model.normalizer)
    x = MnistDataSetIterator(REQUESTS, train=False, shuffle=False, limit=REQUESTS).features
    expected = torch.cat([model.output(x[i:i + 1]).cpu() for i in range(REQUESTS)])
    return model, x, expected


def assert_answers(answer, expected, device):
    """``answer`` (on any device) is ``expected``: one example's answer differs from a merged
    batch's row only in float32 summation order."""
    assert isinstance(answer, torch.Tensor), answer
    torch.testing.assert_close(answer.cpu(), expected, **tolerance(device, cpu=1e-6))


def _ask_from_threads(inference, x, threads=THREADS):
    """Each thread asks for every ``threads``-th example, one request per example."""
    answers, errors = [None] * len(x), []

    def client(first):
        try:
            for i in range(first, len(x), threads):
                answers[i] = inference.output(x[i:i + 1])
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    workers = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    _join(workers)
    assert not errors, errors
    return answers


@on_devices
@pytest.mark.parametrize("mode", ["batched", "sequential", "inplace"])
def test_sixteen_threads_get_model_outputs_answers_in_every_mode(trained_on, device, mode):
    model, x, expected = trained_on(device)
    with ParallelInference(model, workers=2, inference_mode=mode, batch_limit=32, runtime="torch") as inference:
        answers = _ask_from_threads(inference, x)
        stats = inference.stats()
    assert all(a.shape == (1, 10) and a.dtype == expected.dtype and a.device.type == model.device.type for a in answers)
    assert_answers(torch.cat(answers), expected, device)
    assert stats["requests"] == REQUESTS and stats["examples"] == REQUESTS and stats["failed"] == 0
    if mode == "batched":  # how much merged depends on the threads' timing: only the bound is sure here
        assert stats["max_batch_size"] <= 32, stats
    else:
        assert stats["batch_sizes"] == {1: REQUESTS}  # one request per forward pass


@contextmanager
def gated_replica(inference):
    """Replica 0's network behind a closed gate: the forward pass it starts next waits there,
    and the requests sent meanwhile stay queued. Opened at the end, even by a failing test."""
    replica = inference.replicas[0]
    gated = GatedModule(replica.module, Gate(open=False))
    replica.module = gated
    try:
        yield gated
    finally:
        gated.gate.open()


def _client(inference, features, results, key) -> threading.Thread:
    """A started thread that puts ``inference.output(features)`` (or its error) in ``results[key]``."""
    def ask():
        try:
            results[key] = inference.output(features)
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            results[key] = error

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def _queue_in_order(inference, requests, results, first=0) -> list[threading.Thread]:
    """One client per request (``results`` keys ``first``, ``first + 1``, ...), each started
    once the one before it is queued, so the queue holds them in this order behind the
    ``first`` queued already. Call with the replica held at its gate."""
    threads = []
    for key, features in enumerate(requests, start=first):
        threads.append(_client(inference, features, results, key))
        wait_for(lambda: len(inference._queue) == key + 1, f"request {key} queued")  # noqa: B023 - called at once
    return threads


def _join(threads):
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a client thread hung"


# Rows of each request, in queue order. With batch_limit=6, a replica takes the oldest request
# and those behind it while their rows still fit: a request that would cross the limit waits
# for the next forward pass (requests are never split), one larger than the limit runs alone.
SIZES = [1, 3, 2, 4, 3, 5, 1, 7, 2]
PASSES = [6, 4, 3, 6, 7, 2]


@on_devices
def test_batched_merges_up_to_exactly_batch_limit_and_each_caller_gets_its_own_rows(trained_on, device):
    model, x, expected = trained_on(device)
    starts = np.cumsum([0, *SIZES]).tolist()
    requests = [x[start:start + size] for start, size in zip(starts, SIZES)]  # distinct images: a swap shows
    results = {}
    with ParallelInference(model, workers=1, batch_limit=6, runtime="torch") as inference, \
            gated_replica(inference) as gated:
        blocker = _client(inference, x[100:101], results, "blocker")
        gated.gate.wait_for_arrivals(1)  # the replica runs the blocker; everything after it queues
        threads = _queue_in_order(inference, requests, results)
        gated.gate.open()
        _join([blocker, *threads])
        stats = inference.stats()
    assert gated.batches == [1, *PASSES]
    assert stats["batch_sizes"] == {1: 1, 2: 1, 3: 1, 4: 1, 6: 2, 7: 1} and stats["requests"] == 1 + len(SIZES)
    assert_answers(results["blocker"], expected[100:101], device)
    for i, (start, size) in enumerate(zip(starts, SIZES)):
        assert results[i].shape == (size, 10), (i, results[i])
        assert_answers(results[i], expected[start:start + size], device)


class ThreadRecorder(nn.Module):
    """``inner``, noting which thread ran each forward pass and on how many examples."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.passes = inner, []

    def forward(self, x):
        self.passes.append((threading.current_thread().name, int(x.shape[0])))
        return self.inner(x)


def test_a_short_lone_request_runs_in_its_callers_thread_and_a_long_one_is_queued(trained_on):
    """No hand-off where nothing waits to be merged: once a pass has been measured, a request
    expected to take under INLINE_SECONDS runs in the caller's thread; a long one goes to the
    replica's thread, as every request does before the first measurement."""
    model, x, expected = trained_on("cpu")
    with ParallelInference(model, workers=1, runtime="torch") as inference:
        recorder = inference.replicas[0].module = ThreadRecorder(inference.replicas[0].module)
        answers = [inference.output(x[i:i + 1]) for i in range(3)]
        many = torch.cat([x] * 40)  # 40,960 examples: far over INLINE_SECONDS
        long_answer = inference.output(many)
        stats = inference.stats()
    caller = threading.current_thread().name
    assert [name for name, _ in recorder.passes[:3]] == ["dl4py-inference-0", caller, caller], recorder.passes
    assert {name for name, rows in recorder.passes[3:]} == {"dl4py-inference-0"}  # chunks of the long one
    assert_answers(torch.cat(answers), expected[:3], "cpu")
    assert_answers(long_answer[-len(x):], expected, "cpu")
    assert stats["requests"] == 4 and stats["examples"] == 3 + len(many) and stats["failed"] == 0
    with ParallelInference(model, workers=1, runtime="torch", inline_seconds=0) as inference:
        recorder = inference.replicas[0].module = ThreadRecorder(inference.replicas[0].module)
        for i in range(3):
            inference.output(x[i:i + 1])
    assert [name for name, _ in recorder.passes] == ["dl4py-inference-0"] * 3  # 0: never in the caller's


class DeviceLost(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("the device was lost")


def test_a_pass_failing_in_the_callers_thread_reaches_the_caller_and_is_counted(trained_on):
    model, x, _ = trained_on("cpu")
    with ParallelInference(model, workers=1, runtime="torch") as inference:
        inference.output(x[:1])  # measured: the next short requests run in the caller's thread
        inference.replicas[0].module = DeviceLost()
        with pytest.raises(RuntimeError, match="the device was lost"):
            inference.output(x[:1])
        future = inference.submit(x[:1])
        assert future.done() and isinstance(future.exception(), RuntimeError), future
        stats = inference.stats()
    assert stats["failed"] == 2 and stats["requests"] == 1, stats


@on_devices
def test_a_malformed_request_fails_alone_and_the_batch_it_met_is_answered(trained_on, device):
    model, x, expected = trained_on(device)
    good = [x[i:i + 2] for i in range(0, 14, 2)]  # 7 requests of 2 examples
    results = {}
    with ParallelInference(model, workers=1, batch_limit=64, runtime="torch") as inference, \
            gated_replica(inference) as gated:
        blocker = _client(inference, x[100:101], results, "blocker")
        gated.gate.wait_for_arrivals(1)
        threads = _queue_in_order(inference, good[:3], results)
        bad = _client(inference, np.zeros((1, 783), dtype=np.float32), results, "bad")
        bad.join(60)
        assert len(inference._queue) == 3  # refused in its own thread: it never joined the queue
        threads += _queue_in_order(inference, good[3:], results, first=3)
        gated.gate.open()
        _join([blocker, *threads])
        stats = inference.stats()
    assert_answers(results["blocker"], expected[100:101], device)
    error = results["bad"]
    assert isinstance(error, DataError) and "[1, 783]" in str(error) and "[n, 784]" in str(error), error
    assert_answers(torch.cat([results[i] for i in range(7)]), expected[:14], device)
    assert stats["requests"] == 8 and stats["batch_sizes"] == {1: 1, 14: 1} and stats["failed"] == 0  # merged


@on_devices
def test_a_full_queue_raises_at_once_or_after_its_timeout_then_serves_on(trained_on, device):
    model, x, expected = trained_on(device)
    results = {}
    with ParallelInference(model, workers=1, inference_mode="sequential", queue_limit=2, queue_timeout=0,
                           runtime="torch") as inference, gated_replica(inference) as gated:
        blocker = _client(inference, x[:1], results, "blocker")
        gated.gate.wait_for_arrivals(1)
        threads = _queue_in_order(inference, [x[1:2], x[2:3]], results)  # the queue is full
        with pytest.raises(InferenceError, match="queue is full.*queue_limit=2"):
            inference.output(x[:1])
        inference.queue_timeout = 0.05
        with pytest.raises(InferenceError, match="queue_timeout=0.05"):
            inference.output(x[:1])
        gated.gate.open()
        _join([blocker, *threads])
        answers = [results["blocker"], results[0], results[1]]  # examples 0, 1, 2
        for i in range(3):
            assert_answers(answers[i], expected[i:i + 1], device)
        assert_answers(inference.output(x[5:6]), expected[5:6], device)  # serves on


@on_devices
def test_close_fails_pending_requests_instead_of_hanging(trained_on, device):
    model, x, expected = trained_on(device)
    inference = ParallelInference(model, workers=1, inference_mode="sequential", runtime="torch")
    results = {}
    with gated_replica(inference) as gated:
        blocker = _client(inference, x[:1], results, "blocker")
        gated.gate.wait_for_arrivals(1)
        threads = _queue_in_order(inference, [x[i:i + 1] for i in range(1, 5)], results)
        closer = threading.Thread(target=inference.close)
        closer.start()
        wait_for(lambda: len(inference._queue) == 0, "close() emptied the queue")
        _join(threads)  # answered with an error while the forward pass under way still waits
        assert closer.is_alive()  # close() waits for the forward pass under way
    _join([closer, blocker])  # the gate opened: the pass under way finishes, close() returns
    assert all(isinstance(results[i], InferenceError) and "closed" in str(results[i]) for i in range(4)), results
    assert_answers(results["blocker"], expected[:1], device)  # the one under way is answered
    assert not any(t.is_alive() for t in inference._threads)  # the replica threads ended
    inference.close()  # idempotent
    with pytest.raises(InferenceError, match="closed"):
        inference.output(x[:1])


@on_devices
def test_replicas_keep_the_models_precision(trained_on, device):
    model, x, _ = trained_on(device)
    half = MultiLayerNetwork(model.config, backend=backend_for(device), precision="bfloat16").init()
    half.set_normalizer(model.normalizer)
    with ParallelInference(half, workers=2, inference_mode="inplace") as inference:
        answers = [inference.output(x[i:i + 1]) for i in range(20)]
    expected = [half.output(x[i:i + 1]) for i in range(20)]
    assert all(a.dtype == torch.bfloat16 for a in answers)
    # One example through the same kernels as output(): the same bits on the CPU; a GPU may pick
    # another kernel for a copy of the weights, a bfloat16 step or two apart.
    close = tolerance(device) if device == "cpu" else {"rtol": 1e-2, "atol": 1e-2}
    for answer, wanted in zip(answers, expected):
        torch.testing.assert_close(answer.cpu(), wanted.cpu(), **close)


@pytest.mark.gpu
def test_replicas_spread_over_the_cpu_and_a_gpu_answer_on_the_models_device(trained_on):
    model, x, expected = trained_on("cpu")
    with ParallelInference(model, workers=2, devices=["cpu", "cuda:0"], batch_limit=8, runtime="torch") as inference:
        assert [r.device.type for r in inference.replicas] == ["cpu", "cuda"]
        answers = _ask_from_threads(inference, x[:256], threads=8)
        stats = inference.stats()
    assert all(a.device == model.device for a in answers)  # where model.output puts them
    assert_answers(torch.cat(answers), expected[:256], "cuda")
    assert stats["requests"] == 256 and stats["max_batch_size"] <= 8


def test_bad_options_name_themselves(trained_on):
    model = trained_on("cpu")[0]
    for options, key in ((dict(inference_mode="fast"), "inference_mode"), (dict(workers=0), "workers"),
                         (dict(batch_limit=0), "batch_limit"), (dict(queue_timeout=-1), "queue_timeout"),
                         (dict(inline_seconds=-1), "inline_seconds"), (dict(inline_seconds=True), "inline_seconds"),
                         (dict(workers=1, devices=["cpu", "cpu"]), "workers")):
        with pytest.raises(ConfigError, match=key):
            ParallelInference(model, **options)
