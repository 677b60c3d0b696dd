"""The vLLM rollout service for real, with vLLM's CPU build from `.venv-vllm` (`make vllm-env`), on tiny models.

One service is started for the whole module (two tiny random Qwen3 models, head_dim 32, float32) and shared by
every test; the restart test runs last. Checks: owners follow the schedule rules, budget/EOS/stop ids follow
the hf engine's contract, no decoded token is discarded, log-probs equal the transformers model's, a weight
push reaches the engine (prefix cache reset), and a killed service is restarted by the next request.
Without `.venv-vllm` these tests skip, unless TANDEM_REQUIRE_VLLM=1 (`make test`), where they fail.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tandem.rollout import toy
from tandem.rollout.core import SamplingParams
from tandem.rollout.schedule import naive_authors
from tandem.rollout.vllm_client import DEFAULT_PYTHON, REPO_ROOT, VLLMEngine, VLLMService
from tandem.rollout.vocab import build_tables, token_texts

pytestmark = [pytest.mark.slow, pytest.mark.integration]

VLLM_PY = REPO_ROOT / DEFAULT_PYTHON


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


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not VLLM_PY.exists():
        msg = f"vLLM's environment is missing ({VLLM_PY}): run `make vllm-env`"
        if os.environ.get("TANDEM_REQUIRE_VLLM"):
            pytest.fail(msg)
        pytest.skip(msg)
    root = tmp_path_factory.mktemp("vllm")
    tok = toy.byte_bpe_tokenizer()
    dirs = {}
    for name, seed in (("senior", 1), ("junior", 2)):
        m = steer(toy.tiny_qwen3(len(tok), seed=seed, layers=2, hidden=128, heads=4, kv_heads=2,
                                 eos_token_id=tok.eos_token_id), tok)
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = root / name
    svc = VLLMService.start(dirs["senior"], dirs["junior"], dtype="float32", max_model_len=512,
                            log_path=root / "service.log")
    yield {"svc": svc, "tok": tok, "dirs": dirs, "root": root}
    svc.stop()


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logprobs(model, seq, start, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    lp = torch.log_softmax(logits / temperature, -1)
    return [float(lp[t - 1, seq[t]]) for t in range(start, len(seq))]


@pytest.mark.parametrize("schedule", ["word", "step", "token", "solo", "junior"])
def test_owners_follow_the_schedule_and_no_token_is_discarded(setup, schedule):
    tok, d = setup["tok"], setup["dirs"]
    eng = VLLMEngine(d["senior"], d["junior"], tok, setup["svc"])
    prompts = toy.prompts(tok, 8)
    rows = list(range(20, 28))
    b = eng.generate(prompts, schedule, SamplingParams(max_new_tokens=48), seed=5, row_ids=rows, max_gap_tokens=6,
                     max_rounds=4)
    texts = token_texts(tok, eng.vocab_size)
    for i, (ids, own) in enumerate(zip(b.completion_ids, b.owner)):
        want, by_rounds = naive_authors(schedule, ids, texts, 5, rows[i], 0.5, 6, 4)
        assert own == want[:len(ids)], f"row {i}: owners differ from the schedule's rules"
        assert b.finish_reason[i] != "rounds" or by_rounds
        assert all((lp != 0.0) == (o == 1) for lp, o in zip(b.senior_logprobs[i], own))
    assert eng.last_stats["decoded"] == eng.last_stats["kept"] == sum(map(len, b.completion_ids))
    n_sen = sum(map(sum, b.owner))
    if schedule in ("word", "token"):
        assert 0 < n_sen < eng.last_stats["kept"] and sum(b.handoffs) > 0
    if schedule == "step":
        assert sum(b.handoffs) > 0  # the steered models write blank lines
    assert (n_sen == 0) == (schedule == "junior")


def test_budget_eos_and_stop_ids_follow_the_engine_contract(setup):
    tok, d = setup["tok"], setup["dirs"]
    eng = VLLMEngine(d["senior"], d["junior"], tok, setup["svc"])
    prompts = toy.prompts(tok, 12)
    for sp in (SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=200)):
        b = eng.generate(prompts, "word", sp, seed=3)
        for ids, why in zip(b.completion_ids, b.finish_reason):
            assert 1 <= len(ids) <= sp.max_new_tokens
            assert why in ("eos", "length")
            assert (why == "length") == (len(ids) == sp.max_new_tokens and ids[-1] != tok.eos_token_id)
            assert (why == "eos") == (ids[-1] == tok.eos_token_id)
            assert tok.eos_token_id not in ids[:-1]
    assert "eos" in b.finish_reason  # the long budget lets rows end at EOS (kept, as in the hf engine)
    stop = tok.convert_tokens_to_ids("Ċ")
    b = eng.generate(prompts, "word", SamplingParams(max_new_tokens=200, stop_token_ids=(stop,)), seed=3)
    assert any(ids[-1] == stop for ids in b.completion_ids)
    assert all(stop not in ids[:-1] for ids in b.completion_ids)


def test_logprobs_match_the_transformers_model(setup):
    tok, d = setup["tok"], setup["dirs"]
    eng = VLLMEngine(d["senior"], d["junior"], tok, setup["svc"])
    senior, junior = _load(d["senior"]), _load(d["junior"])
    prompts = toy.prompts(tok, 4)
    b = eng.generate(prompts, "word", SamplingParams(max_new_tokens=32, temperature=0.7), seed=11)
    worst = 0.0
    for p, ids, own, lps in zip(prompts, b.completion_ids, b.owner, b.senior_logprobs):
        ref = _hf_logprobs(senior, p + ids, len(p), temperature=0.7)
        worst = max([worst] + [abs(a - r) for a, r, o in zip(lps, ref, own) if o == 1])
    assert worst < 1e-3, f"sampled senior log-probs differ from log_softmax(logits / T) by {worst}"
    seqs = [p + ids for p, ids in zip(prompts, b.completion_ids)]
    for role, model in (("senior", senior), ("junior", junior)):
        got = eng.score(seqs, [len(p) for p in prompts], role=role)
        for s, p, g in zip(seqs, prompts, got):
            ref = _hf_logprobs(model, s, len(p))
            assert max(abs(a - r) for a, r in zip(g, ref)) < 1e-3


def test_weight_push_reaches_the_engine_and_resets_the_prefix_cache(setup):
    tok, d = setup["tok"], setup["dirs"]
    senior = _load(d["senior"])
    eng = VLLMEngine(senior, d["junior"], tok, setup["svc"], live=True)
    prompts = [toy.prompts(tok, 1)[0] * 6]  # several full KV blocks (32 tokens on the CPU build) get cached
    assert len(prompts[0]) >= 96
    sp = SamplingParams(max_new_tokens=16)
    before = eng.generate(prompts, "solo", sp, seed=2)  # caches the prompt's blocks under the old weights
    old = _hf_logprobs(senior, prompts[0] + before.completion_ids[0], len(prompts[0]))
    assert max(abs(a - b) for a, b in zip(before.senior_logprobs[0], old)) < 1e-3
    with torch.no_grad():  # a "training update" (the shared embedding component moves the logits most)
        g = torch.Generator().manual_seed(0)
        E = senior.model.embed_tokens.weight
        E[:, 0] += torch.randn(E.shape[0], generator=g) * 0.1
        for n, p in senior.named_parameters():
            if "layers.0" in n and p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    eng.push_weights()
    after = eng.generate(prompts, "solo", sp, seed=2)
    seq = prompts[0] + after.completion_ids[0]
    new_ref = _hf_logprobs(senior, seq, len(prompts[0]))
    old_model = _load(d["senior"])
    old_ref = _hf_logprobs(old_model, seq, len(prompts[0]))
    assert max(abs(a - b) for a, b in zip(after.senior_logprobs[0], new_ref)) < 1e-3
    assert max(abs(a - b) for a, b in zip(after.senior_logprobs[0], old_ref)) > 1e-2
    # another client naming the saved directory gets the original weights back (one service, many users)
    eng_dir = VLLMEngine(d["senior"], d["junior"], tok, setup["svc"])
    again = eng_dir.generate(prompts, "solo", sp, seed=2)
    assert again.completion_ids == before.completion_ids
    assert max(abs(a - b) for a, b in zip(again.senior_logprobs[0], before.senior_logprobs[0])) < 1e-4


def test_tandem_engine_delegates_to_the_service(setup):
    from tandem.rollout.engine import TandemEngine

    tok, d = setup["tok"], setup["dirs"]
    eng = TandemEngine(d["senior"], d["junior"], tok, backend="vllm", vllm_options={"service": setup["svc"]})
    direct = VLLMEngine(d["senior"], d["junior"], tok, setup["svc"])
    prompts = toy.prompts(tok, 3)
    a = eng.generate(prompts, "word", SamplingParams(max_new_tokens=20), seed=8)
    b = direct.generate(prompts, "word", SamplingParams(max_new_tokens=20), seed=8)
    assert a.completion_ids == b.completion_ids and a.owner == b.owner


def test_a_killed_service_is_restarted_by_the_next_request(setup):
    tok, d, svc = setup["tok"], setup["dirs"], setup["svc"]
    senior = _load(d["senior"])
    eng = VLLMEngine(senior, d["junior"], tok, svc, live=True)  # live weights must come back after a restart
    prompts = toy.prompts(tok, 4)
    sp = SamplingParams(max_new_tokens=16)
    first = eng.generate(prompts, "word", sp, seed=4)
    os.killpg(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait()
    again = eng.generate(prompts, "word", sp, seed=4)
    assert svc.restarts == 1 and svc.alive()
    assert again.completion_ids == first.completion_ids and again.owner == first.owner
    assert svc.health()["senior"] == eng.senior_spec["tag"]
