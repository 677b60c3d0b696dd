"""Helpers of the vLLM service tests: the environment check, a script run in vLLM's environment, two steered tiny
models saved to directories, and the shared memory a process group maps."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tandem.rollout import toy
from tandem.rollout.vllm.client import DEFAULT_PYTHON, REPO_ROOT

VLLM_PY = REPO_ROOT / DEFAULT_PYTHON


def need_vllm() -> None:
    if not VLLM_PY.exists():
        msg = f"vLLM's environment is missing ({VLLM_PY}): run `make vllm-env`"
        if os.environ.get("TANDEM_REQUIRE_VLLM"):
            pytest.fail(msg)
        pytest.skip(msg)


def run_in_vllm(script: str, timeout: int = 600) -> None:
    """Run `script` with vLLM's interpreter (the repository on its path); it must exit 0 and print "ok" last."""
    need_vllm()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    r = subprocess.run([str(VLLM_PY), "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                       cwd=str(REPO_ROOT))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def steer(model, tok, newline: float = 0.6, eos: float = 0.1, shared: float = 50.0, shrink: float = 0.2):
    """Make a random tiny model write newlines and EOS often enough for step handoffs and EOS to happen: a large
    embedding component shared by every token dominates the last hidden state, so with tied embeddings a
    token's extra value on it acts as a logit bias (the rest of the embedding is shrunk toward uniform)."""
    nl, e = tok.convert_tokens_to_ids("Ċ"), tok.eos_token_id
    with torch.no_grad():
        E = model.model.embed_tokens.weight
        E[:, 1:] *= shrink
        E[:, 0] = shared
        E[nl, 0] = shared + newline
        E[e, 0] = shared + eos
    return model


def tiny_dirs(root, tok) -> dict:
    dirs = {}
    for name, seed in (("senior", 1), ("junior", 2)):
        m = steer(toy.tiny_qwen3(len(tok), seed, toy.TinyShape(layers=2, hidden=128, heads=4, kv_heads=2),
                                 eos_token_id=tok.eos_token_id), tok)
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def shm_mapped_by(pids) -> set:
    """The /dev/shm files (`psm_*`: Python shared memory, vLLM's message queues) that these processes map."""
    out = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        out |= {Path(ln.split()[-1]) for ln in maps.splitlines() if "/dev/shm/psm_" in ln}
    return out
