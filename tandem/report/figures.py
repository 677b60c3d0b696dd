"""The report's figures, drawn with matplotlib's Agg backend from the eval/analysis dicts.

Each `*_figure` function returns PNG bytes, or None when its data is absent (the report then says why).
Figures are drawn on matplotlib's Agg canvas through the object API (never pyplot).
Numbering follows the paper: figure 2 (solo pass@k against the base, plus checkpoint curves), figure 3
(tandem pass@k), figure 4 (drift: per-token KL distribution and the most-drifted-token pull-back),
figure 7 (KL-Reg: drift against handoff robustness). PNGs carry no timestamp or software tag, so the same
metrics give the same bytes. Given `intervals` ({arm or "base": {"<mode>/pass@<k>": (low, high)}}), the
pass@k-against-k panels of figures 2 and 3 draw 95% error bars on the final checkpoints and the base; the
per-checkpoint curves have no per-problem measures, hence no bars.
"""

from __future__ import annotations

import io
import math
from typing import Any, Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as MplFigure

ARM_LABELS = {"tandem": "TRL (tandem)", "grpo": "GRPO", "kl_reg": "KL-Reg", "grpo_g16": "GRPO-G16",
              "base": "base", "junior": "base (junior)"}
_COLORS = {"tandem": "#1f77b4", "grpo": "#d62728", "kl_reg": "#2ca02c", "grpo_g16": "#9467bd", "base": "#7f7f7f"}
_DPI = 100


def arm_label(arm: str) -> str:
    return ARM_LABELS.get(arm, arm)


def arm_color(arm: str, i: int = 0) -> str:
    return _COLORS.get(arm, f"C{(i + 4) % 10}")


# every arm has its own marker and line style as well as its colour, so arms with identical numbers (GRPO and
# KL-Reg at a tiny beta) stay visible on top of each other: hollow markers of decreasing size nest
_MARKERS = {"tandem": "o", "grpo": "s", "kl_reg": "^", "grpo_g16": "D", "base": "x"}
_LINES = {"tandem": "-", "grpo": "--", "kl_reg": ":", "grpo_g16": "-.", "base": "--"}


def arm_style(arm: str, i: int = 0) -> dict:
    """matplotlib keywords for `arm`'s line: colour, marker, line style, marker size (the i-th arm drawn)."""
    return {"color": arm_color(arm, i), "marker": _MARKERS.get(arm, "ov^sD"[i % 5]),
            "linestyle": _LINES.get(arm, ["-", "--", ":", "-."][i % 4]), "ms": max(4.0, 8.0 - 1.5 * i),
            "markerfacecolor": "none", "markeredgewidth": 1.3}


def _subplots(ncols: int, figsize: tuple[float, float]):
    """A figure on the Agg canvas, outside pyplot: no global backend switch, no global figure registry, so
    drawing is safe from any thread and leaves a notebook's backend alone."""
    fig = MplFigure(figsize=figsize)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def to_png(fig) -> bytes:
    """PNG bytes without metadata (deterministic for identical inputs)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def _macro(ckpt: dict, mode: str, key: str) -> float:
    return _num(((ckpt.get("modes", {}).get(mode) or {}).get("macro") or {}).get(key))


def _final(arm_data: dict) -> dict | None:
    cks = arm_data.get("checkpoints", [])
    return max(cks, key=lambda c: c.get("step", 0)) if cks else None


def _trained_arms(eval_data: dict) -> list[str]:
    return [a for a in eval_data.get("arms", {}) if eval_data["arms"][a].get("checkpoints")]


def _base_ckpt(eval_data: dict) -> dict | None:
    """Step 0 (the base model) of the first arm that has one: the base's scores in every mode."""
    for arm in _trained_arms(eval_data):
        for c in eval_data["arms"][arm]["checkpoints"]:
            if c.get("step", 0) == 0:
                return c
    return None


def _style(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)


Intervals = Mapping[str, Mapping[str, tuple[float, float]]]


def _error_bars(ax, arm: str, mode: str, ks: Sequence[int], ys: Sequence[float], color: str,
                intervals: Intervals | None) -> None:
    """95% error bars at each k whose interval is known (asymmetric, clipped at the point)."""
    per = (intervals or {}).get(arm, {})
    pts = [(k, y, per[f"{mode}/pass@{k}"]) for k, y in zip(ks, ys)
           if f"{mode}/pass@{k}" in per and not math.isnan(y)]
    if pts:
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                    yerr=[[max(p[1] - p[2][0], 0.0) for p in pts], [max(p[2][1] - p[1], 0.0) for p in pts]],
                    fmt="none", ecolor=color, capsize=3, lw=1)


def _passk_panel(ax, eval_data: dict, mode: str, ks: Sequence[int], base: dict | None,
                 intervals: Intervals | None = None) -> bool:
    drew = False
    if base is not None:
        ys = [_macro(base, mode, f"pass@{k}") for k in ks]
        if any(not math.isnan(y) for y in ys):
            ax.plot(ks, ys, label="base", **{**arm_style("base"), "ms": 5})
            _error_bars(ax, "base", mode, ks, ys, _COLORS["base"], intervals)
            drew = True
    for i, arm in enumerate(_trained_arms(eval_data)):
        fin = _final(eval_data["arms"][arm])
        if fin is None or fin.get("step", 0) == 0:
            continue
        ys = [_macro(fin, mode, f"pass@{k}") for k in ks]
        if all(math.isnan(y) for y in ys):
            continue
        ax.plot(ks, ys, label=f"{arm_label(arm)} (step {fin['step']})", **arm_style(arm, i))
        _error_bars(ax, arm, mode, ks, ys, arm_color(arm, i), intervals)
        drew = True
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ks), [str(k) for k in ks])
    ax.set_ylim(-0.02, 1.02)
    return drew


def _checkpoint_panel(ax, eval_data: dict, mode: str, key: str) -> bool:
    """`key` per checkpoint, on the pass@k panels' axis (0 to 1): these points have no interval, and a zoomed
    axis would make differences of a few problems look like trends."""
    drew = False
    for i, arm in enumerate(_trained_arms(eval_data)):
        cks = sorted(eval_data["arms"][arm]["checkpoints"], key=lambda c: c.get("step", 0))
        xs = [c.get("step", 0) for c in cks]
        ys = [_macro(c, mode, key) for c in cks]
        if all(math.isnan(y) for y in ys):
            continue
        ax.plot(xs, ys, label=arm_label(arm), **arm_style(arm, i))
        drew = True
    ax.set_ylim(-0.02, 1.02)
    return drew


def solo_passk_figure(eval_data: dict, intervals: Intervals | None = None) -> bytes | None:
    """Figure 2: solo pass@k against k (last checkpoint per arm, and the base; error bars from `intervals`),
    and solo pass@1 per checkpoint."""
    ks = eval_data.get("settings", {}).get("ks", [])
    if "solo" not in eval_data.get("settings", {}).get("modes", []) or not ks:
        return None
    fig, (ax1, ax2) = _subplots(2, (11, 4))
    ok1 = _passk_panel(ax1, eval_data, "solo", ks, _base_ckpt(eval_data), intervals)
    _style(ax1, "k", "pass@k (macro)", "Solo pass@k, last checkpoint vs base")
    ok2 = _checkpoint_panel(ax2, eval_data, "solo", f"pass@{ks[0]}")
    _style(ax2, "training step (0 = base)", f"pass@{ks[0]} (macro)", f"Solo pass@{ks[0]} per checkpoint")
    if not (ok1 or ok2):
        return None
    for ax in (ax1, ax2):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return to_png(fig)


def tandem_passk_figure(eval_data: dict, intervals: Intervals | None = None) -> bytes | None:
    """Figure 3: pass@k of senior + frozen junior, per tandem mode (step = handoff robustness, word); error
    bars from `intervals` on the final checkpoints and the base."""
    s = eval_data.get("settings", {})
    ks, modes = s.get("ks", []), [m for m in ("step", "word") if m in s.get("modes", [])]
    if not modes or not ks:
        return None
    fig, axes = _subplots(len(modes) + 1, (5.2 * (len(modes) + 1), 4))
    drew = False
    base = _base_ckpt(eval_data)
    for ax, mode in zip(axes, modes):
        drew |= _passk_panel(ax, eval_data, mode, ks, base, intervals)
        _style(ax, "k", "pass@k (macro)", f"Tandem ({mode} schedule) pass@k")
    drew |= _checkpoint_panel(axes[-1], eval_data, modes[0], f"pass@{ks[0]}")
    _style(axes[-1], "training step (0 = base)", f"pass@{ks[0]} (macro)",
           f"Tandem ({modes[0]}) pass@{ks[0]} per checkpoint")
    if not drew:
        return None
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return to_png(fig)


def _final_analysis(analysis: dict, arm: str) -> dict | None:
    cks = analysis.get("arms", {}).get(arm, {}).get("checkpoints", [])
    return max(cks, key=lambda c: c.get("step", 0)) if cks else None


def drift_figure(analysis: dict, max_types: int = 50) -> bytes | None:
    """Figure 4: per-token KL(senior || base) distribution, and each arm's log-ratio on the reference arm's
    most-drifted token types (below the diagonal = pulled back toward the base)."""
    edges = [_num(e) for e in analysis.get("kl_histogram_edges", [])]
    arms = list(analysis.get("arms", {}))
    if not arms:
        return None
    fig, (ax1, ax2) = _subplots(2, (11, 4))
    drew = False
    if len(edges) >= 2:
        for i, arm in enumerate(arms):
            fin = _final_analysis(analysis, arm)
            hist = ((fin or {}).get("drift", {}).get("kl") or {}).get("histogram") if fin else None
            if not fin or fin.get("step", 0) == 0 or not hist or len(hist) != len(edges) - 1:
                continue
            total = sum(_num(h) for h in hist)
            if not total:
                continue
            fr = [_num(h) / total for h in hist]
            st = arm_style(arm, i)
            ax1.stairs(fr, edges, color=st["color"], linestyle=st["linestyle"],
                       label=f"{arm_label(arm)} (step {fin['step']})", lw=1.5)
            drew = True
    _style(ax1, "per-token KL(senior || base), nats", "fraction of tokens", "Drift: per-token KL distribution")
    ax1.set_yscale("log")
    ref = analysis.get("reference", {}) or {}
    ref_tokens = (ref.get("tokens") or [])[:max_types]
    ref_lr = [_num(t.get("logratio")) for t in ref_tokens]
    lim = 0.0
    for i, arm in enumerate(arms):
        if arm == ref.get("arm"):
            continue
        per = analysis["arms"][arm].get("top_tokens_final") or []
        ys = [_num(t.get("logratio")) for t in per[:len(ref_lr)]]
        pts = [(x, y) for x, y in zip(ref_lr, ys) if not (math.isnan(x) or math.isnan(y))]
        if not pts:
            continue
        st = arm_style(arm, i)
        ax2.scatter([p[0] for p in pts], [p[1] for p in pts], s=st["ms"] ** 2, marker=st["marker"],
                    facecolors="none", edgecolors=st["color"], linewidths=1.0, label=arm_label(arm))
        lim = max(lim, max(abs(v) for p in pts for v in p))
        drew = True
    if lim > 0:
        ax2.plot([-lim, lim], [-lim, lim], color="#555", lw=0.8, ls="--", label="no pull-back (y = x)")
    _style(ax2, f"{arm_label(str(ref.get('arm', 'reference')))} log-ratio to base (nats)",
           "arm's log-ratio on the same token types",
           f"Most-drifted token types of {arm_label(str(ref.get('arm', 'reference')))} (top {len(ref_lr)})")
    if not drew:
        return None
    for ax in (ax1, ax2):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return to_png(fig)


def klreg_figure(eval_data: dict, analysis: dict, k: int = 1) -> bytes | None:
    """Figure 7: drift (mean per-token KL) against handoff robustness (step-schedule pass@k), per checkpoint.

    KL-Reg is expected to sit left of GRPO (less drift) without reaching TRL's handoff score.
    """
    mode = "step" if "step" in eval_data.get("settings", {}).get("modes", []) else None
    if mode is None:
        return None
    fig, (ax,) = _subplots(1, (6.5, 4.5))
    drew = False
    for i, arm in enumerate(_trained_arms(eval_data)):
        kl_by_step = {c.get("step", 0): _num(((c.get("drift") or {}).get("kl") or {}).get("mean"))
                      for c in analysis.get("arms", {}).get(arm, {}).get("checkpoints", [])}
        pts = []
        for c in sorted(eval_data["arms"][arm]["checkpoints"], key=lambda c: c.get("step", 0)):
            x, y = kl_by_step.get(c.get("step", 0), math.nan), _macro(c, mode, f"pass@{k}")
            if not (math.isnan(x) or math.isnan(y)):
                pts.append((x, y, c.get("step", 0)))
        if not pts:
            continue
        st = arm_style(arm, i)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{arm_label(arm)} (steps {pts[0][2]}-{pts[-1][2]})",
                **st)
        # the last checkpoint filled in (the legend names the steps: labels on the points would overlap)
        ax.plot([pts[-1][0]], [pts[-1][1]], linestyle="none", marker=st["marker"], ms=st["ms"], color=st["color"])
        drew = True
    _style(ax, "mean per-token KL(senior || base), nats", f"step-schedule tandem pass@{k}",
           "KL-Reg comparison: drift vs handoff robustness (filled: last checkpoint)")
    if not drew:
        return None
    ax.legend(fontsize=8)
    return to_png(fig)


def train_curves_figure(curves: dict[str, dict[str, list[float]]], reward_key: str) -> bytes | None:
    """Training reward per step, one line per arm; `curves[arm]` maps column -> values ('step' included)."""
    fig, (ax,) = _subplots(1, (6.5, 4))
    drew = False
    for i, (arm, cols) in enumerate(curves.items()):
        xs, ys = cols.get("step", []), cols.get(reward_key, [])
        pts = [(_num(x), _num(y)) for x, y in zip(xs, ys)]
        pts = [p for p in pts if not (math.isnan(p[0]) or math.isnan(p[1]))]
        if not pts:
            continue
        st = arm_style(arm, i)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=arm_label(arm),
                **{**st, "marker": st["marker"] if len(pts) < 40 else None})
        drew = True
    _style(ax, "training step", reward_key, "Training reward")
    if not drew:
        return None
    ax.legend(fontsize=8)
    return to_png(fig)
