"""Measure the peak memory one GRPO-style training step adds (run in a fresh process by tests/test_plan.py on a
CPU, and by scripts/gpu_check.sh on a GPU).

The step is trl's real loss path: a Qwen3 with trl's fused LM head (`add_fused_lm_head`: log-probs in tiles,
never the full logits), a clipped-ratio loss on completion tokens of a right-padded micro-batch, backward,
gradient clipping and an AdamW step. A first step allocates AdamW's state; the second is measured: the
process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) minus its resident set just
before it. Run with MALLOC_MMAP_THRESHOLD_ set low so that freed tensors go back to the OS (glibc would
otherwise keep them and the second step would reuse them unseen). With DEVICE cuda the step runs as
`train.precision: bf16_mixed` does (fp32 weights, bf16 autocast over the forward and the loss) and the
measure is torch's peak allocated CUDA memory minus the allocation before the step. Prints one JSON line.

Usage: python tests/memory_probe.py HIDDEN LAYERS HEADS KV_HEADS INTERMEDIATE VOCAB ROWS PROMPT COMPLETION CKPT
       [DEVICE]   (DEVICE: cpu, the default, or cuda)
"""

from __future__ import annotations

import gc
import json
import re
import sys


def _status(key: str) -> int:
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def main(argv: list[str]) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    H, L, heads, kv, I, V, rows, prompt, completion, ckpt = map(int, argv[:10])
    device = argv[10] if len(argv) > 10 else "cpu"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=H // heads,
                      max_position_embeddings=prompt + completion, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).to(device).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    T = prompt + completion
    ids_BT = torch.randint(0, V, (rows, T)).to(device)
    attn_BT = torch.ones(rows, T, dtype=torch.long, device=device)
    attn_BT[0, T - completion // 2:] = 0  # one shorter completion: a padded batch, as in training
    labels_BT = ids_BT.masked_fill(attn_BT == 0, -100)
    labels_BT[:, :prompt] = -100
    adv_B = torch.randn(rows).to(device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model(input_ids=ids_BT, attention_mask=attn_BT, labels=labels_BT, fused_lm_head=True)
            logp_BT = out.log_probs[:, -completion:]
            mask_BT = (labels_BT[:, 1:][:, -completion:] != -100).float()
            ratio_BT = torch.exp(logp_BT - logp_BT.detach())
            clipped_BT = torch.clamp(ratio_BT, 0.8, 1.2)
            per_tok_BT = -torch.min(ratio_BT * adv_B[:, None], clipped_BT * adv_B[:, None])
            loss = (per_tok_BT * mask_BT).sum() / mask_BT.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # allocates AdamW's moments; the measured step is the steady state
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        base = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        step()
        peak = _status("VmHWM")
    print(json.dumps({"step_peak_bytes": peak - base, "base_bytes": base, "device": device,
                      "n_params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main(sys.argv[1:])
