"""The analysis numerics: legibility and drift per checkpoint, the shared KL histogram, most-drifted token types.

These are the numbers of `metrics/analysis.json` (docs/metrics.md); the analyze stage only reads and writes.

Input: for each checkpoint, `stats_by_b` = {benchmark: [one dict per completion]} where each dict holds the
float arrays of `tandem.evaluation.teacher_forced_stats` (`junior_nll`, `overlap`, `kl`, `logratio`, one value
per completion token) and `targets` (the token ids). Everything here is pure: arrays in, JSON-ready dicts out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
import torch

from tandem.metrics.drift import histogram_counts, per_type_sums_V, quantiles, top_types
from tandem.metrics.passk import macro_mean

if TYPE_CHECKING:
    from tandem.config import AnalyzeConfig

StatsByBenchmark = Mapping[str, Sequence[Mapping[str, np.ndarray]]]
HIST_QUANTILE = 0.99  # the shared histogram spans [0, the largest 0.99-quantile]; the last bin takes the rest


def per_completion_mean(stats: Sequence[Mapping[str, np.ndarray]], name: str) -> float | None:
    """Mean over completions of each completion's mean `name` (empty completions skipped; None if all are)."""
    vals = [float(s[name].mean()) for s in stats if s[name].size]
    return float(np.mean(vals)) if vals else None


def _by_problem(stats: Sequence[Mapping[str, np.ndarray]], ids: Sequence[Any]) -> dict[Any, list]:
    if len(stats) != len(ids):
        raise ValueError(f"per-problem statistics: {len(stats)} completions but {len(ids)} problem ids")
    groups: dict[Any, list] = {}
    for s, i in zip(stats, ids):
        groups.setdefault(i, []).append(s)
    return groups


def per_problem_means(stats: Sequence[Mapping[str, np.ndarray]], ids: Sequence[Any],
                      name: str) -> dict[Any, float | None]:
    """Problem id -> `per_completion_mean` of `name` over that problem's completions (`ids[i]` is the problem
    of `stats[i]`; ids in first-seen order). Weighted by `per_problem_counts`, these average back to
    `per_completion_mean(stats, name)`, so a study can resample problems and keep the per-completion metric."""
    return {i: per_completion_mean(g, name) for i, g in _by_problem(stats, ids).items()}


def per_problem_counts(stats: Sequence[Mapping[str, np.ndarray]], ids: Sequence[Any],
                       name: str = "junior_nll") -> dict[Any, int]:
    """Problem id -> how many of its completions are non-empty (the ones `per_problem_means` averages)."""
    return {i: sum(1 for s in g if s[name].size) for i, g in _by_problem(stats, ids).items()}


def pooled(stats_by_b: StatsByBenchmark, name: str) -> np.ndarray:
    """Every token's `name` value across benchmarks and completions, concatenated in order."""
    arrs = [s[name] for rows in stats_by_b.values() for s in rows]
    return np.concatenate(arrs) if arrs else np.zeros(0, dtype=np.float32)


def type_sums_V(stats_by_b: StatsByBenchmark, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log-ratios, count) per token id over every token of a checkpoint."""
    lr = torch.from_numpy(pooled(stats_by_b, "logratio"))[None]
    ids = torch.from_numpy(pooled(stats_by_b, "targets").astype(np.int64))[None]
    return per_type_sums_V(lr, ids, torch.ones_like(ids), vocab)


def kl_histogram_edges(all_stats: Sequence[StatsByBenchmark], bins: int, q: float = HIST_QUANTILE) -> np.ndarray:
    """`bins` + 1 equal-width edges over [0, the largest per-checkpoint q-quantile of per-token KL]."""
    hi = [float(np.quantile(k, q)) for k in (pooled(s, "kl") for s in all_stats) if k.size]
    return np.linspace(0.0, max(hi + [1e-6]), bins + 1)


def reference_types(stats_by_b: StatsByBenchmark, vocab: int, k: int, min_count: int,
                    to_tokens: Callable[[list[int]], list[str]]) -> tuple[list[int], list[dict]]:
    """The `k` token types with the largest mean log-ratio (seen >= `min_count` times): ids and table rows."""
    s_V, c_V = type_sums_V(stats_by_b, vocab)
    ids = top_types(s_V, c_V, k, min_count)
    rows = [{"rank": r + 1, "id": i, "token": t, "count": int(c_V[i]), "logratio": float(s_V[i] / c_V[i])}
            for r, (i, t) in enumerate(zip(ids, to_tokens(ids)))]
    return ids, rows


def top_tokens_final(stats_by_b: StatsByBenchmark, top_ids: Sequence[int], vocab: int) -> list[dict]:
    """Count and mean log-ratio of each of `top_ids` in one checkpoint (None where the type never occurs)."""
    s_V, c_V = type_sums_V(stats_by_b, vocab)
    return [{"id": i, "count": int(c_V[i]), "logratio": float(s_V[i] / c_V[i]) if c_V[i] > 0 else None}
            for i in top_ids]


def checkpoint_entry(c: Mapping[str, Any], st: StatsByBenchmark, benchmarks: Sequence[str], edges: np.ndarray,
                     qs: Sequence[float], top_set: torch.Tensor, vocab: int) -> dict:
    """Legibility (junior CE, overlap) and drift (KL mean/quantiles/histogram, log-ratios) of one checkpoint."""
    ce = {b: per_completion_mean(st[b], "junior_nll") for b in benchmarks}
    ov = {b: per_completion_mean(st[b], "overlap") for b in benchmarks}
    kl = pooled(st, "kl")
    kl_b = {b: (float(np.concatenate([s["kl"] for s in st[b]]).mean())
                if sum(s["kl"].size for s in st[b]) else None) for b in benchmarks}
    lr = pooled(st, "logratio")
    top: dict[str, Any] = {"mean_logratio": None, "type_mean": None, "coverage": None, "n_tokens": 0}
    if top_set.numel():
        ids = torch.from_numpy(pooled(st, "targets").astype(np.int64))
        in_top = torch.isin(ids, top_set)
        s_V, c_V = per_type_sums_V(torch.from_numpy(lr)[None], ids[None], torch.ones_like(ids)[None], vocab)
        seen = top_set[c_V[top_set] > 0]
        top = {"mean_logratio": float(torch.from_numpy(lr)[in_top].double().mean()) if in_top.any() else None,
               "type_mean": float((s_V[seen] / c_V[seen]).mean()) if seen.numel() else None,
               "coverage": float(seen.numel() / top_set.numel()), "n_tokens": int(in_top.sum())}
    return {
        "step": c["step"], "hash": c["hash"], "n_completions": sum(len(st[b]) for b in benchmarks),
        "n_tokens": int(kl.size),
        "legibility": {"junior_ce": {"macro": macro_mean(ce), "benchmarks": ce},
                       "overlap": {"macro": macro_mean(ov), "benchmarks": ov}},
        "drift": {"kl": {"mean": float(kl.mean()) if kl.size else None, "quantiles": quantiles(kl, qs),
                         "histogram": histogram_counts(kl, edges), "benchmarks": kl_b},
                  "logratio_mean": float(lr.mean()) if lr.size else None, "top_tokens": top},
    }


def analyze_checkpoints(arms: Mapping[str, Sequence[Mapping[str, Any]]], by_hash: Mapping[str, StatsByBenchmark],
                        benchmarks: Sequence[str], vocab: int, cfg: AnalyzeConfig,
                        to_tokens: Callable[[list[int]], list[str]]) -> dict:
    """The analysis document: `arms` maps each arm to its checkpoints ({step, hash, ...} by step, step 0 the
    base) and `by_hash` each checkpoint hash to its statistics; `cfg` the analyze settings (reference arm,
    top drift tokens, minimum type count, KL bins, quantiles). Returns {kl_histogram_edges, reference, arms,
    summary}; the histogram edges are shared by every checkpoint, and the drifted types are the reference
    arm's at its last checkpoint (none when that arm is absent or untrained)."""
    reference_arm, qs = cfg.reference_arm, cfg.quantiles
    edges = kl_histogram_edges(list(by_hash.values()), cfg.kl_bins)
    reference: dict[str, Any] = {"arm": reference_arm, "step": None, "hash": None, "n_types": 0, "tokens": []}
    top_ids: list[int] = []
    if reference_arm in arms and arms[reference_arm][-1]["step"] > 0:
        last = arms[reference_arm][-1]
        top_ids, rows = reference_types(by_hash[last["hash"]], vocab, cfg.top_drift_tokens, cfg.min_type_count,
                                        to_tokens)
        reference.update(step=last["step"], hash=last["hash"], n_types=len(top_ids), tokens=rows)
    top_set = torch.tensor(top_ids, dtype=torch.long)
    out_arms = {arm: {"checkpoints": [checkpoint_entry(c, by_hash[c["hash"]], benchmarks, edges, qs, top_set, vocab)
                                      for c in cks],
                      "top_tokens_final": top_tokens_final(by_hash[cks[-1]["hash"]], top_ids, vocab)}
                for arm, cks in arms.items()}
    summary = {}
    for arm, a in out_arms.items():
        last = a["checkpoints"][-1]
        summary[arm] = {"final_step": last["step"], "junior_ce": last["legibility"]["junior_ce"]["macro"],
                        "overlap": last["legibility"]["overlap"]["macro"], "kl_mean": last["drift"]["kl"]["mean"],
                        "logratio_top": last["drift"]["top_tokens"]["mean_logratio"]}
    return {"kl_histogram_edges": edges.tolist(), "reference": reference, "arms": out_arms, "summary": summary}
