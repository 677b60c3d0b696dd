"""A multi-seed study's runs: the pipeline for N seeds x the arms, their per-problem results, their claims.

`tandem study run` (cli/main.py) runs the Prefect flow `tandem-study` (flows/study.py), which calls the steps
here; `--direct`, a registered study and the pilot (tasks/study/pilot.py) call them without Prefect (this module
imports none):

- `shared_inputs`: the study params file's own prepared data and base model (its `out_root`, the project root
  for params.study.yaml, which shares them with params.yaml); built with the prepare and base stages when
  missing.
- `prepare_root`: one output root per seed, `<out>/seed-<S>/`, holding a complete params file (the study file
  with only `seed` and `out_root` changed: the record of that run) and links to the shared data and base, so
  study runs never touch the default run's checkpoints or each other's.
- `train` (one seed x arm), `evaluate` and `analyze` (one seed): the stages' own functions (`tasks.<stage>.run`,
  `tasks.train.run_arm`, on the paths their `default_io` declares: the calls the pipeline flow and `tandem
  stage` make), each in a child interpreter of its own (tasks/study/stages.py) with the study
  file's torch threads, so runs go side by side; each appends its output to `<root>/logs/`.
  Interrupted and rerun, a finished arm is skipped, an unfinished one resumes from its last checkpoint
  (`train.resume: auto`), evaluation reuses its per-unit cache, and analysis reruns only when evaluation moved.
- `unit_state` / `status`: where each seed x arm stands (the one status rule of every study kind);
- `export_results`: one seed x arm's per-problem CSV (tandem/study/results.py's format);
- `aggregate`: per-problem measures of every seed (tasks/measures.py) stacked into seeds x problems, the claims
  (tandem.metrics.claims: estimates, paired differences, 95% intervals from a bootstrap over seeds and
  problems, verdicts), written to `<out>/claims.json`, `<out>/report.md` / `report.html` and
  `<out>/figures/`.
"""

from __future__ import annotations

import csv
import math
import os
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from tandem.errors import BadInputError
from tandem.metrics.claims import EQUIVALENCE_MARGIN, claims_for, evaluate_claims, seeds_of
from tandem.study.results import COLUMNS, arm_csv_text
from tasks.common import atomic_path, load_params, read_json, read_jsonl, read_metrics, write_json
from tasks.measures import final_steps, run_measures, stack_seeds
from tandem.study.params import derive, seed_changes
from tasks.study.stages import CODE_ROOT, stage, write_params
SHARED = ("data/prepared", "models/base", "models/junior")


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
        """The study file's own output root (its `out_root`; a relative one is taken from the project root, as the
        stages take it): where the shared data and base model live."""
        raw = yaml.safe_load(self.params_file.read_text())
        return (CODE_ROOT / raw.get("out_root", ".")).resolve()

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
# Seed roots
# --------------------------------------------------------------------------------------------------

def shared_inputs(s: StudySettings) -> Path:
    """The study file's root with its prepared data and base model (built by the prepare and base stages when
    missing); every seed links them."""
    main_root = s.main_root
    for rel, name in zip(SHARED, ("prepare", "base", "junior")):
        if not (main_root / rel).exists():
            stage(s.params_file, name, s.out / "logs" / f"{name}.log")
    return main_root


def prepare_root(s: StudySettings, seed: int) -> Path:
    """<out>/seed-<S>/ with params.yaml (the study file, this seed, this root) and links to the shared data and
    base model."""
    main_root = s.main_root
    root = s.root(seed)
    for rel in SHARED:
        src, dst = main_root / rel, root / rel
        if not src.exists():
            raise BadInputError(f"study: {src} does not exist; run the prepare and base stages for "
                                f"{s.params_file.name} first (tandem study does this itself)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(src, target_is_directory=True)
    write_params(root / "params.yaml", derive(yaml.safe_load(s.params_file.read_text()), *seed_changes(seed, str(root))))
    return root


def train(root: Path, arm: str) -> dict:
    """Train one arm of one seed (skipped when its summary exists; resumes an unfinished run)."""
    summary = root / "metrics" / f"train_{arm}.json"
    if not summary.exists():
        stage(root / "params.yaml", "train", root / "logs" / f"train_{arm}.log", arm=arm)
    return read_json(summary)


def evaluate(root: Path) -> dict:
    """Evaluate one seed's checkpoints (cached units are not redone, so a rerun only collects)."""
    out = root / "metrics" / "eval.json"
    before = (out.read_bytes(), out.stat()) if out.exists() else None
    stage(root / "params.yaml", "evaluate", root / "logs" / "evaluate.log")
    if before is not None and out.read_bytes() == before[0]:
        # the same results, collected again from the cache: keep the old time so analysis is not redone
        os.utime(out, ns=(before[1].st_atime_ns, before[1].st_mtime_ns))
    return read_json(out)["summary"]


def analyze(root: Path) -> dict:
    """Legibility and drift of one seed (skipped when newer than its evaluation)."""
    out, ev = root / "metrics" / "analysis.json", root / "metrics" / "eval.json"
    if not (out.exists() and out.stat().st_mtime >= ev.stat().st_mtime):
        stage(root / "params.yaml", "analyze", root / "logs" / "analyze.log")
    return read_json(out)["summary"]


def unit_state(root: Path, arm: str, total: int) -> dict:
    """Where one training run of a study root stands (every study's `--status` rows): pending, started (a log, no
    checkpoint yet), partial (its last saved step), trained, then evaluated and analyzed as each of those stages
    writes its metrics after the one before it (an older file is a former run's)."""
    done = root / "metrics" / f"train_{arm}.json"
    if done.exists():
        state, step = "trained", read_json(done).get("steps", total)
        ev, an = root / "metrics" / "eval.json", root / "metrics" / "analysis.json"
        if ev.exists() and ev.stat().st_mtime >= done.stat().st_mtime:
            state = "evaluated"
            if an.exists() and an.stat().st_mtime >= ev.stat().st_mtime:
                state = "analyzed"
        return {"arm": arm, "state": state, "step": step, "steps": total}
    saved = [int(p.name[5:]) for d in (root / "scratch" / "train" / arm, root / "models" / "checkpoints" / arm)
             for p in d.glob("step-*") if p.name[5:].isdigit()]
    started = any((root / "logs").glob(f"*{arm}*.log")) or (root / "logs" / "stages.log").exists()
    return {"arm": arm, "state": "partial" if saved else "started" if started else "pending",
            "step": max(saved, default=0), "steps": total}


def status(s: StudySettings) -> list[dict]:
    """Where each seed x arm of a multi-seed study stands (`unit_state`)."""
    total = load_params(s.params_file).train.steps
    return [{"unit": f"seed {seed}", **unit_state(s.root(seed), arm, total)} for seed in s.seeds for arm in s.arms]


# --------------------------------------------------------------------------------------------------
# Per-problem results of one seed x arm (committed; what the claims are computed from)
# --------------------------------------------------------------------------------------------------

RESULT_COLUMNS = COLUMNS  # the results format lives with its reader, tandem/study/results.py
CONTROL = "control"  # the positive control's pseudo-arm (trained as `grpo` in its own root)


def result_file(results_dir: Path, seed: int, arm: str) -> Path:
    """Where one seed x arm's per-problem values live: `<results>/seed-<S>/<arm>.csv`."""
    return Path(results_dir) / f"seed-{seed}" / f"{arm}.csv"


def _read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _num(v) -> str:
    """A value as the results files hold it: repr of the float (shortest round trip), empty when missing."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return repr(float(v)) if isinstance(v, float) else str(v)


def _steps_of(root: Path, ev: dict, arm: str) -> dict[str, int]:
    """{"final": step, "best": step} of `arm` among its evaluated checkpoints ("base": both 0)."""
    from tandem.checkpoints import best_by_validation, complete_checkpoints

    if arm == "base":
        return {"final": 0, "best": 0}
    evaluated = [int(c["step"]) for c in ev["arms"][arm]["checkpoints"]]
    final = evaluated[-1]
    best = best_by_validation(complete_checkpoints(root / "models" / "checkpoints" / arm))
    return {"final": final, "best": best if best in evaluated else final}


def export_results(root: Path, seed: int, arm: str, results_dir: Path, label: str | None = None) -> Path:
    """Write `<results>/seed-<S>/<label or arm>.csv`: per (checkpoint, benchmark, problem) the sample counts,
    the correct samples per mode, the own-text and common-text measures and the compact-style share, from
    one seed root's evaluated generations and analysis tables (`arm` "base" = step 0)."""
    from tandem.checkpoints import generations_file
    from tandem.data.synthetic import solution_style

    root = Path(root)
    ev = read_json(root / "metrics" / "eval.json")
    src = next(iter(ev["arms"])) if arm == "base" else arm  # the base's generations sit under every arm's step 0
    plots = root / "metrics" / "plots" / "analysis"
    own = {(r["arm"], int(r["step"]), r["benchmark"], r["id"]): r for r in _read_csv(plots / "per_problem.csv")}
    common = {(r["arm"], int(r["step"]), r["benchmark"], r["id"]): r for r in _read_csv(plots / "common_text.csv")}
    gen_dir = root / "results" / "generations"
    rows = []
    for label_ck, step in _steps_of(root, ev, arm).items():
        for b in sorted(ev["settings"]["benchmarks"]):
            per: dict[str, dict] = defaultdict(lambda: {"n": 0, "solo": 0, "step": 0, "compact": 0, "n_step": 0})
            for mode in ("solo", "step"):
                f = generations_file(gen_dir, src, step, mode, b)
                if not f.exists():
                    if mode == "step":
                        continue
                    raise BadInputError(f"study: missing generations {f}; rerun the evaluate stage")
                for r in read_jsonl(f):
                    d = per[str(r["id"])]
                    ok = float(r["score"]) >= 0.5
                    if mode == "solo":
                        d["n"] += 1
                        d["solo"] += ok
                        d["compact"] += solution_style(r.get("text", "")) == "compact"
                    else:
                        d["n_step"] += 1
                        d["step"] += ok
            for pid in sorted(per):
                d = per[pid]
                o, c = own.get((src, step, b, pid), {}), common.get((src, step, b, pid), {})
                rows.append({"seed": seed, "arm": label or arm, "checkpoint": label_ck, "step": step, "benchmark": b,
                             "id": pid, "n_samples": d["n"], "solo_correct": d["solo"],
                             "step_correct": d["step"] if d["n_step"] == d["n"] else "",
                             "junior_ce": _num(_f(o.get("junior_ce"))), "overlap": _num(_f(o.get("overlap"))),
                             "kl_mean": _num(_f(o.get("kl_mean"))), "common_kl": _num(_f(c.get("kl_mean"))),
                             "common_overlap": _num(_f(c.get("overlap"))),
                             "compact_share": _num(d["compact"] / d["n"] if d["n"] else None)})
    out = result_file(results_dir, seed, label or arm)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        Path(tmp).write_text(arm_csv_text(rows), encoding="utf-8")
    return out


def _f(v) -> float | None:
    return None if v in (None, "") else float(v)


# --------------------------------------------------------------------------------------------------
# The positive control and the whole study, unit by unit
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Control:
    """The positive control: the base fine-tuned on compact-style reference solutions only (registered)."""

    sft_steps: int = 30
    sft_batch_size: int = 8
    sft_lr: float = 1e-3


def build_control(s: StudySettings, seed: int, c: Control) -> Path:
    """`<out>/seed-<S>/control/`: a root with the seed's params (arms: grpo only) whose one `grpo` checkpoint is
    the base fine-tuned for `c.sft_steps` steps on compact-style solutions of fresh training-like problems drawn
    with the seed (none of the prepared problems); evaluated and analysed like an arm, exported as "control"."""
    import dataclasses

    from tandem import models as M
    from tandem.checkpoints import step_name, write_state
    from tandem.data.prompts import user_message
    from tandem.data.synthetic import ProblemShape, generate
    from tasks.base import _prepared_problems
    from tasks.common import torch_threads

    seed_root = s.root(seed)
    root = seed_root / CONTROL
    ck = root / "models" / "checkpoints" / "grpo" / step_name(c.sft_steps)
    raw = derive(yaml.safe_load((seed_root / "params.yaml").read_text()),
                 {"out_root": str(root), "train": {"arms": ["grpo"]}, "evaluate": {"checkpoints": "final"},
                  "analyze": {"reference_arm": "grpo"}})
    for rel in SHARED:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to((seed_root / rel).resolve(), target_is_directory=True)
    write_params(root / "params.yaml", raw)
    if ck.exists():
        return root
    params = load_params(root / "params.yaml")
    dc, mc = params.data, params.model
    prepared = root / "data" / "prepared"
    corpus = generate(c.sft_steps * c.sft_batch_size, dc.min_steps, dc.max_steps, seed,
                      ProblemShape(dc.max_operand, dc.max_value, {"compact": 1.0}),
                      exclude=_prepared_problems(prepared), prefix="control")
    with torch_threads(1):
        base = root / "models" / "base"
        model, tok = M.load_model(base, "float32"), M.load_tokenizer(base)
        cfg = dataclasses.replace(mc, pretrain_steps=c.sft_steps, pretrain_lr=c.sft_lr,
                                  pretrain_batch_size=c.sft_batch_size, pretrain_warmup=0.1, pretrain_max_seconds=0.0,
                                  pretrain_loss="completion")
        M.pretrain(model, tok, [(user_message(p.problem), p.solution) for p in corpus], cfg, progress=False,
                   seed=seed)
    with atomic_path(ck) as tmp:
        M.save_model(model, tok, tmp)
        write_state(Path(tmp), {"arm": "grpo", "step": c.sft_steps, "control": dataclasses.asdict(c)})
    return root


def run_study(s: StudySettings, until: str = "claims", control: Control | None = None,
              results_dir: Path | None = None, log=print) -> None:
    """Train every seed x arm (`s.jobs` side by side, seed-major), and after each, evaluate and analyse its seed
    (one seed at a time: the stages cache per unit, so only the new arm's work is done) and export its
    per-problem results; then the positive control of every seed. Finished units are skipped on a rerun."""
    shared_inputs(s)
    roots = {seed: prepare_root(s, seed) for seed in s.seeds}
    locks = {seed: threading.Lock() for seed in s.seeds}
    results_dir = Path(results_dir) if results_dir else None

    def exported(seed: int, arm: str) -> bool:
        return results_dir is not None and result_file(results_dir, seed, arm).exists()

    def one(seed: int, arm: str) -> None:
        if exported(seed, arm):
            return
        log(f"study: seed {seed} {arm}: training (log: {roots[seed] / 'logs' / f'train_{arm}.log'})")
        train(roots[seed], arm)
        if until == "train":
            return
        with locks[seed]:
            log(f"study: seed {seed}: evaluating and analysing ({arm} trained)")
            evaluate(roots[seed])
            analyze(roots[seed])
            if results_dir is not None:
                for a in ("base", arm):
                    export_results(roots[seed], seed, a, results_dir)
                log(f"study: seed {seed} {arm}: results in {result_file(results_dir, seed, arm)}")

    def control_unit(seed: int) -> None:
        if control is None or exported(seed, CONTROL):
            return
        log(f"study: seed {seed}: positive control")
        root = build_control(s, seed, control)
        evaluate(root)
        analyze(root)
        if results_dir is not None:
            export_results(root, seed, "grpo", results_dir, label=CONTROL)

    with ThreadPoolExecutor(max_workers=max(1, s.jobs)) as pool:
        futures = [pool.submit(one, seed, arm) for seed in s.seeds for arm in s.arms]
        for f in futures:
            f.result()
        if until != "train":
            for f in [pool.submit(control_unit, seed) for seed in s.seeds]:
                f.result()


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
    write_report(s.out, doc)
    return doc


def _final_steps(root: Path, arms: list[str]) -> dict[str, int]:
    return {a: st for a, st in final_steps(read_json(root / "metrics" / "eval.json"), arms).items() if a != "base"}


def write_report(out: Path, doc: dict) -> None:
    """<out>/report.md and report.html from a claims document of `aggregate`: the claims first, then every measure
    per arm with its interval."""
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
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    for f in rep.figures():
        (figs / figure_filename(f.name)).write_bytes(f.png)
    with atomic_path(out / "report.md") as tmp:
        Path(tmp).write_text(render_markdown(rep, "figures"))
    with atomic_path(out / "report.html") as tmp:
        Path(tmp).write_text(render_html(rep))


def claims_summary(doc: dict) -> str:
    """The claims as plain lines for a terminal."""
    lines = [f"claims over {doc['n_seeds']} seed(s):"]
    for r in doc["claims"]:
        d = "-" if r["difference"] is None else f"{r['difference']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
        lines.append(f"  {r['claim']:<22} {r['metric']:<12} {r['comparison']:<16} {d:<28} {r['verdict']}")
    return "\n".join(lines)
