# dl4py: set-up, demo and tests. `make demo` trains the seed's LeNet on MNIST (installing dl4py's
# core only); `make test` runs the test suite (installing the test extra and, as root, Chromium).
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

.PHONY: setup demo demo-run test test-quick bench soak gpu-check browser

setup:
	$(if $(TORCH),$(PYTHON) -m pip install -q "$(TORCH)")
	$(PYTHON) -m pip install -q -e ".[test]"

# The demo needs only dl4py's core (torch, numpy, pyyaml, safetensors, tqdm), not the test extra.
# Where the current Python refuses packages (PEP 668: Debian's, Ubuntu's), it goes into a venv
# made here (.venv-demo), which later runs reuse.
DEMO_VENV ?= .venv-demo
demo:
	@if $(PYTHON) -c 'import sys, sysconfig, pathlib; sys.exit(0 if sys.prefix == sys.base_prefix and (pathlib.Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").exists() else 1)'; then \
	    echo "make demo: this Python is externally managed: installing into $(DEMO_VENV)"; \
	    test -x $(DEMO_VENV)/bin/python || $(PYTHON) -m venv $(DEMO_VENV); \
	    $(MAKE) --no-print-directory demo-run PYTHON=$(abspath $(DEMO_VENV))/bin/python; \
	else $(MAKE) --no-print-directory demo-run; fi

demo-run:
	$(if $(TORCH),$(PYTHON) -m pip install -q "$(TORCH)")
	$(PYTHON) -m pip install -q -e .
	$(PYTHON) -m dl4py train examples/lenet_mnist.yaml

# Chromium for the browser tests (dl4py ui, dl4py report), from the OS's packages: installed
# where this runs as root with apt-get; elsewhere those tests are skipped, saying how to run them.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make browser: installing Chromium (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	        chromium fonts-liberation >/dev/null; \
	else echo "make browser: no Chromium, and not root with apt-get: the browser tests will be skipped" \
	    "(as root: make browser)"; fi

# The long soak tests (pytest -m soak) run with make soak.
test: setup browser
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
