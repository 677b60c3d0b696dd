"""The junior positive control's report (studies/junior-control/report.md and .html), dose curve first.

Built from `claims.json`'s document (tandem/study/claims.py `control_document`) and the gate: the dose curve
(the dialect's share of each arm's solo samples at every checkpoint, mean with the seeds' range, and the per-step
share in the rollouts), the registered claims with their intervals and verdicts, the bug indicators, the gate,
and the secondary rows. Rendered by `tandem.report.render` like every report of the project.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from tandem.report.document import Estimate, Figure, Report, Section, Table
from tandem.report.figures import _subplots, to_png

ARM_COLORS = {"grpo": "#d62728", "tandem-naive": "#1f77b4", "tandem-self": "#2ca02c"}
ARM_LINES = {"grpo": "--", "tandem-naive": "-", "tandem-self": ":"}


def dose_figure(dose: Mapping[str, Any], dialect: str) -> bytes | None:
    """Left: the dialect's share of solo samples per checkpoint (mean over seeds, band = the seeds' range).
    Right: the share of senior-first rollout rows opening in the dialect, per training step (mean over seeds,
    a 10-step running mean)."""
    if not dose:
        return None
    fig, (ax, ax2) = _subplots(2, (11, 4))
    for arm, d in dose.items():
        c, ls = ARM_COLORS.get(arm, "k"), ARM_LINES.get(arm, "-")
        steps = d["steps"]
        seeds = list(d["per_seed"].values())
        lo = [min(v[i] for v in seeds) for i in range(len(steps))]
        hi = [max(v[i] for v in seeds) for i in range(len(steps))]
        ax.fill_between(steps, lo, hi, color=c, alpha=0.15, linewidth=0)
        n = f"{len(seeds)} seed" + ("" if len(seeds) == 1 else "s")
        ax.plot(steps, d["mean"], color=c, linestyle=ls, marker="o", ms=4, label=f"{arm} ({n})")
        per = [{int(k): v for k, v in r.items() if v is not None} for r in d["rollout"].values()]
        xs = sorted(set().union(*[set(p) for p in per])) if per else []
        if xs:
            ys = [sum(p[x] for p in per if x in p) / sum(1 for p in per if x in p) for x in xs]
            w = 10
            sm = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
            ax2.plot(xs, sm, color=c, linestyle=ls, label=arm)
    for a, title, xl in ((ax, f"solo samples in the {dialect} dialect", "checkpoint (training step)"),
                         (ax2, f"senior-first rollout rows opening in {dialect}", "training step")):
        a.set_title(title, fontsize=10)
        a.set_xlabel(xl)
        a.set_ylabel("share")
        a.set_ylim(-0.02, 1.02)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    return to_png(fig)


def _num(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def build_report(doc: Mapping[str, Any], gate_doc: Mapping[str, Any]) -> Report:
    dialect = doc.get("dialect") or "?"
    seeds = doc.get("seeds") or []
    reg_md = str(doc.get("registration") or "studies/junior-control/registration.yaml").replace(".yaml", ".md")
    setting = f", setting {doc['setting']}" if doc.get("setting") not in (None, "1") else ""
    rep = Report("The junior positive control" + setting,
                 f"Registered in {reg_md}; dialect {dialect!r}; "
                 f"{len(seeds)} complete seed(s) of {len(doc.get('seeds_registered') or [])}"
                 + ("" if doc.get("verdicts_final") else " (verdicts are final only when every registered seed has finished)"))
    s = Section("Dose curve")
    png = dose_figure(doc.get("dose") or {}, dialect)
    if png:
        s.figures.append(Figure("dose-curve", f"The {dialect} dialect's share, per arm (band: the seeds' range)", png))
        rows = []
        for arm, d in (doc.get("dose") or {}).items():
            slopes = [v for v in d["slope_per_100_steps"].values() if v is not None]
            rows.append([arm, len(d["per_seed"]), d["mean"][0], d["mean"][-1], d["mean"][-1] - d["mean"][0],
                         sum(slopes) / len(slopes) if slopes else None])
        s.tables.append(Table("Solo dialect share at the first and last checkpoint (mean over seeds)",
                              ["arm", "seeds", "first", "last", "change", "slope per 100 steps"], rows))
    else:
        s.paragraphs.append("No seed x arm result yet.")
    rep.sections.append(s)
    s = Section("Claims")
    if doc.get("claims"):
        s.tables.append(Table(
            "Registered claims at the final checkpoint (Holm over the four; crossed bootstrap 95% interval)",
            ["id", "claim", "comparison", "measure", "estimate [95% CI]", "Holm p", "needs", "verdict"],
            [[c["id"], c["statement"], c["comparison"], c["metric"],
              Estimate(c["estimate"], c["ci_low"], c["ci_high"], signed=True), c["p_holm"],
              f"{'<=' if c['threshold'] < 0 else '>='} {c['threshold']:+.3f}", c["verdict"]] for c in doc["claims"]]))
    else:
        s.paragraphs.append(doc.get("note") or "No claims yet.")
    rep.sections.append(s)
    for key, title, caption in (
            ("bug_indicators", "Bug indicators (read before the claims)", "The registered indicators B1-B7"),
            ("setting_indicators", "Setting indicators (not bugs: the setting's own assumptions, read before the "
             "claims)", "The registered setting indicators")):
        if doc.get(key):
            s = Section(title)
            s.tables.append(Table(caption, ["id", "rule", "fired"],
                                  [[k, v["rule"], "n/a" if v["fired"] is None else ("FIRED" if v["fired"] else "no")]
                                   for k, v in doc[key].items()]))
            rep.sections.append(s)
    s = Section("The gate (base models only)")
    for d in gate_doc.get("dialects", []):
        s.tables.append(Table(f"Dialect {d['dialect']}: {'passed' if d['passed'] else 'failed'}",
                              ["id", "rule", "passed"],
                              [[g, r["rule"], "-" if r["passed"] is None else ("yes" if r["passed"] else "no")]
                               for g, r in d["criteria"].items()]))
        s.paragraphs.append(f"Dialect {d['dialect']}: S's share {d['values']['share']:.3f}, solo pass@1 S "
                            f"{d['values']['solo_pass1_S']:.3f} / J {d['values']['solo_pass1_J']:.3f}, cost with J "
                            f"{_fmt(d['values']['cost_SJ'])}, with S {_fmt(d['values']['cost_SS'])}, S's solo gap "
                            f"{_fmt(d['values']['solo_gap_S'])} (gate.md has every number).")
    rep.sections.append(s)
    if doc.get("builds"):
        rep.sections.append(_builds_section(doc))
    if doc.get("secondary"):
        s = Section("Secondary rows (unadjusted)")
        s.tables.append(Table("Final checkpoint", ["id", "row", "comparison", "estimate [95% CI]", "note"],
                              [[c["id"], c["statement"], c.get("comparison", ""),
                                Estimate(c["estimate"], c.get("ci_low"), c.get("ci_high"), signed=True)
                                if c.get("estimate") is not None else None,
                                c.get("verdict") or c.get("note") or ""] for c in doc["secondary"]]))
        rep.sections.append(s)
    s = Section("What this does and does not show")
    s.paragraphs.append("A positive control of the tandem training path: with a frozen junior that never saw the "
                        "senior's dialect, tandem training should drive the dialect out (J1), because of the partner "
                        "(J2, against the self-paired arm), with better handoff to that junior (H1) and text it reads "
                        "more easily (L1). It is not evidence for or against the self-paired claims of the paper, "
                        "whose registered pilot found no room at toy scale (studies/pilot/result.md).")
    folder = reg_md.rsplit("/", 1)[0]
    s.paragraphs.append(f"Rerun: `tandem study --recompute --out {folder}` rebuilds this report and claims.json from "
                        "the committed results.")
    rep.sections.append(s)
    return rep


def _builds_section(doc: Mapping[str, Any]) -> Section:
    """Which runs trained from which build of S and J (a registered rebuild amendment), each build's gate values."""
    s = Section("Builds of S and J (amendments.md)")
    s.tables.append(Table(
        "Each build's gate (base models only) and the runs it trained; claims pool the builds",
        ["gate", "S", "J", "passed", "S's share", "keyed share", "pass@1 S / J", "cost with J", "S's solo gap", "runs"],
        [[b["gate"], b["S"][:16], b["J"][:16], "yes" if b["passed"] else "no", b["values"]["share"],
          b["values"]["keyed_share"], f"{b['values']['solo_pass1_S']:.3f} / {b['values']['solo_pass1_J']:.3f}",
          _fmt(b["values"]["cost_SJ"]), _fmt(b["values"]["solo_gap_S"]), ", ".join(b["runs"])]
         for b in doc["builds"]]))
    for cid, seeds in (doc.get("mixed_build_seeds") or {}).items():
        s.paragraphs.append(f"{cid} compares, in seed(s) {', '.join(map(str, seeds))}, two runs that trained from "
                            "different builds of S and J.")
    return s


def _fmt(x: Any) -> str:
    return "n/a" if x is None else f"{x:+.3f}"
