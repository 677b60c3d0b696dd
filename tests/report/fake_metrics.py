"""Small, schema-faithful fake metrics (docs/metrics.md) for the report tests: eval.json, analysis.json,
training CSVs and generations, with hostile text in a generation to exercise escaping."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

HOSTILE = ('<script>console.error("xss")</script><img src=x onerror="console.error(1)"> '
           "```\n# not a heading\n[link](javascript:alert(1)) | pipe & \\boxed{7}")


def fake_eval(arms=("tandem", "grpo", "kl_reg"), steps=(0, 10, 20), modes=("solo", "step", "word"),
              ks=(1, 2, 4, 8), benches=("arith-short", "arith-long"), seed=0, offset=0.0) -> dict:
    rnd = random.Random(seed)

    def mode_block(step: int, mode: str) -> dict:
        b = {}
        for bench in benches:
            p1 = min(1.0, max(0.0, 0.2 + 0.01 * step + offset + rnd.uniform(-0.05, 0.05)))
            d = {"key": "k" * 64, "n_problems": 4, "n_generations": 32, "senior_share": 1.0 if mode == "solo" else 0.5,
                 "handoffs": 0.0 if mode == "solo" else 3.0, "mean_tokens": 50.0, "finish_reasons": {"eos": 32},
                 "seconds": 1.5}
            d.update({f"pass@{k}": min(1.0, p1 * (1 + 0.3 * i)) for i, k in enumerate(ks)})
            b[bench] = d
        macro = {f"pass@{k}": sum(v[f"pass@{k}"] for v in b.values()) / len(b) for k in ks}
        macro.update({"senior_share": 1.0 if mode == "solo" else 0.5, "mean_tokens": 50.0})
        return {"macro": macro, "benchmarks": b}

    base_modes = {m: mode_block(0, m) for m in modes}
    arm_docs = {}
    for a_i, arm in enumerate(arms):
        cks = []
        for s in steps:
            h = "base" * 16 if s == 0 else f"{arm}{s}".ljust(64, "0")
            cks.append({"step": s, "path": "models/base" if s == 0 else f"models/checkpoints/{arm}/step-{s}",
                        "hash": h, "modes": base_modes if s == 0 else {m: mode_block(s + a_i, m) for m in modes}})
        arm_docs[arm] = {"checkpoints": cks}
    summary = {a: {"final_step": steps[-1], **{f"{m}/pass@{k}": arm_docs[a]["checkpoints"][-1]["modes"][m]["macro"][f"pass@{k}"]
                                               for m in modes for k in ks}} for a in arms}
    return {
        "settings": {"n_samples": 8, "ks": list(ks), "modes": list(modes), "temperature": 0.7, "top_p": 0.8,
                     "top_k": 20, "max_new_tokens": 160, "max_rounds": 150, "p_senior": 0.5, "max_gap_tokens": 32,
                     "max_problems": 4, "seed": 0,
                     "benchmarks": {b: {"n_problems": 4, "rows_hash": "r" * 64} for b in benches}},
        "junior": {"path": "models/base", "hash": "base" * 16, "modes": {"solo": base_modes.get("solo")}},
        "arms": arm_docs, "summary": summary,
    }


def fake_analysis(arms=("tandem", "grpo", "kl_reg"), steps=(0, 10, 20), benches=("arith-short", "arith-long"),
                  bins=10, seed=0) -> dict:
    rnd = random.Random(seed)
    edges = [i * 0.05 for i in range(bins + 1)]
    ref_tokens = [{"rank": r + 1, "id": 100 + r, "token": f"<tok{r}>", "count": 20 - r, "logratio": 1.0 - 0.05 * r}
                  for r in range(12)]
    arm_docs = {}
    for arm in arms:
        cks = []
        for s in steps:
            kl = 0.0 if s == 0 else 0.01 * s * (0.5 if arm == "tandem" else 1.0)
            hist = [0] * bins if s else [1000] + [0] * (bins - 1)
            if s:
                for _ in range(500):
                    hist[min(bins - 1, int(rnd.expovariate(1 / max(kl, 1e-3)) / 0.05))] += 1
            cks.append({"step": s, "hash": "h", "n_completions": 64, "n_tokens": 3000,
                        "legibility": {"junior_ce": {"macro": 0.4 + kl, "benchmarks": {b: 0.4 + kl for b in benches}},
                                       "overlap": {"macro": 0.9 - kl, "benchmarks": {b: 0.9 - kl for b in benches}}},
                        "drift": {"kl": {"mean": kl, "quantiles": {"0.5": kl / 2, "0.9": kl * 2, "0.99": kl * 3},
                                         "histogram": hist, "benchmarks": {b: kl for b in benches}},
                                  "logratio_mean": kl / 2,
                                  "top_tokens": {"mean_logratio": kl * 5, "type_mean": kl * 5, "coverage": 0.9,
                                                 "n_tokens": 200}}})
        scale = 1.0 if arm == "grpo" else 0.4
        arm_docs[arm] = {"checkpoints": cks,
                         "top_tokens_final": [{"id": t["id"], "count": 5, "logratio": t["logratio"] * scale}
                                              for t in ref_tokens]}
    return {"settings": {"top_drift_tokens": 12, "min_type_count": 3, "kl_bins": bins, "quantiles": [0.5, 0.9, 0.99],
                         "reference_arm": "grpo", "benchmarks": list(benches)},
            "kl_histogram_edges": edges,
            "reference": {"arm": "grpo", "step": steps[-1], "hash": "h", "n_types": len(ref_tokens), "tokens": ref_tokens},
            "arms": arm_docs,
            "summary": {a: {"final_step": steps[-1], "junior_ce": 0.5, "overlap": 0.8, "kl_mean": 0.1,
                            "logratio_top": 0.3} for a in arms}}


def write_fake_run(root: Path, arms=("tandem", "grpo", "kl_reg"), steps=(0, 10, 20), modes=("solo", "step", "word"),
                   offset: float = 0.0) -> dict:
    """Lay out metrics/, metrics/plots/ and results/generations/ under `root` as the real stages would."""
    ev = fake_eval(arms, steps, modes, offset=offset)
    an = fake_analysis(arms, steps)
    (root / "metrics" / "plots").mkdir(parents=True, exist_ok=True)
    (root / "metrics" / "eval.json").write_text(json.dumps(ev))
    (root / "metrics" / "analysis.json").write_text(json.dumps(an))
    (root / "metrics" / "base.json").write_text(json.dumps({"seconds": 12.5}))
    (root / "metrics" / "plots" / "train").mkdir(parents=True, exist_ok=True)
    for arm in arms:
        (root / "metrics" / f"train_{arm}.json").write_text(json.dumps({"steps": steps[-1], "step_seconds": 1.5}))
        with open(root / "metrics" / "plots" / "train" / f"{arm}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "reward", "reward_std", "loss"])
            for s in range(1, steps[-1] + 1):
                w.writerow([s, 0.3 + 0.01 * s, 0.1, 0.0])
        g = root / "results" / "generations" / arm / f"step-{steps[-1]}" / "solo"
        g.mkdir(parents=True, exist_ok=True)
        rows = [{"id": f"p{i}", "sample": 0, "prompt_ids": [1], "completion_ids": [2], "owner": [1],
                 "text": HOSTILE if i == 0 else f"step {i}\n\n\\boxed{{{i}}}", "answer": str(i), "score": 1.0,
                 "finish_reason": "eos", "handoffs": 0} for i in range(3)]
        (g / f"{sorted(ev['settings']['benchmarks'])[0]}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return ev


def write_full_generations(root: Path, ev: dict, p_correct: dict[str, float] | None = None, seed: int = 0) -> None:
    """Every generation file the per-problem measures read (tasks/measures.py): each arm's last checkpoint and
    the base (step 0, under the first arm) in every mode and benchmark, `n_samples` 0/1-scored rows per problem.
    `p_correct` (arm or "base" -> probability a sample is correct) sets how strong each one looks."""
    rnd = random.Random(seed)
    s = ev["settings"]
    arms = list(ev["arms"])
    plan = [("base", arms[0], 0)] + [(a, a, max(c["step"] for c in ev["arms"][a]["checkpoints"])) for a in arms]
    for who, arm, step in plan:
        p = (p_correct or {}).get(who, 0.5)
        for mode in s["modes"]:
            for b, meta in s["benchmarks"].items():
                g = root / "results" / "generations" / arm / f"step-{step}" / mode
                g.mkdir(parents=True, exist_ok=True)
                rows = [{"id": f"{b}-{i}", "sample": j, "text": f"step {i}\n\n\\boxed{{{i}}}", "answer": str(i),
                         "score": 1.0 if rnd.random() < p else 0.0, "finish_reason": "eos", "handoffs": 0}
                        for i in range(meta["n_problems"]) for j in range(s["n_samples"])]
                (g / f"{b}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def write_per_problem_csv(root: Path, ev: dict, kl: dict[str, float] | None = None, seed: int = 0) -> None:
    """metrics/plots/analysis/per_problem.csv as the analyze stage writes it: one row per arm x evaluated
    checkpoint x benchmark x problem id (junior_ce, overlap, kl_mean: means over the problem's completions)."""
    rnd = random.Random(seed)
    d = root / "metrics" / "plots" / "analysis"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "per_problem.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "step", "benchmark", "id", "n_completions", "junior_ce", "overlap", "kl_mean"])
        for arm, doc in ev["arms"].items():
            for c in doc["checkpoints"]:
                level = 0.0 if c["step"] == 0 else (kl or {}).get(arm, 0.1)
                for b, meta in ev["settings"]["benchmarks"].items():
                    for i in range(meta["n_problems"]):
                        x = level * (1 + 0.2 * rnd.uniform(-1, 1))
                        w.writerow([arm, c["step"], b, f"{b}-{i}", ev["settings"]["n_samples"], 0.4 + x, 0.9 - x, x])
