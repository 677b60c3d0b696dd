"""The vLLM rollout service for real, with vLLM's CPU build from `.venv-vllm` (`make vllm-env`), on tiny models.

One service is started for the whole module (two tiny random Qwen3 models, head_dim 32, float32, a KV cache of
48 blocks of 32 tokens per engine, so that the memory-pressure test really runs short of it) and shared by
every test; the restart test runs last. It is the benchmark's service (`benchmarks/vllm_ab_service.py`: the
production service, whose rows go through `DirectSession` unless a request names another way), so that the
ways the benchmark compares can be checked to make the same rollout. Checks: owners follow the schedule rules for every schedule, one chunk
per authorship run (switch stops = handoffs, decoded = kept), budget/EOS/stop ids and the gap cap as in the hf
engine, log-probs equal the transformers model's (< 1e-3), replay from the seed independent of the batch
split, a rollout needing more KV than the engines hold finishes with the same tokens, a resumed session is
not re-seeded, a weight push reaches the engine (prefix cache reset asserted), the service refuses requests
without its secret or with a foreign Host, and a service killed alone (`kill -9` of its pid) takes its engines with it
and is restarted by the next request, its shared memory released and its inbox removed.
Without `.venv-vllm` these tests skip, unless TANDEM_REQUIRE_VLLM=1 (`make test`), where they fail.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time

import pytest
import torch

from tandem.rollout import toy
from tandem.rollout.core import SamplingParams
from tandem.rollout.engine import TandemEngine
from tandem.rollout.schedule import naive_authors
from tandem.rollout.toy import rollout
from tandem.rollout.vllm import lifecycle
from tandem.rollout.vllm.client import LaunchOptions, VLLMService
from tandem.rollout.vllm.knobs import EngineKnobs
from tandem.rollout.vocab import token_texts
from vllm_fixtures import need_vllm, shm_mapped_by, tiny_dirs

pytestmark = [pytest.mark.slow, pytest.mark.integration]

KV_BLOCKS = 48
STEP_TOKENS = 64  # per engine step: prompts are split over steps (chunked prefill) with seeded rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    need_vllm()
    root = tmp_path_factory.mktemp("vllm")
    tok = toy.byte_bpe_tokenizer()
    dirs = tiny_dirs(root, tok)
    svc = VLLMService.start(dirs["senior"], dirs["junior"], roots=[root], options=LaunchOptions(
        knobs=EngineKnobs(dtype="float32", max_model_len=512, kv_blocks=KV_BLOCKS, max_num_batched_tokens=STEP_TOKENS,
                          max_num_seqs=STEP_TOKENS),
        log_path=root / "service.log",
        start_timeout=1500, service="benchmarks.vllm_ab_service"))
    yield {"svc": svc, "tok": tok, "dirs": dirs, "root": root}
    svc.stop()


def engine(setup, senior=None, junior=None, **kw) -> TandemEngine:
    d = setup["dirs"]
    return TandemEngine(senior if senior is not None else d["senior"], junior if junior is not None else d["junior"],
                        setup["tok"], backend="vllm", vllm_options={"service": setup["svc"], **kw})


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logprobs(model, seq, start, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    lp = torch.log_softmax(logits / temperature, -1)
    return [float(lp[t - 1, seq[t]]) for t in range(start, len(seq))]


@pytest.mark.parametrize("schedule", ["word", "step", "token", "solo", "junior"])
def test_owners_follow_the_schedule_and_each_run_is_one_chunk(setup, schedule):
    tok = setup["tok"]
    eng = engine(setup)
    prompts = toy.prompts(tok, 8)
    rows = list(range(20, 28))
    b = rollout(eng, prompts, schedule, SamplingParams(max_new_tokens=48), seed=5, row_ids=rows, max_gap_tokens=6,
                max_rounds=4)
    texts = token_texts(tok, eng.vocab_size)
    for i, (ids, own) in enumerate(zip(b.completion_ids, b.owner)):
        want, by_rounds = naive_authors(schedule, ids, texts, 5, rows[i], 0.5, 6, 4)
        assert own == want[:len(ids)], f"row {i}: owners differ from the schedule's rules"
        assert b.finish_reason[i] != "rounds" or by_rounds
        assert all((lp != 0.0) == (o == 1) for lp, o in zip(b.senior_logprobs[i], own))
    st = eng._backend.last_stats
    kept = sum(map(len, b.completion_ids))
    assert st["decoded"] == st["kept"] == kept  # nothing decoded past a switch
    assert st["chunks"] == sum(h + 1 for h in b.handoffs)  # one chunk per authorship run
    switches = st["engines"]["senior"]["switch_stops"] + st["engines"]["junior"]["switch_stops"]
    assert switches == sum(b.handoffs)  # every switch stop is a handoff, and back
    eng_st = st["engines"].values()
    assert sum(e["sent_outputs"] for e in eng_st) == st["chunks"]  # one engine-core output per chunk
    assert sum(e["sent_outputs"] + e["held_outputs"] for e in eng_st) == kept  # the others were held back
    # every chunk went in a batched submission, a message carrying one or more, its encode and send counted
    assert st["submit_requests"] == st["chunks"] and 0 < st["submit_messages"] <= st["chunks"]
    assert st["submit_cpu_seconds"] > 0
    # and every chunk came back on the chunk returns, a message carrying one or more; a switch came with the
    # engine core's schedule state, so the frontend walked only each row's last chunk
    assert st["return_chunks"] == st["chunks"] and 0 < st["return_messages"] <= st["chunks"]
    assert st["walked_chunks"] == len(rows)
    assert st["return_cpu_seconds"] > 0
    n_sen = sum(map(sum, b.owner))
    if schedule in ("word", "token"):
        assert 0 < n_sen < kept and sum(b.handoffs) > 0
    if schedule == "step":
        assert sum(b.handoffs) > 0  # the steered models write blank lines
    assert (n_sen == 0) == (schedule == "junior")


def test_budget_eos_stop_ids_and_gap_follow_the_engine_contract(setup):
    tok = setup["tok"]
    eng = engine(setup)
    prompts = toy.prompts(tok, 12)
    for sp in (SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=200)):
        b = rollout(eng, prompts, "word", sp, seed=3, max_gap_tokens=32)
        texts = token_texts(tok, eng.vocab_size)
        for i, (ids, why) in enumerate(zip(b.completion_ids, b.finish_reason)):
            assert 1 <= len(ids) <= sp.max_new_tokens
            assert why in ("eos", "length")
            assert (why == "length") == (len(ids) == sp.max_new_tokens and ids[-1] != tok.eos_token_id)
            assert (why == "eos") == (ids[-1] == tok.eos_token_id)
            assert tok.eos_token_id not in ids[:-1]
            assert b.owner[i] == naive_authors("word", ids, texts, 3, i, 0.5, 32, 150)[0]
    assert "eos" in b.finish_reason  # the long budget lets rows end at EOS (kept, as in the hf engine)
    stop = tok.convert_tokens_to_ids("Ċ")
    b = rollout(eng, prompts, "word", SamplingParams(max_new_tokens=200, stop_token_ids=(stop,)), seed=3)
    assert any(ids[-1] == stop for ids in b.completion_ids)
    assert all(stop not in ids[:-1] for ids in b.completion_ids)


def test_logprobs_match_the_transformers_model(setup):
    tok, d = setup["tok"], setup["dirs"]
    eng = engine(setup)
    senior, junior = _load(d["senior"]), _load(d["junior"])
    prompts = toy.prompts(tok, 4)
    b = rollout(eng, prompts, "word", SamplingParams(max_new_tokens=32, temperature=0.7), seed=11)
    worst = 0.0
    for p, ids, own, lps in zip(prompts, b.completion_ids, b.owner, b.senior_logprobs):
        ref = _hf_logprobs(senior, p + ids, len(p), temperature=0.7)
        worst = max([worst] + [abs(a - r) for a, r, o in zip(lps, ref, own) if o == 1])
    assert worst < 1e-3, f"sampled senior log-probs differ from log_softmax(logits / T) by {worst}"
    seqs = [p + ids for p, ids in zip(prompts, b.completion_ids)]
    for role, model in (("senior", senior), ("junior", junior)):
        got = eng._backend.score(seqs, [len(p) for p in prompts], role=role)
        for s, p, g in zip(seqs, prompts, got):
            ref = _hf_logprobs(model, s, len(p))
            assert max(abs(a - r) for a, r in zip(g, ref)) < 1e-3


def test_replay_is_exact_and_independent_of_the_batch_split_and_of_kv_pressure(setup):
    """24 rows of up to 120 tokens need about twice the KV the engines hold (48 blocks of 32 tokens each):
    the service admits as many rows as fit and the rest wait, with the tokens of the same rows generated in
    calls of 6 rows (each fits), i.e. a replay independent of the split. The prompts of either call exceed one
    step's token budget (`STEP_TOKENS`), so some are split over steps, differently in the two: a split prefill
    must not move a seeded row's random stream (on the CPU build `worker.install_cpu_generator_rewind`)."""
    tok = setup["tok"]
    eng = engine(setup)
    prompts = toy.prompts(tok, 24)
    rows = list(range(40, 64))
    sp = SamplingParams(max_new_tokens=120)
    assert min(sum(map(len, prompts[i:i + 6])) for i in range(0, 24, 6)) > 2 * STEP_TOKENS
    need = sum(-(-(len(p) + 120) // 32) for p in prompts)
    assert need > 1.6 * KV_BLOCKS  # the engines hold at most ~60% of the rows at their full length
    full = rollout(eng, prompts, "word", sp, seed=7, row_ids=rows)
    assert eng._backend.last_stats["max_live_rows"] < len(rows)
    parts = [rollout(eng, prompts[i:i + 6], "word", sp, seed=7, row_ids=rows[i:i + 6]) for i in range(0, 24, 6)]
    assert [c for p in parts for c in p.completion_ids] == full.completion_ids
    assert [o for p in parts for o in p.owner] == full.owner
    other = rollout(eng, prompts[:6], "word", sp, seed=8, row_ids=rows[:6])  # the seed matters
    assert other.completion_ids != full.completion_ids[:6]
    # the sessions driven through the engine-core client and through AsyncLLM.generate make the same rollout
    from tandem.rollout.request import RolloutSettings
    from tandem.rollout.schedule import ScheduleSpec

    req = RolloutSettings(ScheduleSpec("word"), sp).request(prompts[:6], 7, rows[:6])
    stream = eng._backend._generate(req, {"sessions": "stream"})
    assert stream.completion_ids == full.completion_ids[:6] and stream.owner == full.owner[:6]
    assert max(abs(a - b) for x, y in zip(stream.senior_logprobs, full.senior_logprobs) for a, b in zip(x, y)) < 1e-5
    # and the chunks back through vLLM's output path instead of the chunk returns: the same rollout, exactly
    out = eng._backend._generate(req, {"sessions": "direct-vllm-out"})
    assert eng._backend.last_stats["return_chunks"] == 0
    assert out.completion_ids == full.completion_ids[:6] and out.owner == full.owner[:6]
    assert out.senior_logprobs == full.senior_logprobs[:6] and out.finish_reason == full.finish_reason[:6]


def test_a_resumed_session_is_not_reseeded(setup):
    """With a model whose next-token distribution is uniform whatever the context (final norm zeroed), each
    token is the noise alone. A session re-seeded at every chunk would draw the same first token in every
    chunk; independent noise repeats the session's first one about once in |V| chunks."""
    tok, root = setup["tok"], setup["root"]
    flat = _load(setup["dirs"]["senior"])
    with torch.no_grad():
        flat.model.norm.weight.zero_()
    flat.save_pretrained(root / "flat")
    tok.save_pretrained(root / "flat")
    eng = engine(setup, senior=root / "flat", junior=root / "flat")
    b = rollout(eng, toy.prompts(tok, 16), "token", SamplingParams(max_new_tokens=64), seed=2)
    repeats = starts = 0
    for ids, own in zip(b.completion_ids, b.owner):
        first: dict[int, int] = {}
        for t, (tok_id, o) in enumerate(zip(ids, own)):
            if t == 0 or own[t - 1] != o:  # a chunk starts here
                if o in first:
                    starts += 1
                    repeats += tok_id == first[o]
                else:
                    first[o] = tok_id
    assert starts > 200
    assert repeats / starts < 0.05, f"{repeats} of {starts} resumed chunks repeat the session's first token"
    V = len(tok)
    counts = torch.bincount(torch.tensor([t for ids in b.completion_ids for t in ids]), minlength=V).double()
    assert counts.max() < 8 * counts.sum() / V + 10  # no token is drawn far more often than uniform


def test_weight_push_reaches_the_engine_and_resets_the_prefix_cache(setup):
    tok, d = setup["tok"], setup["dirs"]
    senior = _load(d["senior"])
    eng = engine(setup, senior=senior, live=True)
    prompts = [toy.prompts(tok, 1)[0] * 6]  # several full KV blocks (32 tokens on the CPU build) get cached
    assert len(prompts[0]) >= 96
    sp = SamplingParams(max_new_tokens=16)
    before = rollout(eng, prompts, "solo", sp, seed=2)  # caches the prompt's blocks under the old weights
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
    assert not list(setup["svc"].inbox.glob("senior-*.safetensors"))  # the pushed file is gone once loaded
    after = rollout(eng, prompts, "solo", sp, seed=2)
    seq = prompts[0] + after.completion_ids[0]
    new_ref = _hf_logprobs(senior, seq, len(prompts[0]))
    old_ref = _hf_logprobs(_load(d["senior"]), seq, len(prompts[0]))
    assert max(abs(a - b) for a, b in zip(after.senior_logprobs[0], new_ref)) < 1e-3
    assert max(abs(a - b) for a, b in zip(after.senior_logprobs[0], old_ref)) > 1e-2
    # another client naming the saved directory gets the original weights back (one service, many users)
    again = rollout(engine(setup), prompts, "solo", sp, seed=2)
    assert again.completion_ids == before.completion_ids
    assert max(abs(a - b) for a, b in zip(again.senior_logprobs[0], before.senior_logprobs[0])) < 1e-4


def _raw(svc, method, path, body=b"", headers=None):
    from urllib.parse import urlparse

    u = urlparse(svc.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def test_the_service_serves_its_pipeline_only(setup, tmp_path):
    svc = setup["svc"]
    good = {"Authorization": f"Bearer {svc.token}", "Content-Type": "application/json"}
    body = json.dumps({"role": "senior", "tag": "x", "dir": str(tmp_path)}).encode()
    status, out = _raw(svc, "POST", "/weights", body, {"Content-Type": "application/json"})
    assert status == 401 and "token" in out["error"]
    status, _ = _raw(svc, "POST", "/shutdown", b"{}", {**good, "Authorization": "Bearer wrong-token-123456"})
    assert status == 401
    status, out = _raw(svc, "POST", "/weights", body, {**good, "Host": "evil.example:80"})
    assert status == 421
    status, _ = _raw(svc, "POST", "/weights", body, {**good, "Origin": "http://evil.example"})
    assert status == 403
    status, _ = _raw(svc, "POST", "/weights", body, {**good, "Content-Type": "text/plain"})
    assert status == 415
    status, out = _raw(svc, "POST", "/weights", body, good)  # a directory outside the run's roots
    assert status == 403 and "\n" not in out["error"] and "Traceback" not in out["error"]
    status, out = _raw(svc, "POST", "/tables", json.dumps({"key": "k", "vocab_size": 10**12}).encode(), good)
    assert status == 400
    status, out = _raw(svc, "POST", "/generate", b"{}", {**good, "Content-Length": str(10**12)})
    assert status == 413
    status, out = _raw(svc, "GET", "/health")
    assert status == 200 and out == {"ok": True}  # no state without the token
    assert svc.health()["senior"]  # the client's token sees it


def test_a_killed_service_is_restarted_by_the_next_request(setup):
    tok, d, svc = setup["tok"], setup["dirs"], setup["svc"]
    senior = _load(d["senior"])
    eng = engine(setup, senior=senior, live=True)  # live weights must come back after a restart
    prompts = toy.prompts(tok, 4)
    sp = SamplingParams(max_new_tokens=16)
    first = rollout(eng, prompts, "word", sp, seed=4)
    old, old_inbox = svc.proc.pid, svc.inbox
    assert (old_inbox / lifecycle.OWNER_FILE).exists()
    segments = shm_mapped_by(lifecycle.group_members(old))
    assert segments  # vLLM's message queues
    engines = [p for p in lifecycle.group_members(old) if p != old and not lifecycle.is_tracker(p)]
    assert engines
    os.kill(old, signal.SIGKILL)  # the service alone
    svc.proc.wait()
    # its engines die with it (their parent-death signal), before any request notices it is gone
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and [p for p in lifecycle.group_members(old) if p in engines]:
        time.sleep(0.2)
    assert not [p for p in lifecycle.group_members(old) if p in engines]
    again = rollout(eng, prompts, "word", sp, seed=4)
    assert svc.restarts == 1 and svc.alive()
    # the restart ended the old group (no orphaned engines) and the spared trackers released its shared memory
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (lifecycle.group_members(old) or any(p.exists() for p in segments)):
        time.sleep(0.5)
    assert not lifecycle.group_members(old)
    assert not [p for p in segments if p.exists()]
    assert not old_inbox.exists() and svc.inbox != old_inbox  # the killed service's inbox went with it
    assert again.completion_ids == first.completion_ids and again.owner == first.owner
    assert svc.health()["senior"] == eng._backend.senior_spec["tag"]
