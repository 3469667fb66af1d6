# dl4py: set-up, demo and tests. `make demo` trains the seed's LeNet on MNIST;
# `make test` runs the test suite. Both install what they need first.
PYTHON ?= python3
# PyTorch pin for a fresh machine; GPU users with their own build: make test TORCH=
TORCH ?= torch==2.13.0
# Use the MNIST files beside the repository when they are there (no download).
ifneq ($(wildcard ../shared/data/mnist),)
export DL4PY_DATA ?= $(abspath ../shared/data)
endif

# A copy of MNIST inside the checkout (.data/mnist) travels to a GPU machine with it.
ifneq ($(wildcard .data/mnist),)
export DL4PY_DATA ?= $(abspath .data)
endif
# make gpu-check: the prepared GPU check (docs/gpu-check.md). DEVICE=cpu QUICK=1 is its CPU rehearsal.
DEVICE ?= gpu
QUICK ?=
BUDGET ?=
# ONLY=resume,parallel: some steps (a second call runs what the first left not_run).
ONLY ?=
OUT ?= benchmarks/results
# Wheels carried to a machine without network (dl4py serve's starlette and uvicorn), installed beside it.
WHEELS ?= .whl

.PHONY: setup demo demo-parallel test test-quick bench soak gpu-check

setup:
	$(if $(TORCH),$(PYTHON) -m pip install -q "$(TORCH)")
	$(PYTHON) -m pip install -q -e ".[test]"

demo: setup
	$(PYTHON) -m dl4py train examples/lenet_mnist.yaml

# The long soak tests (pytest -m soak) run with make soak.
test: setup
	$(PYTHON) -m pytest -q -m "not soak"

# The inner loop (a few minutes): what is not slow, soak or Spark (DEVELOPERS.md).
test-quick: setup
	$(PYTHON) -m pytest -q -m "not slow and not soak and not spark"

bench: setup
	$(PYTHON) -m dl4py bench all

# Memory that must stay flat (20 fits, 10 epochs, 10 sweeps, 5 minutes of serving), then the
# long versions of the hostile-input, resume and failure tests (about 20 min in all).
soak: setup
	$(PYTHON) benchmarks/soak.py --out $(OUT)
	$(PYTHON) -m pytest -q -m soak

# No `setup` first: a GPU machine has its own PyTorch build and often no network.
gpu-check:
	@if ls $(WHEELS)/*.whl >/dev/null 2>&1; then \
	    $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(WHEELS)/site $(WHEELS)/*.whl; fi
	PYTHONPATH="$(abspath $(WHEELS))/site$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) benchmarks/gpu_check.py \
	    --device $(DEVICE) --out $(OUT) $(if $(QUICK),--quick) $(if $(BUDGET),--budget $(BUDGET)) $(if $(ONLY),--only $(ONLY))
