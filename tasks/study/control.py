"""A registered positive control, driven from its registration alone: the gate, the seed x arm runs.

`tandem study gate|run --out <folder>` runs it (tasks/study/recompute.py rebuilds its claims). Every number comes
from the project's own stages and library, and every setting from the registration (tandem.study.registration):

- `gate`: for each registered dialect in order, build the senior's base S (the base stage, with the registered
  params file, the senior's build sections and the dialect's styles) and the junior J (the junior stage, with the
  registration's `junior` section: its source and settings) under `work/<dialect>/`, then measure on the base
  models only, at the registered evaluation decoding: S's and J's solo samples, the step schedule of (S, J) and
  of (S, S) on every benchmark problem, and the word schedule of both pairs on the validation problems; styles
  are named by the registered classifier. `tandem.study.control.gate` decides; `gate.json` and `gate.md` are
  written and the first dialect that passes is chosen.
- `run`: every registered seed x arm without a result: a complete params file per run under
  `runs/seed-<S>/<arm>/` (links to the chosen dialect's data, S and J, and to the seed's caches), then
  the train, evaluate and analyze stages (each resumable), then `results/seed-<S>/<arm>.json`, the run's small
  per-problem results, which is what gets committed. A seed's arms share one evaluation cache and one analysis
  cache (`runs/seed-<S>/eval-cache`, `analyze-cache`): an evaluation result's key names its weights, mode,
  problems and settings (the seed among them) and, in step mode, the partner's weights, and an analysis entry's
  key the checkpoint, the base, the junior and the very texts scored, so step 0 (S alone; S with J and J alone
  for the arms whose partner is J) is computed by the first arm that reaches it and read by the others.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import yaml

from tandem.errors import BadInputError
from tandem.study import registration as R
from tandem.study.control import GAP_MEASUREMENT, GateCriteria, gate_markdown
from tandem.study.params import derive, gate_changes, run_changes
from tandem.study.results import classifier
from tasks.common import atomic_path, load_params, read_json, read_jsonl, write_json
from tasks.study.stages import CODE_ROOT, rel, stage, write_params

CONTROL_DIR = CODE_ROOT / "studies" / "junior-control"


def registration(out: Path = CONTROL_DIR) -> R.ControlRegistration:
    """The committed control registration in `out`, typed and validated."""
    reg = R.load(Path(out), CODE_ROOT)
    if not isinstance(reg, R.ControlRegistration):
        raise BadInputError(f"control: {out} holds no positive control's registration (kind: junior-control)")
    return reg


def gate_dir(reg: R.ControlRegistration) -> Path:
    return reg.gated.dir


def work_root(reg: R.ControlRegistration, dialect: str) -> Path:
    return (gate_dir(reg) / "work" / dialect).resolve()


def dialect_params(reg: R.ControlRegistration, dialect: R.Dialect) -> Path:
    """`work/<dialect>/params.yaml`: the registered params file with the senior's build sections and seed, the
    dialect's senior styles, the registered junior section, and this root (tandem.study.params.gate_changes;
    written once: the file is the record of what the gate built)."""
    root = work_root(reg, dialect.name)
    raw = yaml.safe_load((CODE_ROOT / reg.params).read_text())
    if reg.senior.build == "dialect_phase" and not (raw.get("model") or {}).get("dialect_steps"):
        raise BadInputError(f"control: senior.build dialect_phase, but {reg.params} has no dialect phase "
                            "(model.dialect_steps is 0)")
    return write_params(root / "params.yaml", derive(raw, *gate_changes(reg, dialect, str(root))))


def build_models(params_file: Path, log_dir: Path) -> None:
    """The prepare, base and junior stages for one dialect's root, each only when its output is missing."""
    p = load_params(params_file)
    root = Path(p.out_root)
    for name, out in (("prepare", root / "data" / "prepared"), ("base", root / "models" / "base"),
                      ("junior", root / "models" / "junior")):
        if not out.exists():
            stage(params_file, name, log_dir / f"{name}.log")


# S and J are committed under `models/<dialect>/` only when both together stay under this size; larger ones (the
# SmolLM2 control's, about 540 MB each) stay git-ignored under `work/<dialect>/models/` and are rebuilt by the
# stages when missing; either way every run checks them against the hashes the gate recorded. A rebuild has the
# same bits on the same CPU kernels only; on another machine it trains only as a gated rebuild (`accepted_build`).
KEEP_MAX_BYTES = 50 * 2**20


def models_dir(reg: R.ControlRegistration, dialect: str) -> Path:
    """`models/<dialect>/{S,J}`: the committed copies of the gated S and J (small), so that every seed x arm,
    on any machine, trains from the very weights the gate measured (a rebuild on other CPU kernels may differ)."""
    return (gate_dir(reg) / "models" / dialect).resolve()


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())


def keep_models(reg: R.ControlRegistration, dialect: str) -> Path:
    """Copy the dialect's S (models/base) and J (models/junior) into `models_dir` (once; checked equal after)
    when they are small (KEEP_MAX_BYTES); larger ones stay in the git-ignored work root, and `gate.json`'s hashes
    are what a later run checks them against. Returns where they are kept."""
    import shutil

    from tandem.evaluation import content_hash

    src, dest = work_root(reg, dialect) / "models", models_dir(reg, dialect)
    if not dest.exists() and sum(_size(src / rel) for rel in ("base", "junior")) > KEEP_MAX_BYTES:
        return src
    for name, rel in (("S", "base"), ("J", "junior")):
        if not (dest / name).exists():
            with atomic_path(dest / name) as tmp:
                shutil.copytree(src / rel, tmp)
        if content_hash(dest / name) != content_hash(src / rel):
            raise BadInputError(f"control: {dest / name} differs from {src / rel}: remove it and rerun the gate")
    return dest


def gated_hashes(reg: R.ControlRegistration, dialect: str) -> dict[str, str]:
    """{"S": hash, "J": hash} of the dialect's models as the gate measured them (gate.json)."""
    doc = read_json(gate_dir(reg) / "gate.json")
    found = [d for d in doc["dialects"] if d["dialect"] == dialect]
    if not found:
        raise BadInputError(f"control: {rel(gate_dir(reg) / 'gate.json')} has no dialect {dialect!r}")
    return dict(found[0]["hashes"])


def build_of(root: Path) -> dict[str, str]:
    """{"S": hash, "J": hash} of the S (`root/models/base`) and J (`root/models/junior`) a work root holds."""
    from tandem.evaluation import content_hash

    return {name: content_hash(Path(root) / "models" / sub) for name, sub in (("S", "base"), ("J", "junior"))}


def rebuild_dir(reg: R.ControlRegistration, build: dict[str, str]) -> Path:
    """`rebuilds/<S hash 16>-<J hash 16>/` beside gate.json: a rebuild's gate, measured again (amendment `rebuild`)."""
    return gate_dir(reg) / "rebuilds" / f"{build['S'][:16]}-{build['J'][:16]}"


def rebuild_amendment(reg: R.ControlRegistration) -> R.Amendment | None:
    """The registered `rebuild` amendment of this setting or of the setting whose gate it uses."""
    return reg.amended("rebuild") or reg.gated.amended("rebuild")


def accepted_build(reg: R.ControlRegistration, dialect: str, got: dict[str, str]) -> dict[str, str]:
    """`got` ({"S", "J"} hashes) with the gate that lets it train (`gate`, a path): the registered gate when `got`
    is the gated build; else, under a registered `rebuild` amendment, this very build's own gate, measured again
    and passed. Refuses in one line, saying what to run, otherwise."""
    gated = gated_hashes(reg, dialect)
    if got == gated:
        return {**got, "gate": rel(gate_dir(reg) / "gate.json")}
    am = rebuild_amendment(reg)
    where = f"S {got['S'][:16]} and J {got['J'][:16]} (in {rel(work_root(reg, dialect) / 'models')})"
    if am is None:
        raise BadInputError(f"control: {where} are not the gated build (S {gated['S'][:16]}, J {gated['J'][:16]}): "
                            "remove them to rebuild them with the stages on the machine that ran the gate, or "
                            "register a rebuild amendment (amendments.yaml) before anything trains from a rebuild")
    f = rebuild_dir(reg, got) / "gate.json"
    if not f.exists():
        raise BadInputError(f"control: {where} are a rebuild, not the gated build; amendment {am.id} lets a rebuild "
                            f"train once its own gate has passed: run `tandem study gate --rebuild --out "
                            f"{rel(reg.dir)}` and commit {rel(f.parent)}")
    if not read_json(f)["passed"]:
        raise BadInputError(f"control: {where} failed their own gate ({rel(f.parent / 'gate.md')}): amendment "
                            f"{am.id} lets this rebuild train nothing")
    return {**got, "gate": rel(f)}


def built(reg: R.ControlRegistration, dialect: str) -> tuple[Path, dict[str, str]]:
    """The dialect's work root with its prepared data (rebuilt by the prepare stage when missing: it is
    deterministic) and its models: linked to the committed S and J where the gate kept them in git, otherwise
    the git-ignored ones in the work root, rebuilt by the base and junior stages when missing; and their hashes
    (`build_of`)."""
    reg = reg.gated
    d = reg.dialect(dialect)
    f = dialect_params(reg, d)
    root = work_root(reg, dialect)
    keep = models_dir(reg, dialect)
    for name, sub in (("S", "base"), ("J", "junior")):
        dst = root / "models" / sub
        if not dst.exists() and (keep / name).exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(keep / name, target_is_directory=True)
    build_models(f, root / "logs")
    return root, build_of(root)


def ensure_inputs(reg: R.ControlRegistration, dialect: str) -> tuple[Path, dict[str, str]]:
    """`built`'s work root and the build it holds, accepted by `accepted_build` (the gate's hashes, a later
    setting's: its gate's; or a rebuild's own gate, passed)."""
    root, got = built(reg, dialect)
    return root, accepted_build(reg, dialect, got)


# --------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------

def _pair_records(params, tok, senior, junior, rows_by_bench: dict, mode: str, who: str) -> list[dict]:
    """Scored samples of the loaded `senior` (with `junior` as partner outside solo) at the registered decoding."""
    from tqdm.auto import tqdm

    from tandem.evaluation import Decoder, run_benchmark
    from tandem.generation import eos_token_ids, stable_seed
    from tandem.rewards import score_many
    from tandem.rollout.factory import make_engine
    from tasks.evaluate import settings_of

    ev, settings = params.evaluate, settings_of(params)
    decoder = Decoder(make_engine(senior, junior, tok, "hf"), tok, eos_token_ids(tok, senior))
    out = []
    for b, rows in rows_by_bench.items():
        t0 = time.perf_counter()
        # progress on the long measurement (minutes per benchmark on a CPU); shapes no output
        with tqdm(total=len(rows) * settings.n_samples, desc=f"gate {who} {mode} {b}", unit="gen",
                  disable=not ev.progress, file=sys.stderr, mininterval=10) as bar:
            recs = run_benchmark(decoder, rows, mode, settings, seed=stable_seed("gate", who, mode, b),
                                 score_fn=lambda t, g: score_many(t, g, timeout=ev.score_timeout, workers=1),
                                 progress=bar.update)
        for r in recs:
            r["benchmark"] = b
        out += recs
        print(f"gate: {who} {mode} {b}: {len(recs)} samples in {time.perf_counter() - t0:.0f}s", file=sys.stderr,
              flush=True)
    return out


def _summary(records: list[dict], dialect: str, style_of, keyed) -> dict:
    """One measurement's summary; `per_problem` keeps each problem's class counts (tandem.metrics.dialect.
    class_counts, keyed by benchmark and id) for the differences taken within problems."""
    from tandem.metrics.dialect import accuracy_by_style, annotated_anywhere, class_counts, class_gap

    styles, scores = [style_of(r["text"]) for r in records], [float(r["score"]) for r in records]
    n = len(scores)
    p = sum(scores) / n
    by_bench: dict[str, list[float]] = {}
    for r, s in zip(records, scores):
        by_bench.setdefault(r["benchmark"], []).append(s)
    return {"n": n, "pass@1": p, "se": (p * (1 - p) / n) ** 0.5,
            "pass@1_by_benchmark": {b: sum(v) / len(v) for b, v in by_bench.items()},
            "styles": accuracy_by_style(styles, scores), "dialect_vs_keyed": class_gap(styles, scores, dialect, keyed),
            "annotated_anywhere": sum(annotated_anywhere(r["text"]) for r in records) / n,
            "per_problem": class_counts([f"{r['benchmark']}/{r['id']}" for r in records], styles, scores, dialect,
                                        keyed),
            "senior_share": (sum(sum(r["owner"]) / len(r["owner"]) for r in records if r["owner"]) /
                             max(1, sum(1 for r in records if r["owner"])))}


# The gate's six measurements: name -> (senior, partner or None, problems: `benchmarks` or `validation`, mode,
# who). The self pairs use a second copy of S as the junior, as training does. Each measurement's draws are seeded
# by its own name (tandem.generation.stable_seed), so measuring them in any order or process gives the same samples.
GATE_MEASUREMENTS = {
    "S_solo": ("S", None, "benchmarks", "solo", "S"),
    "J_solo": ("J", None, "benchmarks", "solo", "J"),
    "SJ_step": ("S", "J", "benchmarks", "step", "SJ"),
    "SS_step": ("S", "S", "benchmarks", "step", "SS"),
    "SJ_word": ("S", "J", "validation", "word", "SJ"),
    "SS_word": ("S", "S", "validation", "word", "SS"),
}


def gate_measurement(params_file: Path, name: str) -> list[dict]:
    """The scored samples of one gate measurement (GATE_MEASUREMENTS) of the S and J `params_file` names, on one
    thread; each model loaded once per call."""
    import dataclasses

    from tandem.data.prompts import user_message
    from tandem.models import load_model, load_tokenizer
    from tandem.threads import torch_threads
    from tasks.evaluate import load_benchmarks

    params = load_params(params_file)
    root = Path(params.out_root)
    dirs = {"S": root / "models" / "base", "J": root / "models" / "junior"}
    senior, partner, problems, mode, who = GATE_MEASUREMENTS[name]
    if problems == "benchmarks":
        everything = dataclasses.replace(params, evaluate=dataclasses.replace(params.evaluate, max_problems=0))
        rows = load_benchmarks(everything, {"eval_data": root / "data" / "prepared" / "eval"})
    else:
        val = read_jsonl(root / "data" / "prepared" / "val.jsonl")
        rows = {"validation": [{**r, "prompt": r.get("prompt") or user_message(r["problem"]),
                                "answer": str(r["answer"])} for r in val]}
    mc = params.model
    tok = load_tokenizer(dirs["S"], mc.trust_remote_code)  # J shares it (the junior stage checked)
    with torch_threads(1):
        s_ = load_model(dirs[senior], mc.dtype, mc.trust_remote_code).eval()
        j_ = None if partner is None else load_model(dirs[partner], mc.dtype, mc.trust_remote_code).eval()
        return _pair_records(params, tok, s_, j_, rows, mode, who)


def gate_measures(params_file: Path, dialect: str, style_of, keyed, estimator: str = "pooled", jobs: int = 1) -> dict:
    """Every gate measurement of one dialect's S and J (solo, step and word), summarised; `dialect` is the style
    the classifier names. G3-G5 by the registered `estimator` (tandem.study.control.GateCriteria): `pooled`, or
    `paired_problems` (tandem.study.control.paired_gate_values, kept whole under `paired`). `jobs` > 1 measures
    that many side by side, one process and one thread each: the same samples as one after the other."""
    from tandem.evaluation import content_hash

    root = Path(load_params(params_file).out_root)
    names = list(GATE_MEASUREMENTS)
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(jobs, len(names)), mp_context=multiprocessing.get_context("spawn")) as pool:
            runs = dict(zip(names, pool.map(gate_measurement, [params_file] * len(names), names)))
    else:
        runs = {n: gate_measurement(params_file, n) for n in names}
    summ = {k: _summary(v, dialect, style_of, keyed) for k, v in runs.items()}
    return {**gate_values(summ, dialect, keyed, estimator), "measures": summ,
            "hashes": {"S": content_hash(root / "models" / "base"), "J": content_hash(root / "models" / "junior")},
            "junior_metrics": read_json(root / "metrics" / "junior.json")}


def gate_values(summ: dict, dialect: str, keyed, estimator: str = "pooled") -> dict:
    """`values` (what tandem.study.control.gate decides on) from the measurements' summaries, and for the paired
    estimator `paired` (every difference taken within problems, tandem.study.control.paired_gate_values)."""
    gap = {g: summ[k]["dialect_vs_keyed"]["gap"] for g, k in GAP_MEASUREMENT.items()}
    values = {"share": summ["S_solo"]["styles"].get(dialect, {}).get("share", 0.0),
              "solo_pass1_S": summ["S_solo"]["pass@1"], "solo_pass1_J": summ["J_solo"]["pass@1"],
              "cost_SJ": gap["G3"], "solo_gap_S": gap["G4"], "cost_SS": gap["G5"],
              "keyed_share": sum(v["share"] for k, v in summ["S_solo"]["styles"].items() if k in keyed)}
    if estimator != "paired_problems":
        return {"values": values}
    from tandem.study.control import paired_gate_values

    paired = paired_gate_values({k: summ[k]["per_problem"] for k in GAP_MEASUREMENT.values()})
    values.update({k: paired[k] for k in ("solo_gap_S", "cost_SJ", "cost_SS", "gap_SJ", "problems")})
    return {"values": values, "paired": paired}


def dialect_result_file(reg: R.ControlRegistration, dialect: str) -> Path:
    """`gate-dialects/<dialect>.json` beside gate.json: one dialect's gate measurement and decision, written as
    soon as it is measured (and small enough to commit then), so that a gate stopped later, on this machine or
    another, or another dialect measured in a process of its own, keeps it."""
    return gate_dir(reg) / "gate-dialects" / f"{dialect}.json"


def measure_dialect(reg: R.ControlRegistration, d: R.Dialect, crit, jobs: int = 1) -> dict:
    """One dialect's gate result: kept from its result file when there is one, else S and J built and measured
    (`gate_measures`, `jobs` measurements side by side) and the result file written."""
    kept = dialect_result_file(reg, d.name)
    if kept.exists():
        return read_json(kept)
    f = dialect_params(reg, d)
    build_models(f, work_root(reg, d.name) / "logs")
    res = _measured(reg, d, crit, f, jobs)
    write_json(kept, res)
    return res


def _measured(reg: R.ControlRegistration, d: R.Dialect, crit, f: Path, jobs: int = 1) -> dict:
    """One dialect's gate result from the S and J its params file `f` names, as built (`jobs` measurements side
    by side)."""
    from tandem.study.control import gate as decide

    m = gate_measures(f, d.style, classifier(reg.classifier), reg.keyed_styles, crit.estimator, jobs)
    return {"dialect": d.name, **({"style": d.style} if d.style != d.name else {}),
            "senior_styles": dict(d.senior_styles), **decide(m["values"], crit), **m, "params": rel(f)}


def _gate_registration(out: Path) -> tuple[R.ControlRegistration, GateCriteria]:
    """The registration of a control whose gate is its own, and its gate criteria."""
    reg = registration(out)
    if reg.gate_from is not None:
        raise BadInputError(f"control: {out} is a later setting that trains from the gate of "
                            f"{rel(reg.gate_from.dir)}; it has no gate of its own")
    return reg, GateCriteria.from_dict(reg.gate.criteria)


def measure_dialects(out: Path, names: list[str], jobs: int = 1) -> list[dict]:
    """The named registered dialects alone, each measured into its result file (`dialect_result_file`; several
    can run side by side, one process each) or read from it: no decision, neither gate.json nor gate.md; a
    later `gate` reads these results and decides in the registered order."""
    reg, crit = _gate_registration(out)
    registered = [d.name for d in reg.dialects]
    unknown = sorted(set(names) - set(registered))
    if unknown:
        raise BadInputError(f"control: dialect(s) {', '.join(unknown)} are not registered (registered: "
                            f"{', '.join(registered)})")
    return [measure_dialect(reg, d, crit, jobs) for d in reg.dialects if d.name in names]


def write_gate(folder: Path, doc: dict) -> None:
    """A gate's record: `gate.json` and the page rendered from it, `gate.md`, in `folder`."""
    write_json(folder / "gate.json", doc)
    with atomic_path(folder / "gate.md") as tmp:
        Path(tmp).write_text(gate_markdown(doc))


def gate(out: Path = CONTROL_DIR, jobs: int = 1) -> dict:
    """The registered gate: dialects in order until one passes (each measured, or read from its result file or
    gate.json); writes gate.json and gate.md."""
    reg, crit = _gate_registration(out)
    done = {}
    if (Path(out) / "gate.json").exists():
        done = {d["dialect"]: d for d in read_json(Path(out) / "gate.json")["dialects"]}
    results, chosen = [], None
    for d in reg.dialects:
        name = d.name
        res = done[name] if name in done else measure_dialect(reg, d, crit, jobs)
        results.append(res)
        if res["passed"]:
            chosen = name
            keep_models(reg, name)
            break
    doc = {"registration": rel(Path(out) / "registration.yaml"), "passed": chosen is not None,
           "dialect": chosen, "dialects": results, **({"setting": reg.setting} if reg.setting else {})}
    write_gate(Path(out), doc)
    return doc


def gate_rebuild(out: Path, jobs: int = 1) -> dict:
    """The gate measured again on a rebuild (a registered `rebuild` amendment): the S and J the stages build in the
    taken dialect's work root on this machine, measured as the registered gate measures them (that dialect only,
    the registered criteria and estimator), written to `rebuilds/<S>-<J>/gate.json` and `gate.md` (read back when
    they exist: a rebuild on a machine whose kernels give the same bits is that earlier build). The gated build
    itself is refused: its gate is gate.json. `jobs`: measurements side by side (the same samples)."""
    reg, crit = _gate_registration(out)
    am = rebuild_amendment(reg)
    if am is None:
        raise BadInputError(f"control: {rel(Path(out))} registers no rebuild amendment (amendments.yaml): its runs "
                            "train from the gated S and J only")
    dialect = chosen_dialect(reg)
    d = reg.dialect(dialect)
    root, got = built(reg, dialect)
    gated = gated_hashes(reg, dialect)
    if got == gated:
        raise BadInputError(f"control: {rel(root / 'models')} holds the gated build itself: gate.json is its gate")
    dest = rebuild_dir(reg, got)
    if (dest / "gate.json").exists():
        return read_json(dest / "gate.json")
    res = _measured(reg, d, crit, dialect_params(reg, d), jobs)
    doc = {"registration": rel(reg.path), "amendment": am.id, "rebuild_of": gated, "build": got,
           "passed": res["passed"], "dialect": dialect if res["passed"] else None, "dialects": [res],
           **({"setting": reg.setting} if reg.setting else {})}
    write_gate(dest, doc)
    return doc


# --------------------------------------------------------------------------------------------------
# The seed x arm runs
# --------------------------------------------------------------------------------------------------

def chosen_dialect(reg: R.ControlRegistration) -> str:
    """The dialect the committed gate chose (a later setting's: its gate's); refuses to run without a passed gate."""
    f = gate_dir(reg) / "gate.json"
    if not f.exists():
        raise BadInputError(f"control: {f} does not exist: run `tandem study gate` (and commit its result) first")
    g = read_json(f)
    if not g["passed"]:
        raise BadInputError("control: no dialect passed the gate; the gate's numbers are the result, nothing trains")
    return g["dialect"]


def run_root(out: Path, seed: int, arm: str) -> Path:
    return (Path(out) / "runs" / f"seed-{seed}" / arm).resolve()


def result_file(out: Path, seed: int, arm: str) -> Path:
    return Path(out) / "results" / f"seed-{seed}" / f"{arm}.json"


SEED_CACHES = {"evaluate": "eval-cache", "analyze": "analyze-cache"}  # stage -> the seed's shared cache


def seed_cache(out: Path, seed: int, stage: str) -> Path:
    """The cache of stage `stage` that one seed's arms share (each run's `scratch/<stage>` links to it)."""
    return (Path(out) / "runs" / f"seed-{seed}" / SEED_CACHES[stage]).resolve()


def share_dir(link: Path, shared: Path) -> None:
    """Make `link` a link to the directory `shared`. A `link` that is a directory of its own (a run begun before
    its cache was shared) moves its entries there first: an entry `shared` already holds is the same result
    under the same key and is dropped, and each `<key>.json`, which marks an entry complete, moves after the
    records beside it, so a sibling reading `shared` meanwhile never sees half an entry."""
    shared.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        return
    if link.is_dir():
        for f in sorted(link.iterdir(), key=lambda f: (f.suffix == ".json", f.name)):
            if (shared / f.name).exists():
                f.unlink()
            else:
                os.replace(f, shared / f.name)
        link.rmdir()
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(shared, target_is_directory=True)


def keep_build(f: Path, build: dict[str, str]) -> None:
    """Record the build a run trains from (`build.json` in its root) when it begins; refuse to go on with another
    one (a run resumed on a machine whose rebuild differs would mix two builds in one run)."""
    if f.exists():
        began = read_json(f)
        if (began["S"], began["J"]) != (build["S"], build["J"]):
            raise BadInputError(f"control: {rel(f.parent)} began on S {began['S'][:16]} and J {began['J'][:16]}, and "
                                f"the work root now holds S {build['S'][:16]} and J {build['J'][:16]}: remove "
                                f"{rel(f.parent)} to start that run over on this build")
        return
    write_json(f, build)


def prepare_run(reg: R.ControlRegistration, dialect: str, seed: int, arm: str) -> Path:
    """`runs/seed-<S>/<arm>/params.yaml`: the dialect's gate file with this seed, this root, the arm's pipeline
    arm and its partner (J: the dialect's junior; S: `junior.source: base`), and links to the dialect's prepared
    data, S, (partner J) J and the seed's evaluation and analysis caches."""
    spec = reg.arms[arm]
    src_root, build = ensure_inputs(reg, dialect)
    root = run_root(reg.dir, seed, arm)
    keep_build(root / "build.json", build)
    links = ["data/prepared", "models/base"] + (["models/junior"] if spec.partner == "J" else [])
    for rel in links:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(src_root / rel, target_is_directory=True)
    for stage_name in SEED_CACHES:
        share_dir(root / "scratch" / stage_name, seed_cache(reg.dir, seed, stage_name))
    raw = yaml.safe_load((src_root / "params.yaml").read_text())
    return write_params(root / "params.yaml", derive(raw, *run_changes(reg, seed, arm, str(root))))


def run_one(reg: R.ControlRegistration, dialect: str, seed: int, arm: str) -> Path:
    """Train, evaluate and analyse one seed x arm (each stage resumable), then write its result file."""
    f = prepare_run(reg, dialect, seed, arm)
    root, spec = f.parent, reg.arms[arm]
    log = root / "logs" / "stages.log"
    if spec.partner == "S" and not (root / "models" / "junior").exists():
        stage(f, "junior", log)
    stage(f, "train", log, arm=spec.train)
    stage(f, "evaluate", log)
    stage(f, "analyze", log)
    doc = collect_result(reg, dialect, seed, arm, root)
    dest = result_file(reg.dir, seed, arm)
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_json(dest, doc)
    return dest


def _problems(records: list[dict], dialect: str, style_of) -> dict[str, list[int]]:
    """Problem id -> [samples, correct, in the dialect] (the per-problem counts a result file keeps), and for the
    `annotated` dialect a fourth: samples with an annotation on any line (tandem.metrics.dialect.annotated_anywhere,
    the secondary row S7)."""
    from tandem.metrics.dialect import annotated_anywhere

    anywhere = dialect == "annotated"
    out: dict[str, list[int]] = {}
    for r in records:
        c = out.setdefault(str(r["id"]), [0, 0, 0, 0] if anywhere else [0, 0, 0])
        c[0] += 1
        c[1] += int(float(r["score"]) > 0)
        c[2] += int(style_of(r["text"]) == dialect)
        if anywhere:
            c[3] += int(annotated_anywhere(r["text"]))
    return out


def collect_result(reg: R.ControlRegistration, dialect: str, seed: int, arm: str, root: Path) -> dict:
    """The small result of one seed x arm: per checkpoint and mode the per-problem counts (samples, correct, in
    the dialect), per checkpoint the per-problem analysis means, the per-step training series, and every hash
    the bug indicator B2 compares (`junior_gate`: the partner's hash as its build's gate measured it); a run on a
    rebuild (amendment `rebuild`) also names its build (`build`: S and J hashes and the gate that passed them)."""
    import csv

    from tandem.checkpoints import generations_file
    from tasks.common import read_metrics

    spec = reg.arms[arm]
    tarm = spec.train
    style_of = classifier(reg.classifier)
    style = reg.gated.dialect(dialect).style  # what the classifier names the dialect (its name unless registered)
    ev = read_json(root / "metrics" / "eval.json")
    an = read_json(root / "metrics" / "analysis.json")
    summ = read_metrics(root / "metrics" / f"train_{tarm}.json")
    gens = root / "results" / "generations"
    ckpts = {}
    for c in ev["arms"][tarm]["checkpoints"]:
        ckpts[str(c["step"])] = {m: {b: _problems(read_jsonl(generations_file(gens, tarm, c["step"], m, b)), style, style_of)
                                     for b in ev["settings"]["benchmarks"]}
                                 for m in ev["settings"]["modes"]}
    per_problem: dict[str, dict] = {}
    with open(root / "metrics" / "plots" / "analysis" / "per_problem.csv", newline="") as fh:
        for r in csv.DictReader(fh):
            if r["arm"] != tarm:
                continue
            vals = {k: (float(r[k]) if r.get(k) not in (None, "") else None)
                    for k in ("junior_ce", "overlap", "kl_mean", "kl_junior_mean") if k in r}
            per_problem.setdefault(r["step"], {}).setdefault(r["benchmark"], {})[r["id"]] = vals
    build = read_json(root / "build.json")  # the build it trained from: the gated one, or a gated rebuild
    last = sorted((root / "models" / "checkpoints" / tarm).glob("step-*"), key=lambda p: int(p.name[5:]))[-1]
    history = read_json(last / "trainer_state.json")["log_history"]
    series: dict[str, dict] = {}
    for h in history:
        if "loss" in h and "tandem/step" in h:
            series[str(int(h["tandem/step"]))] = {"reward": h.get("reward"),
                                                  "senior_fraction": h.get("tandem/senior_fraction"),
                                                  "dialect_share_rollout": h.get(f"style/{style}")}
    return {
        "seed": seed, "arm": arm, "train_arm": tarm, "partner": spec.partner, "dialect": dialect,
        "steps": summ.get("steps"),
        **({"build": build} if build["gate"] != rel(gate_dir(reg) / "gate.json") else {}),
        "hashes": {"junior_gate": build[spec.partner],
                   "junior_train": (summ.get("junior") or {}).get("hash"), "junior_eval": ev["junior"]["hash"],
                   "junior_analysis": (an.get("junior") or {}).get("hash", ev["junior"]["hash"]),
                   "junior_weights_before": summ.get("junior_hash_before"),
                   "junior_weights_after": summ.get("junior_hash_after")},
        "junior_unchanged": summ.get("junior_unchanged"),
        "senior_fraction": summ.get("senior_fraction"),
        "evaluation": {"settings": {k: ev["settings"][k] for k in ("n_samples", "modes", "temperature", "top_p",
                                                                  "top_k", "max_new_tokens")},
                       "junior_floor": ev["junior"]["modes"]["solo"]["macro"],
                       "checkpoints": ckpts},
        "analysis": per_problem,
        "training": series,
    }


def status(out: Path = CONTROL_DIR) -> list[dict]:
    """Where each registered seed x arm stands (tasks.study.runs.unit_state), `result written` once its result is."""
    from tasks.study.runs import unit_state

    reg = registration(out)
    rows = []
    for seed in reg.seeds:
        for arm, spec in reg.arms.items():
            row = unit_state(run_root(out, seed, arm), spec.train, reg.steps)
            if result_file(out, seed, arm).exists():
                row.update(state="result written", step=reg.steps)
            rows.append({"unit": f"seed {seed}", **row, "arm": arm})
    return rows


def _git_commit(paths: list[Path], message: str, log) -> None:
    import subprocess

    try:
        subprocess.run(["git", "add", "--", *map(str, paths)], cwd=CODE_ROOT, check=True, capture_output=True)
        subprocess.run(["git", "commit", "-q", "-m", message, "--", *map(str, paths)], cwd=CODE_ROOT, check=True,
                       capture_output=True)
        log(f"committed {', '.join(str(p) for p in paths)}")
    except subprocess.CalledProcessError as e:  # the result stays on disk; a later commit picks it up
        log(f"could not commit {paths}: {(e.stderr or b'').decode(errors='replace').strip()[:300]}")


def run(out: Path = CONTROL_DIR, seeds: list[int] | None = None, arms: list[str] | None = None, jobs: int = 2,
        commit: bool = False, log=print) -> list[Path]:
    """Every (seed, arm) without a result, seeds in registered order, `jobs` side by side."""
    from concurrent.futures import ThreadPoolExecutor

    reg = registration(out)
    dialect = chosen_dialect(reg)
    seeds = list(reg.seeds) if seeds is None else seeds
    arms = list(reg.arms) if arms is None else arms
    unknown = [a for a in arms if a not in reg.arms]
    if unknown:
        raise BadInputError(f"control: unknown arm(s) {unknown}; registered: {list(reg.arms)}")
    todo = [(s, a) for s in seeds for a in arms if not result_file(out, s, a).exists()]
    done: list[Path] = []

    def one(sa):
        s, a = sa
        t0 = time.perf_counter()
        log(f"seed {s} {a}: started")
        dest = run_one(reg, dialect, s, a)
        log(f"seed {s} {a}: result written in {time.perf_counter() - t0:.0f}s -> {dest}")
        if commit:
            setting = f" setting {reg.setting}" if reg.setting else ""
            _git_commit([dest], f"Junior control{setting}: result of seed {s}, arm {a} (registered run, {reg.steps} "
                                f"steps; per-problem counts, analysis means and training series)", log)
        return dest

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for dest in pool.map(one, todo):
            done.append(dest)
    return done


