"""Dialect measures: which solution style a text is written in, and each style's share and accuracy.

A style is read off a solution's first line (`tandem.data.synthetic.solution_style`: verbose, terse, compact,
coded, annotated, reversed or other). The junior positive control (studies/junior-control/registration.md) follows
one style, the *dialect* the senior's base writes in the majority and the junior never saw: its share of a run's
solo samples is the dose curve, and the accuracy of dialect-first against keyed-first samples is the gate's cost.

The jargon control on SmolLM2 (studies/jargon-smollm2/registration.md) reads its jargon the same way, off the
first line: a row is a *jargon row* when its first line carries a GSM8K calculator annotation `<<expression=
result>>` (style `annotated`; `tandem.data.synthetic.ANNOTATION`), or, for the pre-listed second jargon, when its
first line is a `reversed` step. `annotated_anywhere` is the looser reading (an annotation on any line), reported
beside the first-line share so that a jargon that leaves the first step but stays in later ones is seen.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence

from tandem.data.synthetic import ANNOTATION, solution_style

KEYED = ("verbose", "terse")  # the styles that open each step with its ordinal key


def styles_of(texts: Iterable[str]) -> list[str]:
    """The style of each text, in order."""
    return [solution_style(t) for t in texts]


def style_counts(texts: Iterable[str]) -> dict[str, int]:
    """Style -> how many of `texts` are written in it (styles that occur only), sorted by name."""
    return dict(sorted(Counter(styles_of(texts)).items()))


def share(styles: Sequence[str], style: str) -> float | None:
    """The share of `styles` equal to `style` (None for no texts). Naive: sum(s == style) / len(styles)."""
    return sum(s == style for s in styles) / len(styles) if styles else None


def accuracy_by_style(styles: Sequence[str], scores: Sequence[float]) -> dict[str, dict[str, float]]:
    """Style -> {n, share, accuracy} over paired `styles` and `scores` (mean score of the samples in that style)."""
    if len(styles) != len(scores):
        raise ValueError(f"{len(styles)} styles but {len(scores)} scores")
    out: dict[str, dict[str, float]] = {}
    for s in sorted(set(styles)):
        xs = [float(x) for st, x in zip(styles, scores) if st == s]
        out[s] = {"n": len(xs), "share": len(xs) / len(styles), "accuracy": sum(xs) / len(xs)}
    return out


def class_gap(styles: Sequence[str], scores: Sequence[float], dialect: str,
              keyed: Sequence[str] = KEYED) -> dict[str, float | int | None]:
    """Mean score of dialect-first samples minus keyed-first ones, with each class's size, mean and the
    difference's standard error (independent binomial classes). None where a class is empty."""
    d = [float(x) for s, x in zip(styles, scores) if s == dialect]
    k = [float(x) for s, x in zip(styles, scores) if s in keyed]

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    md, mk = mean(d), mean(k)
    gap = None if md is None or mk is None else md - mk
    se = None
    if gap is not None:
        se = (md * (1 - md) / len(d) + mk * (1 - mk) / len(k)) ** 0.5
    return {"n_dialect": len(d), "n_keyed": len(k), "dialect": md, "keyed": mk, "gap": gap, "se": se}


def shares_per_problem(records: Sequence[Mapping], style: str) -> dict[str, float]:
    """Problem id -> share of its samples in `style` (records with `id` and `text`, problem-major)."""
    by: dict[str, list[str]] = {}
    for r in records:
        by.setdefault(str(r["id"]), []).append(solution_style(r["text"]))
    return {pid: sum(s == style for s in ss) / len(ss) for pid, ss in by.items()}


def annotated_anywhere(text: str) -> bool:
    """Whether any line of `text` carries a calculator annotation `<<expression=result>>`."""
    return ANNOTATION.search(text) is not None


def class_counts(ids: Sequence[str], styles: Sequence[str], scores: Sequence[float], dialect: str,
                 keyed: Sequence[str] = KEYED) -> dict[str, list[int]]:
    """Problem id -> [dialect-first samples, of them correct, keyed-first samples, of them correct] (a sample is
    correct when its score is > 0); every id of `ids` appears, in first-seen order. The gate keeps these counts so
    that its differences can be taken within problems (`paired_difference`)."""
    if not len(ids) == len(styles) == len(scores):
        raise ValueError(f"{len(ids)} ids, {len(styles)} styles and {len(scores)} scores")
    out: dict[str, list[int]] = {}
    for pid, s, x in zip(ids, styles, scores):
        c = out.setdefault(str(pid), [0, 0, 0, 0])
        at = 0 if s == dialect else 2 if s in keyed else None
        if at is not None:
            c[at] += 1
            c[at + 1] += int(float(x) > 0)
    return out


def paired_difference(n_a_p, correct_a_p, n_b_p, correct_b_p) -> dict[str, float | int | None]:
    """The Mantel-Haenszel risk difference of class a minus class b, stratified by problem: over the problems with
    samples in both classes, sum_p w_p (a_p / n_a_p - b_p / n_b_p) / sum_p w_p with w_p = n_a_p n_b_p / (n_a_p +
    n_b_p). Within a problem both classes face the same difficulty, so a class that falls mostly on easy problems
    does not look better for it (a pooled difference of class means would). `se`: the fixed-weight standard error
    sqrt(sum_p w_p^2 (pa(1 - pa) / n_a_p + pb(1 - pb) / n_b_p)) / sum_p w_p. `problems`: the problems used;
    `n_a`, `n_b`: their samples per class. value and se None when no problem has both classes.

    Arrays are per problem (suffix `_p`), aligned: samples and correct samples of class a and of class b."""
    import numpy as np

    n_a, c_a, n_b, c_b = (np.asarray(x, dtype=float) for x in (n_a_p, correct_a_p, n_b_p, correct_b_p))
    if not n_a.shape == c_a.shape == n_b.shape == c_b.shape or n_a.ndim != 1:
        raise ValueError("paired_difference: four aligned one-dimensional per-problem arrays")
    if np.any(c_a > n_a) or np.any(c_b > n_b) or np.any(np.minimum(c_a, c_b) < 0):
        raise ValueError("paired_difference: correct counts within [0, samples]")
    both = (n_a > 0) & (n_b > 0)
    out: dict[str, float | int | None] = {"value": None, "se": None, "problems": int(both.sum()),
                                          "n_a": int(n_a[both].sum()), "n_b": int(n_b[both].sum())}
    if not both.any():
        return out
    n_a, c_a, n_b, c_b = n_a[both], c_a[both], n_b[both], c_b[both]
    w = n_a * n_b / (n_a + n_b)
    pa, pb = c_a / n_a, c_b / n_b
    out["value"] = float(np.sum(w * (pa - pb)) / np.sum(w))
    out["se"] = float(np.sqrt(np.sum(w ** 2 * (pa * (1 - pa) / n_a + pb * (1 - pb) / n_b))) / np.sum(w))
    return out
