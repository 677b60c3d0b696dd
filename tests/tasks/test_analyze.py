"""Stage `analyze`: batched teacher forcing against an unbatched naive loop, and the full stage on a tiny
evaluated checkpoint tree (every field for every arm and checkpoint, base self-drift 0, the reference ranking,
the per-problem table)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from tandem.evaluation import teacher_forced_stats
from tests.tasks import eval_fixtures as F

import tasks.analyze as an
import tasks.evaluate as ev


def _tiny_lm(seed: int, vocab: int = 23):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).eval()


def test_teacher_forced_stats_match_an_unbatched_naive_loop():
    senior, base = _tiny_lm(0), _tiny_lm(1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 23, (n,), generator=g).tolist() for n in (3, 7, 1, 5)]
    comps = [torch.randint(0, 23, (n,), generator=g).tolist() for n in (4, 2, 6, 0)]
    got = teacher_forced_stats(senior, base, prompts, comps, batch_size=3, pad_id=0, chunk_tokens=2)
    for p, c, st in zip(prompts, comps, got):
        assert all(st[k].shape == (len(c),) for k in ("junior_nll", "overlap", "kl", "logratio"))
        if not c:
            continue
        ids = torch.tensor([p + c])
        with torch.no_grad():
            ls = senior(ids).logits[0].double().log_softmax(-1)
            lb = base(ids).logits[0].double().log_softmax(-1)
        for t, y in enumerate(c):
            pos = len(p) - 1 + t
            ps, pb = ls[pos].exp().tolist(), lb[pos].exp().tolist()
            assert st["junior_nll"][t] == pytest.approx(-math.log(pb[y]), rel=1e-4, abs=1e-5)
            assert st["overlap"][t] == pytest.approx(sum(min(a, b) for a, b in zip(ps, pb)), rel=1e-4, abs=1e-5)
            assert st["kl"][t] == pytest.approx(sum(a * math.log(a / b) for a, b in zip(ps, pb)), rel=1e-3, abs=1e-5)
            assert st["logratio"][t] == pytest.approx(math.log(ps[y]) - math.log(pb[y]), rel=1e-4, abs=1e-5)


def test_teacher_forcing_a_model_against_itself_shows_no_drift():
    base = _tiny_lm(1)
    prompts, comps = [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]]
    same = teacher_forced_stats(base, base, prompts, comps)
    short = teacher_forced_stats(None, base, prompts, comps)  # None: the senior is the base itself
    for a, b in zip(same, short):
        assert abs(a["kl"]).max() < 1e-5 and (b["kl"] == 0).all()
        assert abs(a["overlap"] - 1).max() < 1e-5 and (b["overlap"] == 1).all()
        assert abs(a["logratio"]).max() < 1e-6 and (b["logratio"] == 0).all()
        assert a["junior_nll"] == pytest.approx(b["junior_nll"], abs=1e-6)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = F.build_tree(tmp_path_factory.mktemp("antree"), steps=(2, 4), n_problems=2)
    p = F.small_params(root, modes=["solo"])
    ev.run(p, *ev.default_io(p))
    return root


@pytest.mark.slow
def test_analyze_reports_every_metric_for_every_arm_and_checkpoint(evaluated):
    from tandem.models import load_model

    p = F.small_params(evaluated, modes=["solo"])
    inputs, outputs = an.default_io(p)
    flat = an.run(p, inputs, outputs)
    doc = json.loads(outputs["metrics"].read_text())
    benches = ["arith-long", "arith-short"]
    assert doc["settings"]["benchmarks"] == benches
    edges = doc["kl_histogram_edges"]
    assert len(edges) == 8 + 1 and edges[0] == 0.0
    for arm in F.ARMS:
        cks = doc["arms"][arm]["checkpoints"]
        assert [c["step"] for c in cks] == [0, 2, 4]
        for c in cks:
            leg, dr = c["legibility"], c["drift"]
            assert c["n_completions"] == 2 * 2 * 4 and c["n_tokens"] > 0
            for m in ("junior_ce", "overlap"):
                assert set(leg[m]["benchmarks"]) == set(benches)
                assert leg[m]["macro"] == pytest.approx(sum(leg[m]["benchmarks"].values()) / 2)
            assert 0 < leg["overlap"]["macro"] <= 1 + 1e-6 and leg["junior_ce"]["macro"] > 0
            assert sum(dr["kl"]["histogram"]) == c["n_tokens"] and len(dr["kl"]["histogram"]) == 8
            assert set(dr["kl"]["quantiles"]) == {"0.5", "0.9", "0.99"}
            assert set(dr["top_tokens"]) == {"mean_logratio", "type_mean", "coverage", "n_tokens"}
        base_ck = cks[0]
        assert base_ck["drift"]["kl"]["mean"] == 0.0 and base_ck["drift"]["logratio_mean"] == 0.0
        assert base_ck["legibility"]["overlap"]["macro"] == pytest.approx(1.0)
        assert cks[2]["drift"]["kl"]["mean"] > 0 and cks[2]["legibility"]["overlap"]["macro"] < 1
        assert len(doc["arms"][arm]["top_tokens_final"]) == doc["reference"]["n_types"]
    assert set(flat) == {f"{a}/{m}" for a in F.ARMS for m in ("junior_ce", "overlap", "kl_mean", "logratio_top")}

    # the reference ranking: grpo's last checkpoint, mean log-ratio descending, min count respected
    ref = doc["reference"]
    assert ref["arm"] == "grpo" and ref["step"] == 4 and 0 < ref["n_types"] <= 20
    lrs = [t["logratio"] for t in ref["tokens"]]
    assert lrs == sorted(lrs, reverse=True) and all(t["count"] >= 2 for t in ref["tokens"])
    final = doc["arms"]["grpo"]["top_tokens_final"]
    assert [f["logratio"] for f in final] == pytest.approx(lrs)
    assert doc["arms"]["grpo"]["checkpoints"][-1]["drift"]["top_tokens"]["coverage"] == 1.0

    # junior cross-entropy of one checkpoint and benchmark by a naive loop over the saved generations
    ck = doc["arms"]["kl_reg"]["checkpoints"][1]
    base = load_model(evaluated / "models" / "base").eval()
    rows = [json.loads(x) for x in (evaluated / "results" / "generations" / "kl_reg" / "step-2" / "solo" /
                                    "arith-short.jsonl").read_text().splitlines()]
    per_row = []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        with torch.no_grad():
            logp = base(ids).logits[0].log_softmax(-1)
        P = len(r["prompt_ids"])
        per_row.append(-sum(logp[P - 1 + t, y].item() for t, y in enumerate(r["completion_ids"]))
                       / len(r["completion_ids"]))
    assert ck["legibility"]["junior_ce"]["benchmarks"]["arith-short"] == pytest.approx(sum(per_row) / len(per_row),
                                                                                        rel=1e-4)

    plots = outputs["plots"]
    with open(plots / "grpo.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["step"] for r in table] == ["0", "2", "4"]
    assert {"junior_ce", "overlap", "kl_mean", "kl_q0.9", "top_logratio", "junior_ce/arith-long"} <= set(table[0])
    with open(plots / "drift_hist.csv") as f:
        hist = list(csv.DictReader(f))
    assert len(hist) == 8 and sum(float(r["grpo"]) for r in hist) == pytest.approx(1.0)
    with open(plots / "drift_tokens.csv") as f:
        toks = list(csv.DictReader(f))
    assert len(toks) == ref["n_types"] and {"tandem/logratio", "kl_reg/count"} <= set(toks[0])

    # per problem: one row per (arm, step, benchmark, problem); with every problem sampled n_samples times,
    # the mean over problems is the benchmark's per-completion mean of analysis.json
    with open(plots / "per_problem.csv") as f:
        reader = csv.DictReader(f)
        pp = list(reader)
    assert reader.fieldnames == ["arm", "step", "benchmark", "id", "n_completions", "junior_ce", "overlap", "kl_mean"]
    assert len(pp) == len(F.ARMS) * 3 * len(benches) * 2
    for arm in F.ARMS:
        for c in doc["arms"][arm]["checkpoints"]:
            for b in benches:
                rows = [r for r in pp if r["arm"] == arm and r["step"] == str(c["step"]) and r["benchmark"] == b]
                gens = [json.loads(x) for x in (evaluated / "results" / "generations" / arm / f"step-{c['step']}" /
                                                "solo" / f"{b}.jsonl").read_text().splitlines()]
                assert sorted(r["id"] for r in rows) == sorted({str(g["id"]) for g in gens})
                assert all(r["n_completions"] == "4" for r in rows)
                for col, m in (("junior_ce", "junior_ce"), ("overlap", "overlap")):
                    got = sum(float(r[col]) for r in rows) / len(rows)
                    assert got == pytest.approx(c["legibility"][m]["benchmarks"][b], rel=1e-5)
                if c["step"] == 0:
                    assert all(float(r["kl_mean"]) == 0.0 and float(r["overlap"]) == pytest.approx(1.0) for r in rows)

    # the common text: every arm and checkpoint on the same reference solutions, one row per problem
    with open(plots / "common_text.csv") as f:
        reader = csv.DictReader(f)
        ct = list(reader)
    assert reader.fieldnames == ["arm", "step", "benchmark", "id", "kl_mean", "overlap"]
    ids = {b: {str(json.loads(x)["id"]) for x in (evaluated / "data" / "prepared" / "eval" / f"{b}.jsonl")
               .read_text().splitlines()} for b in benches}
    for arm in F.ARMS:
        for c in doc["arms"][arm]["checkpoints"]:
            for b in benches:
                rows = [r for r in ct if r["arm"] == arm and r["step"] == str(c["step"]) and r["benchmark"] == b]
                assert {r["id"] for r in rows} <= ids[b] and len(rows) == len({r["id"] for r in rows}) > 0
                kls = [float(r["kl_mean"]) for r in rows]
                assert all(k == 0.0 for k in kls) if c["step"] == 0 else all(k > 0.0 for k in kls)
    # the same text for every arm: at one checkpoint hash the values agree whichever arm lists it
    base_rows = {(r["benchmark"], r["id"]): r for r in ct if r["step"] == "0" and r["arm"] == F.ARMS[0]}
    assert all(base_rows[(r["benchmark"], r["id"])]["overlap"] == r["overlap"] for r in ct if r["step"] == "0")


@pytest.mark.slow
def test_analyze_without_the_reference_arm_leaves_top_token_metrics_undefined(evaluated, tmp_path):
    from tandem.config import params_from_dict

    p = params_from_dict({"out_root": str(evaluated), "train": {"arms": ["tandem", "kl_reg"]},
                          "evaluate": {"progress": False}, "analyze": {"kl_bins": 4}})
    inputs, _ = an.default_io(p)
    outputs = {"metrics": tmp_path / "analysis.json", "plots": tmp_path / "plots"}
    an.run(p, inputs, outputs)
    doc = json.loads(outputs["metrics"].read_text())
    assert sorted(doc["arms"]) == ["kl_reg", "tandem"]
    assert doc["reference"]["n_types"] == 0 and doc["reference"]["step"] is None
    top = doc["arms"]["tandem"]["checkpoints"][-1]["drift"]["top_tokens"]
    assert top["mean_logratio"] is None and top["coverage"] is None
    assert (tmp_path / "plots" / "tandem.csv").exists() and not (tmp_path / "plots" / "grpo.csv").exists()


@pytest.mark.slow
def test_an_analysis_resumes_from_its_cache_and_writes_the_same_bytes(evaluated, tmp_path, monkeypatch):
    """Each checkpoint's statistics are cached under their key: a second analysis whose cache lost one entry (a
    run stopped before that checkpoint finished) scores that checkpoint alone and writes the same files."""
    p = F.small_params(evaluated, modes=["solo"])
    inputs, _ = an.default_io(p)

    def outputs(d):
        return {"metrics": d / "analysis.json", "headline": d / "headline.json", "plots": d / "plots",
                "cache": tmp_path / "cache"}

    an.run(p, inputs, outputs(tmp_path / "first"))
    ev_doc = json.loads((evaluated / "metrics" / "eval.json").read_text())
    distinct = {c["hash"] for a in F.ARMS for c in ev_doc["arms"][a]["checkpoints"]}
    entries = sorted((tmp_path / "cache").glob("*.json"))
    assert len(entries) == len(distinct) == 1 + 2 * len(F.ARMS)  # the base (every arm's step 0) once
    entries[0].unlink()
    scored = []
    real = an._checkpoint_stats
    monkeypatch.setattr(an, "_checkpoint_stats", lambda *a, **k: (scored.append(a[-1]), real(*a, **k))[1])
    an.run(p, inputs, outputs(tmp_path / "second"))
    assert len(scored) == 1
    for f in sorted((tmp_path / "first").rglob("*")):
        if f.is_file():
            assert (tmp_path / "second" / f.relative_to(tmp_path / "first")).read_bytes() == f.read_bytes(), f
