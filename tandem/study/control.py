"""A positive control's decision rules (studies/junior-control/registration.md), as pure functions.

- `gate`: the base-only criteria G1-G4 (and G5, reported) of one dialect from its measured values;
- `dose_slope`: the least-squares change of the dialect share per 100 training steps over the checkpoints;
- `dose_series`: the dose curve (solo dialect share per checkpoint, per arm and seed) from the results;
- `bug_indicators`: the registered checks B1-B7 from the study's numbers (`bug_inputs` gathers them), each with
  its value and whether it fired (a fired indicator points at the implementation, and is read before any claim);
- `gate_markdown`, `claims_summary`: the gate's page and the claims as terminal lines.

The measurements themselves (generation, scoring, training) are the driver's (tasks/study/control.py); nothing
here reads files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class GateCriteria:
    """The registered gate thresholds (registration.yaml `gate.criteria`).

    `estimator` says how G3-G5 are measured: `pooled` (the first settings': a class's pass@1 over all its
    samples, dialect-first minus keyed-first, so a class that falls on easier problems looks better, and G3 counts
    S's own gap as the junior's cost) or `paired_problems` (`paired_gate_values`: differences within problems,
    Mantel-Haenszel weighted; G3 is the junior's handoff cost on dialect-first minus on keyed-first samples, each
    against S alone; each needs `min_problems` problems with both sides). `keyed_share_min` (optional): G1 also
    needs S's keyed share of solo samples at least this (keyed samples left for RL to select and for G3/G4 to
    compare)."""

    share_range: tuple[float, float] = (0.5, 0.9)  # G1: S's dialect share of solo samples
    solo_pass1_min: float = 0.30                   # G2: solo pass@1 of S and of J
    cost_max: float = -0.15                        # G3: step pass@1 of (S, J), dialect-first minus keyed-first
    solo_gap_abs_max: float = 0.10                 # G4: |S's solo pass@1, dialect-first minus keyed-first|
    keyed_share_min: float | None = None           # G1 (optional): S's keyed share of solo samples at least this
    estimator: str = "pooled"                      # G3-G5: pooled or paired_problems
    min_problems: int = 0                          # paired_problems: problems each difference needs

    @classmethod
    def from_dict(cls, d: Mapping) -> "GateCriteria":
        lo, hi = d["G1_share"]
        keyed = d.get("G1_keyed_share_min")
        return cls((float(lo), float(hi)), float(d["G2_solo_pass1_min"]), float(d["G3_cost_max"]),
                   float(d["G4_solo_gap_abs_max"]), None if keyed is None else float(keyed),
                   str(d.get("estimator", "pooled")), int(d.get("min_problems", 0)))


# The gate's criteria keys beyond the four every registration has (GateCriteria.from_dict reads them).
OPTIONAL_CRITERIA = ("G1_keyed_share_min", "estimator", "min_problems")
ESTIMATORS = ("pooled", "paired_problems")

# G3-G5 are each a difference `dialect_vs_keyed.gap` (dialect-first minus keyed-first pass@1) of one measurement
# (tasks/study/control.py measures them); gate.md shows each class's size beside it
GAP_MEASUREMENT = {"G3": "SJ_step", "G4": "S_solo", "G5": "SS_step"}


def _side(counts: Mapping[str, Sequence[int]], at: int, ids: Sequence[str]) -> tuple[list[int], list[int]]:
    """(samples, correct) per problem of one class (at 0: dialect-first, at 2: keyed-first), in `ids` order."""
    return ([int((counts.get(p) or (0, 0, 0, 0))[at]) for p in ids],
            [int((counts.get(p) or (0, 0, 0, 0))[at + 1]) for p in ids])


def _paired(a: Mapping, at_a: int, b: Mapping, at_b: int) -> dict:
    from tandem.metrics.dialect import paired_difference

    ids = sorted(set(a) | set(b))
    return paired_difference(*_side(a, at_a, ids), *_side(b, at_b, ids))


def paired_gate_values(per_problem: Mapping[str, Mapping[str, Sequence[int]]]) -> dict:
    """G3-G5 measured within problems, from each measurement's per-problem class counts (measurement -> problem id
    -> [dialect-first samples, correct, keyed-first samples, correct]; tandem.metrics.dialect.class_counts):

    - `solo_gap_S` (G4): S alone, dialect-first minus keyed-first, within problems;
    - `cost_SJ` (G3): the junior's handoff cost on dialect-first samples (the step schedule of (S, J) minus S
      alone, both dialect-first, within problems) minus its cost on keyed-first ones (the same, keyed-first):
      what J pays for the dialect beyond what S pays itself and beyond what any handoff to J costs; it is the
      extra reward gap against the dialect that tandem training with J adds to GRPO's own (`solo_gap_S`);
    - `cost_SS` (G5): the same with S as the partner (expected about 0);
    - `gap_SJ`: the step schedule of (S, J), dialect-first minus keyed-first, within problems (what a shed
      dialect changes step pass@1 with J by; bug indicator B7's cost);
    - `problems`: per criterion the fewest problems any of its differences rests on; `parts`: every difference.
    Naive check: each part is `tandem.metrics.dialect.paired_difference` of two classes' per-problem counts."""
    S, SJ, SS = per_problem["S_solo"], per_problem["SJ_step"], per_problem["SS_step"]
    parts = {"S_solo dialect - keyed": _paired(S, 0, S, 2),
             "SJ_step dialect - keyed": _paired(SJ, 0, SJ, 2),
             "SJ_step - S_solo, dialect-first": _paired(SJ, 0, S, 0),
             "SJ_step - S_solo, keyed-first": _paired(SJ, 2, S, 2),
             "SS_step - S_solo, dialect-first": _paired(SS, 0, S, 0),
             "SS_step - S_solo, keyed-first": _paired(SS, 2, S, 2)}

    def diff(x: str, y: str) -> float | None:
        a, b = parts[x]["value"], parts[y]["value"]
        return None if a is None or b is None else a - b

    def fewest(*names: str) -> int:
        return min(parts[n]["problems"] for n in names)

    return {"solo_gap_S": parts["S_solo dialect - keyed"]["value"],
            "cost_SJ": diff("SJ_step - S_solo, dialect-first", "SJ_step - S_solo, keyed-first"),
            "cost_SS": diff("SS_step - S_solo, dialect-first", "SS_step - S_solo, keyed-first"),
            "gap_SJ": parts["SJ_step dialect - keyed"]["value"],
            "problems": {"G3": fewest("SJ_step - S_solo, dialect-first", "SJ_step - S_solo, keyed-first"),
                         "G4": fewest("S_solo dialect - keyed"),
                         "G5": fewest("SS_step - S_solo, dialect-first", "SS_step - S_solo, keyed-first")},
            "parts": parts}


def _ok(x: float | None, test) -> bool:
    return x is not None and math.isfinite(x) and bool(test(x))


def gate(values: Mapping[str, float | None], c: GateCriteria) -> dict:
    """The gate of one dialect: each criterion's value, rule and outcome, and `passed` (G1-G4 all hold).

    `values`: `share` (S's solo dialect share), `solo_pass1_S`, `solo_pass1_J`, `cost_SJ` (G3's difference),
    `solo_gap_S` (G4's difference) and `cost_SS` (G5, reported only); with `c.keyed_share_min`, `keyed_share`
    (S's keyed share of solo samples); with the paired estimator, `problems` (criterion -> problems it rests on)."""
    lo, hi = c.share_range
    paired = c.estimator == "paired_problems"
    problems = values.get("problems") or {}

    def enough(g: str) -> bool:
        return not paired or int(problems.get(g) or 0) >= c.min_problems

    where = f", within problems (Mantel-Haenszel, >= {c.min_problems} problems)" if paired else ""
    g1_ok = _ok(values.get("share"), lambda x: lo <= x <= hi)
    g1 = {"value": values.get("share"), "rule": f"in [{lo}, {hi}]", "passed": g1_ok}
    if c.keyed_share_min is not None:
        g1 = {"value": {"dialect": values.get("share"), "keyed": values.get("keyed_share")},
              "rule": f"dialect share in [{lo}, {hi}], keyed share >= {c.keyed_share_min}",
              "passed": g1_ok and _ok(values.get("keyed_share"), lambda x: x >= c.keyed_share_min)}
    g3_rule = (f"<= {c.cost_max}" if not paired else
               f"<= {c.cost_max}: J's handoff cost (step with J - S alone) on dialect-first minus on keyed-first{where}")
    rows = {
        "G1": g1,
        "G2": {"value": {"S": values.get("solo_pass1_S"), "J": values.get("solo_pass1_J")},
               "rule": f">= {c.solo_pass1_min} for S and for J",
               "passed": all(_ok(values.get(k), lambda x: x >= c.solo_pass1_min) for k in ("solo_pass1_S", "solo_pass1_J"))},
        "G3": {"value": values.get("cost_SJ"), "rule": g3_rule,
               "passed": _ok(values.get("cost_SJ"), lambda x: x <= c.cost_max) and enough("G3")},
        "G4": {"value": values.get("solo_gap_S"), "rule": f"within +-{c.solo_gap_abs_max}{where}",
               "passed": _ok(values.get("solo_gap_S"), lambda x: abs(x) <= c.solo_gap_abs_max) and enough("G4")},
        "G5": {"value": values.get("cost_SS"), "rule": "reported (expected about 0)", "passed": None},
    }
    return {"criteria": rows, "passed": all(rows[g]["passed"] for g in ("G1", "G2", "G3", "G4"))}


def dose_slope(steps: Sequence[float], shares: Sequence[float]) -> float | None:
    """Least-squares slope of `shares` against `steps`, per 100 steps (None with fewer than two distinct steps).
    Naive: fit share = a + b * step by ordinary least squares; return 100 * b."""
    pts = [(float(s), float(y)) for s, y in zip(steps, shares) if y is not None and math.isfinite(float(y))]
    if len({s for s, _ in pts}) < 2:
        return None
    n = len(pts)
    ms, my = sum(s for s, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((s - ms) ** 2 for s, _ in pts)
    sxy = sum((s - ms) * (y - my) for s, y in pts)
    return 100.0 * sxy / sxx


def bug_indicators(v: Mapping[str, float | bool | None], reg: Mapping) -> dict:
    """The registered bug indicators B1-B7 from the study's numbers; each {value, rule, fired} (fired None when
    its inputs are missing).

    `v` keys: `senior_share` (arm -> mean senior token share of training), `junior_hashes_equal`,
    `junior_unchanged`, `junior_matches_warmup` (a warm-up junior's equality to S's warm-up; None otherwise),
    `first_reward` / `first_reward_se` (tandem-naive, first steps), `gate_word_SJ`,
    `gate_cost` (G3's pooled gap, or a paired gate's `gap_SJ`; `gate_cost_label` names it), `move` (arm -> final
    minus initial dialect share), `final_share` (arm -> final share),
    `J1_holds`, `H1_estimate`."""
    lo, hi = reg["B1_senior_share"]
    out: dict[str, dict] = {}
    shares = v.get("senior_share") or {}
    out["B1"] = {"value": shares, "rule": f"every tandem arm's senior share in [{lo}, {hi}]",
                 "fired": None if not shares else any(not (lo <= s <= hi) for s in shares.values())}
    eq, unch = v.get("junior_hashes_equal"), v.get("junior_unchanged")
    out["B2"] = {"value": {"hashes_equal": eq, "unchanged_by_training": unch},
                 "rule": "one junior hash across gate, training, evaluation and analysis; unchanged by training",
                 "fired": None if eq is None or unch is None else not (eq and unch)}
    warm = v.get("junior_matches_warmup")  # a junior built from the base's warm-up (junior.source: warmup) only
    if warm is not None:
        out["B2"]["value"]["matches_base_warmup"] = warm
        out["B2"]["rule"] += "; J equal to S's warm-up"
        out["B2"]["fired"] = None if out["B2"]["fired"] is None else out["B2"]["fired"] or not warm
    fr, se, gw = v.get("first_reward"), v.get("first_reward_se"), v.get("gate_word_SJ")
    k = float(reg["B3_max_se"])
    out["B3"] = {"value": {"first_reward": fr, "se": se, "gate_word_SJ": gw},
                 "rule": f"tandem-naive's mean reward over its first {reg['B3_first_steps']} steps within {k} SE of "
                         "the gate's word-schedule pass@1 of (S, J)",
                 "fired": None if None in (fr, se, gw) else abs(fr - gw) > k * max(se, 1e-12)}
    move, final = v.get("move") or {}, v.get("final_share") or {}
    m = float(reg["B4_min_move"])
    naive, grpo, self_ = move.get("tandem-naive"), move.get("grpo"), move.get("tandem-self")
    out["B4"] = {"value": {"tandem-naive": naive, "grpo": grpo},
                 "rule": f"not (tandem-naive's share moves < {m} while grpo's is flat, < {m})",
                 "fired": None if naive is None or grpo is None else (abs(naive) < m and abs(grpo) < m)}
    fn, fg = final.get("tandem-naive"), final.get("grpo")
    out["B5"] = {"value": {"tandem-naive": fn, "grpo": fg}, "rule": "tandem-naive's final share not above grpo's",
                 "fired": None if fn is None or fg is None else fn > fg}
    frac = float(reg["B6_self_fraction"])
    j1 = v.get("J1_holds")
    out["B6"] = {"value": {"tandem-self": self_, "tandem-naive": naive, "J1_holds": j1},
                 "rule": f"if J1 holds, tandem-self's fall is at most {frac} of tandem-naive's",
                 "fired": None if None in (j1, self_, naive) else bool(j1) and naive < 0 and -self_ > frac * -naive}
    rlo, rhi = reg["B7_ratio"]
    h1, cost = v.get("H1_estimate"), v.get("gate_cost")
    drop = None if fn is None or fg is None else fg - fn
    pred = None if drop is None or cost is None else drop * -cost
    ratio = None if pred in (None, 0) or h1 in (None, 0) else h1 / pred
    out["B7"] = {"value": {"H1_estimate": h1, "predicted": pred, "ratio": ratio},
                 "rule": f"H1's estimate within {rlo}-{rhi}x of (share drop x {v.get('gate_cost_label', 'G3 cost')}), "
                         "when both are nonzero",
                 "fired": None if ratio is None else not (rlo <= ratio <= rhi)}
    return out


def setting_indicators(dose: Mapping, reg: Mapping) -> dict:
    """The registered setting indicators (not bugs: the setting's own assumptions), each {value, rule, fired}:
    `H_grpo_keeps` fires when grpo's mean final dialect share is below that fraction of its step-0 share (the
    horizon was too long: grpo shed the dialect alone). `dose`: dose_series's output."""
    out: dict[str, dict] = {}
    if "H_grpo_keeps" in reg:
        frac = float(reg["H_grpo_keeps"])
        mean = (dose.get("grpo") or {}).get("mean") or []
        first, last = (mean[0], mean[-1]) if mean else (None, None)
        out["H"] = {"value": {"grpo_step0": first, "grpo_final": last},
                    "rule": f"grpo's mean final share not below {frac} of its step-0 share",
                    "fired": None if first is None else last < frac * first}
    return out


def dose_series(reg, res, seeds: list[int]) -> dict:
    """arm -> {steps, per_seed (seed -> share per checkpoint), mean, slope_per_100_steps, rollout (seed -> step ->
    share of the training rollouts)} of the solo dialect share (`res`: tandem.study.results.Results)."""
    from tandem.metrics.intervals import point_estimate

    out = {}
    for arm in reg.arms:
        have = [s for s in seeds if (s, arm) in res.docs]
        if not have:
            continue
        steps = sorted(res.docs[(have[0], arm)]["evaluation"]["checkpoints"], key=int)
        per_seed = {str(s): [point_estimate(res.arrays(k, [arm], "dialect_share", [s])[arm]) for k in steps]
                    for s in have}
        slopes = {s: dose_slope([int(k) for k in steps], v) for s, v in per_seed.items()}
        rollout = {str(s): {k: v.get("dialect_share_rollout") for k, v in res.docs[(s, arm)]["training"].items()}
                   for s in have}
        out[arm] = {"steps": [int(k) for k in steps], "per_seed": per_seed,
                    "mean": [sum(v[i] for v in per_seed.values()) / len(per_seed) for i in range(len(steps))],
                    "slope_per_100_steps": slopes, "rollout": rollout}
    return out


# A build's gate values the claims document shows beside the runs it trained (builds_section).
BUILD_VALUES = ("share", "keyed_share", "solo_pass1_S", "solo_pass1_J", "cost_SJ", "solo_gap_S", "cost_SS")


def build_of_run(doc: Mapping, gate_doc: Mapping, gate_path: str) -> dict:
    """The build a result trained from: its `build` (a rebuild, amendment `rebuild`), else the registered gate's."""
    h = gate_doc["dialects"][-1]["hashes"]
    return dict(doc.get("build") or {"S": h["S"], "J": h["J"], "gate": gate_path})


def builds_section(reg, docs: Mapping, gate_doc: Mapping, gate_path: str, rebuild_gates: Mapping[str, Mapping]) -> dict:
    """Which build (S and J) each run trained from, each build's gate values, and per claim the seeds whose two arms
    trained from different builds; empty when every run trained from the registered gate's build.
    `rebuild_gates`: gate path -> that rebuild's gate.json (tasks.study.control.gate_rebuild)."""
    runs: dict[str, list[str]] = {}
    by_run: dict[tuple, str] = {}
    for (seed, arm), d in sorted(docs.items()):
        b = build_of_run(d, gate_doc, gate_path)
        runs.setdefault(b["gate"], []).append(f"seed {seed} {arm}")
        by_run[(seed, arm)] = b["gate"]
    if set(runs) <= {gate_path}:
        return {}
    builds = []
    for path in [gate_path] + sorted(set(runs) - {gate_path}):
        g = gate_doc if path == gate_path else rebuild_gates[path]
        d = g["dialects"][-1]
        builds.append({"gate": path, "S": d["hashes"]["S"], "J": d["hashes"]["J"], "passed": g["passed"],
                       "values": {k: d["values"].get(k) for k in BUILD_VALUES},
                       "runs": runs.get(path, [])})
    seeds = sorted({s for s, _ in docs})
    mixed = {c.id: [s for s in seeds if (s, c.a) in by_run and (s, c.b) in by_run
                    and by_run[(s, c.a)] != by_run[(s, c.b)]] for c in reg.claims}
    return {"builds": builds, "mixed_build_seeds": {k: v for k, v in mixed.items() if v}}


def bug_inputs(reg, res, seeds: list[int], gate_doc: Mapping, doc: Mapping,
               rebuild_gates: Mapping[str, Mapping] | None = None) -> dict:
    """The numbers `bug_indicators` reads, from the results, the gate (and the gates of any rebuild the runs
    trained from) and the claims rows of `doc`."""
    docs = res.docs
    share = {a: d["mean"] for a, d in doc["dose"].items()}
    k = int(reg.bug_indicators["B3_first_steps"])
    first = [v["reward"] for s in seeds for _, v in sorted(docs[(s, "tandem-naive")]["training"].items(),
                                                          key=lambda kv: int(kv[0]))[:k]
             if v.get("reward") is not None]
    mean = float(np.mean(first)) if first else None
    se = float(np.std(first, ddof=1) / math.sqrt(len(first))) if len(first) > 1 else None
    gate_d = gate_doc["dialects"][-1]
    by_claim = {c["id"]: c for c in doc["claims"]}
    hashes_ok = all(len({h for k2, h in docs[(s, a)]["hashes"].items() if k2.startswith("junior_") and
                         k2 not in ("junior_weights_before", "junior_weights_after")}) == 1
                    for s in seeds for a in reg.arms)
    return {
        "senior_share": {f"{a} seed {s}": docs[(s, a)]["senior_fraction"] for s in seeds for a in reg.arms
                         if reg.arms[a].train == "tandem"},
        "junior_hashes_equal": hashes_ok,
        "junior_unchanged": all(docs[(s, a)]["junior_unchanged"] for s in seeds for a in reg.arms),
        "first_reward": mean, "first_reward_se": se, "gate_word_SJ": gate_d["measures"]["SJ_word"]["pass@1"],
        # the pooled gate's G3 is the step-with-J gap itself; a paired gate records that gap apart (`gap_SJ`), its
        # G3 being J's extra cost only
        "gate_cost": gate_d["values"].get("gap_SJ", gate_d["values"]["cost_SJ"]),
        **({"gate_cost_label": "the gate's paired (S, J) step gap"} if "gap_SJ" in gate_d["values"] else {}),
        "move": {a: v[-1] - v[0] for a, v in share.items()}, "final_share": {a: v[-1] for a, v in share.items()},
        "J1_holds": by_claim["J1"]["verdict"] == "holds", "H1_estimate": by_claim["H1"]["estimate"],
        # every build's J equal to its own S's warm-up (the registered gate's, and each rebuild's gate)
        "junior_matches_warmup": _all_or_none((g["dialects"][-1].get("junior_metrics") or {}).get("matches_base_warmup")
                                              for g in (gate_doc, *(rebuild_gates or {}).values())),
    }


def _all_or_none(values) -> bool | None:
    vals = list(values)
    return None if any(v is None for v in vals) else all(vals)


def _f(x, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:+.{digits}f}" if isinstance(x, float) and x < 0 else (
        f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def gate_markdown(doc: dict) -> str:
    setting = f", setting {doc['setting']}" if doc.get("setting") else ""
    lines = [f"# The gate of the junior positive control{setting}", "",
             "Base models only, no RL (studies/junior-control/registration.md). Written by `tandem study gate` "
             "from `gate.json`.", ""]
    if doc.get("amendment"):  # a rebuild's gate, measured again (tasks.study.control.gate_rebuild)
        b, g = doc["build"], doc["rebuild_of"]
        lines += [f"Measured again on a rebuild of S and J (amendment {doc['amendment']}, amendments.md): S "
                  f"`{b['S'][:16]}`, J `{b['J'][:16]}`, made by the registered stages on another machine; the "
                  f"registered gate measured S `{g['S'][:16]}`, J `{g['J'][:16]}`. The dialect the registered gate "
                  "took, its measurements, criteria and estimator; this build trains only if it passes.", ""]
    lines.append(f"**Result: {'passed, dialect ' + repr(doc['dialect']) if doc['passed'] else 'no dialect passed'}.**")
    for d in doc["dialects"]:
        m, c = d["measures"], d["criteria"]
        lines += ["", f"## Dialect `{d['dialect']}`: {'passed' if d['passed'] else 'failed'}", "",
                  "| id | value | rule | passed |", "|---|---|---|---|"]
        for g, row in c.items():
            v = row["value"]
            v = ", ".join(f"{k} {_f(x)}" for k, x in v.items()) if isinstance(v, dict) else _f(v)
            if g in GAP_MEASUREMENT and "paired" in d:
                v += f" ({d['values']['problems'][g]} problems)"
            elif g in GAP_MEASUREMENT:
                n = m[GAP_MEASUREMENT[g]]["dialect_vs_keyed"]
                v += f" (n {n['n_dialect']} dialect-first, {n['n_keyed']} keyed-first)"
            lines.append(f"| {g} | {v} | {row['rule']} | {'' if row['passed'] is None else 'yes' if row['passed'] else 'no'} |")
        if "paired" in d:  # a paired gate: every difference within problems, and the pooled ones beside them
            lines += ["", "| difference, within problems (Mantel-Haenszel) | value | se | problems | samples (a, b) |",
                      "|---|---|---|---|---|"]
            for name, p in d["paired"]["parts"].items():
                lines.append(f"| {name} | {_f(p['value'])} | {_f(p['se'])} | {p['problems']} | {p['n_a']}, {p['n_b']} |")
            lines += ["", "Pooled over all samples (the first setting's estimator, not a criterion here): "
                      + ", ".join(f"{g} {_f(m[k]['dialect_vs_keyed']['gap'])}" for g, k in GAP_MEASUREMENT.items())
                      + "."]
        lines += ["", "| measurement | samples | pass@1 | dialect share | dialect-first pass@1 (n) | keyed-first pass@1 (n) |",
                  "|---|---|---|---|---|---|"]
        for k, s in m.items():
            g = s["dialect_vs_keyed"]
            share = s["styles"].get(d.get("style", d["dialect"]), {}).get("share", 0.0)
            lines.append(f"| {k} | {s['n']} | {_f(s['pass@1'])} | {_f(share)} | {_f(g['dialect'])} ({g['n_dialect']}) "
                         f"| {_f(g['keyed'])} ({g['n_keyed']}) |")
        lines += ["", f"Hashes: S `{d['hashes']['S'][:16]}`, J `{d['hashes']['J'][:16]}`. "
                      f"J's styles: " + ", ".join(f"{k} {_f(v['share'])} (accuracy {_f(v['accuracy'])})"
                                                 for k, v in (d["junior_metrics"].get("styles") or {}).items()) + "."]
        if "matches_base_warmup" in d["junior_metrics"]:
            lines.append(f"J equals S's warm-up (matches_base_warmup): {d['junior_metrics']['matches_base_warmup']}.")
        anywhere = {k: s["annotated_anywhere"] for k, s in m.items() if "annotated_anywhere" in s}
        if anywhere:
            lines.append("Share of samples with an annotation on any line: "
                         + ", ".join(f"{k} {_f(v)}" for k, v in anywhere.items()) + ".")
    return "\n".join(lines) + "\n"


def claims_summary(doc: dict) -> str:
    lines = [f"junior control: {len(doc['seeds'])} complete seed(s) of {len(doc['seeds_registered'])}"
             + ("" if doc.get("verdicts_final") else " (verdicts not final)")]
    for c in doc["claims"]:
        lines.append(f"  {c['id']}: {c['comparison']} {c['metric']} = {c['estimate']:+.3f} "
                     f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] -> {c['verdict']}")
    fired = [k for k, v in doc.get("bug_indicators", {}).items() if v.get("fired")]
    if doc.get("bug_indicators"):
        lines.append("  bug indicators fired: " + (", ".join(fired) if fired else "none"))
    if doc.get("note"):
        lines.append("  " + doc["note"])
    return "\n".join(lines)
