"""`dl4py serve` under clients that misbehave: connections that never finish their headers,
sit idle, or come in a flood cannot starve the server of descriptors or of connection
places (each is bounded, and refused with a JSON 4xx/503 naming the bound); bodies nested
100,000 deep or holding a 5,000-digit number get a 4xx naming the problem, with no
traceback in the server's log; every bound is an option checked with one line."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(120)  # a server that never answers fails the test, never hangs the suite

from dl4py import MultiLayerNetwork, TorchModel  # noqa: E402
from dl4py.cli import main  # noqa: E402
from dl4py.errors import ConfigError  # noqa: E402
from dl4py.serve import PredictionServer  # noqa: E402
from child_output import first_line  # noqa: E402
from toy import mlp  # noqa: E402

GOOD = b'{"features": [[0.5, 1.0, -1.0, 2.0]]}'
HALF_SENT = b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"  # no blank line
WAIT = 15  # seconds a client waits for the server before the test fails: a hang, never a timing


@pytest.fixture(scope="module")
def linear():
    return TorchModel(nn.Linear(4, 3), loss=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                      backend="cpu").init()


@contextmanager
def serving(model, **options):
    """A PredictionServer on a free port of 127.0.0.1, stopped (and checked stopped) after."""
    server = PredictionServer(model, port=0, input_shape=(4,), **options).start()
    try:
        yield server
    finally:
        server.stop(timeout=60)
        assert not server.running, "the server's thread did not end"


def post(port, body=GOOD, headers=None):
    """(status, JSON answer) of a POST /predict over a fresh connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    try:
        connection.request("POST", "/predict", body=body, headers={"Content-Type": "application/json",
                                                                   **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def answered(port, body=GOOD) -> tuple[int, dict]:
    """``post``, again while the answer is 503 (the server closing connections still counts
    them), for up to WAIT seconds."""
    deadline = time.monotonic() + WAIT
    status, answer = post(port, body)
    while status == 503 and time.monotonic() < deadline:
        time.sleep(0.05)
        status, answer = post(port, body)
    return status, answer


def opened(port, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    with suppress(OSError):  # a connection refused on arrival may be closed already
        sock.sendall(first)
    return sock


def until_closed(sock, wait: float = WAIT) -> bytes:
    """Everything the server sends until it closes the connection (b"" for a close without a
    word); fails the test when the server keeps it open for ``wait`` seconds."""
    received = b""
    sock.settimeout(wait)
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        pytest.fail(f"the server kept a connection open for {wait} s; it had sent {received[:80]!r}")
    return received


def answer_of(raw: bytes) -> tuple[int, dict]:
    """(status, JSON body) of one HTTP response as raw bytes."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_body_that_keeps_arriving_is_read_however_long_it_takes_in_all(linear):
    """body_timeout bounds each pause, not the whole body: six pieces a quarter of a second apart
    take 1.5 s against a 1 s body_timeout, and the request is answered."""
    pieces = [GOOD[i:i + 7] for i in range(0, len(GOOD), 7)][:6]
    pieces[-1] += GOOD[sum(len(piece) for piece in pieces):]
    with serving(linear, body_timeout=1.0) as server:
        sock = opened(server.port, HALF_SENT + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(GOOD))
        try:
            for piece in pieces:
                time.sleep(0.25)
                sock.sendall(piece)
            got, answer = answer_of(until_closed(sock))
        finally:
            sock.close()
    assert got == 200 and len(answer["predictions"]) == 1, answer


# ---- connections -----------------------------------------------------------------------------
def test_half_sent_requests_are_closed_at_the_header_deadline_and_a_valid_client_is_answered(linear, caplog):
    half = []
    with caplog.at_level(logging.WARNING), serving(linear, max_connections=20, header_timeout=2.0) as server:
        try:
            half = [opened(server.port, HALF_SENT) for _ in range(60)]
            status, answer = post(server.port)  # while the half-sent requests hold every place
            assert status == 200 or (status == 503 and "(max_connections)" in answer["error"]), answer
            ends = []
            for sock in half:  # the server closes every one; each client closes its end then
                ends.append(until_closed(sock))
                sock.close()
            status, answer = answered(server.port)  # their places are free again
        finally:
            for sock in half:
                sock.close()
    assert status == 200 and len(answer["predictions"]) == 1
    # The first 20 were served: each heard why it was closed. Each later one was refused with
    # 503 on arrival (or served and timed out, if an earlier place had come free by then: not
    # the 21st, opened well within 2 s of the first).
    for end in ends[:20]:
        got, answer = answer_of(end)
        assert got == 408 and "did not all arrive within 2 s (header_timeout)" in answer["error"], end
    refused = "the server is serving its most connections, 20 (max_connections); retry later"
    statuses = [answer_of(end)[0] for end in ends[20:]]
    assert set(statuses) <= {408, 503} and 503 in statuses, statuses
    assert all(answer_of(end)[1]["error"] == refused for end in ends[20:] if answer_of(end)[0] == 503)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_idle_connections_are_closed_and_each_next_request_has_its_header_deadline(linear):
    with serving(linear, header_timeout=0.5, keep_alive_timeout=0.5) as server:
        silent = opened(server.port)  # connected, sends nothing
        kept = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT)
        slow = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT)
        try:
            assert until_closed(silent) == b""  # closed without a word
            for connection in (kept, slow):
                connection.request("POST", "/predict", body=GOOD, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                assert response.status == 200 and response.getheader("connection") != "close"
                response.read()
            # A second request on the same connection, half-sent at once: sent after kept's idle
            # close, it would race slow's own keep-alive deadline, as old as kept's.
            slow.sock.sendall(HALF_SENT)
            assert until_closed(kept.sock, wait=4) == b""  # idle between requests: closed (uvicorn's default: 5 s)
            got, answer = answer_of(until_closed(slow.sock))
            assert got == 408 and "within 0.5 s (header_timeout)" in answer["error"]
            assert post(server.port)[0] == 200
        finally:
            silent.close()
            kept.close()
            slow.close()


def test_headers_over_the_limit_get_431_malformed_ones_400_and_a_stalled_body_408(linear):
    with serving(linear, max_header_bytes=2048, body_timeout=0.5) as server:
        large = opened(server.port, HALF_SENT + b"Content-Length: %d\r\nX-Padding: %s\r\n\r\n%s"
                       % (len(GOOD), b"a" * 4096, GOOD))  # whole: h11 alone would take it
        malformed = opened(server.port, b"POST /predict HTTP/1.1\r\nno colon here\r\n\r\n")
        stalled = opened(server.port, HALF_SENT + b"Content-Length: 100\r\n\r\n" + b'{"features": ')
        try:
            got, answer = answer_of(until_closed(large))
            assert got == 431 and "over 2048 bytes, the most this server reads (max_header_bytes)" in answer["error"]
            got, answer = answer_of(until_closed(malformed))
            assert got == 400 and "not valid HTTP/1.1" in answer["error"]
            got, answer = answer_of(until_closed(stalled))  # the answer, then the connection closes
            assert got == 408 and "no bytes for 0.5 s (body_timeout), after 13 bytes" in answer["error"]
            # Headers just within the limit are read.
            padding = "a" * (2048 - len(HALF_SENT) - 200)
            assert post(server.port, headers={"X-Padding": padding})[0] == 200
        finally:
            large.close()
            malformed.close()
            stalled.close()


# ---- bodies the JSON parser cannot take ------------------------------------------------------
def test_deep_nesting_and_huge_numbers_get_4xx_naming_them_and_no_traceback(linear, caplog):
    deep = b'{"features": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    huge = b'{"features": [[1, 2, 3, ' + b"9" * 5000 + b"]]}"
    # Brackets and escaped quotes inside strings are not nesting.
    strings = b'{"features": [[1, 2, 3, 4]], "note": "' + b"[{" * 40 + b'\\"' + b"[" * 40 + b'"}'
    with caplog.at_level(logging.WARNING), serving(linear, max_body_bytes=1 << 20) as server:
        status, nested = post(server.port, deep)
        digits_status, digits = post(server.port, huge)
        after, answer = post(server.port, strings)
        beyond_int64, _ = post(server.port, b'{"features": [[100000000000000000000, 1, 2, 3]]}')  # 1e20
    assert status == 400 and nested["error"].startswith(
        "the body nests arrays or objects 100001 levels deep, deeper than the 32 this server reads"), nested
    assert digits_status == 422 and digits["error"].startswith(
        "the body holds a number of 5000 digits at line 1, column 25, more than the 4300 digits"), digits
    assert after == 200 and len(answer["predictions"]) == 1
    assert beyond_int64 == 200  # a number numpy keeps as an object, not "different lengths"
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text


def test_nesting_is_refused_one_level_past_the_limit_and_many_examples_are_not_nesting():
    from dl4py.serve.body import MAX_NESTING, RequestError, read_features

    def refusal(body):
        with pytest.raises(RequestError) as caught:
            read_features(body, (4,))
        return caught.value.status, caught.value.message

    over = b'{"features": ' + b"[" * MAX_NESTING + b"1" + b"]" * MAX_NESTING + b"}"  # the object + 32 arrays
    # 32 levels, with one more array opened beside the deepest: counting openings would refuse it.
    at = b'{"features": ' + b"[" * (MAX_NESTING - 2) + b"[1], [1]" + b"]" * (MAX_NESTING - 2) + b"}"
    assert refusal(over) == (400, f"the body nests arrays or objects {MAX_NESTING + 1} levels deep, deeper than "
                                  f"the {MAX_NESTING} this server reads; features are a list of examples, each "
                                  "nested as one example's shape")
    assert refusal(at)[0] == 422  # read, then refused for its shape
    wide = json.dumps({"features": [[1, 2, 3, 4]] * 100}).encode()  # 101 arrays opened, 3 levels deep
    assert read_features(wide, (4,)).shape == (100, 4)


# ---- the command, under a low open-file limit --------------------------------------------------
@pytest.mark.slow  # starting the command takes seconds
@pytest.mark.timeout(300)
def test_a_flood_of_half_sent_connections_cannot_take_every_descriptor_of_the_command(tmp_path):
    """The issue's case, scaled down: under a 256 open-file limit, 300 half-sent requests
    (more than the limit) against `dl4py serve`; the server never runs out of descriptors,
    closes each (at its header deadline, or refused), answers a valid client after, and
    neither they nor bad JSON leave a traceback in its log."""
    model_file = tmp_path / "model.dl4py"
    MultiLayerNetwork(mlp()).init().save(model_file)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    command = [sys.executable, "-m", "dl4py", "serve", str(model_file), "--port", "0", "--backend", "cpu",
               "--max-connections", "40", "--header-timeout", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    half = []
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", first_line(process, 60, "dl4py serve")).group(1))
        half = [opened(port, HALF_SENT) for _ in range(300)]
        for _ in range(100):  # and a port scanner's: connected and gone, before the server answers
            opened(port).close()
        ends = []
        for sock in half:
            ends.append(until_closed(sock))
            sock.close()
        status, answer = answered(port, b'{"features": [[1, 2, 3, 4, 5]]}')
        nested, _ = post(port, b'{"features": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        digits, _ = post(port, b'{"features": [[' + b"9" * 5000 + b"]]}")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        log = process.stderr.read()
    finally:
        for sock in half:
            sock.close()
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()
    assert status == 200 and len(answer["predictions"]) == 1
    assert (nested, digits) == (400, 422)
    assert sum(end.startswith(b"HTTP/1.1 408") for end in ends) >= 40  # the served ones heard why
    assert "Too many open files" not in log and "Traceback" not in log, log


# ---- the options -------------------------------------------------------------------------------
@pytest.mark.parametrize("option, value, message", [
    ("max_connections", 0, "max_connections: must be a whole number >= 1, got 0"),
    ("header_timeout", 0, "header_timeout: must be seconds > 0, got 0"),
    ("keep_alive_timeout", float("inf"), "keep_alive_timeout: must be seconds > 0, got inf"),
    ("max_header_bytes", 100, "max_header_bytes: must be a whole number >= 1024, got 100"),
    ("body_timeout", -1.0, "body_timeout: must be seconds > 0, got -1.0"),
])
def test_a_bad_bound_is_one_line_naming_the_option(linear, option, value, message):
    with pytest.raises(ConfigError) as error:
        PredictionServer(linear, port=0, input_shape=(4,), **{option: value})
    assert str(error.value) == message


def test_max_connections_must_fit_the_open_file_limit(linear, tmp_path, capsys):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 300, hard))
    try:
        with pytest.raises(ConfigError, match=r"^max_connections: 1000 connections may hold 1500 open files, but this "
                                              rf"process may open {in_use + 300} \(ulimit -n\)"):
            PredictionServer(linear, port=0, input_shape=(4,), max_connections=1000)
        server = PredictionServer(linear, port=0, input_shape=(4,))  # the default fits under the limit
        server.stop()
        assert 100 < server.limits.max_connections < 256 and server.limits.descriptors <= 300 - 64
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    model_file = tmp_path / "model.dl4py"
    MultiLayerNetwork(mlp()).init().save(model_file)
    assert main(["serve", str(model_file), "--port", "0", "--header-timeout", "-1"]) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert printed == ["dl4py serve: error: header_timeout: must be seconds > 0, got -1.0"]


def test_plain_bodies_read_straight_into_float32_and_the_rest_say_what_is_wrong():
    """A body of numbers and lists only is read by numpy into float32 at once (serve/body.py's
    plain path); a value that path cannot take goes to the checking path, which names it."""
    from dl4py.serve import body as body_module
    from dl4py.serve.body import RequestError, read_features

    plain = b'{"features": [[0.5, -1, 3e5, 7]]}'
    assert body_module._plain_numbers([[0.5, -1, 3e5, 7]]) is not None  # the fast path takes it
    values = read_features(plain, (4,))
    assert values.dtype == np.float32 and values.tolist() == [[0.5, -1.0, 3e5, 7.0]]
    for body, message in ((b'{"features": [[1, 1e39, 2, 3]]}', "features[0][1] = 1e+39 is beyond float32's range"),
                          (b'{"features": [[1, null, 2, 3]]}', "features[0][1] is null, not a number"),
                          (b'{"features": [[1, 2, 3, 4], [5]]}', "different lengths")):
        with pytest.raises(RequestError) as caught:
            read_features(body, (4,))
        assert message in caught.value.message, caught.value.message


def test_one_pass_tells_a_body_of_numbers_and_lists_from_one_the_checking_path_must_read():
    """serve/body.py's ``_plain``: what it passes skips the boolean scan and the nesting count,
    so a boolean, null, string, second key or deep nesting must never pass it."""
    from dl4py.serve.body import MAX_NESTING, RequestError, _plain, read_features

    depth = MAX_NESTING - 1  # arrays under the object: as deep as a body may nest
    assert _plain(b'{"features": [[0.5, -1, 3E+5, 7e-2]]}')
    assert _plain(b' {\n\t"features" :[[1,2],[3,4]] }\r\n')
    assert _plain(json.dumps({"features": [[1, 2, 3, 4]] * 100}).encode())  # many examples, 3 levels
    assert _plain(b'{"features": ' + b"[" * depth + b"1" + b"]" * depth + b"}")
    for body in (b'{"features": [[true, 1, 2, 3]]}', b'{"features": [[1, false, 2, 3]]}',
                 b'{"features": [[1, null, 2, 3]]}', b'{"features": [["1", 2, 3, 4]]}',
                 b'{"features": [[1, 2, 3, 4]], "note": 5}', b'{"feat\\u0075res": [[1, 2, 3, 4]]}',
                 b'{"features": [[NaN, 1, 2, 3]]}', b'{"features": [[-Infinity, 1, 2, 3]]}',
                 b'[{"features": [[1, 2, 3, 4]]}]', b'{"features": {"x": [1, 2, 3, 4]}}',
                 b'{"features": ' + b"[" * (depth + 1) + b"1" + b"]" * (depth + 1) + b"}",
                 b'{"features": [' + b"[1], " * 40 + b"[" * depth + b"1" + b"]" * depth + b"]}"):
        assert not _plain(body), body[:60]
    with pytest.raises(RequestError) as caught:  # what the plain path would have read as 1.0
        read_features(b'{"features": [[true, 1, 2, 3]]}', (4,))
    assert caught.value.message == "features[0][0] is true, not a number"
