"""The registered pilot (`studies/registration.yaml`): GRPO against the base on a pilot-only seed, measured for
the room criteria, and the study's setting they decide (the rules: tandem/study/pilot.py).

`tandem study pilot` runs it. Each pilot params file (a variant's GRPO file, or one of its KL-Reg candidates) is a
one-seed study root `studies/pilot/<file stem>/seed-<S>/` driven by the steps of tasks/study/runs.py (shared data
and base of the variant's task, training resumable, evaluation cached, analysis). The registered first batch trains
side by side; later variants and KL-Reg candidates train only when the decision rule reaches them. `room` measures
one length (per-problem measures of tasks/measures.py and the per-step training table); the study file is written
to `studies/study.yaml` only when it does not exist yet (once committed, it is frozen).

Results go to `studies/pilot/result.json` and `result.md`. Rerun, finished runs are skipped and the result is
recomputed from what is on disk.
"""

from __future__ import annotations

import csv
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from tandem.errors import BadInputError
from tandem.metrics.intervals import point_estimate
from tandem.study import registration as R
from tandem.study.pilot import choose_beta, decide_room, result_markdown, study_file_text
from tasks.common import atomic_path, write_json
from tasks.measures import run_measures
from tasks.study import runs as st
from tasks.study.stages import CODE_ROOT, rel

REGISTRATION = CODE_ROOT / "studies" / "registration.yaml"
PILOT_DIR = CODE_ROOT / "studies" / "pilot"  # beside the registration: <its folder>/pilot/, <its folder>/study.yaml


@dataclass(frozen=True)
class Unit:
    """One pilot run: a params file (GRPO of a variant, or a KL-Reg candidate) trained on the pilot seed."""

    variant: str
    params_file: Path
    arm: str
    seed: int
    pilot_dir: Path = PILOT_DIR

    @property
    def name(self) -> str:
        return self.params_file.stem

    def settings(self) -> st.StudySettings:
        return st.StudySettings(self.params_file, (self.seed,), (self.pilot_dir / self.name).resolve(), jobs=1)

    @property
    def root(self) -> Path:
        return self.settings().root(self.seed)


def load_registration(path: str | Path = REGISTRATION) -> R.PilotRegistration:
    reg = R.load(Path(path), CODE_ROOT)
    if not isinstance(reg, R.PilotRegistration):
        raise BadInputError(f"pilot: {path} holds no pilot registration (pilot: and study: sections)")
    return reg


def units_of(reg: R.PilotRegistration, variant: str, kind: str) -> list[Unit]:
    """The GRPO unit ("grpo") or the KL-Reg candidate units ("kl_reg") of one registered variant."""
    v = reg.variant(variant)
    files = [v.params] if kind == "grpo" else list(v.kl_reg)
    return [Unit(variant, (CODE_ROOT / f).resolve(), kind, reg.seed, reg.pilot_dir) for f in files]


def _first_batch(reg: R.PilotRegistration) -> list[Unit]:
    out = []
    for item in reg.first_batch:
        variant, _, kind = item.partition("/")
        out += units_of(reg, variant, kind or "grpo")
    return out


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------

def _complete(u: Unit) -> bool:
    root = u.root
    return (root / "metrics" / f"train_{u.arm}.json").exists() and (root / "metrics" / "analysis.json").exists() \
        and (root / "metrics" / "analysis.json").stat().st_mtime >= (root / "metrics" / "eval.json").stat().st_mtime


def run_units(units: list[Unit], jobs: int, log=print, skip=None) -> None:
    """Train the units side by side (`jobs` at a time), then evaluate and analyse each; finished work is skipped,
    and so is a unit for which `skip(unit)` is true when a worker comes to it (a KL-Reg candidate whose variant
    has already failed: it would be used only for a chosen variant)."""
    todo = [u for u in units if not _complete(u)]
    if not todo:
        return
    for u in todo:  # shared data and base first, one task at a time (two units may share a task)
        st.shared_inputs(u.settings())
        st.prepare_root(u.settings(), u.seed)

    def one(u: Unit) -> None:
        if skip is not None and skip(u):
            log(f"pilot: {u.name}: not trained (variant {u.variant} has no room)")
            return
        log(f"pilot: {u.name}: training {u.arm} on seed {u.seed} (log: {u.root / 'logs' / f'train_{u.arm}.log'})")
        st.train(u.root, u.arm)
        log(f"pilot: {u.name}: evaluating and analysing")
        st.evaluate(u.root)
        st.analyze(u.root)
        log(f"pilot: {u.name}: done")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for f in [pool.submit(one, u) for u in todo]:
            f.result()


# --------------------------------------------------------------------------------------------------
# Measures and rules
# --------------------------------------------------------------------------------------------------

def _macro(per_bench: dict[str, dict[str, float]]) -> float:
    """Macro mean over benchmarks of the mean over problems, for one seed (point_estimate on 1 x P arrays)."""
    return point_estimate({b: np.array([[v[i] for i in sorted(v)]], dtype=np.float64) for b, v in per_bench.items()})


def zero_variance_until(root: Path, arm: str, step: int) -> float:
    """Mean share of zero-variance groups over the training steps <= `step` (the per-step training table)."""
    path = root / "metrics" / "plots" / "train" / f"{arm}.csv"
    if not path.exists():
        raise BadInputError(f"pilot: {path} does not exist; the {arm} run has not finished")
    with open(path, newline="", encoding="utf-8") as f:
        vals = [float(r["zero_variance_groups"]) for r in csv.DictReader(f)
                if r.get("zero_variance_groups") not in ("", None) and int(r["step"]) <= step]
    if not vals:
        raise BadInputError(f"pilot: {path} has no zero-variance values up to step {step}")
    return float(np.mean(vals))


def room(root: Path, arm: str, step: int, criteria: dict) -> dict:
    """The room criteria of `arm` at `step` against the base (step 0) of one pilot root."""
    m = run_measures(root, [arm], steps={"base": 0, arm: step})
    if "kl_mean" not in m.get(arm, {}):
        raise BadInputError(f"pilot: {root} has no analysis of {arm} step {step}; rerun the pilot")
    solo_g, solo_b = _macro(m[arm]["solo/pass@1"]), _macro(m["base"]["solo/pass@1"])
    step_g = _macro(m[arm]["step/pass@1"])
    kl = _macro(m[arm]["kl_mean"])
    ce_g, ce_b = _macro(m[arm]["junior_ce"]), _macro(m["base"]["junior_ce"])
    zv = zero_variance_until(root, arm, step)
    values = {"solo_pass1_base": solo_b, "solo_pass1": solo_g, "step_pass1": step_g, "solo_gain": solo_g - solo_b,
              "kl_to_base": kl, "junior_ce": ce_g, "junior_ce_base": ce_b, "junior_ce_ratio": ce_g / ce_b,
              "handoff_cost": solo_g - step_g, "zero_variance_groups": zv,
              "solo_pass8": _macro(m[arm]["solo/pass@8"]) if "solo/pass@8" in m[arm] else None,
              "solo_pass8_base": _macro(m["base"]["solo/pass@8"]) if "solo/pass@8" in m["base"] else None}
    return {"step": step, "values": values, **decide_room(values, criteria)}


def kl_at(root: Path, arm: str, step: int) -> float:
    return _macro(run_measures(root, [arm], steps={arm: step})[arm]["kl_mean"])


def _beta_of(u: Unit) -> float:
    return float(yaml.safe_load(u.params_file.read_text())["train"]["kl_beta"])


# --------------------------------------------------------------------------------------------------
# The study file
# --------------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------------
# The pilot
# --------------------------------------------------------------------------------------------------

def run(registration: str | Path = REGISTRATION, jobs: int | None = None, log=print) -> dict:
    """Run the registered pilot to its decision; write studies/pilot/result.json and .md (and studies/study.yaml
    when a variant passes and no study file exists yet). Returns the result document."""
    reg = load_registration(registration)
    pilot_dir, study_file = reg.pilot_dir, reg.dir / "study.yaml"
    jobs = int(jobs or reg.jobs)
    lengths = list(reg.lengths)

    def failed(u: Unit) -> bool:
        """A KL-Reg candidate of a variant whose GRPO run is done and meets no length's criteria."""
        if u.arm != "kl_reg":
            return False
        (g,) = units_of(reg, u.variant, "grpo")
        return _complete(g) and not any(room(g.root, g.arm, L, reg.criteria)["room"] for L in lengths)

    run_units(_first_batch(reg), jobs, log, skip=failed)
    doc: dict = {"registration": rel(Path(registration).resolve()),
                 "seed": reg.seed, "criteria": dict(reg.criteria), "variants": {}, "chosen": None}
    for v in reg.variants:
        (u,) = units_of(reg, v.name, "grpo")
        run_units([u], jobs, log)
        rows = [room(u.root, u.arm, L, reg.criteria) for L in lengths]
        doc["variants"][v.name] = {"params": rel(u.params_file), "lengths": rows}
        hit = next((r for r in rows if r["room"]), None)
        if hit is not None:
            doc["chosen"] = {"variant": v.name, "params": rel(u.params_file),
                             "steps": hit["step"]}
            break
    if doc["chosen"] is not None:
        c = doc["chosen"]
        cands = units_of(reg, c["variant"], "kl_reg")
        run_units(cands, jobs, log)
        kl_grpo = doc["variants"][c["variant"]]["lengths"][lengths.index(c["steps"])]["values"]["kl_to_base"]
        kls = {_beta_of(k): kl_at(k.root, "kl_reg", c["steps"]) for k in cands}
        beta, ratio = choose_beta(kl_grpo, kls)
        c.update(kl_reg={"grpo_kl": kl_grpo, "target": kl_grpo / 2, "candidates": {f"{b:g}": kl for b, kl in kls.items()},
                         "beta": beta, "kl_over_target": ratio, "within_factor_1_5": 1 / 1.5 <= ratio <= 1.5})
        doc["verdict"] = f"room: {c['variant']} at {c['steps']} steps; KL-Reg beta {beta:g}"
        if not study_file.exists():
            with atomic_path(study_file) as tmp:
                Path(tmp).write_text(study_file_text(CODE_ROOT / c["params"], c["steps"], beta, reg))
        doc["study_file"] = rel(study_file)
    else:
        doc["verdict"] = "no room at toy scale: no registered variant met every criterion"
    write_json(pilot_dir / "result.json", doc)
    with atomic_path(pilot_dir / "result.md") as tmp:
        Path(tmp).write_text(result_markdown(doc))
    return doc


def status(registration: str | Path = REGISTRATION) -> list[dict]:
    """Every pilot unit of every variant (tasks.study.runs.unit_state)."""
    reg = load_registration(registration)
    rows = []
    for v in reg.variants:
        for kind in ("grpo", "kl_reg"):
            for u in units_of(reg, v.name, kind):
                total = st.load_params(u.params_file).train.steps
                rows.append({"unit": f"{v.name} {u.name}", **st.unit_state(u.root, u.arm, total)})
    return rows


