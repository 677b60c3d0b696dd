"""The claims engine of every registered study: rows driven by the registered claims, over one `Results`.

A registered claim (`tandem.metrics.verdicts.RegisteredClaim`) is evaluated on the arrays of its arms at its
checkpoint (`claim_row`: estimate, crossed-bootstrap interval, one-sided p, seed t-interval, every arm's value);
the primary family is Holm-adjusted (`holm_family`, a row not measured entering with p = 1) and each row decided
(`tandem.metrics.verdicts.decide`). Two documents are built on it:

- `compute` (a pilot-kind registration's study, `studies/registration.yaml`): the primary and secondary rows, the
  positive control's detection check and every arm's value of every measure at the final and the
  best-by-validation checkpoint; partial data give rows on the seeds every arm of the row has, marked
  incomplete, or `not measured` with what is missing;
- `control_document` (a positive control): the claims J1.. at the registered final step, the secondary rows,
  the dose curve and the bug indicators (tandem.study.control).

`dumps` gives the bytes of a claims.json (fixed key order, floats to 12 significant digits, no timestamps, a fixed
bootstrap seed: the same results give the same bytes). Reading and writing files is the driver's
(tasks/study/recompute.py).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

import numpy as np

from tandem.metrics.intervals import bootstrap_interval, seed_means_M, seed_t_interval
from tandem.metrics.verdicts import RegisteredClaim, decide, evaluate, excludes, holm_adjust, not_robust
from tandem.study.registration import ControlRegistration, PilotRegistration
from tandem.study.results import ARMS, CHECKPOINTS, FLOAT_MEASURES, MODES, Results, _natural

FORMAT = "tandem-study-claims/2"
# The registered detection check of the positive control (registration.yaml: positive_control.detected_when):
# (arm a, arm b, measure, constructed direction of a - b).
CONTROL_CHECKS = (("control", "base", "junior_ce", "greater"), ("control", "base", "overlap", "less"),
                  ("control", "base", "common/kl_mean", "greater"), ("control", "grpo", "common/kl_mean", "greater"))


# --------------------------------------------------------------------------------------------------
# Computing the document
# --------------------------------------------------------------------------------------------------

def _row(c: RegisteredClaim, res: Results, stats: Mapping, family: str, expected: list[int]) -> dict:
    """A claim row's numbers (verdicts are decided later, with the family's Holm adjustment)."""
    ckpt = CHECKPOINTS[c.checkpoint]
    seeds = res.seeds_with(ckpt, c.arms, c.metric)
    row: dict[str, Any] = {
        "id": c.id, "family": family, "claim": c.claim, "statement": c.statement, "metric": c.metric,
        "checkpoint": c.checkpoint, "test": c.test, "direction": c.direction, "a": c.a, "b": c.b,
        "comparison": c.comparison,
        "coefficients": c.coefficients, "seeds": seeds, "complete": seeds == expected and bool(seeds),
        "estimate": None, "ci": None, "seed_t": None, "p_one_sided": None, "p_holm": None,
        "sesoi": {"kind": c.sesoi_rule()[0], "registered": c.keep if c.test == "keeps_gain" else c.sesoi_rule()[1],
                  "threshold": None},
        "verdict": "not measured", "excludes": None, "not_robust": None, "kept_share": None, "arms": None,
        "missing": [],
    }
    if not seeds:
        row["missing"] = [f"{a}: no seed with {c.metric} at {c.checkpoint}" for a in c.arms
                          if not res.seeds_with(ckpt, [a], c.metric)] or \
                         [f"no seed where {', '.join(c.arms)} all have {c.metric} at {c.checkpoint}"]
        return row
    row["missing"] = [f"seed {s}" for s in expected if s not in seeds]
    arrays = res.arrays(ckpt, c.arms, c.metric, seeds)
    r = claim_row(c, arrays, stats)
    if not all(math.isfinite(x) for x in [r["estimate"], *r["ci"]]):
        row["missing"] = [f"no finite {c.metric} contrast on seeds {seeds}"]
        return row
    row.update(estimate=r["estimate"], ci=r["ci"], seed_t=r["seed_t"], p_one_sided=r["p_one_sided"],
               kept_share=r.get("kept_share"), arms=r["arms"])
    row["sesoi"]["threshold"] = r["threshold"]
    row["not_robust"] = not_robust(tuple(r["ci"]), tuple(r["seed_t"]) if r["seed_t"] else None)
    return row


def _decide(row: dict, c: RegisteredClaim, p: float, alpha: float) -> None:
    lo, hi = row["ci"]
    row["verdict"] = decide(p, alpha, row["estimate"], lo, hi, c.direction, row["sesoi"]["threshold"])
    if row["verdict"] != "holds":
        row["excludes"] = excludes(c, lo, hi, row["arms"][c.b]["estimate"], row["kept_share"])


def _arm_table(res: Results, ckpt_name: str, stats: Mapping) -> dict:
    """{arm: {measure: {estimate, ci, seed_t, seeds}}} at one checkpoint, every measure of every present arm."""
    ckpt = CHECKPOINTS[ckpt_name]
    measures = [f"{m}/pass@{k}" for m in MODES for k in res.ks] + list(FLOAT_MEASURES)
    out: dict = {}
    for arm in ARMS:
        per: dict = {}
        for m in measures:
            seeds = res.seeds_with(ckpt, [arm], m)
            if not seeds:
                continue
            v = res.arrays(ckpt, [arm], m, seeds)[arm]
            iv = bootstrap_interval(v, n_boot=int(stats["n_boot"]), level=float(stats["level"]),
                                    seed=int(stats["boot_seed"]))
            st = seed_t_interval(seed_means_M(v), float(stats["level"]))
            per[m] = {"estimate": iv.estimate, "ci": [iv.low, iv.high], "seed_t": [st.low, st.high] if st else None,
                      "seeds": seeds}
        if per:
            out[arm] = per
    return out


def _positive_control(res: Results, reg: PilotRegistration, stats: Mapping) -> dict:
    pc = reg.study.get("positive_control") or {}
    checks = []
    for a, b, m, direction in CONTROL_CHECKS:
        c = RegisteredClaim(f"{a} - {b} {m}", "positive control", f"{a} is {'above' if direction == 'greater' else 'below'} "
                            f"{b} on {m}", m, direction, a, b)
        seeds = res.seeds_with("final", c.arms, m)
        check = {"comparison": c.comparison, "metric": m, "direction": direction, "seeds": seeds, "estimate": None,
                 "ci": None, "seed_t": None, "detected": None}
        if seeds:
            r = claim_row(c, res.arrays("final", c.arms, m, seeds), stats)
            lo, hi = r["ci"]
            check.update(estimate=r["estimate"], ci=r["ci"], seed_t=r["seed_t"],
                         detected=bool(lo > 0) if direction == "greater" else bool(hi < 0))
        checks.append(check)
    found = [c["detected"] for c in checks]
    return {"what": pc.get("what"), "detected_when": pc.get("detected_when"), "checks": checks,
            "detected": None if None in found else all(found)}


def holm_family(p_values: Sequence[float | None]) -> list[float]:
    """Holm over the whole registered family; a row not measured enters with p = 1, so missing rows never make
    the others' adjustment milder than registered."""
    return holm_adjust([p if p is not None else 1.0 for p in p_values])


def claim_row(c: RegisteredClaim, arrays: Mapping, stats: Mapping) -> dict:
    """One registered claim's numbers on {arm: {benchmark: values_MP}} (tandem.metrics.verdicts.evaluate)."""
    return evaluate(c, arrays, int(stats["n_boot"]), float(stats["level"]), int(stats["boot_seed"]))


def compute(res: Results, reg: PilotRegistration) -> dict:
    """The claims document (see docs/metrics.md for its schema)."""
    from tandem.errors import BadInputError

    stats = reg.statistics.as_dict()
    alpha = float(stats["alpha_one_sided"])
    expected = sorted(int(s) for s in reg.study.get("seeds", []))
    extra = sorted({s for (_, _, s) in res.values} - set(expected))
    if extra:
        raise BadInputError(f"study claims: results for seed(s) {extra}, which the registration does not list "
                            f"(study.seeds: {expected}); only registered seeds enter the claims")
    primary = [_row(c, res, stats, "primary", expected) for c in reg.claims]
    adjusted = holm_family([r["p_one_sided"] for r in primary])
    for c, r, p in zip(reg.claims, primary, adjusted):
        if r["estimate"] is not None:
            r["p_holm"] = p
            _decide(r, c, p, alpha)
    secondary = [_row(c, res, stats, "secondary", expected) for c in reg.secondary]
    for c, r in zip(reg.secondary, secondary):
        if r["estimate"] is not None:
            _decide(r, c, r["p_one_sided"], alpha)  # secondary rows: the same rules, unadjusted
    present = {arm: {name: res.seeds(ck, arm) for name, ck in CHECKPOINTS.items()} for arm in ARMS}
    missing = [f"seed-{s}/{arm}.csv" for s in expected for arm in ARMS if s not in present[arm]["final"]]
    verdicts = {v: [r["id"] for r in primary if r["verdict"] == v]
                for v in ("holds", "does not hold", "inconclusive", "not measured")}
    return {
        "format": FORMAT,
        "statistics": stats,
        "data": {"seeds": expected, "arms": list(ARMS), "files": sorted(res.files, key=_natural),
                 "present": present, "missing": missing, "complete": not missing,
                 "benchmarks": res.benchmarks, "n_samples": res.n_samples, "ks": list(res.ks)},
        "steps": {name: {arm: {str(s): res.steps[(ck, arm, s)] for s in res.seeds(ck, arm)} for arm in ARMS
                         if res.seeds(ck, arm)} for name, ck in CHECKPOINTS.items()},
        "summary": verdicts,
        "claims": primary,
        "secondary": secondary,
        "positive_control": _positive_control(res, reg, stats),
        "arms": {name: _arm_table(res, name, stats) for name in CHECKPOINTS},
    }


def _plain(x: Any) -> Any:
    """JSON-ready and machine-independent: floats to 12 significant digits (the last bits of a sum may differ
    between machines), NaN and infinities as null, numpy scalars as Python numbers."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return float(f"{x:.12g}") if math.isfinite(x) else None
    return x


def dumps(doc: dict) -> str:
    return json.dumps(_plain(doc), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def summary(doc: dict) -> str:
    """The primary rows as plain lines for a terminal."""
    d = doc["data"]
    lines = [f"claims over seeds {', '.join(map(str, sorted({s for r in doc['claims'] for s in r['seeds']}))) or '-'}"
             f" ({'complete' if d['complete'] else 'partial: missing ' + ', '.join(d['missing'])}):"]
    for r in doc["claims"]:
        num = "-" if r["estimate"] is None else \
            f"{r['estimate']:+.3g} [{r['ci'][0]:+.3g}, {r['ci'][1]:+.3g}] p_holm {r['p_holm']:.2g}"
        lines.append(f"  {r['id']:<4} {r['metric']:<12} {r['comparison']:<34} {num:<44} {r['verdict']}")
    pc = doc["positive_control"]["detected"]
    lines.append(f"  positive control: {'not measured' if pc is None else 'detected' if pc else 'NOT detected'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# A positive control's claims document
# --------------------------------------------------------------------------------------------------

def complete_seeds(reg: ControlRegistration, res: Results) -> list[int]:
    """Registered seeds whose every arm has a result, in registered order."""
    return [s for s in reg.seeds if all((s, a) in res.docs for a in reg.arms)]


def control_document(reg: ControlRegistration, res: Results, gate_doc: dict, registration: str,
                     gate_path: str = "gate.json", rebuild_gates: Mapping[str, dict] | None = None) -> dict:
    """claims.json of a positive control from its results, registration and gate: the claims (Holm over the
    family), the secondary rows, the dose curve and the bug indicators; a note only, with the dose curve, while
    fewer seeds than the registered minimum are complete. Where runs trained from a rebuild of S and J (amendment
    `rebuild`; `rebuild_gates`: gate path -> its gate.json, `gate_path` the registered gate's), `builds` says which
    run trained from which build, with each build's gate values (tandem.study.control.builds_section)."""
    from tandem.study.control import builds_section, bug_inputs, bug_indicators, dose_series, setting_indicators

    seeds = complete_seeds(reg, res)
    stats = reg.statistics.as_dict()
    final = str(reg.steps)
    doc: dict = {"registration": registration, "setting": reg.setting or "1", "dialect": gate_doc.get("dialect"),
                 "seeds": seeds, "seeds_registered": list(reg.seeds),
                 "complete": len(seeds) == len(reg.seeds), "verdicts_final": len(seeds) == len(reg.seeds),
                 "claims": [], "secondary": [], "bug_indicators": {}, "dose": {},
                 **builds_section(reg, res.docs, gate_doc, gate_path, rebuild_gates or {})}
    if len(seeds) < reg.min_seeds_for_verdict:
        doc["note"] = (f"{len(seeds)} of the registered seeds have every arm's result; verdicts need at least "
                       f"{reg.min_seeds_for_verdict}")
        doc["dose"] = dose_series(reg, res, sorted({s for s, _ in res.docs}))
        return doc
    rows = [(c, claim_row(c, res.arrays(final, (c.a, c.b), c.metric, seeds), stats)) for c in reg.claims]
    for (c, row), p in zip(rows, holm_family([r["p_one_sided"] for _, r in rows])):
        v = decide(p, reg.statistics.alpha_one_sided, row["estimate"], row["ci"][0], row["ci"][1], c.direction,
                   row["threshold"])
        doc["claims"].append({"id": c.id, "statement": c.statement, "metric": c.metric,
                              "comparison": f"{c.a} - {c.b}", "estimate": row["estimate"],
                              "ci_low": row["ci"][0], "ci_high": row["ci"][1],
                              "seed_t": row["seed_t"], "p_one_sided": row["p_one_sided"], "p_holm": p,
                              "threshold": row["threshold"], "arms": row["arms"],
                              "verdict": {"holds": "holds", "does not hold": "fails"}.get(v, "inconclusive")})
    for sec in reg.secondary:
        if sec.test == "per_arm":
            continue
        arrays = res.arrays(final, (sec.a, sec.b), sec.metric, seeds) if sec.metric in \
            res.values.get((final, sec.a, seeds[0]), {}) else None
        if arrays is None or any(np.isnan(v).all() for vals in arrays.values() for v in vals.values()):
            doc["secondary"].append({"id": sec.id, "statement": sec.statement, "estimate": None,
                                     "note": "not measured for these arms"})
            continue
        row = claim_row(sec.claim(), arrays, stats)
        entry = {"id": sec.id, "statement": sec.statement, "metric": sec.metric,
                 "comparison": f"{sec.a} - {sec.b}", "estimate": row["estimate"], "ci_low": row["ci"][0],
                 "ci_high": row["ci"][1], "seed_t": row["seed_t"], "arms": row["arms"]}
        if sec.test == "noninferior":
            entry["verdict"] = "holds" if row["ci"][0] > -float(sec.margin) else "not shown"
        doc["secondary"].append(entry)
    doc["dose"] = dose_series(reg, res, seeds)
    doc["bug_indicators"] = bug_indicators(bug_inputs(reg, res, seeds, gate_doc, doc, rebuild_gates),
                                           reg.bug_indicators)
    if reg.setting_indicators:  # read before the claims and reported beside the bug indicators; not bugs
        doc["setting_indicators"] = setting_indicators(doc["dose"], reg.setting_indicators)
    return doc
