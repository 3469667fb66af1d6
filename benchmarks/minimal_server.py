"""The yardstick for dl4py serve: a minimal Starlette + ONNX Runtime prediction server.

    python benchmarks/minimal_server.py MODEL.onnx PORT

What a user would write in 30 lines instead of running ``dl4py serve``: one ONNX Runtime
session with its default options, ``POST /predict`` with ``{"features": [[...], ...]}`` run in
the event loop, the answer as JSON (class and probabilities, as dl4py serve answers). No
limits, no validation beyond what numpy and ONNX Runtime refuse, no batching.
"""

import sys

import numpy as np
import onnxruntime
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

session = onnxruntime.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
input_name = session.get_inputs()[0].name
example_shape = session.get_inputs()[0].shape[1:]


async def predict(request):
    body = await request.json()
    features = np.asarray(body["features"], dtype=np.float32).reshape(-1, *example_shape)
    probabilities = session.run(None, {input_name: features})[0]
    return JSONResponse({"predictions": probabilities.argmax(axis=1).tolist(),
                         "probabilities": probabilities.tolist()})


app = Starlette(routes=[Route("/predict", predict, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
