#!/usr/bin/env bash
# Serve one model directory (a promoted checkpoint, the base, or a hub id) with vLLM's OpenAI-compatible
# server, from vLLM's own virtual environment: vLLM pins torch/transformers/fastapi differently from the
# pipeline's environment (prefect 3.9 needs fastapi >= 0.139), so the two never share one.
#
#   infra/vllm/serve.sh models/checkpoints/tandem/step-120 8000            # one GPU
#   VLLM_TP=4 infra/vllm/serve.sh Qwen/Qwen3-4B-Instruct-2507 8001         # tensor parallel over 4 GPUs
#
# The senior and the junior (the frozen base) run as two servers on two ports; prefix caching makes the
# catch-up prefill of the shared history at each handoff cheap. Health: GET http://HOST:PORT/health.
# It listens on 127.0.0.1 only; VLLM_HOST=0.0.0.0 exposes it to the network (put authentication in front).
set -euo pipefail

MODEL=${1:?usage: serve.sh MODEL_DIR_OR_HUB_ID [PORT] [extra vllm serve args...]}
PORT=${2:-8000}
shift $(( $# >= 2 ? 2 : 1 ))
VENV=${VLLM_VENV:-/opt/vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}   # the version the rollout service is built and tested with (Makefile: vllm-env)

if [ ! -x "$VENV/bin/vllm" ]; then
  echo "creating $VENV with vllm==$VLLM_VERSION" >&2
  python3.11 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "vllm==$VLLM_VERSION"
fi

exec "$VENV/bin/vllm" serve "$MODEL" \
  --host "${VLLM_HOST:-127.0.0.1}" --port "$PORT" \
  --dtype "${VLLM_DTYPE:-bfloat16}" \
  --max-model-len "${VLLM_MAX_LEN:-4096}" \
  --gpu-memory-utilization "${VLLM_GPU_UTIL:-0.85}" \
  --tensor-parallel-size "${VLLM_TP:-1}" \
  --enable-prefix-caching \
  --generation-config vllm \
  --served-model-name "$(basename "$MODEL")" \
  "$@"
