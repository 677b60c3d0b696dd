"""Tests of the tandem/train package: pure helpers, batch geometry, the rollout function, the zero-gradient proof,
the PPO clip under several updates per rollout batch, resume at step boundaries, a training smoke run.

The zero-gradient proof is the centre: the gradient of trl's own `compute_loss` on a prepared tandem batch
equals a gradient computed by hand from the senior's positions alone, and differs once the mask is wrongly
all ones (so the test can fail). Models are tiny randomly initialised Qwen3s; where the engine does not
matter, a scripted engine returns fixed completions and owner masks.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch

from tandem.config import RolloutConfig, TrainConfig
from tandem.geometry import batch_geometry
from tandem.rollout.request import RolloutSettings
from tandem.checkpoints import commit_dir, complete_checkpoints, latest_checkpoint
from tandem.logprobs import token_logprobs_B
from tandem.train import (ArmRun, CorrectnessReward, JuniorGuard, StepStats, TandemRollout, arm_spec,
                          build_trainer, run_fingerprint, step_rows, train_arm, weights_hash,
                          zero_variance_fraction)
from tandem.train.trainer import merge_rank_stats
from train_fixtures import FakeBatch, build_base, write_prepared


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steady on a shared 2-core machine; these models are too small to gain from more
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return build_base(tmp_path_factory.mktemp("train") / "base")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, list[dict]]:
    from tasks.common import read_jsonl

    d = tmp_path_factory.mktemp("prepared")
    write_prepared(d, n_train=32, n_val=8)
    return {"train": read_jsonl(d / "train.jsonl"), "val": read_jsonl(d / "val.jsonl")}


def _load(base_dir):
    from tandem.models import load_model, load_tokenizer

    return load_model(base_dir), load_model(base_dir), load_tokenizer(base_dir)


class ScriptedEngine:
    """Returns pre-set completions and owner masks (in call order), with the senior's true log-probs."""

    def __init__(self, senior, tokenizer, completions, owners, temperature):
        self.senior, self.tokenizer, self.completions, self.owners, self.t = senior, tokenizer, completions, owners, temperature
        self.calls = []

    def generate(self, request):
        prompt_ids = [list(p) for p in request.prompts]
        self.calls.append({"n": len(request), "schedule": request.schedule.kind, "seed": request.seed,
                           "row_ids": request.row_ids})
        lps = token_logprobs_B(self.senior, prompt_ids, self.completions, self.t, self.tokenizer.pad_token_id)
        lps = [[lp if o else 0.0 for lp, o in zip(row, own)] for row, own in zip(lps, self.owners)]
        hand = [sum(a != b for a, b in zip(o, o[1:])) for o in self.owners]
        return FakeBatch([list(c) for c in self.completions], [list(o) for o in self.owners], lps, hand,
                         ["eos"] * len(self.completions))


# --------------------------------------------------------------------------------------------------
# Pure helpers against naive versions
# --------------------------------------------------------------------------------------------------

def test_zero_variance_fraction_matches_naive():
    rewards = [1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    naive = sum(len(set(rewards[i:i + 4])) == 1 for i in range(0, 12, 4)) / 3
    assert zero_variance_fraction(rewards, 4) == pytest.approx(naive) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="groups of 5"):
        zero_variance_fraction(rewards, 5)


def test_token_logprobs_match_per_row_forward(base_dir):
    senior, _, tok = _load(base_dir)
    prompts, comps = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16, 17, 18]]
    for chunk_rows in (1, 4):  # rows one at a time, and both rows in one padded chunk
        got = token_logprobs_B(senior, prompts, comps, 0.7, tok.pad_token_id, batch_size=chunk_rows)
        for p, c, row in zip(prompts, comps, got):
            with torch.no_grad():
                logits = senior(torch.tensor([p + c])).logits[0] / 0.7
            want = [float(torch.log_softmax(logits[len(p) - 1 + t], -1)[c[t]]) for t in range(len(c))]
            assert row == pytest.approx(want, abs=1e-5)


def test_weights_hash_sees_one_changed_weight(base_dir):
    a, b, _ = _load(base_dir)
    assert weights_hash(a) == weights_hash(b)
    with torch.no_grad():
        next(b.parameters()).view(-1)[3] += 1e-3
    assert weights_hash(a) != weights_hash(b)


def test_junior_guard_raises_when_the_junior_moves(base_dir):
    _, junior, _ = _load(base_dir)
    guard = JuniorGuard(junior)
    guard.on_train_end(None, None, None)
    assert guard.after == guard.before
    with torch.no_grad():
        next(junior.parameters()).add_(1.0)
    with pytest.raises(RuntimeError, match="junior changed"):
        guard.on_train_end(None, None, None)


def test_arm_specs_differ_only_where_the_paper_says():
    t, r = TrainConfig(group_size=8, kl_beta=0.01), RolloutConfig(schedule="word")
    specs = {a: arm_spec(a, t, r) for a in ("tandem", "grpo", "kl_reg", "grpo_g16")}
    assert (specs["tandem"].schedule, specs["tandem"].beta, specs["tandem"].group_size) == ("word", 0.0, 8)
    assert (specs["grpo"].schedule, specs["grpo"].beta) == ("solo", 0.0)
    assert (specs["kl_reg"].schedule, specs["kl_reg"].beta) == ("solo", 0.01)
    assert specs["grpo_g16"].group_size == 16
    with pytest.raises(ValueError, match="tandem schedule"):
        arm_spec("tandem", t, RolloutConfig(schedule="solo"))
    with pytest.raises(ValueError, match="unknown arm"):
        arm_spec("ppo", t, r)
    fp = run_fingerprint(specs["tandem"], t, r, 0, "h")
    assert fp == run_fingerprint(specs["tandem"], TrainConfig(group_size=8, kl_beta=0.01, save_every=3), r, 0, "h")
    assert fp != run_fingerprint(specs["tandem"], TrainConfig(group_size=8, kl_beta=0.01, learning_rate=1e-3), r, 0, "h")
    assert fp != run_fingerprint(specs["tandem"], t, r, 1, "h")


def test_train_config_rules():
    from tandem.config import ParamsError

    with pytest.raises(ParamsError, match="kl_beta"):
        TrainConfig(arms=["kl_reg"], kl_beta=0.0)
    with pytest.raises(ParamsError, match="kl_rows"):
        TrainConfig(kl_rows=-1)


def test_commit_dir_and_checkpoint_discovery(tmp_path):
    arm = tmp_path / "tandem"

    def fake_ckpt(name, step, complete=True):
        d = arm / name
        d.mkdir(parents=True)
        for f in ("config.json", "trainer_state.json", "model.safetensors"):
            (d / f).write_text("{}")
        if complete:
            (d / "tandem_state.json").write_text(json.dumps({"step": step, "fingerprint": "A"}))
        return d

    fake_ckpt("step-2", 2)
    fake_ckpt("step-10", 10)
    fake_ckpt("step-12", 12, complete=False)  # no marker: never trusted
    fake_ckpt("checkpoint-14", 14)  # staging name: never trusted
    assert [s for s, _ in complete_checkpoints(arm)] == [2, 10]
    assert latest_checkpoint(arm).name == "step-10"
    assert latest_checkpoint(arm, "B") is None
    staging = fake_ckpt("checkpoint-16", 16)
    commit_dir(staging, arm / "step-16")
    assert not staging.exists() and latest_checkpoint(arm, "A").name == "step-16"
    again = fake_ckpt("checkpoint-16", 16)
    (again / "extra").write_text("x")
    commit_dir(again, arm / "step-16")  # replacing an existing step keeps exactly the new content
    assert (arm / "step-16" / "extra").exists()
    assert not [p for p in arm.iterdir() if p.name.startswith(".old-")]


def test_step_rows_keeps_one_row_per_step():
    hist = [{"loss": 0.1, "reward": 0.5, "step": 1}, {"loss": 0.2, "reward": 0.6, "step": 2},
            {"loss": 0.3, "reward": 0.7, "step": 2}, {"train_runtime": 3.0, "step": 2}]
    rows = step_rows(hist)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward_mean"] == 0.7 and rows[0]["val_accuracy"] is None


# --------------------------------------------------------------------------------------------------
# The rollout function and the reward
# --------------------------------------------------------------------------------------------------

def test_rollout_func_returns_owner_as_env_mask(base_dir):
    senior, junior, tok = _load(base_dir)
    from tandem.rollout import engine as em

    comps, owners = [[20, 21, 22], [23, 24], [], [26]], [[1, 0, 1], [0, 0], [], [1]]
    engine = ScriptedEngine(senior, tok, comps, owners, 1.0)
    stats = StepStats()
    run = ArmRun("tandem", senior, junior, tok, [], TrainConfig(group_size=2, kl_rows=4), RolloutConfig(), ".",
                 seed=3, engine=engine)
    settings = RolloutSettings(em.ScheduleSpec(run.spec.schedule), em.SamplingParams(max_new_tokens=8))
    fn = TandemRollout(run, settings, stats)

    class T:  # the two attributes of the trainer the rollout function reads
        model = senior
        state = type("S", (), {"global_step": 5})()

    out = fn(["a b", "a b", "c d", "c d"], T())
    assert len(engine.calls) == 1 and engine.calls[0]["n"] == 4 and engine.calls[0]["schedule"] == "word"
    assert engine.calls[0]["seed"] == fn.step_seed(5) != fn.step_seed(6)
    assert out["env_mask"][:2] == owners[:2] and out["completion_ids"][:2] == comps[:2]
    eos = tok.eos_token_id
    assert out["completion_ids"][2] == [eos] and out["env_mask"][2] == [0]  # empty -> a lone untrained EOS
    assert out["prompt_ids"][0] == out["prompt_ids"][1] == tok("a b", add_special_tokens=False)["input_ids"]
    v = stats.pop()
    assert v["tandem/senior_fraction"] == pytest.approx(3 / 6)
    assert v["tandem/joint_length"] == pytest.approx(7 / 4)
    assert v["tandem/kl_to_base"] == pytest.approx(0.0, abs=1e-6)  # senior == base here
    assert v["time/rollout"] > 0 and "time/kl" in v
    with pytest.raises(ValueError, match="groups of 2"):
        fn(["a", "b", "c"], T())


def test_reward_scores_joint_text_and_records_zero_variance():
    stats = StepStats()
    seen = {}

    def score(texts, golds, timeout, workers):
        seen.update(texts=texts, golds=golds, timeout=timeout, workers=workers)
        return [1.0 if t.endswith(g) else 0.0 for t, g in zip(texts, golds)]

    reward = CorrectnessReward(stats, group_size=2, timeout=2.0, workers=1, score_fn=score)
    r = reward(prompts=["p"] * 4, completions=["x 1", "x 2", "y 3", "y 3"], answer=["1", "1", "3", "3"])
    assert r == [1.0, 0.0, 1.0, 1.0] and seen["timeout"] == 2.0
    assert stats.values["tandem/zero_variance_groups"] == 0.5
    assert reward.__name__ == "correct"


def test_real_reward_accepts_boxed_answers():
    reward = CorrectnessReward(StepStats(), group_size=2)
    assert reward(prompts=["p", "p"], completions=["so \\boxed{12}", "\\boxed{13}"], answer=["12", "12"]) == [1.0, 0.0]


# --------------------------------------------------------------------------------------------------
# The zero-gradient proof
# --------------------------------------------------------------------------------------------------

def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


@pytest.mark.slow
def test_junior_tokens_get_exactly_zero_gradient(base_dir, rows, tmp_path):
    """trl's compute_loss gradient == hand gradient over senior positions only; all-ones mask differs."""
    from tandem.data.prompts import render_prompt

    senior, junior, tok = _load(base_dir)
    temperature, group = 0.7, 4
    train = TrainConfig(steps=1, prompts_per_step=2, group_size=group, temperature=temperature,
                        max_new_tokens=12, report_to="none", kl_rows=0, learning_rate=1e-3)
    rng = random.Random(0)
    lengths = [5, 9, 7, 12, 6, 8, 10, 4]
    comps = [[rng.randrange(10, len(tok) - 10) for _ in range(n)] for n in lengths]
    comps[1][-1] = tok.eos_token_id
    owners = [[rng.randint(0, 1) for _ in c] for c in comps]
    owners[0][0], owners[0][1] = 1, 0  # at least one of each in every row
    for o in owners:
        o[0], o[-1] = 1, 0
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    picked = rows["train"][:2]
    prompts = [render_prompt(r["prompt"], tok) for r in picked]
    batch_rows = [{"prompt": p, "answer": r["answer"], "id": r["id"]} for p, r in zip(prompts, picked)
                  for _ in range(group)]

    def run(mask_all_ones: bool):
        model = _load(base_dir)[0]
        own = [[1] * len(o) for o in owners] if mask_all_ones else owners
        engine = ScriptedEngine(model, tok, comps, own, temperature)
        trainer = build_trainer(ArmRun("tandem", model, junior, tok, picked, train, RolloutConfig(),
                                       tmp_path / f"arm{int(mask_all_ones)}", 0, engine=engine, progress=False,
                                       score_fn=lambda texts, golds, **kw: rewards), "fp", JuniorGuard(junior))
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs = trainer._generate_and_score_completions([dict(r) for r in batch_rows])
        got_mask = inputs["tool_mask"]
        for b, o in enumerate(own):
            assert got_mask[b, :len(o)].tolist() == o
        model.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        return _grads(model), float(loss.detach())

    def by_hand(use_all: bool):
        model = _load(base_dir)[0]
        adv = []
        for g in range(0, len(rewards), group):
            grp = rewards[g:g + group]
            mu, sd = statistics.mean(grp), statistics.stdev(grp)
            adv += [(r - mu) / (sd + 1e-4) for r in grp]
        total, n_tok = 0.0, 0
        for b, (c, o) in enumerate(zip(comps, owners)):
            p_ids = tok(prompts[b // group], add_special_tokens=False)["input_ids"]
            logits = model(torch.tensor([p_ids + c])).logits[0] / temperature
            for t, tok_id in enumerate(c):
                if use_all or o[t]:  # the senior's positions only, unless the mask is deliberately wrong
                    total = total - adv[b] * torch.log_softmax(logits[len(p_ids) - 1 + t], -1)[tok_id]
                    n_tok += 1
        (total / n_tok).backward()  # trl's dapo loss: token mean over the batch; ratio = 1 on-policy
        return _grads(model)

    g_trl, loss = run(mask_all_ones=False)
    g_hand = by_hand(use_all=False)
    assert math.isfinite(loss)
    scale = max(float(g.abs().max()) for g in g_hand.values())
    assert scale > 1e-4  # a real gradient, not zero == zero
    for name in g_hand:
        assert torch.allclose(g_trl[name], g_hand[name], atol=1e-6 * max(scale, 1), rtol=1e-4), name

    g_wrong, _ = run(mask_all_ones=True)
    diff = max(float((g_wrong[n] - g_trl[n]).abs().max()) for n in g_trl)
    assert diff > 1e-3 * scale  # junior tokens would have moved the senior: the mask matters
    g_hand_all = by_hand(use_all=True)  # and the hand calculation tracks the mask, so it is no tautology
    for name in g_hand_all:
        assert torch.allclose(g_wrong[name], g_hand_all[name], atol=1e-6 * max(scale, 1), rtol=1e-4), name


# --------------------------------------------------------------------------------------------------
# A short run end to end
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_few_steps_change_the_senior_only(base_dir, rows, tmp_path):
    senior, junior, tok = _load(base_dir)
    before = weights_hash(senior)
    train = TrainConfig(arms=["tandem"], steps=3, prompts_per_step=2, group_size=4, max_new_tokens=12,
                        save_every=2, report_to="none", learning_rate=1e-2, warmup_steps=0, kl_rows=4,
                        val_every=3, val_problems=4)

    def score(texts, golds, **kw):  # a reward with variance for an untrained model: more digits is better
        return [float(sum(ch.isdigit() for ch in t) >= 2) for t in texts]

    res = train_arm(ArmRun("tandem", senior, junior, tok, rows["train"], train, RolloutConfig(),
                           tmp_path / "tandem", val_rows=rows["val"], score_fn=score, progress=False))
    s = res.summary
    assert s["steps"] == 3 and s["loss_finite"] and s["junior_unchanged"]
    assert res.checkpoints == ["step-2", "step-3"]
    assert weights_hash(senior) != before and weights_hash(junior) == before
    assert 0.0 < s["senior_fraction"] < 1.0
    assert s["phase_seconds"]["rollout"] > 0 and s["phase_seconds"]["update"] > 0
    assert s["val_accuracy_initial"] is not None and s["val_accuracy_last"] is not None
    table = step_rows(res.log_history)
    assert [r["step"] for r in table] == [1, 2, 3] and all(r["kl_to_base"] is not None for r in table)
    ck = tmp_path / "tandem" / "step-3"
    state = json.loads((ck / "tandem_state.json").read_text())
    assert state["step"] == 3 and state["prompts_seen"] == 6 and state["junior_hash"] == s["junior_hash_before"]
    from tandem.models import load_model

    reloaded = load_model(ck)  # a plain HF model directory with safetensors
    assert weights_hash(reloaded) == weights_hash(senior)
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= {p.name for p in ck.iterdir()}
    assert not [p for p in (tmp_path / "tandem").iterdir() if p.name.startswith("checkpoint-")]

    # Rerunning a finished arm trains nothing and rebuilds the same summary from the last checkpoint.
    senior2, junior2, _ = _load(base_dir)
    again = train_arm(ArmRun("tandem", senior2, junior2, tok, rows["train"], train, RolloutConfig(),
                             tmp_path / "tandem", score_fn=score, progress=False))
    assert again.summary["resumed_from"] == "step-3" and again.summary["steps"] == 3
    assert again.summary["reward_mean"] == pytest.approx(s["reward_mean"])


# --------------------------------------------------------------------------------------------------
# Batch geometry, several updates per rollout batch, several processes
# --------------------------------------------------------------------------------------------------

def test_batch_geometry_cuts_the_rollout_batch_like_naive_counting():
    for prompts, group, micro, updates, procs in [(16, 8, 4, 2, 1), (16, 8, 2, 2, 8), (2, 4, 0, 1, 1),
                                                  (4, 2, 1, 2, 2), (8, 8, 0, 2, 2)]:
        g = batch_geometry(prompts, group, micro, updates, procs)
        rows = [(p, k) for p in range(prompts) for k in range(group)]  # the rollout batch, row by row
        per_proc = [rows[r::procs] for r in range(procs)]  # any equal split will do for counting
        assert g.rollout_rows == len(rows) and g.rows_per_process == len(per_proc[0])
        assert g.rows_per_update * updates == g.rows_per_process
        assert g.micro_batch_size * g.grad_accum == g.rows_per_update
        assert g.steps_per_generation * g.micro_batch_size * procs == len(rows)  # trl's generation batch
    with pytest.raises(ValueError, match="num_processes"):
        batch_geometry(3, 8, 0, 1, 2)
    with pytest.raises(ValueError, match="updates_per_batch"):
        batch_geometry(1, 3, 0, 2, 1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        batch_geometry(2, 4, 3, 1, 1)


def test_train_config_batch_rules():
    from tandem.config import ParamsError

    TrainConfig(prompts_per_step=16, group_size=8, micro_batch_size=4, updates_per_batch=2, num_processes=8)
    for bad in ({"prompts_per_step": 3, "num_processes": 2}, {"updates_per_batch": 0},
                {"prompts_per_step": 1, "group_size": 3, "updates_per_batch": 2}, {"micro_batch_size": 5},
                {"sharding": "fsdp"}):
        with pytest.raises(ParamsError):
            TrainConfig(**bad)


def test_merge_rank_stats_takes_the_slowest_time_and_the_finite_mean():
    m = merge_rank_stats([{"time/rollout": 1.0, "tandem/senior_fraction": 0.2, "tandem/kl_to_base": float("nan")},
                          {"time/rollout": 3.0, "tandem/senior_fraction": 0.6, "tandem/kl_to_base": 0.5}])
    assert m == {"time/rollout": 3.0, "tandem/senior_fraction": pytest.approx(0.4), "tandem/kl_to_base": 0.5}


def _digits_score(texts, golds, **kw):  # a reward with variance for an untrained model: more digits is better
    return [float(sum(ch.isdigit() for ch in t) >= 2) for t in texts]


def _alternating_score(texts, golds, **kw):  # every group has reward variance, so every update moves the senior
    return [float(i % 2) for i in range(len(texts))]


@pytest.mark.slow
@pytest.mark.parametrize("updates", [1, 2])
def test_clip_acts_only_when_a_rollout_batch_feeds_several_updates(base_dir, rows, tmp_path, updates):
    """Update 2 of a batch sees weights moved by update 1: ratio != 1 and the clip acts; one update: ratio == 1."""
    senior, junior, tok = _load(base_dir)
    ro = RolloutConfig()
    train = TrainConfig(arms=["grpo"], steps=1, prompts_per_step=2, group_size=4, max_new_tokens=12, save_every=1,
                        report_to="none", learning_rate=0.05, warmup_steps=0, kl_rows=0, clip_epsilon=0.05,
                        updates_per_batch=updates, micro_batch_size=2)
    trainer = build_trainer(ArmRun("grpo", senior, junior, tok, rows["train"], train, ro, tmp_path / "arm", 0,
                                   score_fn=_alternating_score, progress=False), "fp", JuniorGuard(junior))
    seen = []
    compute = trainer._compute_loss

    def spy(model, inputs):  # the importance ratio trl will use, per micro-batch, with the update it belongs to
        with torch.no_grad():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            logp = trainer._get_per_token_logps_and_entropies(model, ids, att, inputs["completion_ids"].size(1))[0]
        old = inputs.get("old_per_token_logps")
        mask = inputs["completion_mask"] * inputs["tool_mask"]
        dev = 0.0 if old is None else float(((torch.exp(logp - old) - 1).abs() * mask).max())
        seen.append((trainer.state.global_step, dev))
        return compute(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    assert trainer.state.global_step == updates and len(seen) == 4  # 8 rows in micro-batches of 2
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1 and logs[0]["tandem/step"] == 1  # one step (rollout batch) = `updates` updates
    clipped = logs[0]["clip_ratio/region_mean"]
    if updates == 1:
        assert all(d == 0.0 for _, d in seen) and clipped == 0.0
    else:
        first = [d for u, d in seen if u == 0]
        second = [d for u, d in seen if u == 1]
        assert len(first) == len(second) == 2
        assert max(first) < 1e-4  # the rollout policy itself: ratio 1 up to float noise
        assert max(second) > train.clip_epsilon  # moved by the first update, beyond the clip range
        assert clipped > 0.0


@pytest.mark.slow
def test_resume_with_two_updates_per_batch_matches_an_uninterrupted_run(base_dir, rows, tmp_path):
    """step-<N> = N rollout batches = 2N optimizer updates; a run stopped at step 2 and resumed ends like one
    that never stopped."""
    ro = RolloutConfig()
    train = TrainConfig(arms=["tandem"], steps=4, prompts_per_step=2, group_size=2, max_new_tokens=8, save_every=2,
                        report_to="none", learning_rate=1e-2, warmup_steps=1, kl_rows=2, updates_per_batch=2,
                        micro_batch_size=1)

    def run(arm_dir, stop_after=None):
        senior, junior, tok = _load(base_dir)
        res = train_arm(ArmRun("tandem", senior, junior, tok, rows["train"], train, ro, arm_dir,
                               score_fn=_digits_score, progress=False, stop_after=stop_after))
        return res, senior

    full, w_full = run(tmp_path / "full")
    assert full.checkpoints == ["step-2", "step-4"] and full.summary["steps"] == 4
    state = json.loads((tmp_path / "full" / "step-4" / "tandem_state.json").read_text())
    assert state["step"] == 4 and state["optimizer_updates"] == 8 and state["prompts_seen"] == 8
    assert [r["step"] for r in step_rows(full.log_history)] == [1, 2, 3, 4]

    part, _ = run(tmp_path / "cut", stop_after=2)
    assert part.checkpoints == ["step-2"]
    rest, w_rest = run(tmp_path / "cut")
    assert rest.summary["resumed_from"] == "step-2" and rest.checkpoints == ["step-2", "step-4"]
    assert weights_hash(w_rest) == weights_hash(w_full)
    assert [r["step"] for r in step_rows(rest.log_history)] == [1, 2, 3, 4]


def test_each_rank_rolls_out_its_rows_with_global_row_ids(base_dir):
    senior, junior, tok = _load(base_dir)
    from tandem.rollout import engine as em

    engine = ScriptedEngine(senior, tok, [[20, 21]] * 4, [[1, 0]] * 4, 1.0)
    run = ArmRun("grpo", senior, junior, tok, [], TrainConfig(group_size=2, kl_rows=0, updates_per_batch=2),
                 RolloutConfig(), ".", seed=3, engine=engine)
    settings = RolloutSettings(em.ScheduleSpec(run.spec.schedule), em.SamplingParams(max_new_tokens=4))
    fn = TandemRollout(run, settings, StepStats())

    class T:  # a trainer on rank 1 of 2, at optimizer update 6 = step 3 of 2 updates each
        model = senior
        state = type("S", (), {"global_step": 6})()
        accelerator = type("A", (), {"process_index": 1})()

    fn(["a b", "a b", "c d", "c d"], T())
    assert list(engine.calls[0]["row_ids"]) == [4, 5, 6, 7]  # rank 0 holds rows 0-3 of the same step
    assert engine.calls[0]["seed"] == fn.step_seed(3)
