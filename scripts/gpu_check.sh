#!/usr/bin/env bash
# The one GPU check; exits non-zero when any check fails (each prints a JSON line with "ok").
#   0. the memory plan: `tandem plan` of params.paper.yaml (table, then the one JSON line), and the plan's
#      training-phase figure against the peak CUDA memory of one real bf16-autocast step of a mid-sized Qwen3
#      (tests/memory_probe.py), with and without gradient checkpointing (ok within 25%);
#   1. hf backend on CUDA: the catch-up kernel is token-identical to the lockstep oracle (float64), with the
#      solo/word/step statistics and tokens/s of the hf engine;
#   2. the vLLM rollout service on CUDA (vLLM's CUDA build in .venv-vllm, `make vllm-env` picks it on a
#      machine with nvidia-smi): `tandem bench rollout --backend vllm --json` (log-probs against transformers
#      <= 0.1, weights synced after an optimizer step, tandem_over_solo, the counters, the predicted GPU ratio),
#      the same with `--vocab qwen3` (Qwen3's vocabulary, 128 rows of replayed real text at 3,000 tokens:
#      tandem_over_solo with the layout and vllm_gpu_memory), the service tests
#      (tests/rollout/test_vllm_service.py, test_vllm_lifecycle.py), and the layouts (scripts/gpu_check_layouts.py:
#      each engine on the GPU it was placed on; with >= 2 GPUs one service call per step, dedicated layout);
#   3. a few training steps of the `tandem` arm through the real stages (prepare, base, train) on CUDA, once
#      with the hf rollout backend and once with vllm, each checked for the planned steps, a finite loss, a
#      senior token share near one half and an unchanged junior;
#   4. a 2-process training run (train.num_processes 2, two updates per rollout batch) through the same stage,
#      which launches accelerate: on >= 2 GPUs once with DDP and once with FSDP; on one GPU the two processes
#      run on the CPU (gloo), because NCCL refuses two ranks on one GPU. Each is checked for world_size 2, the
#      planned steps, a finite loss and a loadable final checkpoint.
# The vLLM backend and the CUDA training path stay "unverified" in the docs until this script has passed.
#
# Usage: scripts/gpu_check.sh [MODEL_DIR]   (default models/base; a random tiny Qwen3 when it is missing)
# GPU_CHECK_SKIP_TRAIN=1 skips part 3. PYTHON=... names the pipeline's Python (default .venv/bin/python).
set -uo pipefail
failed=0
fail() { echo "{\"check\": \"$1\", \"ok\": false}"; failed=1; }
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -m cli plan --params params.paper.yaml || true   # exit 1 means "does not fit": the JSON line says so too
"$PY" -m cli plan --params params.paper.yaml --json | tee /dev/stderr | grep -q '"fits": true' || fail "paper plan fits"
for ckpt in 0 1; do
  "$PY" - "$ckpt" <<'PYEOF'
import json, subprocess, sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU visible")
from tandem.config import params_from_dict
from tandem.plan import model_shape, plan_train_arm
ckpt = sys.argv[1] == "1"
H, L, heads, kv, I, V, rows, prompt, completion = 1024, 8, 16, 8, 2816, 32768, 4, 256, 768
p = params_from_dict({"model": {"source": "tiny", "hidden_size": H, "num_layers": L, "num_heads": heads,
                                "num_kv_heads": kv, "intermediate_size": I, "vocab_size": V, "max_position": 2048},
                      "train": {"arms": ["grpo"], "prompts_per_step": 1, "group_size": rows, "micro_batch_size": rows,
                                "max_prompt_tokens": prompt, "max_new_tokens": completion,
                                "gradient_checkpointing": ckpt, "precision": "bf16_mixed"}})
plan = plan_train_arm(p, "grpo", model_shape(p), device="cuda")
out = subprocess.run([sys.executable, "tests/memory_probe.py", *map(str, (H, L, heads, kv, I, V, rows, prompt,
                      completion, int(ckpt))), "cuda"], capture_output=True, text=True, check=True)
measured = json.loads(out.stdout.strip().splitlines()[-1])["step_peak_bytes"]
ratio = plan.training_phase_bytes / measured
print(json.dumps({"check": f"memory plan vs measured CUDA step (bf16 autocast, checkpointing={ckpt})",
                  "plan_mib": plan.training_phase_bytes / 2**20, "measured_mib": measured / 2**20,
                  "ratio": ratio, "ok": 0.75 <= ratio <= 1.25}), flush=True)
sys.exit(0 if 0.75 <= ratio <= 1.25 else 1)
PYEOF
  [ $? -eq 0 ] || failed=1
done
"$PY" - "${1:-models/base}" <<'PYEOF'
import json, sys, tempfile, time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU visible")

from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.rollout import _prompts  # the working directory (the checkout) is on the path
from tandem.rollout.engine import RolloutSettings, SamplingParams, ScheduleSpec, TandemEngine
from tandem.rollout.lockstep import lockstep_generate
from tandem.rollout.toy import rollout

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
    rollout(engine, prompts[:8], schedule, SamplingParams(max_new_tokens=8), seed=1)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    b = rollout(engine, prompts, schedule, sp, seed=0)
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
fast = rollout(eng64, few, "word", SamplingParams(max_new_tokens=64), seed=3)
with torch.no_grad():
    ref = lockstep_generate(eng64.pair, RolloutSettings(ScheduleSpec("word"), SamplingParams(max_new_tokens=64)).request(few, 3))
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
# one summary line per bench: the measured ratio beside the layout, vllm_gpu_memory and the cost model's prediction
summary() { "$PY" -c 'import json, sys
r = json.loads(sys.stdin.readlines()[-1])
keys = ("vocab", "rows", "max_new_tokens", "tandem_over_solo", "stream_tandem_over_solo", "layout", "vllm_gpu_memory",
        "predicted_gpu_tandem_over_solo", "chunks_per_token", "computed_per_token", "handoff_latency_steps_p50",
        "handoff_latency_steps_p90", "idle_row_step_fraction", "logprob_max_abs_diff", "weights_synced",
        "isolated_sched_cpu_long_over_short_senior", "isolated_sched_cpu_long_over_short_junior",
        "isolated_sched_cpu_qwen3_over_small_vocab_senior", "isolated_sched_cpu_qwen3_over_small_vocab_junior",
        "isolated_sched_cpu_per_row_tandem_over_solo_senior", "isolated_sched_cpu_per_row_tandem_over_solo_junior")
print(json.dumps({"check": "vllm bench summary", **{k: r.get(k) for k in keys}}))'; }
"$PY" -m cli bench rollout --backend vllm --json "${model_arg[@]}" > /tmp/gpu-check-bench-vllm.json \
  || fail "tandem bench rollout --backend vllm"
cat /tmp/gpu-check-bench-vllm.json; summary < /tmp/gpu-check-bench-vllm.json
# Qwen3's real vocabulary on replayed real text at full length (3,000 tokens): tandem_over_solo measured on the
# GPU beside the cost model's prediction, with the layout and vllm_gpu_memory in the same JSON line
"$PY" -m cli bench rollout --backend vllm --json --vocab qwen3 --prompts 16 --samples 8 --repeats 1 \
  > /tmp/gpu-check-bench-qwen3.json || fail "tandem bench rollout --backend vllm --vocab qwen3"
cat /tmp/gpu-check-bench-qwen3.json; summary < /tmp/gpu-check-bench-qwen3.json
TANDEM_REQUIRE_VLLM=1 "$PY" -m pytest -q -p no:cacheprovider tests/rollout/test_vllm_service.py tests/rollout/test_vllm_lifecycle.py \
  || fail "vLLM rollout service tests on CUDA"
# the layouts on the GPUs: each engine on its own GPU (nvidia-smi shows each engine core where it was placed),
# and with two or more GPUs one service call per training step in the dedicated layout (scripts/gpu_check_layouts.py)
"$PY" scripts/gpu_check_layouts.py || fail "vLLM layouts on CUDA (placement, one call per step)"

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

# Two training processes through the stage's own `accelerate launch` (DDP, then FSDP when there are 2 GPUs).
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -ge 2 ]; then runs="none fsdp"; dev=""; else runs="none"; dev="cpu"; fi
root=$(mktemp -d)
for sharding in $runs; do
  "$PY" - "$root" "$sharding" <<'PYEOF'
import sys, yaml
root, sharding = sys.argv[1], sys.argv[2]
p = yaml.safe_load(open("tests/flows/tiny_params.yaml"))
p["out_root"] = root
p["rollout"]["backend"] = "hf"
p["train"].update(arms=["tandem"], steps=2, save_every=2, prompts_per_step=4, group_size=4, num_processes=2,
                  updates_per_batch=2, micro_batch_size=2, sharding=sharding)
yaml.safe_dump(p, open(f"{root}/params_mp.yaml", "w"), sort_keys=False)
PYEOF
  label="train tandem, 2 processes, sharding $sharding${dev:+, on the CPU (one GPU only)}"
  for stage in prepare base; do
    "$PY" -m cli stage "$stage" --params "$root/params_mp.yaml" > "$root/$stage.log" 2>&1 || fail "$stage stage (2 processes)"
  done
  if ! ( [ "$dev" = cpu ] && export CUDA_VISIBLE_DEVICES=""; \
         "$PY" -m cli stage train --arm tandem --params "$root/params_mp.yaml" > "$root/train_mp_$sharding.log" 2>&1 ); then
    tail -40 "$root/train_mp_$sharding.log"; fail "$label"; continue
  fi
  "$PY" - "$root" "$label" <<'PYEOF'
import json, sys
from tandem.models import load_model
root, label = sys.argv[1], sys.argv[2]
m = json.load(open(f"{root}/metrics/train_tandem.json"))
load_model(f"{root}/models/checkpoints/tandem/step-2")  # complete and loadable
ok = m["world_size"] == 2 and m["steps"] == 2 and m["loss_finite"] and m["junior_unchanged"]
print(json.dumps({"check": label, "world_size": m["world_size"], "distributed": m.get("distributed"),
                  "steps": m["steps"], "loss_finite": m["loss_finite"], "step_seconds": m["step_seconds"],
                  "ok": ok}), flush=True)
sys.exit(0 if ok else 1)
PYEOF
  [ $? -eq 0 ] || failed=1
done
exit $failed
