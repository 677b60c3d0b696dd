#!/usr/bin/env bash
# GPU check of the rollout backends; exits non-zero when any check fails (each prints a JSON line with "ok").
#   1. hf backend on CUDA: the catch-up kernel is token-identical to the lockstep oracle (float64), with the
#      solo/word/step statistics and tokens/s of the hf engine;
#   2. the vLLM rollout service on CUDA (vLLM's CUDA build in .venv-vllm, `make vllm-env` picks it on a
#      machine with nvidia-smi): `tandem bench rollout --backend vllm --json` (log-probs against transformers
#      <= 0.1, weights synced after an optimizer step, tokens/s, decoded vs kept tokens) and the service tests
#      (tests/rollout/test_vllm_service.py: schedule rules, budget/EOS contract, sync-and-reset, restart);
#   3. a few training steps of the `tandem` arm through the real stages (prepare, base, train) on CUDA, once
#      with the hf rollout backend and once with vllm, each checked for the planned steps, a finite loss, a
#      senior token share near one half and an unchanged junior.
#
# Usage: scripts/gpu_check.sh [MODEL_DIR]   (default models/base; a random tiny Qwen3 when it is missing)
# GPU_CHECK_SKIP_TRAIN=1 skips part 3. PYTHON=... names the pipeline's Python (default .venv/bin/python).
set -uo pipefail
failed=0
fail() { echo "{\"check\": \"$1\", \"ok\": false}"; failed=1; }
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" - "${1:-models/base}" <<'PYEOF'
import json, sys, tempfile, time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU visible")

from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.rollout.bench import _prompts
from tandem.rollout.engine import SamplingParams, TandemEngine
from tandem.rollout.lockstep import lockstep_generate

model_dir = Path(sys.argv[1])
desc = str(model_dir)
if not (model_dir.is_dir() and any(model_dir.glob("*.safetensors"))):
    from tandem.rollout import toy
    tok = toy.byte_bpe_tokenizer(vocab_size=640)
    m = toy.tiny_qwen3(len(tok), seed=0, eos_token_id=tok.eos_token_id)
    model_dir = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "toy"
    m.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    desc = f"random tiny Qwen3 saved to {model_dir} ({desc} not found)"
tok = AutoTokenizer.from_pretrained(str(model_dir))
prompts = [p for p in _prompts(tok, 8, 0) for _ in range(8)]
sp = SamplingParams(temperature=1.0, max_new_tokens=128)
print(json.dumps({"model": desc, "rows": len(prompts), "max_new_tokens": sp.max_new_tokens,
                  "gpu": torch.cuda.get_device_name(0)}), flush=True)


def run(name, engine, schedule):
    engine.generate(prompts[:8], schedule, SamplingParams(max_new_tokens=8), seed=1)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    b = engine.generate(prompts, schedule, sp, seed=0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    st = b.stats()
    print(json.dumps({"backend": name, "schedule": schedule, "tok_s": st["tokens"] / dt, "seconds": dt,
                      **{k: st[k] for k in ("senior_fraction", "handoffs_per_100", "mean_run_length",
                                            "mean_length", "eos_fraction")}}), flush=True)
    return b, st["tokens"] / dt


# 1. hf backend on CUDA (float32 for speed; float64 for the identity check)
senior = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
junior = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
hf_eng = TandemEngine(senior, junior, tok)
hf = {s: run("hf", hf_eng, s) for s in ("solo", "word", "step")}
s64, j64 = senior.double(), junior.double()
eng64 = TandemEngine(s64, j64, tok)
few = prompts[::8]
fast = eng64.generate(few, "word", SamplingParams(max_new_tokens=64), seed=3)
with torch.no_grad():
    ref = lockstep_generate(s64, j64, eng64.tables, few, "word", SamplingParams(max_new_tokens=64), 3, eng64.eos_ids)
print(json.dumps({"check": "hf catch-up == lockstep (cuda, float64)",
                  "ok": fast.completion_ids == ref.completion_ids}), flush=True)
ok = fast.completion_ids == ref.completion_ids
print(json.dumps({"summary": {st: {"hf_tok_s": hf[st][1]} for st in hf},
                  "hf_tandem_over_solo": hf["word"][1] / hf["solo"][1]}), flush=True)
sys.exit(0 if ok else 1)
PYEOF
[ $? -eq 0 ] || fail "hf backend on CUDA"

# 2. the vLLM rollout service on CUDA
make vllm-env > /tmp/gpu-check-vllm-env.log 2>&1 || { tail -20 /tmp/gpu-check-vllm-env.log; fail "make vllm-env"; }
model_arg=()
[ -d "${1:-models/base}" ] && model_arg=(--model "${1:-models/base}")
"$PY" -m cli bench rollout --backend vllm --json "${model_arg[@]}" || fail "tandem bench rollout --backend vllm"
TANDEM_REQUIRE_VLLM=1 "$PY" -m pytest -q -p no:cacheprovider tests/rollout/test_vllm_service.py \
  || fail "vLLM rollout service tests on CUDA"

if [ "${GPU_CHECK_SKIP_TRAIN:-0}" = 1 ]; then exit $failed; fi
# Training on CUDA: the tiny test pipeline, tandem arm only, 3 GRPO steps, per rollout backend.
for backend in hf vllm; do
  root=$(mktemp -d)
  "$PY" - "$root" "$backend" <<'PYEOF'
import sys, yaml
root, backend = sys.argv[1], sys.argv[2]
p = yaml.safe_load(open("tests/flows/tiny_params.yaml"))
p["out_root"] = root
p["rollout"]["backend"] = backend
p["train"].update(arms=["tandem"], steps=3, save_every=3, prompts_per_step=4, group_size=4)
yaml.safe_dump(p, open(f"{root}/params.yaml", "w"), sort_keys=False)
PYEOF
  for stage in prepare base; do
    "$PY" -m cli stage "$stage" --params "$root/params.yaml" > "$root/$stage.log" 2>&1 || fail "$stage stage ($backend)"
  done
  t0=$(date +%s)
  "$PY" -m cli stage train --arm tandem --params "$root/params.yaml" > "$root/train.log" 2>&1 \
    || { tail -30 "$root/train.log"; fail "train tandem on CUDA ($backend)"; continue; }
  "$PY" - "$root" "$backend" "$(( $(date +%s) - t0 ))" <<'PYEOF'
import json, math, sys
root, backend, secs = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = json.load(open(f"{root}/metrics/train_tandem.json"))
ok = (m["steps"] == 3 and m["loss_finite"] and 0.3 < m["senior_fraction"] < 0.7
      and m["junior_hash_before"] == m["junior_hash_after"])
print(json.dumps({"check": f"train tandem on CUDA ({backend})", "steps": m["steps"], "loss_finite": m["loss_finite"],
                  "senior_fraction": m["senior_fraction"], "step_seconds": m["step_seconds"], "wall_s": secs,
                  "ok": ok}), flush=True)
sys.exit(0 if ok else 1)
PYEOF
  [ $? -eq 0 ] || failed=1
done
exit $failed
