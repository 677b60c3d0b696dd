"""The fake stages (tests/flows/fake_stages.py) inside the workers of a local Ray cluster: Ray runs `install` in every
worker process it starts (`worker_process_setup_hook`), which points the flow's stage lookup at the fakes and
records, for every stage call, where it ran (node, process, the GPUs Ray assigned, `CUDA_VISIBLE_DEVICES`) as one
JSON line in the file named by $TANDEM_TEST_RAY_LOG.

`install_service_arm` (and `service_modules` in the flow's process) swaps two fakes for a run whose rollout
engines are Ray actors: the base stage saves a tiny random Qwen3 with the project's tiny tokenizer, and a train arm
attaches to the service the flow started for it (`rollout.vllm_url`) with the trainer's own engine call
(`tandem.rollout.factory.rollout_engine`, live senior), rolls out, pushes changed weights as after an optimizer
step, rolls out again, and records the service's /health, its parent process and its engine cores' devices; the
arm named `grpo` then fails (`FAILING_ARM`: the flow must tear its service down all the same)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.flows import fake_stages

LOG_ENV = "TANDEM_TEST_RAY_LOG"
FAILING_ARM = "grpo"


def where() -> dict:
    """The Ray node and GPUs of the calling process (the driver has no GPUs of its own)."""
    import ray

    ctx = ray.get_runtime_context()
    return {"node": ctx.get_node_id(), "pid": os.getpid(), "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "group": os.environ.get("TANDEM_RUN_GROUP")}


class PlacedRecorder(fake_stages.Recorder):
    """A Recorder that also appends each call and where it ran to $TANDEM_TEST_RAY_LOG."""

    def hit(self, name: str) -> None:
        super().hit(name)
        with open(os.environ[LOG_ENV], "a") as f:
            f.write(json.dumps({"call": name, **where()}) + "\n")


def install() -> None:
    import flows.pipeline as fp

    fake_stages.ACTIVE = fake_stages.modules(PlacedRecorder())
    fp._stage = fake_stages.stage


def _record(entry: dict) -> None:
    with open(os.environ[LOG_ENV], "a") as f:
        f.write(json.dumps(entry) + "\n")


def _parent(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")))


def _engine_core_devices(service_pid: int) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` of each engine-core process of the service (vLLM titles them EngineCore)."""
    from tandem.rollout.vllm.lifecycle import group_members

    out = []
    for pid in group_members(service_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"EngineCore" in cmd:
            out += [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
    return sorted(out)


def service_modules(rec: fake_stages.Recorder) -> dict:
    """The fakes with a base that is a real tiny model and an arm that uses the flow's rollout service."""
    from tasks.common import Layout

    mods = fake_stages.modules(rec)

    def base_run(params, inputs, outputs):
        from tandem.rollout import toy

        rec.hit("base")
        tok = toy.byte_bpe_tokenizer()
        model = toy.tiny_qwen3(len(tok), 1, toy.TinyShape(layers=2, hidden=128, heads=4, kv_heads=2),
                               eos_token_id=tok.eos_token_id)
        base = Layout.of(params).base_model
        model.save_pretrained(base)
        tok.save_pretrained(base)
        return {"ok": True}

    def run_arm(params, arm, inputs, outputs):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tandem.rollout import toy
        from tandem.rollout.core import SamplingParams
        from tandem.rollout.factory import rollout_engine
        from tandem.rollout.vllm.client import shared_service
        from tasks.train import weight_roots

        rec.hit(f"train-{arm}")
        base = Layout.of(params).base_model.resolve()
        tok = AutoTokenizer.from_pretrained(base)
        senior = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        # the trainer's call (tandem.train.trainer, one process): attaches to rollout.vllm_url, pushes the senior
        engine = rollout_engine(senior, base, tok, params.rollout, live=True, roots=weight_roots(params, base))
        sp, prompts = SamplingParams(max_new_tokens=8), toy.prompts(tok, 2)
        before = toy.rollout(engine, prompts, "token", sp, seed=1)
        with torch.no_grad():  # an optimizer step's change, pushed as VLLMWeightSync does
            senior.model.embed_tokens.weight[:, 0] += 0.5
        pushed = engine.push_weights()
        after = toy.rollout(engine, prompts, "token", sp, seed=1)
        health = shared_service(params.rollout, base).health()
        _record({"call": f"service-{arm}", "url": params.rollout.vllm_url, "pid": health["pid"],
                 "parent": _parent(health["pid"]), "devices": health["devices"], "senior": health["senior"],
                 "pushed": pushed["tag"], "reloads": health["reloads"], "calls": health["calls"],
                 "engine_cores": _engine_core_devices(health["pid"]), "transport": engine._backend.transport,
                 "tokens": [sum(map(len, before.completion_ids)), sum(map(len, after.completion_ids))],
                 "logprobs_moved": before.senior_logprobs != after.senior_logprobs})
        if arm == FAILING_ARM:
            raise RuntimeError(f"fake failure in train-{arm}, its rollout service up")
        fake_stages._write(Layout.of(params).checkpoints / arm / "step-2" / "w.txt", arm)
        return {"arm": arm}

    mods["base"].run = base_run
    mods["train"].run_arm = run_arm
    return mods


def install_service_arm() -> None:
    import flows.pipeline as fp

    fake_stages.ACTIVE = service_modules(PlacedRecorder())
    fp._stage = fake_stages.stage
