"""A study's registration, typed: frozen dataclasses read once from a committed `registration.yaml`, as it is.

Two kinds of registered study share these types (docs/studies.md):

- `ControlRegistration` (`kind: junior-control`): a positive control. A senior S that writes a dialect and a
  junior J that cannot read it are built by the pipeline's own stages from the registration alone: the params
  file (`params`), the senior's build settings (`senior`: its seed and any params sections it changes, e.g. a
  supervised phase of the base stage), each dialect's senior styles (`dialects`), the junior (`junior`: the
  params file's `junior` section, `source` included), the classifier that names a text's style (`classifier`),
  the gate, arms, seeds, steps, evaluation, statistics, claims and bug indicators. A later setting
  (`gate_from`) trains from an earlier setting's gate and applies `params_overrides`.
- `PilotRegistration` (`pilot:` + `study:` + `claims:`): the registered pilot, the study it decides, and the
  study's claims over per-problem results.

A control's `amendments.yaml` beside its registration (`Amendment`) holds what was registered later, each entry
committed before anything it governs ran; the one kind the code reads is `rebuild` (a run may train from S and J
rebuilt on another machine once their own gate, measured again, has passed: tasks/study/control.py).

Every problem of a file is collected and raised as one `BadInputError` naming the file, one problem per clause.
Nothing here writes a file: a registration is a record and is never rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from tandem.errors import BadInputError
from tandem.metrics.verdicts import RegisteredClaim
from tandem.study.results import CLASSIFIERS

KINDS = ("junior-control", "pilot")
# What the claims engine implements (tandem.study.claims); a registration asking for anything else is refused.
IMPLEMENTED = {"bootstrap": "crossed", "robustness": "seed_t", "multiplicity": "holm"}
PARTNERS = ("S", "J")
# How S is built from a dialect's senior styles: `styles` (the toy's: they are the base stage's warm-up corpus,
# data.solution_styles) or `dialect_phase` (they are the base stage's dialect phase, model.dialect_styles, after the
# keyed warm-up that J shares; model.dialect_steps must be on).
SENIOR_BUILDS = ("styles", "dialect_phase")
# The top-level fields a control's registration may hold; any other is refused (a field no code reads is a
# registered rule nothing checks).
CONTROL_FIELDS = ("kind", "setting", "reason", "params", "gate_from", "params_overrides", "classifier", "senior",
                  "junior", "dialects", "keyed_styles", "gate", "arms", "seeds", "min_seeds_for_verdict", "steps",
                  "checkpoint_every", "evaluation", "statistics", "claims", "secondary", "bug_indicators",
                  "setting_indicators")
# The setting indicators the claims engine computes (tandem.study.control.setting_indicators).
SETTING_INDICATORS = ("H_grpo_keeps",)
SECONDARY_TESTS = ("less", "greater", "noninferior", "difference", "per_arm")
# The kinds of amendment the code acts on (amendments.yaml): `rebuild` accepts S and J rebuilt by the registered
# stages whose gate, measured again on them, passed.
AMENDMENT_KINDS = ("rebuild",)
AMENDMENT_FIELDS = ("id", "kind", "reason", "governs", "rule")


def _need(d: Mapping, key: str, where: str, problems: list[str], kind: type | tuple = object) -> Any:
    if key not in d:
        problems.append(f"{where}{key}: missing")
        return None
    if not isinstance(d[key], kind):
        problems.append(f"{where}{key}: {d[key]!r} has the wrong type")
        return None
    return d[key]


@dataclass(frozen=True)
class Statistics:
    """The registered statistics: interval level, bootstrap draws and seed, one-sided alpha, and the methods."""

    level: float
    n_boot: int
    boot_seed: int
    alpha_one_sided: float
    bootstrap: str = "crossed"
    robustness: str = "seed_t"
    multiplicity: str = "holm"

    @classmethod
    def parse(cls, d: Any, problems: list[str]) -> "Statistics | None":
        if not isinstance(d, Mapping):
            problems.append("statistics: missing or not a mapping")
            return None
        for k, want in IMPLEMENTED.items():
            if d.get(k) != want:
                problems.append(f"statistics.{k}: {d.get(k)!r}, but the claims engine implements {want!r}")
        vals = {k: _need(d, k, "statistics.", problems, (int, float)) for k in ("level", "n_boot", "boot_seed",
                                                                             "alpha_one_sided")}
        if None in vals.values():
            return None
        if not 0 < vals["level"] < 1 or not 0 < vals["alpha_one_sided"] < 0.5 or vals["n_boot"] < 100:
            problems.append(f"statistics: level in (0, 1), alpha_one_sided in (0, 0.5), n_boot >= 100 (got {vals})")
            return None
        return cls(float(vals["level"]), int(vals["n_boot"]), int(vals["boot_seed"]), float(vals["alpha_one_sided"]),
                   d["bootstrap"], d["robustness"], d["multiplicity"])

    def as_dict(self) -> dict:
        return {"level": self.level, "n_boot": self.n_boot, "boot_seed": self.boot_seed, "bootstrap": self.bootstrap,
                "robustness": self.robustness, "multiplicity": self.multiplicity,
                "alpha_one_sided": self.alpha_one_sided}


@dataclass(frozen=True)
class Secondary:
    """A control's secondary row: unadjusted, reported beside the claims (`test`: one of SECONDARY_TESTS)."""

    id: str
    statement: str
    metric: str
    test: str
    a: str | None = None
    b: str | None = None
    margin: float | None = None

    def claim(self) -> RegisteredClaim:
        """The row as a one-sided comparison a - b (noninferior and difference rows read as `greater`)."""
        return RegisteredClaim(id=self.id, claim=self.id, statement=self.statement, metric=self.metric,
                               test="less" if self.test == "less" else "greater", a=self.a, b=self.b)


@dataclass(frozen=True)
class Dialect:
    """One registered dialect: its name, the senior base's styles, the style the classifier names for it (`style`;
    the name when absent) and the params sections its S build changes beyond the senior's (`params`, e.g. a longer
    dialect phase). Two dialects may share a style with different builds; the name keeps their work apart."""

    name: str
    senior_styles: Mapping[str, float]
    style_name: str | None = None
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def style(self) -> str:
        return self.style_name or self.name


@dataclass(frozen=True)
class Arm:
    """A control arm: the pipeline arm it trains (`train.arms`) and its partner throughout (S or J)."""

    train: str
    partner: str


@dataclass(frozen=True)
class Build:
    """How S or J is built: `seed`, and the params sections it sets (section -> {key: value}); for J, its
    `junior` section (the junior stage's source and settings); for S, `build` (one of SENIOR_BUILDS: where the
    dialect's senior styles go)."""

    seed: int
    sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    build: str = "styles"


@dataclass(frozen=True)
class GateSpec:
    n_samples: int
    problems: str
    criteria: Mapping[str, Any]
    reported: tuple[str, ...] = ()


@dataclass(frozen=True)
class Amendment:
    """One registered amendment (amendments.yaml): its id, kind (AMENDMENT_KINDS), reason, the runs it governs and
    its rule in words."""

    id: str
    kind: str
    reason: str
    governs: tuple[str, ...]
    rule: str


@dataclass(frozen=True)
class ControlRegistration:
    """A registered positive control (`kind: junior-control`), with the setting it gates from, if any."""

    path: Path
    params: str
    senior: Build
    junior: Build
    dialects: tuple[Dialect, ...]
    keyed_styles: tuple[str, ...]
    gate: GateSpec
    arms: Mapping[str, Arm]
    seeds: tuple[int, ...]
    min_seeds_for_verdict: int
    steps: int
    checkpoint_every: int
    evaluation: Mapping[str, Any]
    statistics: Statistics
    claims: tuple[RegisteredClaim, ...]
    secondary: tuple[Secondary, ...]
    bug_indicators: Mapping[str, Any]
    setting: str | None = None
    reason: str | None = None
    gate_from: "ControlRegistration | None" = None
    params_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    classifier: str = "solution_style"
    setting_indicators: Mapping[str, Any] = field(default_factory=dict)
    amendments: tuple[Amendment, ...] = ()
    kind: str = "junior-control"

    @property
    def dir(self) -> Path:
        return self.path.parent

    @property
    def gated(self) -> "ControlRegistration":
        """The registration whose gate (gate.json, the gated S and J) this one uses: its own, or `gate_from`'s."""
        return self.gate_from or self

    def dialect(self, name: str) -> Dialect:
        found = [d for d in self.dialects if d.name == name]
        if not found:
            raise BadInputError(f"{self.path}: no dialect {name!r} (registered: {[d.name for d in self.dialects]})")
        return found[0]

    def claim(self, cid: str) -> RegisteredClaim:
        return next(c for c in self.claims if c.id == cid)

    def amended(self, kind: str) -> Amendment | None:
        """The registered amendment of `kind`, if any."""
        return next((a for a in self.amendments if a.kind == kind), None)


@dataclass(frozen=True)
class Variant:
    name: str
    params: str
    kl_reg: tuple[str, ...]


@dataclass(frozen=True)
class PilotRegistration:
    """The registered pilot (`pilot:`), the study it decides (`study:`) and the study's claims."""

    path: Path
    seed: int
    jobs: int
    lengths: tuple[int, ...]
    variants: tuple[Variant, ...]
    first_batch: tuple[str, ...]
    criteria: Mapping[str, float]
    study: Mapping[str, Any]
    statistics: Statistics
    claims: tuple[RegisteredClaim, ...]
    secondary: tuple[RegisteredClaim, ...]
    kind: str = "pilot"

    @property
    def dir(self) -> Path:
        return self.path.parent

    @property
    def pilot_dir(self) -> Path:
        return self.dir / "pilot"

    def variant(self, name: str) -> Variant:
        found = [v for v in self.variants if v.name == name]
        if not found:
            raise BadInputError(f"{self.path}: no pilot variant {name!r}")
        return found[0]


CRITERIA = ("R1_solo_gain", "R2_kl", "R2_junior_ce_ratio", "R3_handoff_cost", "R4_zero_variance")
GATE_CRITERIA = ("G1_share", "G2_solo_pass1_min", "G3_cost_max", "G4_solo_gap_abs_max")
SECONDARY_CHECKPOINTS = ("final", "best_by_validation")


def _claims(raw: Any, problems: list[str]) -> tuple[RegisteredClaim, ...]:
    out = []
    for i, c in enumerate(raw or []):
        try:
            out.append(RegisteredClaim.from_dict({"claim": c.get("id"), **c} if "claim" not in c else c))
        except (TypeError, ValueError, AttributeError) as e:
            problems.append(f"claims[{i}]: {e}")
    if not out:
        problems.append("claims: at least one registered claim")
    return tuple(out)


def _derived_secondary(primary: tuple[RegisteredClaim, ...], s: Any, problems: list[str]) -> RegisteredClaim | None:
    """A study's secondary row: a primary claim (`of`) on another metric or checkpoint."""
    of = next((c for c in primary if isinstance(s, Mapping) and c.id == s.get("of")), None)
    if of is None:
        problems.append(f"secondary {s}: names no primary claim (of: <id>)")
        return None
    unknown = sorted(set(s) - {"of", "metric", "checkpoint"})
    ckpt = s.get("checkpoint", of.checkpoint)
    if unknown or ckpt not in SECONDARY_CHECKPOINTS:
        problems.append(f"secondary {dict(s)}: unknown keys {unknown} or checkpoint {ckpt!r} none of "
                        f"{', '.join(SECONDARY_CHECKPOINTS)}")
        return None
    metric = s.get("metric", of.metric)
    rid = of.id + (f" {metric}" if "metric" in s else "") + (f" at {ckpt}" if "checkpoint" in s else "")
    return RegisteredClaim.from_dict({**of.__dict__, "id": rid, "metric": metric, "checkpoint": ckpt})


def _build(d: Any, where: str, problems: list[str], junior: bool) -> Build | None:
    """S's or J's build settings: `seed`, then (J) the junior section's keys, or (S) `params: {section: {...}}`."""
    if not isinstance(d, Mapping) or not isinstance(d.get("seed"), int):
        problems.append(f"{where}: a mapping with an integer seed")
        return None
    if junior:
        rest = {k: v for k, v in d.items() if k != "seed"}
        # the committed registrations build J with the junior stage's `tiny` source (their comment says so)
        return Build(int(d["seed"]), {"junior": {"source": rest.pop("source", "tiny"), "seed": int(d["seed"]), **rest}})
    extra = sorted(set(d) - {"seed", "params", "build"})
    if extra:
        problems.append(f"{where}: unknown keys {extra} (seed, params, build)")
    build = d.get("build", "styles")
    if build not in SENIOR_BUILDS:
        problems.append(f"{where}.build: {build!r} is none of {', '.join(SENIOR_BUILDS)}")
    sections = d.get("params") or {}
    if not isinstance(sections, Mapping) or not all(isinstance(v, Mapping) for v in sections.values()):
        problems.append(f"{where}.params: section -> {{key: value}}")
        return None
    return Build(int(d["seed"]), {k: dict(v) for k, v in sections.items()}, build)


def _amendments(path: Path, problems: list[str]) -> tuple[Amendment, ...]:
    """The amendments in `path` (amendments.yaml; none when it does not exist), each checked."""
    if not path.is_file():
        return ()
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        problems.append(f"{path.name}: not YAML: {str(e).splitlines()[0]}")
        return ()
    items = raw.get("amendments") if isinstance(raw, Mapping) else None
    if not isinstance(items, list) or not items:
        problems.append(f"{path.name}: an `amendments:` list of entries ({', '.join(AMENDMENT_FIELDS)})")
        return ()
    out = []
    for i, a in enumerate(items):
        where = f"{path.name}: amendments[{i}]"
        if not isinstance(a, Mapping) or sorted(set(a) ^ set(AMENDMENT_FIELDS)):
            problems.append(f"{where}: exactly the fields {', '.join(AMENDMENT_FIELDS)}")
            continue
        if a["kind"] not in AMENDMENT_KINDS:
            problems.append(f"{where}.kind: {a['kind']!r} is none of {', '.join(AMENDMENT_KINDS)}")
            continue
        if not isinstance(a["governs"], list) or not all(isinstance(g, str) for g in a["governs"]):
            problems.append(f"{where}.governs: a list of the runs it governs (e.g. 'seed 2 grpo')")
            continue
        out.append(Amendment(str(a["id"]), a["kind"], str(a["reason"]), tuple(a["governs"]), str(a["rule"])))
    ids = [a.id for a in out]
    if len(set(ids)) != len(ids):
        problems.append(f"{path.name}: amendment ids repeat ({ids})")
    return tuple(out)


def _control(path: Path, raw: Mapping, problems: list[str], root: Path) -> ControlRegistration | None:
    from tandem.config import SOLUTION_STYLES

    unknown = sorted(set(raw) - set(CONTROL_FIELDS))
    if unknown:
        problems.append(f"unknown fields {unknown} (a control registers only {', '.join(CONTROL_FIELDS)})")
    gate_from = None
    if raw.get("gate_from"):
        parent = (root / raw["gate_from"]).resolve()
        if parent == path.parent.resolve():
            problems.append("gate_from: names this very folder")
        else:
            gate_from = load(parent / "registration.yaml", root)
            if not isinstance(gate_from, ControlRegistration):
                problems.append(f"gate_from: {raw['gate_from']} is not a control's folder")
    classifier = raw.get("classifier", "solution_style")
    if classifier not in CLASSIFIERS:
        problems.append(f"classifier: {classifier!r} is none of {', '.join(CLASSIFIERS)}")
    params = _need(raw, "params", "", problems, str)
    if params and not (root / params).is_file():
        problems.append(f"params: {params} does not exist")
    dialects = []
    for i, d in enumerate(raw.get("dialects") or []):
        styles = d.get("senior_styles") if isinstance(d, Mapping) else None
        if not isinstance(styles, Mapping) or not isinstance(d.get("name"), str):
            problems.append(f"dialects[{i}]: name and senior_styles")
            continue
        unknown = sorted(set(styles) - set(SOLUTION_STYLES))
        if unknown or abs(sum(float(v) for v in styles.values()) - 1) > 1e-6:
            problems.append(f"dialects[{i}].senior_styles: known styles ({', '.join(SOLUTION_STYLES)}) whose shares "
                            f"sum to 1 (got {dict(styles)})")
        extra = sorted(set(d) - {"name", "senior_styles", "style", "params"})
        style, sections = d.get("style"), d.get("params") or {}
        if extra or (style is not None and style not in styles) or not isinstance(sections, Mapping) or not all(
                isinstance(v, Mapping) for v in sections.values()):
            problems.append(f"dialects[{i}]: only name, senior_styles, style (one of its senior styles) and params "
                            f"(section -> {{key: value}}) (got {dict(d)})")
            continue
        dialects.append(Dialect(d["name"], dict(styles), style, {k: dict(v) for k, v in sections.items()}))
    if not dialects:
        problems.append("dialects: at least one, in gate order")
    if len({d.name for d in dialects}) != len(dialects):
        problems.append(f"dialects: names must differ (got {[d.name for d in dialects]})")
    arms = {}
    for name, a in (raw.get("arms") or {}).items():
        if not isinstance(a, Mapping) or a.get("partner") not in PARTNERS or not isinstance(a.get("train"), str):
            problems.append(f"arms.{name}: {{train: <pipeline arm>, partner: S or J}}")
            continue
        arms[name] = Arm(a["train"], a["partner"])
    if not arms:
        problems.append("arms: at least one")
    g = raw.get("gate") or {}
    crit = g.get("criteria") or {}
    missing = [k for k in GATE_CRITERIA if k not in crit]
    if missing:
        problems.append(f"gate.criteria: missing {', '.join(missing)}")
    from tandem.study.control import ESTIMATORS, OPTIONAL_CRITERIA

    unknown = sorted(set(crit) - set(GATE_CRITERIA) - set(OPTIONAL_CRITERIA))
    if unknown:
        problems.append(f"gate.criteria: unknown {unknown} (known: {', '.join(GATE_CRITERIA + OPTIONAL_CRITERIA)})")
    if crit.get("estimator", "pooled") not in ESTIMATORS:
        problems.append(f"gate.criteria.estimator: {crit.get('estimator')!r} is none of {', '.join(ESTIMATORS)}")
    if not (isinstance(crit.get("min_problems", 0), int) and crit.get("min_problems", 0) >= 0):
        problems.append("gate.criteria.min_problems: an integer >= 0")
    keyed_min = crit.get("G1_keyed_share_min")
    if keyed_min is not None and not (isinstance(keyed_min, (int, float)) and 0 <= keyed_min < 1):
        problems.append("gate.criteria.G1_keyed_share_min: a share in [0, 1)")
    seeds = raw.get("seeds") or []
    if not seeds or len(set(seeds)) != len(seeds) or not all(isinstance(s, int) for s in seeds):
        problems.append(f"seeds: distinct integers (got {seeds})")
    secondary = []
    for i, s in enumerate(raw.get("secondary") or []):
        try:
            sec = Secondary(**s)
        except TypeError as e:
            problems.append(f"secondary[{i}]: {e}")
            continue
        if sec.test not in SECONDARY_TESTS or (sec.test != "per_arm" and not (sec.a and sec.b)):
            problems.append(f"secondary[{i}] ({sec.id}): test one of {', '.join(SECONDARY_TESTS)}, with a and b")
        secondary.append(sec)
    claims = _claims(raw.get("claims"), problems)
    for c in claims:
        for a in (c.a, c.b):
            if arms and a not in arms:
                problems.append(f"claims {c.id}: arm {a!r} is not registered")
    stats = Statistics.parse(raw.get("statistics"), problems)
    senior = _build(raw.get("senior"), "senior", problems, junior=False)
    junior = _build(raw.get("junior"), "junior", problems, junior=True)
    ints = {k: raw.get(k) for k in ("min_seeds_for_verdict", "steps", "checkpoint_every")}
    bad = [k for k, v in ints.items() if not (isinstance(v, int) and v >= 1)]
    if bad:
        problems.append(f"{', '.join(bad)}: integers >= 1")
    overrides = raw.get("params_overrides") or {}
    if not isinstance(overrides, Mapping) or not all(isinstance(v, Mapping) for v in overrides.values()):
        problems.append("params_overrides: section -> {key: value}")
    setting_ind = raw.get("setting_indicators") or {}
    if not isinstance(setting_ind, Mapping) or sorted(set(setting_ind) - set(SETTING_INDICATORS)):
        problems.append(f"setting_indicators: known ones are {', '.join(SETTING_INDICATORS)} (got {setting_ind!r})")
    elif "H_grpo_keeps" in setting_ind and not (isinstance(setting_ind["H_grpo_keeps"], (int, float))
                                                 and 0 < setting_ind["H_grpo_keeps"] <= 1):
        problems.append("setting_indicators.H_grpo_keeps: a fraction in (0, 1] of grpo's step-0 share")
    amendments = _amendments(path.parent / "amendments.yaml", problems)
    if problems:
        return None
    return ControlRegistration(
        path=path, params=params, senior=senior, junior=junior, dialects=tuple(dialects),
        keyed_styles=tuple(raw.get("keyed_styles") or ()),
        gate=GateSpec(int(g.get("n_samples", 0)), str(g.get("problems", "")), dict(crit), tuple(g.get("reported") or ())),
        arms=arms, seeds=tuple(seeds), steps=ints["steps"], checkpoint_every=ints["checkpoint_every"],
        min_seeds_for_verdict=ints["min_seeds_for_verdict"], evaluation=dict(raw.get("evaluation") or {}),
        statistics=stats, claims=claims, secondary=tuple(secondary), bug_indicators=dict(raw.get("bug_indicators") or {}),
        setting=raw.get("setting"), reason=raw.get("reason"), gate_from=gate_from,
        params_overrides={k: dict(v) for k, v in overrides.items()}, classifier=classifier,
        setting_indicators=dict(setting_ind), amendments=amendments)


def _pilot(path: Path, raw: Mapping, problems: list[str]) -> PilotRegistration | None:
    pc = raw.get("pilot") or {}
    for key in ("pilot", "study", "claims", "statistics"):
        if key not in raw:
            problems.append(f"{key}: missing section")
    variants = []
    for i, v in enumerate(pc.get("variants") or []):
        if not isinstance(v, Mapping) or not {"name", "params"} <= set(v):
            problems.append(f"pilot.variants[{i}]: name and params")
            continue
        variants.append(Variant(v["name"], v["params"], tuple(v.get("kl_reg") or ())))
    crit = pc.get("criteria") or {}
    missing = [k for k in CRITERIA if not isinstance(crit.get(k), (int, float))]
    if missing:
        problems.append(f"pilot.criteria: missing {', '.join(missing)}")
    names = {v.name for v in variants}
    for item in pc.get("first_batch") or []:
        if item.partition("/")[0] not in names or item.partition("/")[2] not in ("", "grpo", "kl_reg"):
            problems.append(f"pilot.first_batch: {item!r} is not <variant> or <variant>/kl_reg")
    lengths = pc.get("lengths") or []
    if not lengths or not all(isinstance(x, int) and x > 0 for x in lengths):
        problems.append(f"pilot.lengths: positive integers (got {lengths})")
    stats = Statistics.parse(raw.get("statistics"), problems)
    claims = _claims(raw.get("claims"), problems)
    secondary = tuple(s for s in (_derived_secondary(claims, s, problems) for s in raw.get("secondary") or [])
                      if s is not None)
    if problems:
        return None
    return PilotRegistration(path=path, seed=int(pc["seed"]), jobs=int(pc.get("jobs", 2)),
                             lengths=tuple(sorted(int(x) for x in lengths)), variants=tuple(variants),
                             first_batch=tuple(pc.get("first_batch") or ()), criteria=dict(crit),
                             study=dict(raw["study"]), statistics=stats, claims=claims, secondary=secondary)


def kind_of(raw: Mapping) -> str | None:
    """`junior-control` (its `kind:`), `pilot` (a `pilot:` section), or None."""
    if raw.get("kind") == "junior-control":
        return "junior-control"
    if "pilot" in raw and "study" in raw:
        return "pilot"
    return None


def load(path: str | Path, root: str | Path | None = None) -> ControlRegistration | PilotRegistration:
    """The registration at `path` (a registration.yaml, or the folder holding one), validated once; `root` is the
    project root its paths are relative to (default: the folder above `studies/`, else the working directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "registration.yaml"
    if not p.is_file():
        raise BadInputError(f"study: {p} does not exist (a study runs only from a committed registration)")
    root = Path(root) if root else _project_root(p)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise BadInputError(f"study: {p} is not YAML: {str(e).splitlines()[0]}") from None
    problems: list[str] = []
    kind = kind_of(raw)
    if kind is None:
        raise BadInputError(f"study: {p}: no registered kind (kind: junior-control, or pilot: and study: sections)")
    reg = _control(p, raw, problems, root) if kind == "junior-control" else _pilot(p, raw, problems)
    if problems or reg is None:
        raise BadInputError(f"study: {p}: " + "; ".join(problems))
    return reg


def _project_root(p: Path) -> Path:
    """The folder holding `studies/` above `p` (registrations name project files relative to it)."""
    for parent in p.resolve().parents:
        if parent.name == "studies":
            return parent.parent
    return Path.cwd().resolve()
