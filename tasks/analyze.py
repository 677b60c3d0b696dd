"""Stage `analyze`: legibility to the junior and drift from the base, per arm and checkpoint.

Reads `metrics/eval.json` (which checkpoints exist, their paths and content hashes) and the saved solo
generations, teacher-forces each checkpoint and the base (= the frozen junior) on the checkpoint's own solo
completions, and reports junior cross-entropy, distribution overlap, per-token KL(senior || base) (mean,
quantiles, histogram), and the mean log-ratio on the reference arm's most-drifted token types. Writes
`metrics/analysis.json` and the CSV tables of docs/metrics.md; identical weights are scored once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.config import Params
from tandem.evaluation import content_hash, teacher_forced_stats, torch_threads
from tandem.metrics.drift import histogram_counts, per_type_sums_V, quantiles, top_types
from tandem.metrics.passk import macro_mean
from tasks.common import Layout, atomic_path, read_json, read_jsonl, write_json
from tasks.evaluate import write_csv
from tandem.errors import BadInputError

HIST_QUANTILE = 0.99  # the shared histogram spans [0, the largest 0.99-quantile]; the last bin takes the rest


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    L = Layout.of(params)
    inputs = {"eval": L.metrics / "eval.json", "generations": L.generations, "base_model": L.base_model,
              "checkpoints": L.checkpoints}
    outputs = {"metrics": L.metrics / "analysis.json", "plots": L.plots / "analysis"}
    return inputs, outputs


def _resolve(path: str, root: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else root / p


def _solo_generations(gen_dir: Path, arm: str, step: int, benchmarks: list[str]) -> dict[str, list[dict]]:
    out = {}
    for b in benchmarks:
        f = gen_dir / arm / f"step-{step}" / "solo" / f"{b}.jsonl"
        if not f.exists():
            raise FileNotFoundError(f"analyze: missing solo generations {f}; rerun evaluate with 'solo' in "
                                    f"evaluate.modes")
        out[b] = read_jsonl(f)
    return out


def _checkpoint_stats(senior, base, gens: dict[str, list[dict]], batch_size: int, pad_id: int,
                      progress: bool, desc: str) -> dict[str, list[dict[str, np.ndarray]]]:
    """Per benchmark, per completion: the per-token arrays of `teacher_forced_stats` plus `targets`."""
    from tqdm.auto import tqdm

    flat = [(b, r) for b, rows in gens.items() for r in rows]
    with tqdm(total=len(flat), desc=desc, unit="seq", disable=not progress, file=sys.stderr) as bar:
        stats = teacher_forced_stats(senior, base, [r["prompt_ids"] for _, r in flat],
                                     [r["completion_ids"] for _, r in flat], batch_size=batch_size,
                                     pad_id=pad_id, progress=bar.update)
    out: dict[str, list[dict[str, np.ndarray]]] = {b: [] for b in gens}
    for (b, r), s in zip(flat, stats):
        s["targets"] = np.asarray(r["completion_ids"], dtype=np.int64)
        out[b].append(s)
    return out


def _per_completion_mean(stats: list[dict[str, np.ndarray]], name: str) -> float | None:
    vals = [float(s[name].mean()) for s in stats if s[name].size]
    return float(np.mean(vals)) if vals else None


def _pooled(stats_by_b: dict[str, list[dict]], name: str) -> np.ndarray:
    arrs = [s[name] for rows in stats_by_b.values() for s in rows]
    return np.concatenate(arrs) if arrs else np.zeros(0, dtype=np.float32)


def _type_sums(stats_by_b: dict[str, list[dict]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    lr = torch.from_numpy(_pooled(stats_by_b, "logratio"))[None]
    ids = torch.from_numpy(_pooled(stats_by_b, "targets").astype(np.int64))[None]
    return per_type_sums_V(lr, ids, torch.ones_like(ids), vocab)


def run(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    """Analyse every arm's checkpoints; returns {"<arm>/<metric>": value} at each arm's last checkpoint."""
    di, do = default_io(params)
    inputs, outputs = {**di, **(inputs or {})}, {**do, **(outputs or {})}
    with torch_threads(params.analyze.torch_threads):
        return _run(params, inputs, outputs)


def _run(params: Params, inputs: dict, outputs: dict) -> dict:
    from tandem.models import load_model, load_tokenizer

    an = params.analyze
    root = Path(params.out_root)
    ev = read_json(inputs["eval"])
    benchmarks = list(ev["settings"]["benchmarks"])
    gen_dir = Path(inputs["generations"])
    base_path = _resolve(ev["junior"]["path"], root)
    base_hash = ev["junior"]["hash"]
    arms = [a for a in params.train.arms if a in ev["arms"]]
    if not arms:
        raise BadInputError(f"analyze: none of train.arms {params.train.arms} is in {inputs['eval']} "
                         f"(arms there: {sorted(ev['arms'])}); rerun evaluate")
    for c in [c for a in arms for c in ev["arms"][a]["checkpoints"]] + [ev["junior"]]:
        p = _resolve(c["path"], root)
        if content_hash(p) != c["hash"]:
            raise BadInputError(f"analyze: the weights at {p} changed since evaluate (hash {c['hash'][:12]} in "
                               f"eval.json); rerun evaluate")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = load_tokenizer(base_path, trust_remote_code=params.model.trust_remote_code)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    base = load_model(base_path, params.model.dtype, params.model.trust_remote_code).to(device).eval()
    vocab = int(base.get_output_embeddings().weight.shape[0]) if base.get_output_embeddings() is not None \
        else int(base.config.vocab_size)

    # Teacher-force each distinct checkpoint once (every arm's step 0 is the base).
    by_hash: dict[str, dict[str, list[dict]]] = {}
    for arm in arms:
        for c in ev["arms"][arm]["checkpoints"]:
            if c["hash"] in by_hash:
                continue
            gens = _solo_generations(gen_dir, arm, c["step"], benchmarks)
            senior = None
            if c["hash"] != base_hash:
                senior = load_model(_resolve(c["path"], root), params.model.dtype,
                                    params.model.trust_remote_code).to(device).eval()
            by_hash[c["hash"]] = _checkpoint_stats(senior, base, gens, an.batch_size, pad_id,
                                                   params.evaluate.progress, f"analyze {arm} step-{c['step']}")
            del senior

    # Shared KL histogram edges, so every arm and checkpoint is binned alike.
    q_hi = [float(np.quantile(k, HIST_QUANTILE)) for k in (_pooled(s, "kl") for s in by_hash.values()) if k.size]
    edges = np.linspace(0.0, max(q_hi + [1e-6]), an.kl_bins + 1)

    # The reference arm's most-drifted token types.
    reference: dict[str, Any] = {"arm": an.reference_arm, "step": None, "hash": None, "n_types": 0, "tokens": []}
    top_ids: list[int] = []
    if an.reference_arm in arms:
        last = ev["arms"][an.reference_arm]["checkpoints"][-1]
        if last["step"] > 0:
            s_V, c_V = _type_sums(by_hash[last["hash"]], vocab)
            top_ids = top_types(s_V, c_V, an.top_drift_tokens, an.min_type_count)
            toks = tok.convert_ids_to_tokens(top_ids)
            reference.update(step=last["step"], hash=last["hash"], n_types=len(top_ids), tokens=[
                {"rank": r + 1, "id": i, "token": t, "count": int(c_V[i]), "logratio": float(s_V[i] / c_V[i])}
                for r, (i, t) in enumerate(zip(top_ids, toks))])
    top_set = torch.tensor(top_ids, dtype=torch.long)

    out_arms: dict[str, Any] = {}
    for arm in arms:
        rows = []
        for c in ev["arms"][arm]["checkpoints"]:
            st = by_hash[c["hash"]]
            rows.append(_checkpoint_entry(c, st, benchmarks, edges, an.quantiles, top_set, vocab))
        last_st = by_hash[ev["arms"][arm]["checkpoints"][-1]["hash"]]
        s_V, c_V = _type_sums(last_st, vocab)
        final = [{"id": i, "count": int(c_V[i]), "logratio": float(s_V[i] / c_V[i]) if c_V[i] > 0 else None}
                 for i in top_ids]
        out_arms[arm] = {"checkpoints": rows, "top_tokens_final": final}

    summary = {}
    for arm, a in out_arms.items():
        last = a["checkpoints"][-1]
        summary[arm] = {"final_step": last["step"], "junior_ce": last["legibility"]["junior_ce"]["macro"],
                        "overlap": last["legibility"]["overlap"]["macro"], "kl_mean": last["drift"]["kl"]["mean"],
                        "logratio_top": last["drift"]["top_tokens"]["mean_logratio"]}
    doc = {
        "settings": {"top_drift_tokens": an.top_drift_tokens, "min_type_count": an.min_type_count,
                     "kl_bins": an.kl_bins, "quantiles": list(an.quantiles), "reference_arm": an.reference_arm,
                     "benchmarks": benchmarks},
        "kl_histogram_edges": edges.tolist(), "reference": reference, "arms": out_arms, "summary": summary,
    }
    with atomic_path(outputs["plots"]) as tmp:
        tmp.mkdir()
        for arm in arms:
            write_csv(tmp / f"{arm}.csv", *_arm_table(out_arms[arm], an.quantiles, benchmarks))
        write_csv(tmp / "drift_tokens.csv", *_tokens_table(reference, out_arms))
        write_csv(tmp / "drift_hist.csv", *_hist_table(edges, out_arms))
    write_json(outputs["metrics"], doc)
    return {f"{arm}/{k}": v for arm, s in summary.items() for k, v in s.items() if k != "final_step"}


def _checkpoint_entry(c: dict, st: dict[str, list[dict]], benchmarks: list[str], edges: np.ndarray,
                      qs: list[float], top_set: torch.Tensor, vocab: int) -> dict:
    ce = {b: _per_completion_mean(st[b], "junior_nll") for b in benchmarks}
    ov = {b: _per_completion_mean(st[b], "overlap") for b in benchmarks}
    kl = _pooled(st, "kl")
    kl_b = {b: (float(np.concatenate([s["kl"] for s in st[b]]).mean())
                if sum(s["kl"].size for s in st[b]) else None) for b in benchmarks}
    lr = _pooled(st, "logratio")
    top: dict[str, Any] = {"mean_logratio": None, "type_mean": None, "coverage": None, "n_tokens": 0}
    if top_set.numel():
        ids = torch.from_numpy(_pooled(st, "targets").astype(np.int64))
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


def _arm_table(arm: dict, qs: list[float], benchmarks: list[str]):
    cols = (["step", "hash", "junior_ce", "overlap", "kl_mean"] + [f"kl_q{q}" for q in qs]
            + ["logratio_mean", "top_logratio", "top_type_mean", "top_coverage"]
            + [f"{m}/{b}" for b in benchmarks for m in ("junior_ce", "overlap", "kl_mean")])
    rows = []
    for c in arm["checkpoints"]:
        leg, dr = c["legibility"], c["drift"]
        r = {"step": c["step"], "hash": c["hash"][:12], "junior_ce": leg["junior_ce"]["macro"],
             "overlap": leg["overlap"]["macro"], "kl_mean": dr["kl"]["mean"],
             "logratio_mean": dr["logratio_mean"], "top_logratio": dr["top_tokens"]["mean_logratio"],
             "top_type_mean": dr["top_tokens"]["type_mean"], "top_coverage": dr["top_tokens"]["coverage"]}
        r.update({f"kl_q{q}": dr["kl"]["quantiles"][str(q)] for q in qs})
        for b in benchmarks:
            r.update({f"junior_ce/{b}": leg["junior_ce"]["benchmarks"][b], f"overlap/{b}": leg["overlap"]["benchmarks"][b],
                      f"kl_mean/{b}": dr["kl"]["benchmarks"][b]})
        rows.append(r)
    return cols, rows


def _tokens_table(reference: dict, arms: dict):
    cols = ["rank", "id", "token", "ref_count", "ref_logratio"] + [f"{a}/{f}" for a in arms for f in ("logratio", "count")]
    rows = []
    for j, t in enumerate(reference["tokens"]):
        r = {"rank": t["rank"], "id": t["id"], "token": t["token"], "ref_count": t["count"], "ref_logratio": t["logratio"]}
        for a, arm in arms.items():
            r[f"{a}/logratio"] = arm["top_tokens_final"][j]["logratio"]
            r[f"{a}/count"] = arm["top_tokens_final"][j]["count"]
        rows.append(r)
    return cols, rows


def _hist_table(edges: np.ndarray, arms: dict):
    cols = ["bin", "lo", "hi"] + list(arms)
    rows = []
    fracs = {}
    for a, arm in arms.items():
        h = np.asarray(arm["checkpoints"][-1]["drift"]["kl"]["histogram"], dtype=np.float64)
        fracs[a] = h / h.sum() if h.sum() else np.full_like(h, np.nan)
    for i in range(len(edges) - 1):
        r: dict[str, Any] = {"bin": i, "lo": float(edges[i]), "hi": float(edges[i + 1])}
        r.update({a: (None if np.isnan(f[i]) else float(f[i])) for a, f in fracs.items()})
        rows.append(r)
    return cols, rows


