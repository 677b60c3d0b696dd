"""The registered study's report from its claims document (`studies/claims.json`, tandem/study/claims.py).

Sections, in order: the claims table (per primary row: claim, measure, verdict, difference with its 95%
crossed-bootstrap interval, the seed-level t-interval, the Holm-adjusted p, the registered smallest effect of
interest, what the interval excludes, then the arms' values) with an error-bar figure; the positive control;
the secondary rows; every measure per arm at the final and the best-by-validation checkpoint; the data behind
it. Each column of a table has one number format (three significant digits, two for p-values).
"""

from __future__ import annotations

import io
import math
from typing import Any, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as MplFigure

from tandem.metrics.verdicts import metric_words, sig
from tandem.report.document import Figure, Report, Section, Table
from tandem.report.figures import arm_label

DASH = "\u2013"
ARM_COLUMNS = ("base", "tandem", "grpo", "kl_reg", "control")


def _num(x: Any, sign: bool = False) -> str:
    return DASH if x is None or (isinstance(x, float) and not math.isfinite(x)) else sig(x, 3, sign)


def _iv(est: Any, ci: Sequence | None, sign: bool = False) -> str:
    if est is None:
        return DASH
    if not ci or None in ci:
        return _num(est, sign)
    return f"{_num(est, sign)} [{_num(ci[0], sign)}, {_num(ci[1], sign)}]"


def _pair(ci: Sequence | None, sign: bool = True) -> str:
    return DASH if not ci or None in ci else f"[{_num(ci[0], sign)}, {_num(ci[1], sign)}]"


def _pct(x: Any) -> str:
    return DASH if x is None else f"{100 * x:.0f}%"


def _pct_pair(ci: Sequence | None) -> str:
    return DASH if not ci or None in ci else f"[{_pct(ci[0])}, {_pct(ci[1])}]"


def _p(p: Any) -> str:
    return DASH if p is None else sig(p, 2)


def _sesoi(r: dict) -> str:
    s = r["sesoi"]
    if r["test"] == "keeps_gain":
        return f"keeps >= {100 * s['registered']:.0f}% of the gain (contrast > 0)"
    what = {"absolute": "absolute",
            "relative": f"{100 * s['registered']:.0f}% of {r['b']}'s value",
            "tv_relative": f"{100 * s['registered']:.0f}% of {r['b']}'s 1 - overlap",
            "none": "none (difference beyond 0)"}[s["kind"]]
    return what if s["threshold"] is None else f"{what}: {_num(s['threshold'], sign=True)}"


def _verdict(r: dict) -> str:
    v = r["verdict"]
    if v == "not measured":
        return f"not measured ({'; '.join(r['missing'])})" if r["missing"] else v
    tags = (["not robust: the seed t-interval disagrees about 0"] if r["not_robust"] else []) + \
        ([f"provisional: {', '.join(r['missing'])} missing"] if r["missing"] else [])
    return v + (f" ({'; '.join(tags)})" if tags else "")


def _arm_value(doc: dict, checkpoint: str, arm: str, metric: str) -> str:
    m = doc["arms"].get(checkpoint, {}).get(arm, {}).get(metric)
    return _iv(m["estimate"], m["ci"]) if m else DASH


def claims_rows_table(doc: dict, rows: Sequence[dict], caption: str, p_label: str, note: str) -> Table:
    arms = [a for a in ARM_COLUMNS[:4]]
    headers = ["id", "claim", "measure", "comparison", "verdict", "difference [95% crossed CI]", "seed t-interval",
               p_label, "smallest effect of interest", "what the interval excludes"] + \
        [f"{arm_label(a)} [95% CI]" for a in arms]
    body = []
    for r in rows:
        body.append([r["id"], r["claim"], metric_words(r["metric"]) + ("" if r["checkpoint"] == "final"
                                                                       else f" ({r['checkpoint']})"),
                     r["comparison"], _verdict(r), _iv(r["estimate"], r["ci"], sign=True), _pair(r["seed_t"]),
                     _p(r["p_holm"] if p_label.startswith("Holm") else r["p_one_sided"]), _sesoi(r),
                     r["excludes"] or DASH] + [_arm_value(doc, r["checkpoint"], a, r["metric"]) for a in arms])
    return Table(caption, headers, body, note)


def claims_figure(rows: Sequence[dict]) -> bytes | None:
    """One panel per measured row: the difference with its crossed interval (thick) and its seed t-interval
    (thin), 0 and the registered smallest effect of interest as lines."""
    rows = [r for r in rows if r["estimate"] is not None]
    if not rows:
        return None
    ncols = min(4, len(rows))
    nrows = math.ceil(len(rows) / ncols)
    fig = MplFigure(figsize=(2.7 * ncols, 2.6 * nrows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, r in zip(axes, rows):
        e, (lo, hi) = r["estimate"], r["ci"]
        ax.errorbar([0], [e], yerr=[[max(e - lo, 0.0)], [max(hi - e, 0.0)]], fmt="o", color="#1f77b4", capsize=5,
                    lw=2, label="95% crossed bootstrap")
        if r["seed_t"]:
            tlo, thi = r["seed_t"]
            ax.errorbar([0.35], [e], yerr=[[max(e - tlo, 0.0)], [max(thi - e, 0.0)]], fmt="s", color="#7f7f7f",
                        capsize=3, lw=1, label="seed t-interval")
        ax.axhline(0.0, color="black", lw=0.8)
        thr = r["sesoi"]["threshold"]
        if thr:
            ax.axhline(thr, color="#d62728", lw=1, ls="--", label="smallest effect of interest")
        ax.set_xlim(-0.5, 0.85)
        ax.set_xticks([])
        ax.set_title(f"{r['id']}: {metric_words(r['metric'])}\n{r['comparison']}", fontsize=7.5)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    for ax in axes[len(rows):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=6, loc="lower left")
    # a fixed layout: tight_layout and a tight bounding box would lay the text out twice more (slow on a busy CPU)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.04, top=0.90, wspace=0.45, hspace=0.45)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, metadata={"Software": None})  # no timestamp: same data, same bytes
    return buf.getvalue()


def _control_section(doc: dict) -> Section:
    pc = doc["positive_control"]
    det = pc["detected"]
    sec = Section("Positive control", paragraphs=[
        f"The control: {pc['what'] or 'not registered'}. Registered check: {pc['detected_when'] or '-'}.",
        "Result: " + ("not measured (an arm of the check has no results yet)." if det is None else
                      "every check detects the constructed drift: the intervals have power where an effect exists."
                      if det else "NOT every check detects the constructed drift: the measurement may lack power.")])
    sec.tables.append(Table("Positive control: the registered detection check",
                            ["comparison", "measure", "constructed direction", "difference [95% crossed CI]",
                             "seed t-interval", "detected"],
                            [[c["comparison"], metric_words(c["metric"]), "higher" if c["direction"] == "greater"
                              else "lower", _iv(c["estimate"], c["ci"], sign=True), _pair(c["seed_t"]),
                              DASH if c["detected"] is None else ("yes" if c["detected"] else "no")]
                             for c in pc["checks"]]))
    return sec


def _measure_order(doc: dict) -> list[str]:
    ms = {m for ck in doc["arms"].values() for a in ck.values() for m in a}
    passk = sorted((m for m in ms if "/pass@" in m), key=lambda m: (m.split("/")[0] != "solo", int(m.split("@")[1])))
    return passk + [m for m in ("junior_ce", "overlap", "kl_mean", "common/kl_mean", "common/overlap",
                                "compact_share") if m in ms]


def _arms_section(doc: dict) -> Section:
    sec = Section("Every measure per arm", paragraphs=[
        "Mean over seeds of the macro mean over benchmarks, with its 95% crossed-bootstrap interval (seeds "
        "resampled, one problem draw per benchmark shared by every seed) and, in the second table, the seed-level "
        "t-interval (df = seeds - 1). The base and the positive control have one checkpoint; their "
        "best-by-validation values repeat the final ones."])
    measures = _measure_order(doc)
    for ck, title in (("final", "final checkpoint"), ("best_by_validation", "best-by-validation checkpoint")):
        table = doc["arms"].get(ck, {})
        arms = [a for a in ARM_COLUMNS if a in table]
        if not arms:
            continue
        sec.tables.append(Table(f"Measures by arm, {title} [95% crossed CI]", ["measure"] + [arm_label(a) for a in arms],
                                [[metric_words(m)] + [_iv(table[a][m]["estimate"], table[a][m]["ci"])
                                                      if m in table[a] else DASH for a in arms] for m in measures]))
        if ck == "final":
            sec.tables.append(Table(f"Measures by arm, {title}: seed t-interval",
                                    ["measure"] + [arm_label(a) for a in arms],
                                    [[metric_words(m)] + [_pair(table[a][m]["seed_t"], sign=False)
                                                          if m in table[a] else DASH for a in arms]
                                     for m in measures]))
    steps = doc.get("steps", {})
    seeds = sorted({int(s) for ck in steps.values() for a in ck.values() for s in a})
    if seeds:
        rows = [[f"{arm_label(a)}, {ck.replace('_', ' ')}"] + [steps[ck][a].get(str(s)) for s in seeds]
                for ck in steps for a in ARM_COLUMNS if a in steps[ck]]
        sec.tables.append(Table("Evaluated step per arm and seed", ["arm, checkpoint"] + [f"seed {s}" for s in seeds],
                                rows))
    return sec


def study_report(doc: dict, registration_name: str = "registration.yaml") -> Report:
    d, st = doc["data"], doc["statistics"]
    seeds_used = sorted({s for r in doc["claims"] for s in r["seeds"]})
    rep = Report("Tandem RL study: the registered claims",
                 f"seeds {', '.join(map(str, seeds_used)) or '-'} (registered: {', '.join(map(str, d['seeds']))}); "
                 f"{sum(d['benchmarks'].values())} problems over {len(d['benchmarks'])} benchmarks, "
                 f"{d['n_samples']} samples each; rules: {registration_name}")
    summ = doc["summary"]
    paras = []
    if not d["complete"]:
        paras.append("WARNING: partial results; missing " + ", ".join(d["missing"]) + ". Rows are computed on "
                     "the seeds every arm of the row has and are provisional until the study is complete.")
    paras.append(", ".join(f"{len(summ[v])} {v}" + (f" ({', '.join(summ[v])})" if summ[v] else "")
                           for v in ("holds", "does not hold", "inconclusive", "not measured") if summ[v])
                 + f" of {len(doc['claims'])} registered primary rows.")
    paras.append(
        f"Each row tests a one-sided contrast at the final checkpoint. The interval is a {100 * st['level']:.0f}% "
        f"crossed percentile bootstrap ({st['n_boot']} replicates, seed {st['boot_seed']}: seeds resampled, one "
        "problem draw per benchmark shared by every seed); the p-value is the share of replicates on the wrong side "
        f"of 0 (+1 correction), Holm-adjusted over the {len(doc['claims'])} primary rows. A row holds when its "
        f"adjusted p is below {st['alpha_one_sided']} and its estimate meets the registered smallest effect of "
        "interest; it does not hold when the interval's end in the claimed direction falls short of that effect "
        "(an effect of the registered size is excluded); otherwise it is inconclusive. 'Not robust' marks a row "
        "whose seed-level t-interval disagrees with the bootstrap about excluding 0. A1 and A2 are the paper's "
        "KL-Reg ablation, reported as such, not as part of claim 4.")
    for r in doc["claims"]:
        k = r.get("kept_share")
        if k and k.get("estimate") is not None:
            a, b = r["a"], r["b"]
            paras.append(f"{r['id']}: {a} keeps {_pct(k['estimate'])} {_pct_pair(k['ci'])} of {b}'s "
                         f"{metric_words(r['metric'])} gain over the base ({b}'s gain {_iv(k['gain_b'], k['gain_b_ci'], sign=True)}"
                         + ("" if k["gain_b_excludes_0"] else "; not told apart from 0, so the share is unstable")
                         + ").")
    sec = Section("Claims", paragraphs=paras)
    sec.tables.append(claims_rows_table(doc, doc["claims"], "Primary rows (one family, Holm-adjusted)", "Holm p",
                                        "Arms' values: each arm at the row's checkpoint on every seed it has."))
    png = claims_figure(doc["claims"])
    if png is not None:
        sec.figures.append(Figure("study-claims", "Each primary row's difference: the 95% crossed-bootstrap interval "
                                  "(circle) and the seed t-interval (square); 0 in black, the registered smallest "
                                  "effect of interest dashed.", png))
    rep.sections.append(sec)
    rep.sections.append(_control_section(doc))
    if doc["secondary"]:
        rep.sections.append(Section("Secondary rows", paragraphs=[
            "The same rules, with unadjusted one-sided p-values, outside the primary family: pass@8, the "
            "common-text drift and overlap (the benchmark problems' reference solutions, the same text for every "
            "arm, so that a difference in style mix or length cannot pass for drift), and C1/C2 at the "
            "best-by-validation checkpoint."],
            tables=[claims_rows_table(doc, doc["secondary"], "Secondary rows (unadjusted)", "p (one-sided)", "")]))
    rep.sections.append(_arms_section(doc))
    rep.sections.append(Section("Data", paragraphs=[
        f"{len(d['files'])} per-problem files under results/ ({', '.join(d['files'])}); "
        + ("every registered seed x arm is present." if d["complete"] else "missing: " + ", ".join(d["missing"]) + ".")
        + f" pass@k for k in {', '.join(map(str, d['ks']))} from {d['n_samples']} samples per problem and mode."]))
    return rep
