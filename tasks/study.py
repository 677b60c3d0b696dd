"""The multi-seed study: the pipeline for N seeds x the arms, then the claims with their intervals.

`tandem study` (cli/main.py) runs the Prefect flow `tandem-study` (flows/study.py), which calls the steps here:

- `shared_inputs`: the study params file's own prepared data and base model (its `out_root`, the project root
  for params.study.yaml, which shares them with params.yaml); built with the prepare and base stages when
  missing.
- `prepare_root`: one output root per seed, `<out>/seed-<S>/`, holding a complete params file (the study file
  with only `seed` and `out_root` changed: the record of that run) and links to the shared data and base, so
  study runs never touch the default run's checkpoints or each other's.
- `train` (one seed x arm), `evaluate` and `analyze` (one seed): the normal stages (`tandem stage ...`) as
  subprocesses with one torch thread each, so runs go side by side; each appends to `<root>/logs/`.
  Interrupted and rerun, a finished arm is skipped, an unfinished one resumes from its last checkpoint
  (`train.resume: auto`), evaluation reuses its per-unit cache, and analysis reruns only when evaluation moved.
- `aggregate`: per-problem measures of every seed (tasks/measures.py) stacked into seeds x problems, the claims
  (tandem.metrics.claims: estimates, paired differences, 95% intervals from a bootstrap over seeds and
  problems, verdicts), written to `<out>/claims.json`, `<out>/report.md` / `report.html` and
  `<out>/figures/`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from tandem.errors import BadInputError, UserError
from tandem.metrics.claims import EQUIVALENCE_MARGIN, claims_for, evaluate_claims, seeds_of
from tasks.common import atomic_path, load_params, read_json, read_metrics, write_json
from tasks.measures import final_steps, run_measures, stack_seeds

CODE_ROOT = Path(__file__).resolve().parents[1]
SHARED = ("data/prepared", "models/base")


@dataclass(frozen=True)
class StudySettings:
    """What one study runs: a complete params file, the seeds, the arms (the file's train.arms), where the
    per-seed roots and the results go, how many runs go side by side, and the claims' settings."""

    params_file: Path
    seeds: tuple[int, ...]
    out: Path
    jobs: int = 2
    margin: float = EQUIVALENCE_MARGIN
    n_boot: int = 2000

    def __post_init__(self) -> None:
        problems = []
        if not self.seeds:
            problems.append("seeds: give at least one seed (e.g. --seeds 3)")
        if len(set(self.seeds)) != len(self.seeds):
            problems.append(f"seeds: {list(self.seeds)} repeats a seed")
        if self.jobs < 1:
            problems.append(f"jobs: {self.jobs} must be >= 1 (runs side by side)")
        if not self.margin > 0:
            problems.append(f"margin: {self.margin} must be > 0 (the largest pass@1 difference that counts as equal)")
        if self.n_boot < 100:
            problems.append(f"n_boot: {self.n_boot} must be >= 100 bootstrap draws")
        if problems:
            raise BadInputError("study settings: " + "; ".join(problems))

    @property
    def arms(self) -> tuple[str, ...]:
        return tuple(load_params(self.params_file).train.arms)

    @property
    def main_root(self) -> Path:
        """The study file's own output root (its `out_root`, relative to the file): where the shared data and
        base model live."""
        raw = yaml.safe_load(self.params_file.read_text())
        return (self.params_file.parent / raw.get("out_root", ".")).resolve()

    def root(self, seed: int) -> Path:
        return (self.out / f"seed-{seed}").resolve()


def settings(params_file: str | Path = "params.study.yaml", seeds: int = 3, first_seed: int = 0,
             out: str | Path = "studies", jobs: int = 2, margin: float = EQUIVALENCE_MARGIN,
             n_boot: int = 2000) -> StudySettings:
    """Settings from the CLI's arguments: `seeds` runs with seeds first_seed, first_seed + 1, ..."""
    p = Path(params_file).resolve()
    if not p.exists():
        raise BadInputError(f"study: params file {params_file} does not exist")
    load_params(p)  # a complete, valid file before anything runs
    return StudySettings(p, tuple(range(first_seed, first_seed + seeds)), Path(out).resolve(), jobs, margin, n_boot)


# --------------------------------------------------------------------------------------------------
# Running stages
# --------------------------------------------------------------------------------------------------

def _stage(params_file: Path, name: str, log: Path, arm: str | None = None) -> None:
    """`tandem stage <name> [--arm A] --params <file>` as a subprocess, output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "cli", "stage", name, "--params", str(params_file)] + (["--arm", arm] if arm else [])
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"))
    env["PYTHONPATH"] = os.pathsep.join([str(CODE_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n== {' '.join(cmd[2:])} ({time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        f.flush()
        rc = subprocess.call(cmd, cwd=CODE_ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-5:]
        raise UserError(f"study: stage {name}{' --arm ' + arm if arm else ''} for {params_file.parent} failed "
                        f"(exit {rc}); see {log}:\n  " + "\n  ".join(tail))


def shared_inputs(s: StudySettings) -> Path:
    """The study file's root with its prepared data and base model (built by the prepare and base stages when
    missing); every seed links them."""
    main_root = s.main_root
    for rel, name in zip(SHARED, ("prepare", "base")):
        if not (main_root / rel).exists():
            _stage(s.params_file, name, s.out / "logs" / f"{name}.log")
    return main_root


def prepare_root(s: StudySettings, seed: int) -> Path:
    """<out>/seed-<S>/ with params.yaml (the study file, this seed, this root) and links to the shared data and
    base model."""
    raw = yaml.safe_load(s.params_file.read_text())
    main_root = s.main_root
    root = s.root(seed)
    raw.update(seed=seed, out_root=str(root))
    for rel in SHARED:
        src, dst = main_root / rel, root / rel
        if not src.exists():
            raise BadInputError(f"study: {src} does not exist; run the prepare and base stages for "
                                f"{s.params_file.name} first (tandem study does this itself)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(src, target_is_directory=True)
    with atomic_path(root / "params.yaml") as tmp:
        Path(tmp).write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


def train(root: Path, arm: str) -> dict:
    """Train one arm of one seed (skipped when its summary exists; resumes an unfinished run)."""
    summary = root / "metrics" / f"train_{arm}.json"
    if not summary.exists():
        _stage(root / "params.yaml", "train", root / "logs" / f"train_{arm}.log", arm=arm)
    return read_json(summary)


def evaluate(root: Path) -> dict:
    """Evaluate one seed's checkpoints (cached units are not redone, so a rerun only collects)."""
    out = root / "metrics" / "eval.json"
    before = (out.read_bytes(), out.stat()) if out.exists() else None
    _stage(root / "params.yaml", "evaluate", root / "logs" / "evaluate.log")
    if before is not None and out.read_bytes() == before[0]:
        # the same results, collected again from the cache: keep the old time so analysis is not redone
        os.utime(out, ns=(before[1].st_atime_ns, before[1].st_mtime_ns))
    return read_json(out)["summary"]


def analyze(root: Path) -> dict:
    """Legibility and drift of one seed (skipped when newer than its evaluation)."""
    out, ev = root / "metrics" / "analysis.json", root / "metrics" / "eval.json"
    if not (out.exists() and out.stat().st_mtime >= ev.stat().st_mtime):
        _stage(root / "params.yaml", "analyze", root / "logs" / "analyze.log")
    return read_json(out)["summary"]


def status(s: StudySettings) -> list[dict]:
    """Where each seed x arm stands: trained, partial (its last saved step), started (no checkpoint yet) or
    pending, and per seed whether it was evaluated and analysed."""
    rows = []
    p = load_params(s.params_file)
    total, arms = p.train.steps, p.train.arms
    for seed in s.seeds:
        root = s.root(seed)
        for arm in arms:
            done = root / "metrics" / f"train_{arm}.json"
            if done.exists():
                d = read_json(done)
                rows.append({"seed": seed, "arm": arm, "state": "trained", "step": d.get("steps", total),
                             "steps": total})
                continue
            saved = [int(p.name[5:]) for p in (root / "scratch" / "train" / arm).glob("step-*")
                     if p.name[5:].isdigit()] + [int(p.name[5:]) for p in (root / "models" / "checkpoints" / arm)
                                                 .glob("step-*") if p.name[5:].isdigit()]
            started = (root / "logs" / f"train_{arm}.log").exists()
            rows.append({"seed": seed, "arm": arm, "state": "partial" if saved else "started" if started else "pending",
                         "step": max(saved, default=0), "steps": total})
        ev, an = root / "metrics" / "eval.json", root / "metrics" / "analysis.json"
        rows.append({"seed": seed, "arm": "-", "state": "analyzed" if an.exists() else
                     "evaluated" if ev.exists() else "pending", "step": None, "steps": None})
    return rows


# --------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------

def _train_summaries(s: StudySettings) -> dict:
    out, arms = {}, s.arms
    for seed in s.seeds:
        for arm in arms:
            f = s.root(seed) / "metrics" / f"train_{arm}.json"
            if f.exists():
                d = read_metrics(f)  # with the run's step time
                out[f"{arm}/seed-{seed}"] = {k: d.get(k) for k in ("steps", "reward_first", "reward_last",
                                                                    "val_accuracy_initial", "val_accuracy_last",
                                                                    "kl_to_base_last", "step_seconds") if k in d}
    return out


def aggregate(s: StudySettings) -> dict:
    """Claims over every seed: writes <out>/claims.json and the study report; returns the claims document."""
    from tandem.metrics.intervals import bootstrap_interval

    arms = list(s.arms)
    per_seed = []
    for seed in s.seeds:
        root = s.root(seed)
        if not (root / "metrics" / "analysis.json").exists():
            raise BadInputError(f"study: seed {seed} has no analysis yet ({root}); run `tandem study` to finish it")
        per_seed.append(run_measures(root, arms))
    measures = stack_seeds(per_seed)
    ev = read_json(s.root(s.seeds[0]) / "metrics" / "eval.json")
    ks = list(ev["settings"]["ks"])
    rows = evaluate_claims(measures, claims_for(max(ks), s.margin), n_boot=s.n_boot, seed=0)
    metrics_table = {arm: {m: bootstrap_interval(per_b, n_boot=s.n_boot, seed=0).as_dict()
                           for m, per_b in sorted(ms.items())} for arm, ms in measures.items()}
    doc = {
        "seeds": list(s.seeds),
        "n_seeds": seeds_of(measures),
        "arms": arms,
        "params_file": os.path.relpath(s.params_file, CODE_ROOT) if s.params_file.is_relative_to(CODE_ROOT)
        else str(s.params_file),
        "settings": {"n_boot": s.n_boot, "level": 0.95, "equivalence_margin": s.margin,
                     "benchmarks": {b: v["n_problems"] for b, v in ev["settings"]["benchmarks"].items()},
                     "evaluate": {k: ev["settings"][k] for k in ("n_samples", "ks", "modes", "temperature",
                                                                   "max_new_tokens")},
                     "final_steps": {f"{a}/seed-{seed}": st for seed in s.seeds
                                     for a, st in _final_steps(s.root(seed), arms).items()}},
        "claims": rows,
        "measures": metrics_table,
        "training": _train_summaries(s),
    }
    write_json(s.out / "claims.json", doc)
    write_report(s, doc)
    return doc


def _final_steps(root: Path, arms: list[str]) -> dict[str, int]:
    return {a: st for a, st in final_steps(read_json(root / "metrics" / "eval.json"), arms).items() if a != "base"}


def write_report(s: StudySettings, doc: dict) -> None:
    """<out>/report.md and report.html: the claims first, then every measure per arm with its interval."""
    from tandem.report.claims import claims_section, metric_label
    from tandem.report.document import Report, Section, Table
    from tandem.report.render import figure_filename, render_html, render_markdown

    n = doc["n_seeds"]
    ev = doc["settings"]["evaluate"]
    rep = Report("Tandem RL study: the paper's claims at toy scale",
                 f"{n} seeds ({', '.join(map(str, doc['seeds']))}) x arms {', '.join(doc['arms'])}; "
                 f"{sum(doc['settings']['benchmarks'].values())} problems over {len(doc['settings']['benchmarks'])} "
                 f"benchmarks, {ev['n_samples']} samples each, modes {', '.join(ev['modes'])}; "
                 f"params {doc['params_file']}")
    rep.sections.append(claims_section(doc["claims"], n))
    arms = [a for a in ("base", "tandem", "grpo", "kl_reg") if a in doc["measures"]] + \
        [a for a in doc["measures"] if a not in ("base", "tandem", "grpo", "kl_reg")]
    metrics = sorted({m for a in arms for m in doc["measures"][a]})
    body = [[metric_label(m)] + [(f"{doc['measures'][a][m]['estimate']:.3f} [{doc['measures'][a][m]['ci_low']:.3f}, "
                                  f"{doc['measures'][a][m]['ci_high']:.3f}]") if m in doc["measures"][a] else None
                                 for a in arms] for m in metrics]
    sec = Section("Every measure", paragraphs=[
        "Each arm's final checkpoint (the base at step 0), mean over seeds of the macro mean over benchmarks, "
        "with its 95% interval (bootstrap over seeds, then problems within each benchmark)."])
    sec.tables.append(Table("Measures by arm [95% interval]", ["measure"] + arms, body))
    tr = doc.get("training", {})
    if tr:
        sec.tables.append(Table("Training runs (one per arm and seed)",
                                ["run", "steps", "reward first", "reward last", "validation greedy: base",
                                 "validation greedy: last", "s/step"],
                                [[k, v.get("steps"), v.get("reward_first"), v.get("reward_last"),
                                  v.get("val_accuracy_initial"), v.get("val_accuracy_last"), v.get("step_seconds")]
                                 for k, v in tr.items()]))
    rep.sections.append(sec)
    figs = s.out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    for f in rep.figures():
        (figs / figure_filename(f.name)).write_bytes(f.png)
    with atomic_path(s.out / "report.md") as tmp:
        Path(tmp).write_text(render_markdown(rep, "figures"))
    with atomic_path(s.out / "report.html") as tmp:
        Path(tmp).write_text(render_html(rep))


def claims_summary(doc: dict) -> str:
    """The claims as plain lines for a terminal."""
    lines = [f"claims over {doc['n_seeds']} seed(s):"]
    for r in doc["claims"]:
        d = "-" if r["difference"] is None else f"{r['difference']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
        lines.append(f"  {r['claim']:<22} {r['metric']:<12} {r['comparison']:<16} {d:<28} {r['verdict']}")
    return "\n".join(lines)
