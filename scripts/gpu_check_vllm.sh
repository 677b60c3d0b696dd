#!/usr/bin/env bash
# The vLLM GPU check for a user's own GPU, in one command: stock vLLM solo (vLLM's defaults, asynchronous
# scheduling on as CUDA has it) against the tandem rollout service on a random Qwen3-4B-shaped model (bf16, Qwen3's
# vocabulary, replayed real text), 128 resident rows x 3,000 new tokens: tokens/s, tandem over solo, engine steps
# per generated token per engine, chunks and computed tokens per token, rows resident, with the tandem service's
# asynchronous scheduling off (production) and on. benchmarks/vllm_gpu.py does the work and says what each figure
# is; this script makes vLLM's environment, runs it and prints its table (docs/gpu/vllm-<gpu>.md, beside the JSON
# record vllm-<gpu>.json).
#
# Needs: a CUDA GPU that vLLM 0.32 runs on, with room for two Qwen3-4B engines of 128 rows x ~3,100 tokens on the
#   one device the service uses: ~64 GiB each (7.5 GiB bf16 weights, 54.6 GiB KV, 1.5 GiB runtime), ~0.47 of an
#   H200 per engine, ~135 GiB in all. On a smaller GPU (an 80 GB H100: ~68 rows resident at 0.48 per engine) the
#   rows beyond run in admission waves and the record says how many were live at once (or pass --rows 64).
#   The pipeline's environment (.venv: `make setup`), vLLM's CUDA build (.venv-vllm: `make vllm-env`, run here;
#   it downloads vLLM the first time), ~10 GB free in $TMPDIR for the random weights (removed at the end) and
#   ~16 GB of RAM to build them.
# Takes: about 20-30 minutes on an H200 (building the 8 GB model, three engine starts with torch.compile and CUDA
#   graphs, about a minute of stock solo decode, a few minutes per tandem run).
#
# Usage: scripts/gpu_check_vllm.sh [benchmarks/vllm_gpu.py flags: --out DIR, --rows N, --tokens N, --gpu-memory
#   SHARE, --eager, --repeats N, --dry]; --dry is the tiny run on vLLM's CPU build (~5 minutes, no GPU; what
#   tests/rollout/test_vllm_gpu_check.py runs). PYTHON=... names the pipeline's Python (default .venv/bin/python).
# Exit status: the benchmark's (0: every run measured, every row complete and resident; 1: not; 2: no GPU).
#
# A script of its own rather than a part of scripts/gpu_check.sh: that check runs every CUDA path of the project
# (plan, hf engine, tiny vLLM benches, training) and passes on any GPU; this one needs the whole of a large GPU for
# half an hour, for one figure a user with such a GPU can produce alone.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
log=$(mktemp -t gpu-check-vllm-env.XXXXXX.log)
# vLLM's environment: made when missing, and remade when it is the other build (make's stamp names the device)
make vllm-env > "$log" 2>&1 || { tail -20 "$log"; echo "gpu_check_vllm: make vllm-env failed (log: $log)" >&2; exit 1; }
line=$("$PY" benchmarks/vllm_gpu.py "$@" | tail -n 1)
rc=${PIPESTATUS[0]}
md=$(printf '%s' "$line" | "$PY" -c 'import json, sys
try:
    print(json.loads(sys.stdin.read())["files"]["md"])
except Exception:
    pass')
if [ -n "$md" ] && [ -f "$md" ]; then
  cat "$md"
  echo "gpu_check_vllm: the record is ${md%.md}.json (exit $rc)"
else
  echo "gpu_check_vllm: benchmarks/vllm_gpu.py wrote no record (exit $rc)" >&2
fi
exit "$rc"
