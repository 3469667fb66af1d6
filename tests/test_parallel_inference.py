"""ParallelInference (DL4J's): many threads get model.output's answers, in every mode; the
batched mode merges requests; a malformed request fails alone; a full queue and close()
answer instead of hanging."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dl4py import (
    ConfigError,
    DataError,
    InferenceError,
    MnistDataSetIterator,
    MultiLayerNetwork,
    ParallelInference,
)

REQUESTS, THREADS = 2000, 16


@pytest.fixture(scope="module")
def trained():
    """An MLP trained one epoch on 512 MNIST images, with a standardizing normalizer, and
    2,000 test images with ``model.output``'s answer for each, asked one example at a time."""
    from toy import trained_mnist_mlp

    model = trained_mnist_mlp(examples=512, batch=64)
    x = MnistDataSetIterator(REQUESTS, train=False, shuffle=False, limit=REQUESTS).features
    expected = torch.cat([model.output(x[i:i + 1]) for i in range(REQUESTS)])
    return model, x, expected


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
    for worker in workers:
        worker.join(60)
    assert not any(w.is_alive() for w in workers), "a client thread hung"
    assert not errors, errors
    return answers


@pytest.mark.parametrize("mode", ["batched", "sequential", "inplace"])
def test_sixteen_threads_get_model_outputs_answers_in_every_mode(trained, mode):
    model, x, expected = trained
    with ParallelInference(model, workers=2, inference_mode=mode, batch_limit=32) as inference:
        answers = _ask_from_threads(inference, x)
        stats = inference.stats()
    assert all(a.shape == (1, 10) and a.dtype == expected.dtype for a in answers)
    assert (torch.cat(answers) - expected).abs().max().item() <= 1e-6
    assert stats["requests"] == REQUESTS and stats["examples"] == REQUESTS and stats["failed"] == 0
    if mode == "batched":
        assert stats["max_batch_size"] > 1 and stats["mean_batch_size"] > 1, stats  # it merged
        assert stats["max_batch_size"] <= 32
    else:
        assert stats["batch_sizes"] == {1: REQUESTS}  # one request per forward pass


def _wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)


def _occupy(inference, features):
    """Make the only replica busy: hold its lock and hand its thread one request, which it
    then waits with. Later requests stay queued until the lock is released."""
    from dl4py.inference.requests import Request

    inference.replicas[0].lock.acquire()
    request = Request(features)
    inference._queue.put(request, None)
    _wait_until(lambda: len(inference._queue) == 0)  # taken: the thread now waits for the lock
    return request


def _start_clients(inference, requests):
    """One thread per request; returns the threads and {index: answer or error}."""
    results = {}

    def client(i, features):
        try:
            results[i] = inference.output(features)
        except BaseException as error:  # noqa: BLE001
            results[i] = error

    threads = [threading.Thread(target=client, args=(i, f)) for i, f in enumerate(requests)]
    for thread in threads:
        thread.start()
    return threads, results


def test_a_malformed_request_fails_alone_and_the_batch_it_met_is_answered(trained):
    model, x, expected = trained
    good = [x[i:i + 2] for i in range(0, 14, 2)]  # 7 requests of 2 examples
    requests = good[:3] + [np.zeros((1, 783), dtype=np.float32)] + good[3:]
    with ParallelInference(model, workers=1, batch_limit=64) as inference:
        blocker = _occupy(inference, x[100:101])
        threads, results = _start_clients(inference, requests)
        _wait_until(lambda: len(inference._queue) == 7)  # the malformed one never got in
        inference.replicas[0].lock.release()
        for thread in threads:
            thread.join(10)
        stats = inference.stats()
    assert (blocker.future.result(0) - expected[100:101]).abs().max() <= 1e-6
    bad = results[3]
    assert isinstance(bad, DataError) and "[1, 783]" in str(bad) and "[n, 784]" in str(bad), bad
    answers = [results[i] for i in range(len(requests)) if i != 3]
    assert all(isinstance(a, torch.Tensor) for a in answers), answers
    assert (torch.cat(answers) - expected[:14]).abs().max().item() <= 1e-6
    assert stats["requests"] == 8 and stats["batch_sizes"] == {1: 1, 14: 1} and stats["failed"] == 0  # merged


def test_a_full_queue_raises_at_once_or_after_its_timeout_then_serves_on(trained):
    model, x, expected = trained
    with ParallelInference(model, workers=1, inference_mode="sequential", queue_limit=2,
                           queue_timeout=0) as inference:
        blocker = _occupy(inference, x[:1])
        threads, results = _start_clients(inference, [x[i:i + 1] for i in range(1, 3)])
        _wait_until(lambda: len(inference._queue) == 2)
        with pytest.raises(InferenceError, match="queue is full.*queue_limit=2"):
            inference.output(x[:1])
        inference.queue_timeout = 0.05
        with pytest.raises(InferenceError, match="queue_timeout=0.05"):
            inference.output(x[:1])
        inference.replicas[0].lock.release()
        for thread in threads:
            thread.join(10)
        answers = [blocker.future.result(30), results[0], results[1]]  # examples 0, 1, 2
        assert all((answers[i] - expected[i:i + 1]).abs().max() <= 1e-6 for i in range(3)), answers
        assert (inference.output(x[5:6]) - expected[5:6]).abs().max() <= 1e-6  # serves on


def test_close_fails_pending_requests_instead_of_hanging(trained):
    model, x, expected = trained
    inference = ParallelInference(model, workers=1, inference_mode="sequential")
    blocker = _occupy(inference, x[:1])
    threads, results = _start_clients(inference, [x[i:i + 1] for i in range(1, 5)])
    _wait_until(lambda: len(inference._queue) == 4)
    closer = threading.Thread(target=inference.close)
    closer.start()
    _wait_until(lambda: len(inference._queue) == 0)
    inference.replicas[0].lock.release()  # the request under way finishes; close() then returns
    closer.join(10)
    for thread in threads:
        thread.join(10)
    assert not closer.is_alive() and not any(t.is_alive() for t in threads)
    assert all(isinstance(r, InferenceError) and "closed" in str(r) for r in results.values()), results
    assert len(results) == 4
    assert (blocker.future.result(0) - expected[:1]).abs().max() <= 1e-6  # the one under way is answered
    assert not any(t.is_alive() for t in inference._threads)  # the replica threads ended
    inference.close()  # idempotent
    with pytest.raises(InferenceError, match="closed"):
        inference.output(x[:1])


def test_replicas_keep_the_models_precision(trained):
    model, x, _ = trained
    half = MultiLayerNetwork(model.config, backend="cpu", precision="bfloat16").init()
    half.set_normalizer(model.normalizer)
    with ParallelInference(half, workers=2, inference_mode="inplace") as inference:
        answers = [inference.output(x[i:i + 1]) for i in range(20)]
    expected = [half.output(x[i:i + 1]) for i in range(20)]
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, e) for a, e in zip(answers, expected))


def test_bad_options_name_themselves(trained):
    model = trained[0]
    for options, key in ((dict(inference_mode="fast"), "inference_mode"), (dict(workers=0), "workers"),
                         (dict(batch_limit=0), "batch_limit"), (dict(queue_timeout=-1), "queue_timeout"),
                         (dict(workers=1, devices=["cpu", "cpu"]), "workers")):
        with pytest.raises(ConfigError, match=key):
            ParallelInference(model, **options)
