"""The report's tables, built from the eval/analysis dicts (docs/metrics.md) as `Table`s.

Rows name arms by their report label; values stay raw floats (the renderer gives each column one number
format) and missing values stay None, so an undefined metric is never shown as 0. Given `intervals` ({arm or "base": {metric:
(low, high)}}, `tandem.metrics.claims.arm_intervals`), the tables of the final checkpoints and the base add a
"95% CI" column next to the values that have a per-problem measure.
"""

from __future__ import annotations

from typing import Any, Mapping

from tandem.report.document import Estimate, Table
from tandem.report.figures import arm_label

Intervals = Mapping[str, Mapping[str, tuple[float, float]]]  # arm (or "base") -> metric -> (low, high)
CI_NOTE = ("95% CI: percentile bootstrap over the benchmark problems of the per-problem values of "
           "that checkpoint; training seeds are not resampled, so a second training run can move a value by "
           "more than its interval.")


def ci_cell(intervals: Intervals | None, arm: str, metric: str) -> Estimate | None:
    """'[low, high]' for one arm's metric (in its column's number format), None (an en dash) when that interval
    was not computed."""
    lo_hi = (intervals or {}).get(arm, {}).get(metric)
    return None if lo_hi is None else Estimate(None, float(lo_hi[0]), float(lo_hi[1]))


def _ckpts(data: dict, arm: str) -> list[dict]:
    return sorted(data.get("arms", {}).get(arm, {}).get("checkpoints", []), key=lambda c: c.get("step", 0))


def _final(data: dict, arm: str) -> dict | None:
    cks = _ckpts(data, arm)
    return cks[-1] if cks else None


def _at_step(data: dict, arm: str, step: int) -> dict | None:
    return next((c for c in _ckpts(data, arm) if c.get("step", 0) == step), None)


def _mode_macro(ckpt: dict | None, mode: str, key: str) -> Any:
    return (((ckpt or {}).get("modes", {}).get(mode) or {}).get("macro") or {}).get(key)


def _base_row_source(eval_data: dict) -> dict | None:
    for arm in eval_data.get("arms", {}):
        c = _at_step(eval_data, arm, 0)
        if c is not None:
            return c
    return None


def passk_table(eval_data: dict, mode: str, caption: str, intervals: Intervals | None = None) -> Table | None:
    """Macro pass@k of the base and of each arm's last checkpoint in one mode, plus per-benchmark pass@1
    (and the 95% interval of the macro pass@k at the first k, when `intervals` are given)."""
    s = eval_data.get("settings", {})
    ks = s.get("ks", [])
    if mode not in s.get("modes", []) or not ks:
        return None
    benches = sorted(s.get("benchmarks", {}))
    ci_metric = f"{mode}/pass@{ks[0]}"
    headers = ["model", "step"] + [f"pass@{k}" for k in ks]
    if intervals is not None:
        headers.append(f"pass@{ks[0]} 95% CI")
    headers += [f"{b} pass@{ks[0]}" for b in benches]
    if mode != "solo":
        headers.append("senior share")

    def row(arm: str, c: dict | None) -> list[Any]:
        m = ((c or {}).get("modes", {}).get(mode) or {})
        r = [arm_label(arm), (c or {}).get("step")] + [(m.get("macro") or {}).get(f"pass@{k}") for k in ks]
        if intervals is not None:
            r.append(ci_cell(intervals, arm, ci_metric))
        r += [((m.get("benchmarks") or {}).get(b) or {}).get(f"pass@{ks[0]}") for b in benches]
        if mode != "solo":
            r.append((m.get("macro") or {}).get("senior_share"))
        return r

    rows = [row("base", _base_row_source(eval_data))]
    for arm in eval_data.get("arms", {}):
        fin = _final(eval_data, arm)
        if fin is not None and fin.get("step", 0) > 0:
            rows.append(row(arm, fin))
    return Table(caption, headers, rows, note=CI_NOTE if intervals is not None else "")


def checkpoint_table(eval_data: dict, k: int = 1) -> Table | None:
    """Every evaluated checkpoint: pass@k in each mode, for the checkpoint-wise curves."""
    modes = eval_data.get("settings", {}).get("modes", [])
    if not eval_data.get("arms") or not modes:
        return None
    headers = ["arm", "step"] + [f"{m} pass@{k}" for m in modes]
    rows = [[arm_label(arm), c.get("step")] + [_mode_macro(c, m, f"pass@{k}") for m in modes]
            for arm in eval_data["arms"] for c in _ckpts(eval_data, arm)]
    return Table(f"pass@{k} (macro) per checkpoint (step 0 = base)", headers, rows)


def legibility_table(analysis: dict, intervals: Intervals | None = None) -> Table | None:
    """Table 1: how legible each arm's solo reasoning is to the frozen junior (base, then last checkpoints),
    with the 95% intervals of junior CE and overlap when `intervals` are given."""
    arms = list(analysis.get("arms", {}))
    if not arms:
        return None
    benches = analysis.get("settings", {}).get("benchmarks", [])
    with_ci = intervals is not None
    headers = ["model", "step", "junior CE (nats/token)"] + (["junior CE 95% CI"] if with_ci else []) + \
        ["overlap"] + (["overlap 95% CI"] if with_ci else []) + [f"CE {b}" for b in benches]

    def row(arm: str, c: dict) -> list[Any]:
        leg = c.get("legibility") or {}
        ce, ov = leg.get("junior_ce") or {}, leg.get("overlap") or {}
        return [arm_label(arm), c.get("step"), ce.get("macro")] + \
            ([ci_cell(intervals, arm, "junior_ce")] if with_ci else []) + [ov.get("macro")] + \
            ([ci_cell(intervals, arm, "overlap")] if with_ci else []) + \
            [(ce.get("benchmarks") or {}).get(b) for b in benches]

    rows = []
    base = next((c for a in arms for c in _ckpts(analysis, a) if c.get("step", 0) == 0), None)
    if base is not None:
        rows.append(row("base", base))
    for arm in arms:
        fin = _final(analysis, arm)
        if fin is not None and fin.get("step", 0) > 0:
            rows.append(row(arm, fin))
    note = ("Junior CE: mean negative log-likelihood per token of the frozen junior on the senior's "
            "solo generations. Overlap: mean over positions of sum_v min(p_senior, p_junior).")
    if with_ci:
        note += (" " + CI_NOTE + " The interval resamples per-problem means (each problem's completions averaged "
                 "first), so it can sit slightly off a value averaged over all tokens.")
    return Table("Table 1: legibility to the junior (lower CE and higher overlap = more legible)", headers, rows,
                 note=note)


def ablation_table(eval_data: dict, analysis: dict, k: int = 1, intervals: Intervals | None = None) -> Table | None:
    """Table 2: every arm's last checkpoint side by side: accuracy, robustness, drift and legibility (its
    values' intervals, when `intervals` are given, are in the tables of each measure; the note says so)."""
    arms = [a for a in eval_data.get("arms", {}) if (_final(eval_data, a) or {}).get("step", 0) > 0]
    if not arms:
        return None
    modes = eval_data.get("settings", {}).get("modes", [])
    headers = ["arm", "step"] + [f"{m} pass@{k}" for m in modes] + \
              ["KL mean", "top-type log-ratio", "junior CE", "overlap"]
    rows = []
    for arm in arms:
        fin = _final(eval_data, arm)
        an = _at_step(analysis, arm, fin.get("step", 0)) or {}
        drift, leg = an.get("drift") or {}, an.get("legibility") or {}
        rows.append([arm_label(arm), fin.get("step")] + [_mode_macro(fin, m, f"pass@{k}") for m in modes] +
                    [(drift.get("kl") or {}).get("mean"), (drift.get("top_tokens") or {}).get("mean_logratio"),
                     (leg.get("junior_ce") or {}).get("macro"), (leg.get("overlap") or {}).get("macro")])
    note = ("Top-type log-ratio: mean log p_senior - log p_base over the reference arm's most-drifted "
            "token types; smaller than the reference arm = pulled back toward the base.")
    if intervals is not None:
        note += (" The 95% intervals of these values are in the solo, tandem, drift and legibility tables; the "
                 "claims table at the top holds the intervals of the differences between arms.")
    return Table("Table 2: ablation across arms (last checkpoints)", headers, rows, note=note)


def drift_table(analysis: dict, intervals: Intervals | None = None) -> Table | None:
    """Per-token KL summary (mean and quantiles) of each arm's last checkpoint, with the 95% interval of the
    mean when `intervals` are given."""
    qs = [str(q) for q in analysis.get("settings", {}).get("quantiles", [])]
    arms = [a for a in analysis.get("arms", {}) if (_final(analysis, a) or {}).get("step", 0) > 0]
    if not arms:
        return None
    with_ci = intervals is not None
    headers = ["arm", "step", "KL mean"] + (["KL mean 95% CI"] if with_ci else []) + [f"KL q{q}" for q in qs] + \
        ["mean log-ratio", "coverage of top types"]
    rows = []
    for arm in arms:
        fin = _final(analysis, arm)
        kl = (fin.get("drift") or {}).get("kl") or {}
        top = (fin.get("drift") or {}).get("top_tokens") or {}
        rows.append([arm_label(arm), fin.get("step"), kl.get("mean")] +
                    ([ci_cell(intervals, arm, "kl_mean")] if with_ci else []) +
                    [(kl.get("quantiles") or {}).get(q) for q in qs] +
                    [(fin.get("drift") or {}).get("logratio_mean"), top.get("coverage")])
    note = (CI_NOTE + " The interval resamples per-problem means of the per-token KL, so it can sit slightly off "
            "the all-token mean.") if with_ci else ""
    return Table("Drift from the base (per-token KL on the senior's own solo generations)", headers, rows, note)


def key_value_table(caption: str, items: dict[str, Any]) -> Table:
    return Table(caption, ["item", "value"], [[k, v] for k, v in items.items()])
