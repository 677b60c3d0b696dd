"""The registered study's claims from its committed per-problem CSVs: `studies/claims.json` and the study report.

Input, all a reader needs (`tandem study --recompute`):

- `<out>/results/seed-<S>/<arm>.csv`, one per finished seed x arm (arm in base, tandem, grpo, kl_reg, control),
  one row per (checkpoint, benchmark, problem) with the columns of `COLUMNS` (docs/metrics.md): the counts of
  correct solo and step-schedule samples, from which pass@k is computed exactly (`tandem.metrics.passk`), and
  the per-problem legibility, drift and style values; an empty field is not measured;
- `<out>/registration.yaml`: the registered claims, secondary rows, positive control and statistics.

`compute` turns them into one document: the primary rows (Holm-adjusted over the family), the secondary rows,
the positive control's detection check, and every arm's value of every measure at the final and the
best-by-validation checkpoint, each with a crossed-bootstrap interval and a seed-level t-interval
(`tandem.metrics.intervals`, `tandem.metrics.verdicts`). Partial data (a seed or an arm not finished yet) give
rows computed on the seeds every arm of the row has, marked incomplete, or `not measured` with what is missing,
so the claims can be aggregated while the study runs.

`write` publishes `<out>/claims.json` (fixed key order, floats to 12 significant digits, no timestamps, a fixed
bootstrap seed: the same CSVs give the same bytes) and `<out>/report.md`, `report.html` and
`<out>/figures/study-claims.png` (`tandem.report.study`).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import yaml

from tandem.errors import BadInputError
from tandem.metrics.intervals import bootstrap_interval, seed_means_M, seed_t_interval
from tandem.metrics.passk import pass_at_k
from tandem.metrics.verdicts import RegisteredClaim, decide, evaluate, excludes, holm_adjust, not_robust
from tasks.common import atomic_path

FORMAT = "tandem-study-claims/2"
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
# (arm a, arm b, measure, constructed direction of a - b).
CONTROL_CHECKS = (("control", "base", "junior_ce", "greater"), ("control", "base", "overlap", "less"),
                  ("control", "base", "common/kl_mean", "greater"), ("control", "grpo", "common/kl_mean", "greater"))
STATISTICS = {"bootstrap": "crossed", "robustness": "seed_t", "multiplicity": "holm"}  # what this module implements


# --------------------------------------------------------------------------------------------------
# The CSV format
# --------------------------------------------------------------------------------------------------

def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return repr(v)  # shortest round trip
    return str(v)


def write_arm_csv(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """One seed x arm's per-problem values in the study's format (atomically; floats as Python's repr, None or
    NaN as an empty field; rows ordered by checkpoint, then benchmark and id as given)."""
    rows = list(rows)
    order = {c: i for i, c in enumerate(("final", "best"))}
    rows.sort(key=lambda r: (order.get(str(r["checkpoint"]), 9), str(r["benchmark"]), _natural(str(r["id"]))))
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(COLUMNS)
            for r in rows:
                w.writerow([_cell(r.get(c)) for c in COLUMNS])


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


# --------------------------------------------------------------------------------------------------
# The registration
# --------------------------------------------------------------------------------------------------

def load_registration(path: str | Path) -> dict:
    """The registration's claims, secondary rows, positive control and statistics, checked against what this
    module implements."""
    p = Path(path)
    if not p.exists():
        raise BadInputError(f"study claims: registration {p} does not exist")
    reg = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    missing = [k for k in ("claims", "statistics", "study") if k not in reg]
    if missing:
        raise BadInputError(f"study claims: registration {p} has no {', '.join(missing)} section")
    stats = reg["statistics"]
    for k, want in STATISTICS.items():
        if stats.get(k) != want:
            raise BadInputError(f"study claims: registration statistics.{k} is {stats.get(k)!r}; this code "
                                f"implements {want!r}")
    for k in ("level", "n_boot", "boot_seed", "alpha_one_sided"):
        if k not in stats:
            raise BadInputError(f"study claims: registration statistics.{k} is missing")
    try:
        reg["_claims"] = [RegisteredClaim.from_dict(c) for c in reg["claims"]]
    except (TypeError, ValueError) as e:
        raise BadInputError(f"study claims: registration {p}: {e}") from None
    reg["_secondary"] = [_secondary(reg["_claims"], s) for s in reg.get("secondary") or []]
    return reg


def _secondary(primary: list[RegisteredClaim], s: Mapping) -> RegisteredClaim:
    of = next((c for c in primary if c.id == s.get("of")), None)
    if of is None:
        raise BadInputError(f"study claims: secondary row {dict(s)} names no primary claim")
    unknown = sorted(set(s) - {"of", "metric", "checkpoint"})
    if unknown:
        raise BadInputError(f"study claims: secondary row {dict(s)}: unknown keys {unknown}")
    ckpt = s.get("checkpoint", of.checkpoint)
    if ckpt not in CHECKPOINTS:
        raise BadInputError(f"study claims: secondary row {dict(s)}: checkpoint {ckpt!r} is none of "
                            f"{', '.join(CHECKPOINTS)}")
    metric = s.get("metric", of.metric)
    rid = of.id + (f" {metric}" if "metric" in s else "") + (f" at {ckpt}" if "checkpoint" in s else "")
    return RegisteredClaim.from_dict({**of.__dict__, "id": rid, "metric": metric, "checkpoint": ckpt})


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
    r = evaluate(c, arrays, int(stats["n_boot"]), float(stats["level"]), int(stats["boot_seed"]))
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


def _positive_control(res: Results, reg: dict, stats: Mapping) -> dict:
    pc = (reg.get("study") or {}).get("positive_control") or {}
    checks = []
    for a, b, m, direction in CONTROL_CHECKS:
        c = RegisteredClaim(f"{a} - {b} {m}", "positive control", f"{a} is {'above' if direction == 'greater' else 'below'} "
                            f"{b} on {m}", m, direction, a, b)
        seeds = res.seeds_with("final", c.arms, m)
        check = {"comparison": c.comparison, "metric": m, "direction": direction, "seeds": seeds, "estimate": None,
                 "ci": None, "seed_t": None, "detected": None}
        if seeds:
            r = evaluate(c, res.arrays("final", c.arms, m, seeds), int(stats["n_boot"]), float(stats["level"]),
                         int(stats["boot_seed"]))
            lo, hi = r["ci"]
            check.update(estimate=r["estimate"], ci=r["ci"], seed_t=r["seed_t"],
                         detected=bool(lo > 0) if direction == "greater" else bool(hi < 0))
        checks.append(check)
    found = [c["detected"] for c in checks]
    return {"what": pc.get("what"), "detected_when": pc.get("detected_when"), "checks": checks,
            "detected": None if None in found else all(found)}


def compute(res: Results, reg: dict) -> dict:
    """The claims document (see docs/metrics.md for its schema)."""
    stats = reg["statistics"]
    alpha = float(stats["alpha_one_sided"])
    expected = sorted(int(s) for s in reg["study"].get("seeds", []))
    extra = sorted({s for (_, _, s) in res.values} - set(expected))
    if extra:
        raise BadInputError(f"study claims: results for seed(s) {extra}, which the registration does not list "
                            f"(study.seeds: {expected}); only registered seeds enter the claims")
    primary = [_row(c, res, stats, "primary", expected) for c in reg["_claims"]]
    # Holm over the whole registered family; a row not measured enters with p = 1, so missing rows never make
    # the others' adjustment milder than registered
    adjusted = holm_adjust([r["p_one_sided"] if r["p_one_sided"] is not None else 1.0 for r in primary])
    for c, r, p in zip(reg["_claims"], primary, adjusted):
        if r["estimate"] is not None:
            r["p_holm"] = p
            _decide(r, c, p, alpha)
    secondary = [_row(c, res, stats, "secondary", expected) for c in reg["_secondary"]]
    for c, r in zip(reg["_secondary"], secondary):
        if r["estimate"] is not None:
            _decide(r, c, r["p_one_sided"], alpha)  # secondary rows: the same rules, unadjusted
    present = {arm: {name: res.seeds(ck, arm) for name, ck in CHECKPOINTS.items()} for arm in ARMS}
    missing = [f"seed-{s}/{arm}.csv" for s in expected for arm in ARMS if s not in present[arm]["final"]]
    verdicts = {v: [r["id"] for r in primary if r["verdict"] == v]
                for v in ("holds", "does not hold", "inconclusive", "not measured")}
    return {
        "format": FORMAT,
        "statistics": {k: stats[k] for k in ("level", "n_boot", "boot_seed", "bootstrap", "robustness",
                                             "multiplicity", "alpha_one_sided")},
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


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------

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


def write(doc: dict, out: str | Path, registration_name: str = "registration.yaml") -> None:
    """<out>/claims.json, then the study report beside it (report.md, report.html, figures/)."""
    from tandem.report.render import figure_filename, render_html, render_markdown
    from tandem.report.study import study_report

    out = Path(out)
    doc = _plain(doc)  # the report shows exactly what the file holds
    with atomic_path(out / "claims.json") as tmp:
        Path(tmp).write_text(dumps(doc), encoding="utf-8")
    rep = study_report(doc, registration_name)
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    for f in rep.figures():
        with atomic_path(figs / figure_filename(f.name)) as tmp:
            Path(tmp).write_bytes(f.png)
    with atomic_path(out / "report.md") as tmp:
        Path(tmp).write_text(render_markdown(rep, "figures"), encoding="utf-8")
    with atomic_path(out / "report.html") as tmp:
        Path(tmp).write_text(render_html(rep), encoding="utf-8")


def recompute(out: str | Path = "studies", registration: str | Path | None = None) -> dict:
    """Rebuild <out>/claims.json and the report from <out>/results/ and the registration alone."""
    out = Path(out)
    reg_path = Path(registration) if registration else out / "registration.yaml"
    reg = load_registration(reg_path)
    res = read_results(out / "results", reg["study"].get("evaluation", {}).get("ks", [1, 2, 4, 8]))
    doc = compute(res, reg)
    write(doc, out, reg_path.name)
    return _plain(doc)


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
