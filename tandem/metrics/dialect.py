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
