"""The GRPO functions against naive loops, and the whole loss against trl's own `compute_loss` on one batch.

A trl upgrade that changes the maths fails here."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from tandem.grpo import (clipped_objective_BT, group_advantages_B, grpo_loss, k3_kl_BT, loss_mask_BT,
                         token_mean)


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


# --------------------------------------------------------------------------------------------------
# Each function against a naive loop
# --------------------------------------------------------------------------------------------------

def test_group_advantages_match_naive_group_loop():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.25, 0.0]
    G = 4
    naive = []
    for g in range(0, len(rewards), G):
        grp = rewards[g:g + G]
        mu, sd = statistics.mean(grp), statistics.stdev(grp)  # Bessel-corrected, as trl's nanstd
        naive += [(r - mu) / (sd + 1e-4) for r in grp]
    got = group_advantages_B(torch.tensor(rewards, dtype=torch.float64), G)
    assert got.tolist() == pytest.approx(naive, abs=1e-12)
    assert got[4:8].abs().max() == 0  # an all-equal group teaches nothing
    centred = group_advantages_B(torch.tensor(rewards), G, scale="none")
    assert centred[:4].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    batch = group_advantages_B(torch.tensor(rewards, dtype=torch.float64), G, scale="batch")
    sd = statistics.stdev(rewards)
    assert batch[:4].tolist() == pytest.approx([(r - statistics.mean(rewards[:4])) / (sd + 1e-4)
                                                for r in rewards[:4]])
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages_B(torch.tensor(rewards), 5)


def test_loss_mask_keeps_real_senior_tokens_only():
    completion = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    owner = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]])
    naive = [[float(m and o == 1) for m, o in zip(mr, orow)] for mr, orow in zip(completion.tolist(), owner.tolist())]
    assert loss_mask_BT(completion, owner).tolist() == naive == [[1, 0, 1, 0], [0, 1, 0, 0]]


def test_clipped_objective_matches_naive_and_clips():
    logp, old = -_rand(3, 5, seed=1).abs(), -_rand(3, 5, seed=2).abs()
    adv = _rand(3, seed=3)
    eps = 0.2
    naive = [[-min(math.exp(lp - o) * adv[b].item(), min(max(math.exp(lp - o), 1 - eps), 1 + eps) * adv[b].item())
              for lp, o in zip(logp[b].tolist(), old[b].tolist())] for b in range(3)]
    assert clipped_objective_BT(logp, old, adv, eps).tolist() == [pytest.approx(r, abs=1e-12) for r in naive]
    # on-policy it is -A everywhere, and the clip bites somewhere in this batch
    assert clipped_objective_BT(logp, logp, adv, eps) == pytest.approx(-adv[:, None].expand(3, 5))
    unclipped = -(torch.exp(logp - old) * adv[:, None])
    assert not torch.allclose(unclipped, clipped_objective_BT(logp, old, adv, eps))


def test_k3_kl_matches_naive_and_is_nonnegative():
    logp, ref = -torch.rand(3, 5) * 4, -torch.rand(3, 5) * 4
    naive = [[math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(lrow, rrow)] for lrow, rrow in zip(logp.tolist(), ref.tolist())]
    got = k3_kl_BT(logp, ref)
    assert torch.allclose(got, torch.tensor(naive), atol=1e-6)
    assert (got >= 0).all() and float(k3_kl_BT(logp, logp).abs().max()) == 0.0


def test_token_mean_weighs_every_token_alike():
    v = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    naive = sum(x * w for xr, wr in zip(v.tolist(), m.tolist()) for x, w in zip(xr, wr)) / 4
    assert float(token_mean(v, m)) == pytest.approx(naive) == 4.0  # not the mean of row means (6.0)
    assert float(token_mean(v, torch.zeros_like(m))) == 0.0


def test_grpo_loss_is_the_token_mean_of_objective_plus_kl():
    logp, old, ref = -_rand(2, 4, seed=4).abs(), -_rand(2, 4, seed=5).abs(), -_rand(2, 4, seed=6).abs()
    adv, mask = _rand(2, seed=7), torch.tensor([[1.0, 0, 1, 1], [0, 1, 0, 0]])
    plain = token_mean(clipped_objective_BT(logp, old, adv, 0.2) + 0.1 * k3_kl_BT(logp, ref), mask)
    assert float(grpo_loss(logp, old, adv, mask, 0.2, beta=0.1, ref_logp_BT=ref, kl_bias_correction=False)) \
        == pytest.approx(float(plain))
    corrected = token_mean(clipped_objective_BT(logp, old, adv, 0.2)
                           + 0.1 * torch.exp(logp - old) * k3_kl_BT(logp, ref), mask)
    assert float(grpo_loss(logp, old, adv, mask, 0.2, beta=0.1, ref_logp_BT=ref)) == pytest.approx(float(corrected))
    assert float(corrected) != pytest.approx(float(plain))
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, adv, mask, 0.2, beta=0.1)


# --------------------------------------------------------------------------------------------------
# Against trl's own loss on one batch
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_matches_trls_compute_loss_on_one_batch(beta, tmp_path):
    """Build the project's trainer (trl's GRPOTrainer), let trl turn a scripted rollout batch into its inputs,
    make the old log-probs differ from the current ones (so the clip acts) and, with beta > 0, give a reference,
    then compare trl's `compute_loss` with `grpo_loss` over our own teacher-forced log-probs."""
    from tandem.config import RolloutConfig, TrainConfig
    from tandem.data.prompts import render_prompt
    from tandem.logprobs import token_logprobs_B
    from tandem.models import load_model, load_tokenizer
    from tandem.train import JuniorGuard, arm_spec, build_trainer
    from train_fixtures import FakeBatch, build_base, write_prepared
    from tasks.common import read_jsonl

    torch.manual_seed(0)
    base_dir = build_base(tmp_path / "base", hidden=32)
    write_prepared(tmp_path / "prepared", n_train=4, n_val=1)
    picked = read_jsonl(tmp_path / "prepared" / "train.jsonl")[:2]
    senior, junior, tok = load_model(base_dir), load_model(base_dir), load_tokenizer(base_dir)
    T, G, eps = 0.7, 4, 0.2
    rng = random.Random(1)
    comps = [[rng.randrange(10, len(tok) - 10) for _ in range(n)] for n in (5, 9, 7, 12, 6, 8, 10, 4)]
    owners = [[rng.randint(0, 1) for _ in c] for c in comps]
    for o in owners:
        o[0], o[-1] = 1, 0
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]

    class Scripted:
        def generate(self, request):
            return FakeBatch([list(c) for c in comps], [list(o) for o in owners], [[0.0] * len(c) for c in comps],
                             [0] * len(comps), ["eos"] * len(comps))

    train = TrainConfig(steps=1, prompts_per_step=2, group_size=G, temperature=T, max_new_tokens=12,
                        report_to="none", kl_rows=0, clip_epsilon=eps)
    trainer = build_trainer(arm_spec("grpo", train, RolloutConfig()), senior, junior, tok, picked, train,
                            RolloutConfig(), tmp_path / "arm", 0, "fp", JuniorGuard(junior), engine=Scripted(),
                            progress=False, score_fn=lambda texts, golds, **kw: rewards)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    prompts = [render_prompt(r["prompt"], tok) for r in picked]
    inputs = trainer._generate_and_score_completions(
        [{"prompt": p, "answer": r["answer"], "id": r["id"]} for p, r in zip(prompts, picked) for _ in range(G)])

    # ours, from scratch: teacher-forced log-probs, advantages, mask
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(G)]
    W = max(map(len, comps))
    pad = lambda rows: torch.tensor([r + [0.0] * (W - len(r)) for r in rows], dtype=torch.float32)  # noqa: E731
    logp_BT = pad(token_logprobs_B(senior, prompt_ids, comps, T))
    completion_BT = pad([[1.0] * len(c) for c in comps])
    mask_BT = loss_mask_BT(completion_BT, pad([[float(x) for x in o] for o in owners]).long())
    adv_B = group_advantages_B(torch.tensor(rewards), G)
    assert inputs["advantages"].tolist() == pytest.approx(adv_B.tolist(), abs=1e-5)
    assert inputs["completion_ids"].shape[1] == W
    assert (inputs["completion_mask"] * inputs["tool_mask"]).float().tolist() == mask_BT.tolist()

    noise = torch.randn(logp_BT.shape, generator=torch.Generator().manual_seed(2)) * 0.4
    old_BT = (logp_BT + noise) * completion_BT
    inputs["old_per_token_logps"] = old_BT
    ref_BT = None
    if beta:
        ref_BT = (logp_BT - torch.randn(logp_BT.shape, generator=torch.Generator().manual_seed(3)).abs() * 0.3)
        inputs["ref_per_token_logps"] = ref_BT
        trainer.beta = beta
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(trainer.model, inputs))
    ours = float(grpo_loss(logp_BT, old_BT, adv_B, mask_BT, eps, beta, ref_BT))
    assert math.isfinite(trl_loss) and trl_loss == pytest.approx(ours, rel=1e-4, abs=1e-6)

    # the comparison can fail: the clip and the KL term both change the number here
    ratio = torch.exp(logp_BT - old_BT)
    assert ((ratio - 1).abs() > eps)[mask_BT.bool()].any()
    kl = beta * ratio * k3_kl_BT(logp_BT, ref_BT) if beta else 0.0
    unclipped = token_mean(-(ratio * adv_B[:, None]) + kl, mask_BT)
    assert abs(float(unclipped) - trl_loss) > 1e-3
    if beta:  # both the KL term and its importance weighting (trl's use_bias_correction_kl) are seen
        assert abs(float(grpo_loss(logp_BT, old_BT, adv_B, mask_BT, eps)) - trl_loss) > 1e-5
        plain = float(grpo_loss(logp_BT, old_BT, adv_B, mask_BT, eps, beta, ref_BT, kl_bias_correction=False))
        assert abs(plain - trl_loss) > 1e-5
