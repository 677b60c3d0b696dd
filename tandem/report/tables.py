"""The report's tables, built from the eval/analysis dicts (docs/metrics.md) as `Table`s.

Rows name arms by their report label; values stay raw floats (the renderer formats them) and missing
values stay None, so an undefined metric is never shown as 0.
"""

from __future__ import annotations

from typing import Any

from tandem.report.document import Table
from tandem.report.figures import arm_label


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


def passk_table(eval_data: dict, mode: str, caption: str) -> Table | None:
    """Macro pass@k of the base and of each arm's last checkpoint in one mode, plus per-benchmark pass@1."""
    s = eval_data.get("settings", {})
    ks = s.get("ks", [])
    if mode not in s.get("modes", []) or not ks:
        return None
    benches = sorted(s.get("benchmarks", {}))
    headers = ["model", "step"] + [f"pass@{k}" for k in ks] + [f"{b} pass@{ks[0]}" for b in benches]
    if mode != "solo":
        headers.append("senior share")

    def row(label: str, c: dict | None) -> list[Any]:
        m = ((c or {}).get("modes", {}).get(mode) or {})
        r = [label, (c or {}).get("step")] + [(m.get("macro") or {}).get(f"pass@{k}") for k in ks]
        r += [((m.get("benchmarks") or {}).get(b) or {}).get(f"pass@{ks[0]}") for b in benches]
        if mode != "solo":
            r.append((m.get("macro") or {}).get("senior_share"))
        return r

    rows = [row("base", _base_row_source(eval_data))]
    for arm in eval_data.get("arms", {}):
        fin = _final(eval_data, arm)
        if fin is not None and fin.get("step", 0) > 0:
            rows.append(row(arm_label(arm), fin))
    return Table(caption, headers, rows)


def checkpoint_table(eval_data: dict, k: int = 1) -> Table | None:
    """Every evaluated checkpoint: pass@k in each mode, for the checkpoint-wise curves."""
    modes = eval_data.get("settings", {}).get("modes", [])
    if not eval_data.get("arms") or not modes:
        return None
    headers = ["arm", "step"] + [f"{m} pass@{k}" for m in modes]
    rows = [[arm_label(arm), c.get("step")] + [_mode_macro(c, m, f"pass@{k}") for m in modes]
            for arm in eval_data["arms"] for c in _ckpts(eval_data, arm)]
    return Table(f"pass@{k} (macro) per checkpoint (step 0 = base)", headers, rows)


def legibility_table(analysis: dict) -> Table | None:
    """Table 1: how legible each arm's solo reasoning is to the frozen junior (base, then last checkpoints)."""
    arms = list(analysis.get("arms", {}))
    if not arms:
        return None
    benches = analysis.get("settings", {}).get("benchmarks", [])
    headers = ["model", "step", "junior CE (nats/token)", "overlap"] + [f"CE {b}" for b in benches]

    def row(label: str, c: dict) -> list[Any]:
        leg = c.get("legibility") or {}
        ce, ov = leg.get("junior_ce") or {}, leg.get("overlap") or {}
        return [label, c.get("step"), ce.get("macro"), ov.get("macro")] + \
            [(ce.get("benchmarks") or {}).get(b) for b in benches]

    rows = []
    base = next((c for a in arms for c in _ckpts(analysis, a) if c.get("step", 0) == 0), None)
    if base is not None:
        rows.append(row("base", base))
    for arm in arms:
        fin = _final(analysis, arm)
        if fin is not None and fin.get("step", 0) > 0:
            rows.append(row(arm_label(arm), fin))
    return Table("Table 1: legibility to the junior (lower CE and higher overlap = more legible)", headers, rows,
                 note="Junior CE: mean negative log-likelihood per token of the frozen junior on the senior's "
                      "solo generations. Overlap: mean over positions of sum_v min(p_senior, p_junior).")


def ablation_table(eval_data: dict, analysis: dict, k: int = 1) -> Table | None:
    """Table 2: every arm's last checkpoint side by side: accuracy, robustness, drift and legibility."""
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
    return Table("Table 2: ablation across arms (last checkpoints)", headers, rows,
                 note="Top-type log-ratio: mean log p_senior - log p_base over the reference arm's most-drifted "
                      "token types; smaller than the reference arm = pulled back toward the base.")


def drift_table(analysis: dict) -> Table | None:
    """Per-token KL summary (mean and quantiles) of each arm's last checkpoint."""
    qs = [str(q) for q in analysis.get("settings", {}).get("quantiles", [])]
    arms = [a for a in analysis.get("arms", {}) if (_final(analysis, a) or {}).get("step", 0) > 0]
    if not arms:
        return None
    headers = ["arm", "step", "KL mean"] + [f"KL q{q}" for q in qs] + ["mean log-ratio", "coverage of top types"]
    rows = []
    for arm in arms:
        fin = _final(analysis, arm)
        kl = (fin.get("drift") or {}).get("kl") or {}
        top = (fin.get("drift") or {}).get("top_tokens") or {}
        rows.append([arm_label(arm), fin.get("step"), kl.get("mean")] +
                    [(kl.get("quantiles") or {}).get(q) for q in qs] +
                    [(fin.get("drift") or {}).get("logratio_mean"), top.get("coverage")])
    return Table("Drift from the base (per-token KL on the senior's own solo generations)", headers, rows)


def key_value_table(caption: str, items: dict[str, Any]) -> Table:
    return Table(caption, ["item", "value"], [[k, v] for k, v in items.items()])
