"""``dl4py serve``: a model behind an HTTP/JSON prediction server (``pip install "dl4py[serve]"``).

    from dl4py.serve import PredictionServer
    with PredictionServer(model, port=8000, workers=2, batch_limit=32) as server:
        ...   # POST {server.url}/predict {"features": [[...], ...]}

``make_app`` gives the ASGI app alone, for another ASGI server. Both import starlette
and uvicorn only when called, so ``import dl4py.serve`` works without them.
"""

from dl4py.serve.app import make_app
from dl4py.serve.body import RequestError
from dl4py.serve.server import DEFAULT_PORT, PredictionServer
from dl4py.serve.service import DEFAULT_MAX_BODY_BYTES, DEFAULT_QUEUE_TIMEOUT, Service, load_model

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_PORT", "DEFAULT_QUEUE_TIMEOUT", "PredictionServer", "RequestError",
           "Service", "load_model", "make_app"]
