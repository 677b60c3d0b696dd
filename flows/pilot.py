"""The registered pilot (`studies/registration.yaml`): GRPO against the base on a pilot-only seed, the room
criteria, and the study's setting they decide.

`tandem pilot` runs it. Each pilot params file (a variant's GRPO file, or one of its KL-Reg candidates) is a
one-seed study root `studies/pilot/<file stem>/seed-<S>/` driven by the steps of flows/multiseed.py (shared data
and base of the variant's task, training resumable, evaluation cached, analysis). The registered first batch trains
side by side; later variants and KL-Reg candidates train only when the decision rule reaches them. Then:

- `room`: the four criteria (R1 solo gain, R2 drift or junior cross-entropy, R3 handoff cost, R4 zero-variance
  groups) of GRPO against the base at one training length, from the per-problem measures (tasks/measures.py)
  and the per-step training table;
- `decide`: variants in the registered order, lengths shortest first; the first that meets every criterion;
- `choose_beta`: the KL-Reg candidate whose KL to the base is closest, on a log scale, to half of GRPO's;
- `study_file`: the chosen variant's file with the registered study changes, written to `studies/study.yaml`
  (only when it does not exist yet: once committed, the study file is frozen).

Results go to `studies/pilot/result.json` and `result.md`. Rerun, finished runs are skipped and the result is
recomputed from what is on disk.
"""

from __future__ import annotations

import csv
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from tandem.errors import BadInputError
from tandem.metrics.intervals import point_estimate
from flows import multiseed as st
from tasks.common import atomic_path, write_json
from tasks.measures import run_measures

CODE_ROOT = st.CODE_ROOT
REGISTRATION = CODE_ROOT / "studies" / "registration.yaml"
PILOT_DIR = CODE_ROOT / "studies" / "pilot"  # beside the registration: <its folder>/pilot/, <its folder>/study.yaml
CRITERIA = ("R1", "R2", "R3", "R4")


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


def load_registration(path: str | Path = REGISTRATION) -> dict:
    p = Path(path)
    if not p.exists():
        raise BadInputError(f"pilot: registration {p} does not exist")
    reg = yaml.safe_load(p.read_text())
    reg["_dir"] = str(p.resolve().parent)
    for key in ("pilot", "study", "claims", "statistics"):
        if key not in reg:
            raise BadInputError(f"pilot: registration {p} has no {key!r} section")
    return reg


def units_of(reg: dict, variant: str, kind: str) -> list[Unit]:
    """The GRPO unit ("grpo") or the KL-Reg candidate units ("kl_reg") of one registered variant."""
    seed = int(reg["pilot"]["seed"])
    v = next((v for v in reg["pilot"]["variants"] if v["name"] == variant), None)
    if v is None:
        raise BadInputError(f"pilot: no variant {variant!r} in the registration")
    files = [v["params"]] if kind == "grpo" else list(v["kl_reg"])
    return [Unit(variant, (CODE_ROOT / f).resolve(), kind, seed, Path(reg["_dir"]) / "pilot") for f in files]


def _first_batch(reg: dict) -> list[Unit]:
    out = []
    for item in reg["pilot"]["first_batch"]:
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
    passed = {
        "R1": values["solo_gain"] >= criteria["R1_solo_gain"],
        "R2": kl >= criteria["R2_kl"] or values["junior_ce_ratio"] >= criteria["R2_junior_ce_ratio"],
        "R3": values["handoff_cost"] >= criteria["R3_handoff_cost"],
        "R4": zv <= criteria["R4_zero_variance"],
    }
    return {"step": step, "values": values, "passed": passed, "room": all(passed.values())}


def kl_at(root: Path, arm: str, step: int) -> float:
    return _macro(run_measures(root, [arm], steps={arm: step})[arm]["kl_mean"])


def choose_beta(kl_grpo: float, candidates: dict[float, float]) -> tuple[float, float]:
    """The beta whose KL is closest to half of GRPO's on a log scale: (beta, its KL / (GRPO's KL / 2))."""
    target = kl_grpo / 2
    if not target > 0:
        raise BadInputError(f"pilot: GRPO's KL to the base is {kl_grpo}; there is no drift to halve")
    best = min(candidates, key=lambda b: abs(math.log(max(candidates[b], 1e-12) / target)))
    return best, candidates[best] / target


def _beta_of(u: Unit) -> float:
    return float(yaml.safe_load(u.params_file.read_text())["train"]["kl_beta"])


# --------------------------------------------------------------------------------------------------
# The study file
# --------------------------------------------------------------------------------------------------

def set_value(text: str, dotted: str, value: str, comment: str) -> str:
    """`text` (a params file) with the scalar or inline-list setting `section.key` replaced by `value` and a
    comment; comments and layout elsewhere are kept."""
    section, key = dotted.split(".")
    lines, sec = text.split("\n"), None
    for i, line in enumerate(lines):
        m = re.match(r"^([A-Za-z_]+):", line)
        if m:
            sec = m.group(1)
        elif sec == section and re.match(rf"^  {re.escape(key)}:", line):
            lines[i] = f"  {key}: {value}  # {comment}"
            while i + 1 < len(lines) and re.match(r"^(   |  - )", lines[i + 1]):  # a block value's lines
                del lines[i + 1]
            return "\n".join(lines)
    raise BadInputError(f"pilot: {dotted} not found in the variant's params file")


def study_file_text(variant_file: Path, steps: int, beta: float, reg: dict) -> str:
    text = variant_file.read_text()
    text = re.sub(r"\A(#.*\n)+", (
        "# The registered study's params file (studies/registration.md): the pilot's chosen variant "
        f"({variant_file.name}) with\n# the registered study changes only. Generated by `tandem pilot` from the "
        "pilot's result and committed before\n# the study's first run; `tandem study --registered` runs it. "
        "A complete params file.\n"), text)
    arms = reg["study"]["arms"]
    changes = {"train.arms": ("[" + ", ".join(arms) + "]", "REGISTERED: the study's arms"),
               "train.steps": (str(steps), "REGISTERED: the pilot's chosen length"),
               "train.kl_beta": (f"{beta:g}", "REGISTERED: the pilot's KL-Reg beta (halves GRPO's drift)"),
               "train.save_every": ("50", "REGISTERED: checkpoints for the best-by-validation row"),
               "evaluate.checkpoints": ("final_and_best", "REGISTERED: the final and the best-by-validation checkpoint"),
               "analyze.reference_arm": ("grpo", "the most-drifted token types are GRPO's")}
    for dotted, (value, comment) in changes.items():
        text = set_value(text, dotted, value, comment)
    return text


# --------------------------------------------------------------------------------------------------
# The pilot
# --------------------------------------------------------------------------------------------------

def run(registration: str | Path = REGISTRATION, jobs: int | None = None, log=print) -> dict:
    """Run the registered pilot to its decision; write studies/pilot/result.json and .md (and studies/study.yaml
    when a variant passes and no study file exists yet). Returns the result document."""
    reg = load_registration(registration)
    pc = reg["pilot"]
    pilot_dir, study_file = Path(reg["_dir"]) / "pilot", Path(reg["_dir"]) / "study.yaml"
    jobs = int(jobs or pc.get("jobs", 2))
    lengths = sorted(int(x) for x in pc["lengths"])

    def failed(u: Unit) -> bool:
        """A KL-Reg candidate of a variant whose GRPO run is done and meets no length's criteria."""
        if u.arm != "kl_reg":
            return False
        (g,) = units_of(reg, u.variant, "grpo")
        return _complete(g) and not any(room(g.root, g.arm, L, pc["criteria"])["room"] for L in lengths)

    run_units(_first_batch(reg), jobs, log, skip=failed)
    doc: dict = {"registration": _rel(Path(registration).resolve()),
                 "seed": int(pc["seed"]), "criteria": pc["criteria"], "variants": {}, "chosen": None}
    for v in pc["variants"]:
        (u,) = units_of(reg, v["name"], "grpo")
        run_units([u], jobs, log)
        rows = [room(u.root, u.arm, L, pc["criteria"]) for L in lengths]
        doc["variants"][v["name"]] = {"params": _rel(u.params_file), "lengths": rows}
        hit = next((r for r in rows if r["room"]), None)
        if hit is not None:
            doc["chosen"] = {"variant": v["name"], "params": _rel(u.params_file),
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
        doc["study_file"] = _rel(study_file)
    else:
        doc["verdict"] = "no room at toy scale: no registered variant met every criterion"
    write_json(pilot_dir / "result.json", doc)
    with atomic_path(pilot_dir / "result.md") as tmp:
        Path(tmp).write_text(result_markdown(doc))
    return doc


def status(registration: str | Path = REGISTRATION) -> list[dict]:
    """Every pilot unit of every variant: trained / partial / pending, and whether it was evaluated."""
    reg = load_registration(registration)
    rows = []
    for v in reg["pilot"]["variants"]:
        for kind in ("grpo", "kl_reg"):
            for u in units_of(reg, v["name"], kind):
                s = [r for r in st.status(u.settings()) if r["arm"] == u.arm]
                state = s[0]["state"] if s else "pending"
                if state == "trained" and _complete(u):
                    state = "analyzed"
                rows.append({"unit": u.name, "variant": v["name"], "arm": u.arm, "state": state,
                             "step": s[0]["step"] if s else 0, "steps": s[0]["steps"] if s else None})
    return rows


def _rel(p: Path) -> str:
    """A path relative to the project root when it lies inside it (the committed result names project files)."""
    return str(p.relative_to(CODE_ROOT)) if p.is_relative_to(CODE_ROOT) else str(p)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def result_markdown(doc: dict) -> str:
    c = doc["criteria"]
    lines = ["# The pilot's result", "",
             f"Registered in `{doc['registration']}`; seed {doc['seed']}; GRPO against the base, macro over the "
             "benchmarks (`tandem pilot` writes this file from `result.json`).", "",
             f"**Verdict: {doc['verdict']}.**", "",
             f"Criteria: R1 solo pass@1 gain >= {c['R1_solo_gain']}; R2 KL to the base >= {c['R2_kl']} nats/token "
             f"or junior CE >= {c['R2_junior_ce_ratio']}x the base's own; R3 solo minus step pass@1 >= "
             f"{c['R3_handoff_cost']}; R4 zero-variance groups <= {c['R4_zero_variance']}.", "",
             "| variant | steps | solo pass@1 base -> GRPO (R1 gain) | KL to base | junior CE base -> GRPO (ratio) "
             "| step pass@1 (R3 cost) | zero-variance groups | R1 | R2 | R3 | R4 | room |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in doc["variants"].items():
        for r in v["lengths"]:
            x, p = r["values"], r["passed"]
            yes = {True: "yes", False: "no"}
            lines.append(f"| {name} | {r['step']} | {_fmt(x['solo_pass1_base'])} -> {_fmt(x['solo_pass1'])} "
                         f"({x['solo_gain']:+.3f}) | {x['kl_to_base']:.4f} | {x['junior_ce_base']:.4f} -> "
                         f"{x['junior_ce']:.4f} ({x['junior_ce_ratio']:.2f}x) | {_fmt(x['step_pass1'])} "
                         f"({x['handoff_cost']:+.3f}) | {x['zero_variance_groups']:.2f} | "
                         + " | ".join(yes[p[k]] for k in CRITERIA) + f" | {yes[r['room']]} |")
    ch = doc.get("chosen")
    if ch and "kl_reg" in ch:
        k = ch["kl_reg"]
        lines += ["", f"KL-Reg on {ch['variant']} at {ch['steps']} steps: GRPO's KL {k['grpo_kl']:.4f}, target (half) "
                  f"{k['target']:.4f}; candidates " + ", ".join(f"beta {b}: KL {kl:.4f}" for b, kl in k["candidates"].items())
                  + f". Chosen beta **{k['beta']:g}** (its KL is {k['kl_over_target']:.2f}x the target"
                  + ("" if k["within_factor_1_5"] else "; outside the factor 1.5 the registration names") + ")."]
    if doc.get("study_file"):
        lines += ["", f"The study's params file: `{doc['study_file']}`."]
    return "\n".join(lines) + "\n"
