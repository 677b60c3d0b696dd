"""Stage `analyze`: legibility to the junior and drift from the base, per arm and checkpoint.

Reads `metrics/eval.json` (which checkpoints exist, their paths and content hashes) and the saved solo
generations, teacher-forces each checkpoint, the junior and the base (the same model unless `junior.source` gives
the junior a model of its own) on the checkpoint's own solo completions, and reports junior cross-entropy and
distribution overlap (against the junior), per-token KL(senior || base) (mean,
quantiles, histogram), and the mean log-ratio on the reference arm's most-drifted token types. Writes
`metrics/analysis.json` and the CSV tables of docs/metrics.md, among them `per_problem.csv` (the values per
problem, which a multi-seed study resamples) and `common_text.csv` (per-token KL(senior || base) and overlap
on each benchmark problem's reference solution: one text shared by every arm and seed, so a difference in the
arms' own style mix or length cannot pass for drift); identical weights are scored once. Each checkpoint's
statistics are cached under their key in `scratch/analyze/` (`tandem.eval_cache.StatsCache`, not a DVC output;
the key names the weights, the texts, the numerics settings and the source of the code that computes them), so
an analysis stopped midway resumes at the first checkpoint it had not finished.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.checkpoints import generations_file
from tandem.config import Params
from tandem.eval_cache import StatsCache, stats_key
from tandem.evaluation import content_hash, teacher_forced_pair_stats, teacher_forced_stats
from tandem.threads import torch_threads
from tandem.metrics.analysis import analyze_checkpoints, per_problem_counts, per_problem_means
from tasks import headline
from tasks.common import Layout, atomic_path, read_json, read_jsonl, write_csv, write_json, write_npz
from tandem.errors import BadInputError


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    lay = Layout.of(params)
    inputs = {"eval": lay.metrics / "eval.json", "generations": lay.generations, "base_model": lay.base_model,
              "junior_model": lay.junior_model, "checkpoints": lay.checkpoints, "eval_data": lay.prepared / "eval"}
    outputs = {"metrics": lay.metrics / "analysis.json", "headline": lay.metrics / "headline" / "analysis.json",
               "plots": lay.plots / "analysis", "cache": lay.scratch / "analyze"}
    return inputs, outputs


def _resolve(path: str, root: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else root / p


def _solo_generations(gen_dir: Path, arm: str, step: int, benchmarks: list[str]) -> dict[str, list[dict]]:
    out = {}
    for b in benchmarks:
        f = generations_file(gen_dir, arm, step, "solo", b)
        if not f.exists():
            raise FileNotFoundError(f"analyze: missing solo generations {f}; rerun evaluate with 'solo' in "
                                    f"evaluate.modes")
        out[b] = read_jsonl(f)
    return out


def _checkpoint_stats(senior, base, junior, gens: dict[str, list[dict]], batch_size: int, pad_id: int,
                      progress: bool, desc: str) -> tuple[dict[str, list[dict[str, np.ndarray]]], dict[str, list]]:
    """Per benchmark, per completion: the per-token arrays of `teacher_forced_stats` plus `targets`; and per
    benchmark, the problem id of each completion (same order)."""
    from tqdm.auto import tqdm

    flat = [(b, r) for b, rows in gens.items() for r in rows]
    with tqdm(total=len(flat), desc=desc, unit="seq", disable=not progress, file=sys.stderr) as bar:
        stats = teacher_forced_pair_stats(senior, base, junior, [r["prompt_ids"] for _, r in flat],
                                          [r["completion_ids"] for _, r in flat], batch_size=batch_size,
                                          pad_id=pad_id, progress=bar.update)
    out: dict[str, list[dict[str, np.ndarray]]] = {b: [] for b in gens}
    for (b, r), s in zip(flat, stats):
        s["targets"] = np.asarray(r["completion_ids"], dtype=np.int64)
        out[b].append(s)
    return out, {b: [r["id"] for r in rows] for b, rows in gens.items()}


def _reference_texts(eval_dir: Path, ids_by_bench: dict[str, list], tok) -> dict[str, tuple[list, list, list]]:
    """Per benchmark, the evaluated problems that have a reference solution: (ids, prompt_ids, solution ids
    with EOS). Benchmarks without reference solutions (most real sets) are left out."""
    from tandem.generation import encode_prompts

    out = {}
    eos = tok.eos_token_id
    for b, ids in ids_by_bench.items():
        f = Path(eval_dir) / f"{b}.jsonl"
        if not f.exists():
            continue
        wanted = set(map(str, ids))
        rows = [r for r in read_jsonl(f) if str(r["id"]) in wanted and r.get("solution")]
        if not rows:
            continue
        sol = [list(tok(r["solution"], add_special_tokens=False)["input_ids"]) + ([eos] if eos is not None else [])
               for r in rows]
        out[b] = ([str(r["id"]) for r in rows], encode_prompts(rows, tok), sol)
    return out


def _common_stats(senior, base, refs: dict, batch_size: int, pad_id: int) -> dict[str, dict[str, dict[str, float]]]:
    """benchmark -> problem id -> {kl_mean, overlap}: per-token means on the problem's reference solution."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for b, (ids, prompts, sols) in refs.items():
        stats = teacher_forced_stats(senior, base, prompts, sols, batch_size=batch_size, pad_id=pad_id)
        out[b] = {i: {"kl_mean": float(np.mean(st["kl"])), "overlap": float(np.mean(st["overlap"]))}
                  for i, st in zip(ids, stats)}
    return out


def _stats_code() -> str:
    """SHA-256 of the source that computes a checkpoint's statistics (this stage and the library modules it
    teacher-forces with): a cache entry written by other code is not read back."""
    import hashlib

    import tandem.evaluation
    import tandem.logprobs
    import tandem.metrics.drift
    import tandem.metrics.legibility

    h = hashlib.sha256()
    for mod in (tandem.evaluation, tandem.logprobs, tandem.metrics.drift, tandem.metrics.legibility,
                sys.modules[__name__]):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def _texts(gens: dict[str, list[dict]]) -> list:
    """What a checkpoint is teacher-forced on, as its cache key names it: per benchmark, each completion's
    problem id, prompt ids and completion ids, in order."""
    return [[b, [[r["id"], r["prompt_ids"], r["completion_ids"]] for r in rows]] for b, rows in gens.items()]


def run(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    """Analyse every arm's checkpoints; returns {"<arm>/<metric>": value} at each arm's last checkpoint."""
    di, do = default_io(params)
    inputs, outputs = {**di, **(inputs or {})}, {**do, **(outputs or {})}
    with torch_threads(params.analyze.cpu_threads):
        return _run(params, inputs, outputs)


def _run(params: Params, inputs: dict, outputs: dict) -> dict:
    from tandem.models import load_model, load_tokenizer

    an = params.analyze
    root = Path(params.out_root)
    ev = read_json(inputs["eval"])
    benchmarks = list(ev["settings"]["benchmarks"])
    gen_dir = Path(inputs["generations"])
    junior_path = _resolve(ev["junior"]["path"], root)
    junior_hash = ev["junior"]["hash"]
    base_path = Path(inputs["base_model"])
    base_hash = content_hash(base_path)
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
    # a junior of its own: legibility against it, drift against the senior's base (and KL to the junior too)
    junior = None if junior_hash == base_hash else load_model(
        junior_path, params.model.dtype, params.model.trust_remote_code).to(device).eval()
    vocab = int(base.get_output_embeddings().weight.shape[0]) if base.get_output_embeddings() is not None \
        else int(base.config.vocab_size)

    # Teacher-force each distinct checkpoint once (every arm's step 0 is the base), on its own solo completions
    # and on the reference solutions of the evaluated problems (the common text); read back a checkpoint whose
    # statistics the cache holds under the same key.
    cache = StatsCache(Path(outputs["cache"]), write_npz, write_json)
    numerics = {"batch_size": an.batch_size, "dtype": params.model.dtype, "device": device,
                "cpu_threads": an.cpu_threads, "code": _stats_code()}
    junior_key = None if junior is None else junior_hash
    by_hash: dict[str, dict[str, list[dict]]] = {}
    ids_by_hash: dict[str, dict[str, list]] = {}
    common_by_hash: dict[str, dict] = {}
    refs = None
    for arm in arms:
        for c in ev["arms"][arm]["checkpoints"]:
            if c["hash"] in by_hash:
                continue
            gens = _solo_generations(gen_dir, arm, c["step"], benchmarks)
            if refs is None:
                refs = _reference_texts(inputs["eval_data"], {b: sorted({str(r["id"]) for r in rows})
                                                              for b, rows in gens.items()}, tok)
            key = stats_key(c["hash"], base_hash, junior_key, _texts(gens), refs, numerics)
            found = cache.load(key)
            if found is not None:
                by_hash[c["hash"]], ids_by_hash[c["hash"]], common_by_hash[c["hash"]] = found
                continue
            senior = None
            if c["hash"] != base_hash:
                senior = load_model(_resolve(c["path"], root), params.model.dtype,
                                    params.model.trust_remote_code).to(device).eval()
            by_hash[c["hash"]], ids_by_hash[c["hash"]] = _checkpoint_stats(
                senior, base, junior, gens, an.batch_size, pad_id, params.evaluate.progress, f"analyze {arm} step-{c['step']}")
            common_by_hash[c["hash"]] = _common_stats(senior, base, refs, an.batch_size, pad_id)
            cache.store(key, by_hash[c["hash"]], ids_by_hash[c["hash"]], common_by_hash[c["hash"]])
            del senior

    doc = {"settings": {"top_drift_tokens": an.top_drift_tokens, "min_type_count": an.min_type_count,
                        "kl_bins": an.kl_bins, "quantiles": list(an.quantiles), "reference_arm": an.reference_arm,
                        "benchmarks": benchmarks}}
    if junior is not None:  # the default (junior = base) document keeps its shape
        doc["junior"] = {"path": ev["junior"]["path"], "hash": junior_hash, "source": ev["junior"].get("source")}
        doc["base"] = {"hash": base_hash}
    doc.update(analyze_checkpoints(
        {arm: ev["arms"][arm]["checkpoints"] for arm in arms}, by_hash, benchmarks, vocab, an,
        tok.convert_ids_to_tokens))
    out_arms = doc["arms"]
    with atomic_path(outputs["plots"]) as tmp:
        tmp.mkdir()
        for arm in arms:
            write_csv(tmp / f"{arm}.csv", *_arm_table(out_arms[arm], an.quantiles, benchmarks))
        write_csv(tmp / "drift_tokens.csv", *_tokens_table(doc["reference"], out_arms))
        write_csv(tmp / "drift_hist.csv", *_hist_table(np.asarray(doc["kl_histogram_edges"]), out_arms))
        write_csv(tmp / "per_problem.csv", *_problem_table(
            {arm: ev["arms"][arm]["checkpoints"] for arm in arms}, by_hash, ids_by_hash, benchmarks,
            junior is not None))
        write_csv(tmp / "common_text.csv", *_common_table(
            {arm: ev["arms"][arm]["checkpoints"] for arm in arms}, common_by_hash))
    write_json(outputs["metrics"], doc)
    write_json(outputs["headline"], headline.analysis(doc))
    return {f"{arm}/{k}": v for arm, s in doc["summary"].items() for k, v in s.items() if k != "final_step"}


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


PER_PROBLEM = {"junior_ce": "junior_nll", "overlap": "overlap", "kl_mean": "kl"}  # column -> per-token array


def _problem_table(arms: dict[str, list[dict]], by_hash: dict, ids_by_hash: dict, benchmarks: list[str],
                   own_junior: bool = False):
    """One row per (arm, step, benchmark, problem): the per-problem means of `per_problem_means` (with a junior
    of its own also `kl_junior_mean`, KL to the junior)."""
    cols_of = {**PER_PROBLEM, **({"kl_junior_mean": "kl_junior"} if own_junior else {})}
    cols = ["arm", "step", "benchmark", "id", "n_completions"] + list(cols_of)
    rows = []
    for arm, cks in arms.items():
        for c in cks:
            for b in benchmarks:
                st, ids = by_hash[c["hash"]][b], ids_by_hash[c["hash"]][b]
                means = {col: per_problem_means(st, ids, name) for col, name in cols_of.items()}
                for pid, n in per_problem_counts(st, ids).items():
                    rows.append({"arm": arm, "step": c["step"], "benchmark": b, "id": pid, "n_completions": n,
                                 **{col: m[pid] for col, m in means.items()}})
    return cols, rows


def _common_table(arms: dict[str, list[dict]], common_by_hash: dict):
    """One row per (arm, step, benchmark, problem) with a reference solution: KL and overlap on that text."""
    cols = ["arm", "step", "benchmark", "id", "kl_mean", "overlap"]
    rows = [{"arm": arm, "step": c["step"], "benchmark": b, "id": pid, **v}
            for arm, cks in arms.items() for c in cks
            for b, per in common_by_hash[c["hash"]].items() for pid, v in per.items()]
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


