"""One result format for every registered study: per-problem values by (checkpoint, arm, seed), read from the
committed files and converted in this one place.

Two committed forms exist, both read as they are:

- `results/seed-<S>/<arm>.csv` (the registered study's, `COLUMNS`, docs/metrics.md): one row per (checkpoint,
  benchmark, problem) with the correct solo and step samples, from which pass@k is exact, and the per-problem
  legibility, drift and style values (`read_results`);
- `results/seed-<S>/<arm>.json` (a positive control's): per checkpoint step and mode the per-problem counts
  [samples, correct, in the dialect], per checkpoint the per-problem analysis means, the training series and
  the junior hashes (`read_control_results`; the documents stay available as `Results.docs`).

Both give a `Results`: checkpoint x arm x seed -> measure -> benchmark -> values over `ids[benchmark]` (NaN where
a problem or value is missing), which the claims engine (tandem.study.claims) reads alone.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from tandem.errors import BadInputError
from tandem.metrics.passk import pass_at_k

COLUMNS = ("seed", "arm", "checkpoint", "step", "benchmark", "id", "n_samples", "solo_correct", "step_correct",
           "junior_ce", "overlap", "kl_mean", "common_kl", "common_overlap", "compact_share")
ARMS = ("base", "tandem", "grpo", "kl_reg", "control")
# the registration's checkpoint names -> the CSV's `checkpoint` column
CHECKPOINTS = {"final": "final", "best_by_validation": "best"}
# measures read as they are: name in claims.json -> CSV column
FLOAT_MEASURES = {"junior_ce": "junior_ce", "overlap": "overlap", "kl_mean": "kl_mean",
                  "common/kl_mean": "common_kl", "common/overlap": "common_overlap", "compact_share": "compact_share"}
MODES = {"solo": "solo_correct", "step": "step_correct"}
# The registered detection check of the positive control (registration.yaml: positive_control.detected_when):

# a positive control's per-problem analysis means (result JSON `analysis`), read as they are
CONTROL_FLOATS = ("junior_ce", "kl_mean", "kl_junior_mean", "overlap")
CONTROL_COUNTS = ("dialect_share", "solo/pass@1", "step/pass@1", "step/pass@8", "solo/pass@8")


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return repr(v)  # shortest round trip
    return str(v)



def arm_csv_text(rows: Iterable[Mapping[str, Any]]) -> str:
    """One seed x arm's per-problem values in the study's format (floats as Python's repr, None or NaN as an
    empty field; rows ordered by checkpoint, then benchmark and id as given)."""
    rows = list(rows)
    order = {c: i for i, c in enumerate(("final", "best"))}
    rows.sort(key=lambda r: (order.get(str(r["checkpoint"]), 9), str(r["benchmark"]), _natural(str(r["id"]))))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([_cell(r.get(c)) for c in COLUMNS])
    return buf.getvalue()


def _natural(s: str) -> tuple:
    """A sort key that orders "p2" before "p10" (numbers inside ids compared as numbers)."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.findall(r"\d+|\D+", s))


@dataclass
class Results:
    """Every CSV's values: (checkpoint, arm, seed) -> measure -> benchmark -> values over `ids[benchmark]` (NaN
    where the unit lacks the problem or the value), each unit's step, the samples per problem, the pass@k orders
    and the files read (relative to the results folder)."""

    values: dict[tuple[str, str, int], dict[str, dict[str, np.ndarray]]] = field(default_factory=dict)
    steps: dict[tuple[str, str, int], int] = field(default_factory=dict)
    n_samples: int | None = None
    ks: tuple[int, ...] = ()
    ids: dict[str, list[str]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    docs: dict[tuple[int, str], dict] = field(default_factory=dict)  # (seed, arm) -> a control's result document

    @property
    def benchmarks(self) -> dict[str, int]:
        return {b: len(ids) for b, ids in self.ids.items()}

    def seeds(self, checkpoint: str, arm: str) -> list[int]:
        return sorted(s for (c, a, s) in self.values if c == checkpoint and a == arm)

    def measured(self, checkpoint: str, arm: str, seed: int, measure: str) -> bool:
        """The unit has a value of `measure` on at least one problem of every benchmark (its macro mean exists)."""
        per_b = self.values.get((checkpoint, arm, seed), {}).get(measure)
        return bool(per_b) and all(bool(np.isfinite(v).any()) for v in per_b.values())

    def seeds_with(self, checkpoint: str, arms: Iterable[str], measure: str) -> list[int]:
        """The seeds on which every one of `arms` has `measure` at `checkpoint`."""
        sets = [{s for s in self.seeds(checkpoint, a) if self.measured(checkpoint, a, s, measure)} for a in arms]
        return sorted(set.intersection(*sets)) if sets else []

    def arrays(self, checkpoint: str, arms: Iterable[str], measure: str, seeds: list[int]
               ) -> dict[str, dict[str, np.ndarray]]:
        """{arm: {benchmark: values_MP}} on `seeds`, problems aligned across arms and seeds."""
        return {a: {b: np.stack([self.values[(checkpoint, a, s)][measure][b] for s in seeds]) for b in self.ids}
                for a in arms}


def _float(raw: str, where: str, col: str) -> float:
    if raw == "":
        return math.nan
    try:
        return float(raw)
    except ValueError:
        raise BadInputError(f"{where}: {col} {raw!r} is not a number") from None


def _int(raw: str, where: str, col: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise BadInputError(f"{where}: {col} {raw!r} is not an integer") from None


def read_results(results_dir: str | Path, ks: Iterable[int]) -> Results:
    """Read every `seed-<S>/<arm>.csv` under `results_dir`, checking each against its name and the format."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise BadInputError(f"study claims: no results folder {results_dir} (seed-<S>/<arm>.csv per finished "
                            "seed x arm)")
    res = Results()
    raw: dict[tuple[str, str, int], dict] = {}  # unit -> {"_counts" | measure: {benchmark: {id: value}}}
    for seed_dir in sorted(results_dir.glob("seed-*"), key=lambda p: _natural(p.name)):
        m = re.fullmatch(r"seed-(\d+)", seed_dir.name)
        if not seed_dir.is_dir() or not m:
            raise BadInputError(f"study claims: {seed_dir} is not a seed folder (seed-<integer>)")
        for f in sorted(seed_dir.glob("*.csv")):
            if f.stem not in ARMS:
                raise BadInputError(f"study claims: {f}: {f.stem!r} is no arm of the study ({', '.join(ARMS)})")
            rel = f.relative_to(results_dir).as_posix()
            for ckpt, unit in _read_one(res, f, int(m.group(1)), f.stem, rel).items():
                first = next(iter(raw.values()), None)
                if first is not None and sorted(unit["_counts"]) != sorted(first["_counts"]):
                    raise BadInputError(f"study claims: {rel} ({ckpt}) covers benchmarks {sorted(unit['_counts'])}, "
                                        f"other files {sorted(first['_counts'])}")
                raw[(ckpt, f.stem, int(m.group(1)))] = unit
            res.files.append(rel)
    if not raw:
        raise BadInputError(f"study claims: no seed-<S>/<arm>.csv under {results_dir}")
    n = res.n_samples
    res.ks = tuple(k for k in sorted({int(k) for k in ks}) if k <= n)
    # one problem order per benchmark (natural order of the ids), every unit's values as arrays in that order
    res.ids = {b: sorted(set().union(*(u["_counts"][b].keys() for u in raw.values())), key=_natural)
               for b in sorted(next(iter(raw.values()))["_counts"])}
    tables = {k: [pass_at_k(n, c, k) for c in range(n + 1)] for k in res.ks}
    for key, unit in raw.items():
        per: dict[str, dict[str, np.ndarray]] = {}
        for name in FLOAT_MEASURES:
            per[name] = {b: np.array([unit[name][b].get(i, math.nan) for i in ids], dtype=np.float64)
                         for b, ids in res.ids.items()}
        for mode in MODES:
            for k in res.ks:
                per[f"{mode}/pass@{k}"] = {b: np.array([_passk(unit["_counts"][b].get(i), mode, tables[k]) for i in ids],
                                                       dtype=np.float64) for b, ids in res.ids.items()}
        res.values[key] = per
    return res


def _passk(counts: dict | None, mode: str, table: list[float]) -> float:
    return math.nan if counts is None or counts[mode] is None else table[counts[mode]]


def _read_one(res: Results, f: Path, seed: int, arm: str, rel: str) -> dict[str, dict]:
    """One file's rows by checkpoint: {"_counts" | measure: {benchmark: {id: value}}}; records steps and n."""
    with open(f, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or tuple(header) != COLUMNS:
            raise BadInputError(f"study claims: {rel}: the header must be {','.join(COLUMNS)}; got "
                                f"{','.join(header or [])!r}")
        per_ckpt: dict[str, dict] = {}
        for line_no, row in enumerate(reader, start=2):
            where = f"study claims: {rel}:{line_no}"
            if len(row) != len(COLUMNS):
                raise BadInputError(f"{where}: {len(row)} fields, the header has {len(COLUMNS)}")
            r = dict(zip(COLUMNS, row))
            if _int(r["seed"], where, "seed") != seed or r["arm"] != arm:
                raise BadInputError(f"{where}: seed {r['seed']} arm {r['arm']} in the file of seed {seed} arm {arm}")
            ckpt = r["checkpoint"]
            if ckpt not in CHECKPOINTS.values():
                raise BadInputError(f"{where}: checkpoint {ckpt!r} is neither final nor best")
            n = _int(r["n_samples"], where, "n_samples")
            if res.n_samples is None:
                res.n_samples = n
            elif n != res.n_samples:
                raise BadInputError(f"{where}: n_samples {n}, other rows have {res.n_samples}; every problem needs "
                                    "the same number of samples")
            step = _int(r["step"], where, "step")
            if res.steps.setdefault((ckpt, arm, seed), step) != step:
                raise BadInputError(f"{where}: step {step}, other {ckpt} rows of this file have "
                                    f"{res.steps[(ckpt, arm, seed)]}")
            unit = per_ckpt.setdefault(ckpt, {"_counts": {}, **{m: {} for m in FLOAT_MEASURES}})
            b, pid = r["benchmark"], r["id"]
            if pid in unit["_counts"].get(b, {}):
                raise BadInputError(f"{where}: problem {b}/{pid} appears twice for checkpoint {ckpt}")
            counts = {}
            for mode, col in MODES.items():
                c = None if r[col] == "" else _int(r[col], where, col)
                if c is not None and not 0 <= c <= n:
                    raise BadInputError(f"{where}: {col} {c} is outside 0..{n}")
                counts[mode] = c
            unit["_counts"].setdefault(b, {})[pid] = counts
            for name, col in FLOAT_MEASURES.items():
                unit[name].setdefault(b, {})[pid] = _float(r[col], where, col)
    if not per_ckpt:
        raise BadInputError(f"study claims: {rel} has no rows")
    return per_ckpt




def read_control_results(results_dir: str | Path, ks: Iterable[int]) -> Results:
    """Every `seed-<S>/<arm>.json` under `results_dir` as a `Results` whose checkpoints are the evaluated steps
    ("0", "25", ...): per problem the dialect share of its solo samples, pass@k per mode (NaN where k exceeds the
    samples), and the analysis means; the documents themselves in `Results.docs`."""
    res = Results()
    for f in sorted(Path(results_dir).glob("seed-*/*.json")):
        d = json.loads(f.read_text())
        res.docs[(int(d["seed"]), d["arm"])] = d
        res.files.append(f.relative_to(results_dir).as_posix())
    res.ks = tuple(sorted({int(k) for k in ks}))
    for (seed, arm), d in res.docs.items():
        for step, modes in d["evaluation"]["checkpoints"].items():
            if not res.ids:  # one problem order: the first document's, ids sorted as strings
                res.ids = {b: sorted(probs) for b, probs in modes["solo"].items()}
            per: dict[str, dict[str, np.ndarray]] = {}
            # a fourth count (samples with an annotation on any line) where the dialect is `annotated`
            anywhere = ("annotated_anywhere",) if _has_anywhere(modes.get("solo", {})) else ()
            for metric in ("dialect_share", *anywhere, *(f"{m}/pass@{k}" for m in ("solo", "step") for k in res.ks)):
                mode = "solo" if metric in ("dialect_share", "annotated_anywhere") else metric.split("/")[0]
                if mode in modes:
                    per[metric] = {b: np.array([_count_value(modes[mode][b].get(p), metric) for p in ids], dtype=float)
                                   for b, ids in res.ids.items()}
            analysis = d["analysis"].get(step, {})
            for name in CONTROL_FLOATS:
                per[name] = {b: np.array([_analysis_value(analysis, b, p, name) for p in ids], dtype=float)
                             for b, ids in res.ids.items()}
            res.values[(step, arm, seed)] = per
            res.steps[(step, arm, seed)] = int(step)
    return res


def _has_anywhere(solo: Mapping) -> bool:
    return any(len(c) == 4 for probs in solo.values() for c in probs.values())


def _count_value(c: list | None, metric: str) -> float:
    """One problem's dialect share, any-line annotation share or pass@k from its [samples, correct, in the
    dialect(, annotated on any line)] counts (NaN if absent)."""
    if c is None:
        return math.nan
    n, correct, dial = c[:3]
    if metric == "dialect_share":
        return dial / n
    if metric == "annotated_anywhere":
        return c[3] / n if len(c) > 3 else math.nan
    k = int(metric.split("@")[1])
    return pass_at_k(n, correct, k) if k <= n else math.nan


def _analysis_value(analysis: Mapping, bench: str, pid: str, name: str) -> float:
    v = (analysis.get(bench, {}).get(pid) or {}).get(name)
    return math.nan if v is None else float(v)


# A registration's `classifier`: its name -> "module:function" of a function text -> style name (the style of a
# solution, read off its text). A new dialect's classifier is one function and one line here.
CLASSIFIERS = {"solution_style": "tandem.data.synthetic:solution_style"}


def classifier(name: str):
    """The registered classifier `name` as a function text -> style name."""
    import importlib

    if name not in CLASSIFIERS:
        raise BadInputError(f"study: no classifier {name!r} (known: {', '.join(CLASSIFIERS)})")
    module, _, func = CLASSIFIERS[name].partition(":")
    return getattr(importlib.import_module(module), func)
