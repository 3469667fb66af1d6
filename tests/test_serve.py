"""`dl4py serve`: an HTTP/JSON server over ParallelInference. Under load from concurrent
clients it loses no request and answers each as model.output does; bad requests get a 4xx
naming the problem and the server serves on; an internal error is a 500 without its
traceback; a shutdown answers the requests it received; the command stops on SIGTERM.

Which requests are under way when a server turns one away or stops is decided with a gate in
front of the model's network (``gates.py``), never by how the threads happen to be scheduled."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from child_output import first_line
from devices import backend_for, on_devices, tolerance
from gates import Gate, GatedModule, wait_for
from torch import nn

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
aiohttp = pytest.importorskip("aiohttp")

from dl4py import MnistDataSetIterator, MultiLayerNetwork, TorchModel  # noqa: E402
from dl4py.errors import MissingDependencyError  # noqa: E402
from dl4py.serve import PredictionServer, make_app  # noqa: E402

ROWS = 512
LIMIT = 256 * 1024  # max_body_bytes of the servers here: a few dozen MNIST rows as JSON


@pytest.fixture(scope="module")
def trained_on():
    """``trained_on(device)``: an MLP trained one epoch on 1,000 MNIST images (with a
    standardizing normalizer) on ``device``'s backend, 512 test images, ``model.output`` of each
    (on the CPU) and each row as JSON text: (model, x, expected, rows)."""
    from toy import trained_mnist_mlp

    made = {}

    def get(device):
        if device not in made:
            if device == "cpu":
                model = trained_mnist_mlp(examples=1000, batch=100)
            else:  # the CPU model's weights and normalizer on the device's backend
                trained = get("cpu")[0]
                model = MultiLayerNetwork(trained.config, backend=backend_for(device)).init()
                model.module.load_state_dict(trained.module.state_dict())
                model.set_normalizer(trained.normalizer)
            x = MnistDataSetIterator(ROWS, train=False, shuffle=False, limit=ROWS).features.numpy()
            rows = [json.dumps(row) for row in x.tolist()]  # float32 values: exact as JSON
            made[device] = model, x, model.output(x).cpu().numpy(), rows
        return made[device]

    return get


@pytest.fixture
def trained(trained_on):
    return trained_on("cpu")


@contextmanager
def serving(model, **options):
    """A PredictionServer on a free port of 127.0.0.1, stopped (and checked stopped) after."""
    server = PredictionServer(model, port=0, **options).start()
    try:
        yield server
    finally:
        server.stop(timeout=60)
        assert not server.running, "the server's thread did not end"


def features_body(rows, indices) -> bytes:
    return ('{"features": [' + ",".join(rows[i] for i in indices) + "]}").encode()


def request(server, method, path, body=b"", headers=None, chunked=False):
    """(status, JSON answer, headers) over a fresh connection."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        if chunked:
            connection.request(method, path, body=iter([body[i:i + 8192] for i in range(0, len(body), 8192)]),
                               headers=headers or {}, encode_chunked=True)
        else:
            connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read()), response.headers
    finally:
        connection.close()


def predict(server, body, content_type="application/json", **kwargs):
    return request(server, "POST", "/predict", body, {"Content-Type": content_type}, **kwargs)


def assert_correct(answer, expected_rows, device="cpu"):
    """The server's answer is ``model.output`` (computed in another batch: float32 summation
    order apart), and its predictions are the highest probabilities'."""
    probabilities = np.array(answer["probabilities"])
    np.testing.assert_allclose(probabilities, expected_rows, **tolerance(device, cpu=1e-6))
    assert answer["predictions"] == probabilities.argmax(axis=1).tolist()


# ---- load ----------------------------------------------------------------------------------
async def _send(session, url, rows, indices):
    async with session.post(url, data=features_body(rows, indices),
                            headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.json()


async def _load(server, rows, total, clients):
    """``clients`` concurrent clients send ``total`` requests of 1 to 4 examples; each
    outcome is (indices, status, answer)."""
    outcomes, next_request = [], iter(range(total))
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)) as session:
        async def client():
            for n in next_request:
                indices = [(7 * n + k) % ROWS for k in range(1 + n % 4)]
                outcomes.append((indices, *await _send(session, server.url + "/predict", rows, indices)))

        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(clients))), 240)
    return outcomes


@pytest.mark.slow
@on_devices
def test_concurrent_clients_get_every_answer_right(trained_on, device):
    model, x, expected, rows = trained_on(device)
    total = 2000
    with serving(model, workers=2, batch_limit=32, queue_limit=64, max_body_bytes=LIMIT) as server:
        outcomes = asyncio.run(_load(server, rows, total, clients=32))
        stats = server.service.inference.stats()
        version = server.service.model_version
    assert len(outcomes) == total  # none lost
    for indices, status, answer in outcomes:
        assert status == 200, answer
        assert_correct(answer, expected[indices], device)
        assert answer["model_version"] == version
    assert stats["requests"] == total and stats["examples"] == sum(1 + n % 4 for n in range(total))
    assert stats["failed"] == 0 and stats["max_batch_size"] <= 32


# ---- bad requests --------------------------------------------------------------------------
BAD = [
    pytest.param("text/plain", b'{"features": [[0]]}', 415, "takes Content-Type application/json, got 'text/plain'",
                 id="wrong-content-type"),
    pytest.param("", b'{"features": [[0]]}', 415, "got none", id="no-content-type"),
    pytest.param("application/json", b'{"features": [[0, 1', 400, "not valid JSON", id="not-json"),
    pytest.param("application/json", b'{"images": [[0]]}', 422, "no \"features\" key (its keys: 'images')",
                 id="no-features-key"),
    pytest.param("application/json", b'{"features": [[0, 1, "x"]]}', 422, 'features[0][2] is "x", not a number',
                 id="non-numeric"),
    pytest.param("application/json", b'{"features": [[0, true]]}', 422, "features[0][1] is true, not a number",
                 id="boolean"),
    pytest.param("application/json", b'{"features": [[0, NaN]]}', 422, "NaN, which is not a JSON number",
                 id="nan"),
    pytest.param("application/json", b'{"features": [[1, 2, 3]]}', 422,
                 "features have shape [1, 3], but the model takes a list of examples [n, 784]", id="wrong-shape"),
    pytest.param("application/json", b'{"features": [[1, 2], [3]]}', 422, "different lengths", id="ragged"),
    pytest.param("application/json", b'{"features": []}', 422, "holds no examples", id="no-examples"),
]


def test_bad_requests_get_4xx_naming_the_problem_and_the_server_serves_on(trained):
    model, x, expected, rows = trained
    too_large = features_body(rows, range(64))
    assert len(too_large) > LIMIT
    with serving(model, max_body_bytes=LIMIT) as server:
        for case in BAD:
            content_type, body, status, message = case.values
            got, answer, headers = predict(server, body, content_type)
            assert got == status and message in answer["error"], (case.id, got, answer)
            assert answer["request_id"] == headers["X-Request-ID"]
        got, answer, _ = predict(server, too_large)  # refused by its Content-Length, unread
        assert got == 413 and f"this server takes at most {LIMIT}" in answer["error"], answer
        got, answer, _ = predict(server, too_large, chunked=True)  # no length: refused while read
        assert got == 413 and f"over {LIMIT} bytes" in answer["error"], answer
        got, answer, _ = request(server, "GET", "/predict")
        assert got == 405 and "GET is not allowed on /predict" in answer["error"]
        got, answer, _ = request(server, "GET", "/nothing")
        assert got == 404 and "POST /predict" in answer["error"]
        # The server serves on, right; a chunked body within the limit is read too.
        got, answer, _ = predict(server, features_body(rows, [3, 4]), chunked=True)
        assert got == 200
        assert_correct(answer, expected[[3, 4]])
        got, answer, _ = predict(server, ('{"features": ' + rows[5] + "}").encode())  # one example alone
        assert got == 200 and len(answer["predictions"]) == 1
        assert_correct(answer, expected[[5]])
        assert server.service.inference.stats()["requests"] == 2  # no bad one reached the model


def test_health_and_metadata(trained, tmp_path):
    model, *_ = trained
    with serving(model, workers=2, batch_limit=16, labels=[f"digit {d}" for d in range(10)]) as server:
        status, health, _ = request(server, "GET", "/health")
        _, metadata, _ = request(server, "GET", "/metadata")
        _, answer, _ = predict(server, features_body(trained[3], [0]))
    assert status == 200 and health["status"] == "serving" and health["in_flight"] == 0
    assert re.fullmatch(r"[0-9a-f]{12}", metadata["model_version"])
    assert metadata["model"] == "MultiLayerNetwork" and metadata["kind"] == "classifier"
    assert metadata["input_shape"] == [784] and metadata["outputs"] == 10
    assert metadata["epochs"] == 1 and metadata["iterations"] == model.iteration_count == 10
    assert metadata["labels"][3] == "digit 3"
    assert metadata["inference"]["workers"] == 2 and metadata["inference"]["batch_limit"] == 16
    assert metadata["inference"]["runtime"] == "onnx"  # auto, with dl4py[export] installed
    assert answer["labels"] == [f"digit {answer['predictions'][0]}"]


# ---- internal errors and shutdown: a model that fails, or waits, on purpose ------------------
class Picky(nn.Module):
    """A linear classifier of 4 features that fails for an example holding 13 and waits at
    ``gate`` over one holding 7 (the server's replica is a copy sharing the gate)."""

    def __init__(self, gate: Gate):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.gate = gate

    def forward(self, x):
        if (x == 13).any():
            raise RuntimeError("weights at /srv/secret/model.bin are corrupt")
        if (x == 7).any():
            self.gate.pass_through()
        return self.linear(x)


@pytest.fixture
def picky():
    gate = Gate()
    model = TorchModel(Picky(gate), loss=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                       output_activation=lambda t: torch.softmax(t, dim=1), backend="cpu").init()
    yield model
    gate.open()  # a failing test must not leave a forward pass waiting


def test_an_internal_error_is_a_500_without_traceback_and_logged(picky, caplog):
    good = [[0.5, 1.0, -1.0, 2.0]]
    with caplog.at_level(logging.ERROR, logger="dl4py.serve"), serving(picky, input_shape=(4,)) as server:
        status, answer, _ = predict(server, json.dumps({"features": [[1, 2, 13, 4]]}).encode())
        after, fine, _ = predict(server, json.dumps({"features": good}).encode())
    assert status == 500
    text = json.dumps(answer)
    assert "Traceback" not in text and "secret" not in text and "RuntimeError" not in text
    assert answer["error"].startswith("internal error") and answer["request_id"] in answer["error"]
    logged = [r for r in caplog.records if answer["request_id"] in r.getMessage()]
    assert logged and "secret" in str(logged[0].exc_info[1])  # the details are in the server's log
    assert after == 200  # the replica serves on
    np.testing.assert_allclose(fine["probabilities"], picky.output(np.array(good, np.float32)).numpy(), atol=1e-6)


def test_a_full_server_says_busy_and_a_shutdown_answers_the_request_in_flight(picky):
    slow = [[7.0, 0.0, 1.0, 2.0]]  # waits at the gate in the forward pass
    gate = picky.module.gate
    gate.close()
    server = PredictionServer(picky, port=0, input_shape=(4,), queue_limit=1, queue_timeout=0.1).start()
    result = {}
    body = json.dumps({"features": slow}).encode()
    client = threading.Thread(target=lambda: result.update(answer=predict(server, body)))
    try:
        client.start()
        gate.wait_for_arrivals(1)  # in the forward pass: it holds the one place (queue_limit=1)
        status, busy, _ = predict(server, json.dumps({"features": [[1, 2, 3, 4]]}).encode())
        assert status == 503 and "the server is busy: 1 requests are being answered (queue_limit)" in busy["error"]
        # A stop's first step, before uvicorn notices it and closes the port: a request now is refused.
        server.service.drain()
        status, refused, _ = predict(server, json.dumps({"features": [[1, 2, 3, 4]]}).encode())
        assert status == 503 and "shutting down" in refused["error"], refused
        status, health, _ = request(server, "GET", "/health")
        assert status == 503 and health["status"] == "draining" and health["in_flight"] == 1
        server.stop(timeout=0)  # the whole stop, while the slow forward pass waits
        assert server.in_flight_at_stop == 1
    finally:
        gate.open()
        client.join(60)
        server.stop(timeout=60)
    assert not server.running and not client.is_alive()
    status, answer, _ = result["answer"]
    assert status == 200
    with torch.no_grad():
        expected = torch.softmax(picky.module.linear(torch.tensor(slow)), dim=1).numpy()
    np.testing.assert_allclose(answer["probabilities"], expected, atol=1e-6)
    with pytest.raises(ConnectionError):  # the port is closed now
        predict(server, body)


async def _load_until_stopped(server, rows, clients, stop_after, gate):
    """Clients send requests until the server stops them. Once ``stop_after`` are answered,
    a thread closes ``gate`` (in front of the server's network), waits until every client has
    a request in flight, stops the server and opens the gate. Outcomes: (indices, status,
    answer), or (indices, "closed", error) for a connection the stopping server refused or
    closed before it read a request."""
    outcomes = []
    timeout = aiohttp.ClientTimeout(total=60)

    def stop_under_load():
        try:
            wait_for(lambda: len(outcomes) >= stop_after, f"{stop_after} requests answered")
            gate.close()
            # Each client has one request at a time, and none is answered now: all come to be in flight.
            wait_for(lambda: server.service.counts()["in_flight"] == clients, f"{clients} requests in flight")
        finally:
            server.stop(timeout=0)  # no more requests: those in flight are answered, later ones refused
            gate.open()

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)) as session:
        async def client(n):
            while True:
                indices = [(5 * n + k) % ROWS for k in range(1 + n % 3)]
                try:
                    outcomes.append((indices, *await _send(session, server.url + "/predict", rows, indices)))
                except aiohttp.ClientConnectionError as error:  # refused, or closed by the stopping server
                    outcomes.append((indices, "closed", error))
                    return
                if outcomes[-1][1] != 200:
                    return
                n += clients

        stopper = asyncio.get_running_loop().run_in_executor(None, stop_under_load)
        await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(clients))), 120)
        await asyncio.wait_for(stopper, 90)
    return outcomes


@on_devices
def test_a_shutdown_under_load_answers_every_request_it_received(trained_on, device):
    model, x, expected, rows = trained_on(device)
    clients, stop_after = 24, 200
    # A gate on the torch module, met in the replica's thread (inline_seconds=0): met in the event
    # loop, it would hold up the requests the test waits for.
    server = PredictionServer(model, port=0, max_body_bytes=LIMIT, runtime="torch", inline_seconds=0).start()
    replica = server.service.inference.replicas[0]
    gate = Gate()
    replica.module = GatedModule(replica.module, gate)
    try:
        outcomes = asyncio.run(_load_until_stopped(server, rows, clients, stop_after, gate))
    finally:
        gate.open()
        server.stop(timeout=60)
    assert not server.running
    assert server.in_flight_at_stop == clients  # the stop came with every client's request under way
    statuses = [o[1] for o in outcomes]
    for indices, status, answer in outcomes:
        if status == 200:
            assert_correct(answer, expected[indices], device)
        elif status == 503:
            assert "shutting down" in answer["error"]
        else:
            assert status == "closed", answer
    counts = server.service.counts()
    # Every request taken (those in flight at the stop among them) got its right answer and
    # every one refused a 503; each client heard of its own; each ended on a refusal, none hung.
    assert counts["in_flight"] == 0 and counts["received"] == counts["answered"] == statuses.count(200)
    assert counts["refused"] == statuses.count(503)
    assert statuses.count(200) >= stop_after + clients and len(outcomes) - statuses.count(200) == clients


# ---- the command -----------------------------------------------------------------------------
@pytest.mark.slow
@on_devices
def test_dl4py_serve_command_answers_and_stops_on_sigterm(trained, tmp_path, device):
    model, x, expected, rows = trained  # trained on the CPU; the command serves it on the device
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    model.save(run_dir / "model.dl4py")
    # The source first, the caller's path kept (where a machine without network has uvicorn).
    paths = [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    process = subprocess.Popen([sys.executable, "-m", "dl4py", "serve", str(run_dir), "--port", "0",
                                "--backend", backend_for(device)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = first_line(process, 60, "dl4py serve")
        url = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert url, line
        port = int(url.group(1))
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/health")
        health = connection.getresponse()
        assert health.status == 200 and json.loads(health.read())["status"] == "serving"
        connection.request("GET", "/metadata")
        metadata = json.loads(connection.getresponse().read())
        assert metadata["model"] == "model.dl4py" and metadata["epochs"] == 1 and metadata["input_shape"] == [784]
        # --runtime auto: ONNX Runtime where the replicas are on the CPU (the extra is in the tests')
        runtime = "onnx" if device == "cpu" else "torch"
        assert metadata["inference"]["runtime"] == runtime and f"runtime {runtime})" in line, (metadata, line)
        connection.request("POST", "/predict", body=features_body(rows, [10, 11]),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
        assert response.status == 200
        assert_correct(answer, expected[[10, 11]], device)
        app = make_app(model)
        app.state.service.close()
        assert answer["model_version"] == app.state.service.model_version  # the file's weights
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()


def test_missing_extra_names_the_pip_install(trained, monkeypatch):
    monkeypatch.setitem(sys.modules, "starlette", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r'pip install "dl4py\[serve\]"'):
        make_app(trained[0])
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(MissingDependencyError, match=r'pip install "dl4py\[serve\]"'):
        PredictionServer(trained[0], port=0)


def test_every_accepted_connection_sends_without_waiting_for_the_clients_ack(trained):
    """TCP_NODELAY on each connection: without it a kept-alive client's every response waits
    for its delayed ACK (about 40 ms on Linux: 22 requests/s on one connection). asyncio sets it
    only on sockets made with IPPROTO_TCP, which is why the listening socket names it; read
    here on the server's side of each accepted connection (uvicorn's transports)."""
    model, x, expected, rows = trained
    with serving(model) as server:
        clients = [http.client.HTTPConnection(server.host, server.port, timeout=30) for _ in range(2)]
        try:
            for client in clients:
                for _ in range(2):  # kept alive: the same connection answers again
                    client.request("POST", "/predict", f'{{"features": [{rows[0]}]}}',
                                   {"Content-Type": "application/json"})
                    response = client.getresponse()
                    assert response.status == 200 and json.loads(response.read())["predictions"] == [int(expected[0].argmax())]
            connections = list(server._server.server_state.connections)
            assert len(connections) == 2
            for connection in connections:
                sock = connection.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            for client in clients:
                client.close()
