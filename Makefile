# dl4py: set-up, demo and tests. `make demo` trains the seed's LeNet on MNIST;
# `make test` runs the test suite. Both install what they need first.
PYTHON ?= python3
# PyTorch pin for a fresh machine; GPU users with their own build: make test TORCH=
TORCH ?= torch==2.13.0
# Use the MNIST files beside the repository when they are there (no download).
ifneq ($(wildcard ../shared/data/mnist),)
export DL4PY_DATA ?= $(abspath ../shared/data)
endif

.PHONY: setup demo demo-parallel test bench

setup:
	$(if $(TORCH),$(PYTHON) -m pip install -q "$(TORCH)")
	$(PYTHON) -m pip install -q -e ".[test]"

demo: setup
	$(PYTHON) -m dl4py train examples/lenet_mnist.yaml

test: setup
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) -m dl4py bench all
