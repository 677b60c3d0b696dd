"""Synthetic per-problem study results (`studies/results/seed-<S>/<arm>.csv`) with known effects and variance
components, written in the study's format (tandem.study.results.arm_csv_text).

Every value is level[arm] + a_p + b_(arm, seed) + e_(arm, seed, p): a problem effect shared by every arm and
seed (problems are crossed with seeds), a seed effect per arm and seed, and a residual. Correct-sample counts
are Binomial(n, clip(p)) draws with p built the same way from the arm's solo / step probability.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.study.results import ARMS, arm_csv_text


def write_arm_csv(path, rows) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(arm_csv_text(rows))

BENCHMARKS = {"arith-long": 24, "arith-mid": 24, "arith-short": 24}
# Levels per arm: solo / step probability of a correct sample and the measures' means. By default tandem keeps
# most of GRPO's gain, is better with the junior, drifts less; the control drifts far, toward the junior's worst.
LEVELS = {
    "base": dict(solo=0.40, step=0.38, junior_ce=0.30, overlap=0.990, kl_mean=0.0, common_kl=0.0,
                 common_overlap=1.0, compact_share=0.05),
    "tandem": dict(solo=0.58, step=0.62, junior_ce=0.32, overlap=0.975, kl_mean=0.05, common_kl=0.04,
                   common_overlap=0.98, compact_share=0.10),
    "grpo": dict(solo=0.60, step=0.45, junior_ce=0.40, overlap=0.950, kl_mean=0.15, common_kl=0.12,
                 common_overlap=0.95, compact_share=0.40),
    "kl_reg": dict(solo=0.59, step=0.47, junior_ce=0.36, overlap=0.960, kl_mean=0.08, common_kl=0.07,
                   common_overlap=0.97, compact_share=0.25),
    "control": dict(solo=0.30, step=0.25, junior_ce=0.70, overlap=0.900, kl_mean=0.40, common_kl=0.35,
                    common_overlap=0.90, compact_share=0.95),
}
# sd of (problem, seed, residual) per quantity
SDS = dict(solo=(0.15, 0.01, 0.05), step=(0.15, 0.01, 0.05), junior_ce=(0.02, 0.005, 0.01),
           overlap=(0.003, 0.001, 0.002), kl_mean=(0.01, 0.003, 0.005), common_kl=(0.01, 0.003, 0.005),
           common_overlap=(0.003, 0.001, 0.002), compact_share=(0.05, 0.02, 0.05))
CLIP = dict(solo=(0, 1), step=(0, 1), junior_ce=(0, None), overlap=(0, 1), kl_mean=(0, None),
            common_kl=(0, None), common_overlap=(0, 1), compact_share=(0, 1))


def write_fake_results(results: Path, seeds=(0, 1, 2), arms=ARMS, levels=None, sds=None, n_samples: int = 8,
                       benchmarks=None, rng_seed: int = 0, best_steps: dict | None = None,
                       best_shift: float = 0.0) -> Path:
    """Write seed-<S>/<arm>.csv for every seed x arm; returns `results`.

    `levels` / `sds` override LEVELS / SDS per arm or quantity. Trained arms get a `best` checkpoint at
    `best_steps[arm]` (default 300) whose solo and step probabilities are shifted by `best_shift`; the base and
    the control repeat their one checkpoint as `best`.
    """
    levels = {a: {**LEVELS[a], **((levels or {}).get(a, {}))} for a in arms}
    sds = {**SDS, **(sds or {})}
    benchmarks = benchmarks or BENCHMARKS
    rng = np.random.default_rng(rng_seed)
    problem = {q: {b: rng.normal(0, sds[q][0], P) for b, P in sorted(benchmarks.items())} for q in SDS}
    for s in seeds:
        for arm in arms:
            rows = []
            one_ckpt = arm in ("base", "control")
            ckpts = [("final", 0 if arm == "base" else 30 if arm == "control" else 600, 0.0),
                     ("best", 0 if arm == "base" else 30 if arm == "control" else (best_steps or {}).get(arm, 300),
                      0.0 if one_ckpt else best_shift)]
            seed_eff = {q: rng.normal(0, sds[q][1]) for q in SDS}
            resid = {q: {b: rng.normal(0, sds[q][2], P) for b, P in sorted(benchmarks.items())} for q in SDS}
            draws = {}
            for b, P in sorted(benchmarks.items()):
                for i in range(P):
                    pid = f"{b}-{i:03d}"
                    vals = {}
                    for q in SDS:
                        lo, hi = CLIP[q]
                        vals[q] = float(np.clip(levels[arm][q] + problem[q][b][i] + seed_eff[q] + resid[q][b][i],
                                                lo, hi))
                    for name, step, shift in ckpts:
                        if name == "best" and one_ckpt:
                            counts = draws[(b, i)]
                        else:
                            counts = {m: int(rng.binomial(n_samples, float(np.clip(vals[m] + shift, 0, 1))))
                                      for m in ("solo", "step")}
                            draws.setdefault((b, i), counts)
                        rows.append({"seed": s, "arm": arm, "checkpoint": name, "step": step, "benchmark": b,
                                     "id": pid, "n_samples": n_samples, "solo_correct": counts["solo"],
                                     "step_correct": counts["step"], "junior_ce": vals["junior_ce"],
                                     "overlap": vals["overlap"], "kl_mean": vals["kl_mean"],
                                     "common_kl": vals["common_kl"], "common_overlap": vals["common_overlap"],
                                     "compact_share": vals["compact_share"]})
            write_arm_csv(results / f"seed-{s}" / f"{arm}.csv", rows)
    return results
