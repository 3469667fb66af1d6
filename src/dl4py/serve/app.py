"""The ASGI application of ``dl4py serve``: ``POST /predict``, ``GET /health``, ``GET /metadata``.

Starlette routes, JSON in and out. The event loop only moves bytes: a request's body is read
here under the size limit, then parsed, run and answered in the service's thread pool
(``Service.answer``), awaited with ``asyncio.wrap_future``. At most ``queue_limit`` requests
are in that pool at once; one more waits up to ``queue_timeout`` seconds for a place, then
gets 503. Every error is JSON ``{"error": message, "request_id": id}``; an unexpected one is
500 with a generic message, its traceback going to the ``dl4py.serve`` log under that id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import itertools
import logging
import os

from dl4py.errors import DataError, InferenceError, MissingDependencyError
from dl4py.nn.model import Model
from dl4py.serve.body import RequestError
from dl4py.serve.service import Service, load_model

log = logging.getLogger("dl4py.serve")


def _starlette():
    try:
        import starlette  # optional: starlette (extra serve)  # noqa: F401
    except ImportError:
        raise MissingDependencyError("dl4py serve", "starlette", "serve") from None


def make_app(model, **options):
    """The ASGI app serving ``model`` (a Model, a model file or a run directory).

    ``options``: ``workers``, ``devices``, ``inference_mode``, ``batch_limit``, ``runtime`` (as
    ParallelInference), ``queue_limit`` (requests answered at once), ``queue_timeout``
    (seconds one more waits for a place before a 503), ``max_body_bytes``, ``body_timeout``
    (the longest pause while a body arrives, in seconds, before a 408), ``input_shape``
    (one example's shape; needed for a TorchModel), ``labels`` (class names), ``backend``
    (for a model read from a file). ``app.state.service`` is the ``Service``; ParallelInference
    is closed when the app's lifespan ends.
    """
    _starlette()
    from starlette.applications import Starlette  # optional: starlette (extra serve)
    from starlette.exceptions import HTTPException  # optional: starlette (extra serve)
    from starlette.routing import Route  # optional: starlette (extra serve)

    backend = options.pop("backend", None)
    model_file = None
    if not isinstance(model, Model):  # a model file or a run directory
        model_file = model
        model = load_model(model, backend=backend)
    service = Service(model, model_file=model_file, **options)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            # The server has answered what it received (or given up waiting): stop the replicas.
            await asyncio.get_running_loop().run_in_executor(None, service.close)

    app = Starlette(
        routes=[Route("/predict", _predict, methods=["POST"]),
                Route("/health", _health, methods=["GET"]),
                Route("/metadata", _metadata, methods=["GET"])],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.slots = asyncio.Semaphore(service.queue_limit)
    return app


_deadline = getattr(asyncio, "timeout", None)  # Python 3.11 and later

# Request ids: this process's random prefix and a counter, unique within the server's log
# (a uuid4 per request read os.urandom each time, 2% of a small request's CPU).
_ID_PREFIX = os.urandom(3).hex()
_request_numbers = itertools.count()


def _next_request_id() -> str:
    return f"{_ID_PREFIX}{next(_request_numbers):06x}"


async def _predict(request):
    service: Service = request.app.state.service
    request_id = _next_request_id()
    if not service.enter():
        return _json_response(503, "the server is shutting down and takes no more requests", request_id)
    try:
        status, body = await _prediction(request, service, request_id)
    finally:
        service.leave()
    # A body that stopped arriving will not be read to its end: the connection ends with the answer.
    return _json_response(status, body, request_id, headers={"Connection": "close"} if status == 408 else None)


async def _prediction(request, service: Service, request_id: str) -> tuple[int, bytes | str]:
    """(status, JSON answer bytes or an error message)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        shown = f"got {media_type!r}" if media_type else "got none"
        return 415, f"POST /predict takes Content-Type application/json, {shown}"
    from starlette.requests import ClientDisconnect  # optional: starlette (extra serve)

    try:
        body = await _read_body(request, service.max_body_bytes, service.body_timeout)
    except RequestError as error:
        return error.status, error.message
    except ClientDisconnect:  # nobody is left to hear the answer; not the server's fault
        return 400, "the client closed the connection before its whole body arrived"
    slots: asyncio.Semaphore = request.app.state.slots
    try:
        if slots.locked():  # every place taken: wait for one, up to queue_timeout (0: not at all)
            await asyncio.wait_for(slots.acquire(), service.queue_timeout)
        else:
            await slots.acquire()
    except asyncio.TimeoutError:
        return 503, (f"the server is busy: {service.queue_limit} requests are being answered (queue_limit) and "
                     f"no place came free in {service.queue_timeout:g} s; retry later")
    try:
        if service.reads_in_loop(body):
            future = service.submit(body)
            # Answered already when it ran in this thread (short, nothing waiting): awaiting a done
            # future would still cost a trip through the loop's self-pipe.
            return 200, service.encode(future.result() if future.done() else await asyncio.wrap_future(future))
        return 200, await asyncio.wrap_future(service.pool.submit(service.answer, body))
    except RequestError as error:
        return error.status, error.message
    except DataError as error:  # features the network itself refuses (an embedding index out of range)
        return 422, str(error).replace("ParallelInference.output(features): ", "")
    except InferenceError as error:
        return 503, f"the model cannot take this request now: {error}"
    except Exception:  # noqa: BLE001 - a bug or a device failure: logged whole, told in brief
        log.exception("dl4py serve: request %s failed", request_id)
        return 500, f"internal error while predicting; the server's log holds the details under request id {request_id}"
    finally:
        slots.release()


async def _read_body(request, limit: int, pause: float) -> bytes:
    """The body, refusing one over ``limit`` bytes: by its Content-Length before reading
    anything, and by the bytes actually read (a chunked body has no length); and one that
    stops arriving for ``pause`` seconds, which would hold its connection for ever."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(400, f"Content-Length {declared!r} is not a number of bytes")
        if int(declared) > limit:
            raise RequestError(413, f"the body is {int(declared)} bytes; this server takes at most {limit} "
                                    "(max_body_bytes): send fewer examples per request")
    from starlette.requests import ClientDisconnect  # optional: starlette (extra serve)

    # The ASGI messages as they come (a body that arrived whole is one). Each wait is bounded by
    # one timer a request, moved on only when more of the body is to come (asyncio.timeout,
    # Python 3.11 and later); before 3.11, by asyncio.wait_for on each message (a task each).
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    try:
        async with _deadline(pause) if _deadline else contextlib.nullcontext() as deadline:
            while True:
                receiving = request.receive()
                message = await (receiving if deadline is not None else asyncio.wait_for(receiving, pause))
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise RequestError(413, f"the body is over {limit} bytes, the most this server takes "
                                            "(max_body_bytes): send fewer examples per request")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
                if deadline is not None:
                    deadline.reschedule(loop.time() + pause)
    except asyncio.TimeoutError:  # TimeoutError itself from 3.11
        raise RequestError(408, f"the body stopped arriving: no bytes for {pause:g} s (body_timeout), after "
                                f"{size} bytes") from None
    return b"".join(chunks)


async def _health(request):
    service: Service = request.app.state.service
    counts = service.counts()
    status = "draining" if service.draining else "serving"
    return _json_response(503 if service.draining else 200,
                          {"status": status, "model_version": service.model_version,
                           "in_flight": counts["in_flight"], "requests": counts["received"],
                           "inference": service.inference.stats()})


async def _metadata(request):
    return _json_response(200, request.app.state.service.metadata)


async def _http_error(request, error):
    # Starlette's 404 and 405, as JSON like every other answer.
    messages = {404: f"no such endpoint {request.url.path}; there are POST /predict, GET /health, GET /metadata",
                405: f"{request.method} is not allowed on {request.url.path}"}
    return _json_response(error.status_code, messages.get(error.status_code, str(error.detail)),
                          headers=getattr(error, "headers", None))


async def _internal_error(request, error):
    request_id = _next_request_id()
    log.error("dl4py serve: request %s failed", request_id, exc_info=error)
    return _json_response(500, f"internal error; the server's log holds the details under request id {request_id}",
                          request_id)


def _json_response(status: int, body, request_id: str | None = None, headers=None) -> "JsonAnswer":
    """``body``: JSON bytes already made, a message (for an error), or a dict."""
    if isinstance(body, str):
        body = {"error": body, **({"request_id": request_id} if request_id else {})}
    if isinstance(body, dict):
        body = json.dumps(body).encode("utf-8")
    raw_headers = [(b"content-length", str(len(body)).encode("latin-1")), _JSON_TYPE]
    if request_id:
        raw_headers.append((b"x-request-id", request_id.encode("latin-1")))
    for name, value in (headers or {}).items():
        raw_headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    return JsonAnswer(status, raw_headers, body)


_JSON_TYPE = (b"content-type", b"application/json")


class JsonAnswer:
    """A JSON answer as the ASGI messages that send it: what Starlette's Response sends for
    it, without building and then reading back a headers object (a tenth of a small request's
    own time in the app)."""

    __slots__ = ("status_code", "raw_headers", "body")

    def __init__(self, status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes):
        self.status_code, self.raw_headers, self.body = status, raw_headers, body

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})
