"""The registered junior positive control (studies/junior-control/): the gate, the seed x arm runs, the claims.

`tandem control` runs it; this module imports no Prefect (like flows/multiseed.py and flows/pilot.py, whose
stage runner it uses). Every number comes from the project's own stages and library:

- `gate`: for each registered dialect in order, build the senior's base S (the base stage, with the dialect's
  styles) and the naive junior J (the junior stage) under `work/<dialect>/`, then measure on the base models only,
  at the registered evaluation decoding: S's and J's solo samples, the step schedule of (S, J) and of (S, S) on
  every benchmark problem, and the word schedule of both pairs on the validation problems. `tandem.control.gate`
  decides; `gate.json` and `gate.md` are written and the first dialect that passes is chosen.
- `run`: every registered seed x arm without a result: a complete params file per run under
  `runs/seed-<S>/<arm>/` (links to the chosen dialect's data, S and J), then the train, evaluate and analyze stages
  (each resumable: training continues from its last checkpoint, evaluation from its cache), then
  `results/seed-<S>/<arm>.json`, the run's small per-problem results, which is what gets committed.
- `claims`: `claims.json` and the report from the committed results alone.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

from tandem.errors import BadInputError
from flows import multiseed as st
from tasks.common import atomic_path, load_params, read_json, read_jsonl, write_json

CODE_ROOT = st.CODE_ROOT
CONTROL_DIR = CODE_ROOT / "studies" / "junior-control"


# --------------------------------------------------------------------------------------------------
# Registration and the per-dialect params
# --------------------------------------------------------------------------------------------------

def registration(out: Path = CONTROL_DIR) -> dict:
    """The committed registration (registration.yaml), with `_dir` set to its folder."""
    f = Path(out) / "registration.yaml"
    if not f.exists():
        raise BadInputError(f"control: {f} does not exist (the control runs only from a committed registration)")
    reg = yaml.safe_load(f.read_text())
    if reg.get("kind") != "junior-control":
        raise BadInputError(f"control: {f} is not a junior-control registration (kind: {reg.get('kind')!r})")
    reg["_dir"] = Path(out)
    if reg.get("gate_from"):  # a later setting: it trains from an earlier setting's gated S and J
        parent = CODE_ROOT / reg["gate_from"]
        if parent.resolve() == Path(out).resolve():
            raise BadInputError(f"control: {f}: gate_from names this very folder")
        reg["_gate"] = registration(parent)
    return reg


def gate_registration(reg: dict) -> dict:
    """The registration whose gate (gate.json, the gated S and J, the dialect's work root) this one uses: its
    own, or for a later setting (`gate_from`) the earlier setting's."""
    return reg.get("_gate") or reg


def gate_dir(reg: dict) -> Path:
    return Path(gate_registration(reg)["_dir"])


def _rel(p: Path) -> str:
    """`p` relative to the project root when it lies inside it (what a committed file names), else as is."""
    try:
        return str(Path(p).resolve().relative_to(CODE_ROOT))
    except ValueError:
        return str(p)


def work_root(reg: dict, dialect: str) -> Path:
    return (gate_dir(reg) / "work" / dialect).resolve()


def dialect_params(reg: dict, dialect: dict) -> Path:
    """`work/<dialect>/params.yaml`: the registered params file with the dialect's senior styles, the junior's
    registered styles and seed, and this root (written once; the file is the record of what the gate built)."""
    root = work_root(reg, dialect["name"])
    f = root / "params.yaml"
    raw = yaml.safe_load((CODE_ROOT / reg["params"]).read_text())
    raw["out_root"] = str(root)
    raw["seed"] = int(reg["senior"]["seed"])
    raw["data"]["solution_styles"] = dict(dialect["senior_styles"])
    raw["junior"].update(source="tiny", seed=int(reg["junior"]["seed"]),
                         solution_styles=dict(reg["junior"]["solution_styles"]))
    text = yaml.safe_dump(raw, sort_keys=False)
    if not f.exists() or f.read_text() != text:
        root.mkdir(parents=True, exist_ok=True)
        with atomic_path(f) as tmp:
            Path(tmp).write_text(text)
    load_params(f)  # a complete, valid file before anything runs
    return f


def build_models(params_file: Path, log_dir: Path) -> None:
    """The prepare, base and junior stages for one dialect's root, each only when its output is missing."""
    p = load_params(params_file)
    root = Path(p.out_root)
    for name, out in (("prepare", root / "data" / "prepared"), ("base", root / "models" / "base"),
                      ("junior", root / "models" / "junior")):
        if not out.exists():
            st._stage(params_file, name, log_dir / f"{name}.log")


def models_dir(reg: dict, dialect: str) -> Path:
    """`models/<dialect>/{S,J}`: the committed copies of the gated S and J (small), so that every seed x arm,
    on any machine, trains from the very weights the gate measured (a rebuild on other CPU kernels may differ)."""
    return (gate_dir(reg) / "models" / dialect).resolve()


def keep_models(reg: dict, dialect: str) -> Path:
    """Copy the dialect's S (models/base) and J (models/junior) into `models_dir` (once; checked equal after)."""
    import shutil

    from tandem.evaluation import content_hash

    src, dest = work_root(reg, dialect) / "models", models_dir(reg, dialect)
    for name, rel in (("S", "base"), ("J", "junior")):
        if not (dest / name).exists():
            with atomic_path(dest / name) as tmp:
                shutil.copytree(src / rel, tmp)
        if content_hash(dest / name) != content_hash(src / rel):
            raise BadInputError(f"control: {dest / name} differs from {src / rel}: remove it and rerun the gate")
    return dest


def ensure_inputs(reg: dict, dialect: str) -> Path:
    """The dialect's work root with its prepared data (rebuilt by the prepare stage when missing: it is
    deterministic) and its models linked to the committed S and J (a later setting's: its gate's)."""
    reg = gate_registration(reg)
    d = next(x for x in reg["dialects"] if x["name"] == dialect)
    f = dialect_params(reg, d)
    root = work_root(reg, dialect)
    keep = models_dir(reg, dialect)
    for name, rel in (("S", "base"), ("J", "junior")):
        dst = root / "models" / rel
        if not dst.exists() and (keep / name).exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(keep / name, target_is_directory=True)
    build_models(f, root / "logs")
    return root


# --------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------

def _pair_records(params, tok, senior, junior, rows_by_bench: dict, mode: str, who: str) -> list[dict]:
    """Scored samples of the loaded `senior` (with `junior` as partner outside solo) at the registered decoding."""
    from tandem.evaluation import Decoder, run_benchmark
    from tandem.generation import eos_token_ids, stable_seed
    from tandem.rewards import score_many
    from tandem.rollout.factory import make_engine
    from tasks.evaluate import settings_of

    ev = params.evaluate
    decoder = Decoder(make_engine(senior, junior, tok, "hf"), tok, eos_token_ids(tok, senior))
    out = []
    for b, rows in rows_by_bench.items():
        t0 = time.perf_counter()
        recs = run_benchmark(decoder, rows, mode, settings_of(params), seed=stable_seed("gate", who, mode, b),
                             score_fn=lambda t, g: score_many(t, g, timeout=ev.score_timeout, workers=1))
        for r in recs:
            r["benchmark"] = b
        out += recs
        print(f"gate: {who} {mode} {b}: {len(recs)} samples in {time.perf_counter() - t0:.0f}s", file=sys.stderr,
              flush=True)
    return out


def _summary(records: list[dict], dialect: str) -> dict:
    from tandem.metrics.dialect import accuracy_by_style, class_gap, styles_of

    styles, scores = styles_of(r["text"] for r in records), [float(r["score"]) for r in records]
    n = len(scores)
    p = sum(scores) / n
    by_bench: dict[str, list[float]] = {}
    for r, s in zip(records, scores):
        by_bench.setdefault(r["benchmark"], []).append(s)
    return {"n": n, "pass@1": p, "se": (p * (1 - p) / n) ** 0.5,
            "pass@1_by_benchmark": {b: sum(v) / len(v) for b, v in by_bench.items()},
            "styles": accuracy_by_style(styles, scores), "dialect_vs_keyed": class_gap(styles, scores, dialect),
            "senior_share": (sum(sum(r["owner"]) / len(r["owner"]) for r in records if r["owner"]) /
                             max(1, sum(1 for r in records if r["owner"])))}


def gate_measures(params_file: Path, dialect: str) -> dict:
    """Every gate measurement of one dialect's S and J (solo, step and word), summarised."""
    from tandem.evaluation import content_hash
    from tandem.threads import torch_threads
    from tasks.evaluate import load_benchmarks

    params = load_params(params_file)
    root = Path(params.out_root)
    S, J = root / "models" / "base", root / "models" / "junior"
    import dataclasses

    everything = dataclasses.replace(params, evaluate=dataclasses.replace(params.evaluate, max_problems=0))
    benches = load_benchmarks(everything, {"eval_data": root / "data" / "prepared" / "eval"})
    from tandem.data.prompts import user_message

    val = {"validation": [{**r, "prompt": r.get("prompt") or user_message(r["problem"]), "answer": str(r["answer"])}
                          for r in read_jsonl(root / "data" / "prepared" / "val.jsonl")]}
    from tandem.models import load_model, load_tokenizer

    mc = params.model
    tok = load_tokenizer(S, mc.trust_remote_code)  # J shares it (the junior stage checked)
    with torch_threads(1):
        # each model loaded once; the self pairs use a second copy of S as the junior, as training does
        s_, s2, j_ = (load_model(d, mc.dtype, mc.trust_remote_code).eval() for d in (S, S, J))
        runs = {
            "S_solo": _pair_records(params, tok, s_, None, benches, "solo", "S"),
            "J_solo": _pair_records(params, tok, j_, None, benches, "solo", "J"),
            "SJ_step": _pair_records(params, tok, s_, j_, benches, "step", "SJ"),
            "SS_step": _pair_records(params, tok, s_, s2, benches, "step", "SS"),
            "SJ_word": _pair_records(params, tok, s_, j_, val, "word", "SJ"),
            "SS_word": _pair_records(params, tok, s_, s2, val, "word", "SS"),
        }
    summ = {k: _summary(v, dialect) for k, v in runs.items()}
    values = {"share": summ["S_solo"]["styles"].get(dialect, {}).get("share", 0.0),
              "solo_pass1_S": summ["S_solo"]["pass@1"], "solo_pass1_J": summ["J_solo"]["pass@1"],
              "cost_SJ": summ["SJ_step"]["dialect_vs_keyed"]["gap"],
              "solo_gap_S": summ["S_solo"]["dialect_vs_keyed"]["gap"],
              "cost_SS": summ["SS_step"]["dialect_vs_keyed"]["gap"]}
    return {"values": values, "measures": summ, "hashes": {"S": content_hash(S), "J": content_hash(J)},
            "junior_metrics": read_json(root / "metrics" / "junior.json")}


def gate(out: Path = CONTROL_DIR) -> dict:
    """The registered gate: dialects in order until one passes; writes gate.json and gate.md."""
    from tandem.control import GateCriteria, gate as decide

    reg = registration(out)
    if reg.get("gate_from"):
        raise BadInputError(f"control: {out} is a later setting that trains from the gate of {reg['gate_from']}; "
                            f"it has no gate of its own")
    crit = GateCriteria.from_dict(reg["gate"]["criteria"])
    done = {}
    if (Path(out) / "gate.json").exists():
        done = {d["dialect"]: d for d in read_json(Path(out) / "gate.json")["dialects"]}
    results, chosen = [], None
    for d in reg["dialects"]:
        name = d["name"]
        if name in done:
            res = done[name]
        else:
            f = dialect_params(reg, d)
            build_models(f, work_root(reg, name) / "logs")
            m = gate_measures(f, name)
            res = {"dialect": name, "senior_styles": d["senior_styles"], **decide(m["values"], crit), **m,
                   "params": _rel(f)}
        results.append(res)
        if res["passed"]:
            chosen = name
            keep_models(reg, name)
            break
    doc = {"registration": _rel(Path(out) / "registration.yaml"), "passed": chosen is not None,
           "dialect": chosen, "dialects": results}
    write_json(Path(out) / "gate.json", doc)
    with atomic_path(Path(out) / "gate.md") as tmp:
        Path(tmp).write_text(gate_markdown(doc))
    return doc


def _f(x, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:+.{digits}f}" if isinstance(x, float) and x < 0 else (
        f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def gate_markdown(doc: dict) -> str:
    lines = ["# The gate of the junior positive control", "",
             "Base models only, no RL (studies/junior-control/registration.md). Written by `tandem control gate` "
             "from `gate.json`.", ""]
    lines.append(f"**Result: {'passed, dialect ' + repr(doc['dialect']) if doc['passed'] else 'no dialect passed'}.**")
    for d in doc["dialects"]:
        m, c = d["measures"], d["criteria"]
        lines += ["", f"## Dialect `{d['dialect']}`: {'passed' if d['passed'] else 'failed'}", "",
                  "| id | value | rule | passed |", "|---|---|---|---|"]
        for g, row in c.items():
            v = row["value"]
            v = ", ".join(f"{k} {_f(x)}" for k, x in v.items()) if isinstance(v, dict) else _f(v)
            lines.append(f"| {g} | {v} | {row['rule']} | {'' if row['passed'] is None else 'yes' if row['passed'] else 'no'} |")
        lines += ["", "| measurement | samples | pass@1 | dialect share | dialect-first pass@1 (n) | keyed-first pass@1 (n) |",
                  "|---|---|---|---|---|---|"]
        for k, s in m.items():
            g = s["dialect_vs_keyed"]
            share = s["styles"].get(d["dialect"], {}).get("share", 0.0)
            lines.append(f"| {k} | {s['n']} | {_f(s['pass@1'])} | {_f(share)} | {_f(g['dialect'])} ({g['n_dialect']}) "
                         f"| {_f(g['keyed'])} ({g['n_keyed']}) |")
        lines += ["", f"Hashes: S `{d['hashes']['S'][:16]}`, J `{d['hashes']['J'][:16]}`. "
                      f"J's styles: " + ", ".join(f"{k} {_f(v['share'])} (accuracy {_f(v['accuracy'])})"
                                                 for k, v in (d["junior_metrics"].get("styles") or {}).items()) + "."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# The seed x arm runs
# --------------------------------------------------------------------------------------------------

def chosen_dialect(reg: dict) -> str:
    """The dialect the committed gate chose (a later setting's: its gate's); refuses to run without a passed gate."""
    f = gate_dir(reg) / "gate.json"
    if not f.exists():
        raise BadInputError(f"control: {f} does not exist: run `tandem control gate` (and commit its result) first")
    g = read_json(f)
    if not g["passed"]:
        raise BadInputError("control: no dialect passed the gate; the gate's numbers are the result, nothing trains")
    return g["dialect"]


def run_root(out: Path, seed: int, arm: str) -> Path:
    return (Path(out) / "runs" / f"seed-{seed}" / arm).resolve()


def result_file(out: Path, seed: int, arm: str) -> Path:
    return Path(out) / "results" / f"seed-{seed}" / f"{arm}.json"


def prepare_run(reg: dict, dialect: str, seed: int, arm: str) -> Path:
    """`runs/seed-<S>/<arm>/params.yaml`: the dialect's gate file with this seed, this root, the arm's pipeline
    arm and its partner (J: the dialect's junior; S: `junior.source: base`), and links to the dialect's prepared
    data, S and (partner J) J."""
    spec = reg["arms"][arm]
    src_root = ensure_inputs(reg, dialect)
    raw = yaml.safe_load((src_root / "params.yaml").read_text())
    root = run_root(reg["_dir"], seed, arm)
    raw.update(seed=seed, out_root=str(root))
    for section, values in (reg.get("params_overrides") or {}).items():  # a later setting's registered changes
        raw[section].update(values)
    raw["train"]["arms"] = [spec["train"]]
    raw["analyze"]["reference_arm"] = spec["train"]
    if spec["partner"] == "S":
        raw["junior"]["source"] = "base"
    links = ["data/prepared", "models/base"] + (["models/junior"] if spec["partner"] == "J" else [])
    for rel in links:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(src_root / rel, target_is_directory=True)
    f = root / "params.yaml"
    text = yaml.safe_dump(raw, sort_keys=False)
    if not f.exists() or f.read_text() != text:
        with atomic_path(f) as tmp:
            Path(tmp).write_text(text)
    load_params(f)
    return f


def run_one(reg: dict, dialect: str, seed: int, arm: str) -> Path:
    """Train, evaluate and analyse one seed x arm (each stage resumable), then write its result file."""
    f = prepare_run(reg, dialect, seed, arm)
    root, spec = f.parent, reg["arms"][arm]
    log = root / "logs" / "stages.log"
    if spec["partner"] == "S" and not (root / "models" / "junior").exists():
        st._stage(f, "junior", log)
    st._stage(f, "train", log, arm=spec["train"])
    st._stage(f, "evaluate", log)
    st._stage(f, "analyze", log)
    doc = collect_result(reg, dialect, seed, arm, root)
    dest = result_file(reg["_dir"], seed, arm)
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_json(dest, doc)
    return dest


def _problems(records: list[dict], dialect: str) -> dict[str, list[int]]:
    """Problem id -> [samples, correct, in the dialect] (the per-problem counts a result file keeps)."""
    from tandem.data.synthetic import solution_style

    out: dict[str, list[int]] = {}
    for r in records:
        c = out.setdefault(str(r["id"]), [0, 0, 0])
        c[0] += 1
        c[1] += int(float(r["score"]) > 0)
        c[2] += int(solution_style(r["text"]) == dialect)
    return out


def collect_result(reg: dict, dialect: str, seed: int, arm: str, root: Path) -> dict:
    """The small result of one seed x arm: per checkpoint and mode the per-problem counts (samples, correct, in
    the dialect), per checkpoint the per-problem analysis means, the per-step training series, and every hash
    the bug indicator B2 compares."""
    import csv

    from tandem.checkpoints import generations_file
    from tasks.common import read_metrics

    spec = reg["arms"][arm]
    tarm = spec["train"]
    ev = read_json(root / "metrics" / "eval.json")
    an = read_json(root / "metrics" / "analysis.json")
    summ = read_metrics(root / "metrics" / f"train_{tarm}.json")
    gens = root / "results" / "generations"
    ckpts = {}
    for c in ev["arms"][tarm]["checkpoints"]:
        ckpts[str(c["step"])] = {m: {b: _problems(read_jsonl(generations_file(gens, tarm, c["step"], m, b)), dialect)
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
    last = sorted((root / "models" / "checkpoints" / tarm).glob("step-*"), key=lambda p: int(p.name[5:]))[-1]
    history = read_json(last / "trainer_state.json")["log_history"]
    series: dict[str, dict] = {}
    for h in history:
        if "loss" in h and "tandem/step" in h:
            series[str(int(h["tandem/step"]))] = {"reward": h.get("reward"),
                                                  "senior_fraction": h.get("tandem/senior_fraction"),
                                                  "dialect_share_rollout": h.get(f"style/{dialect}")}
    return {
        "seed": seed, "arm": arm, "train_arm": tarm, "partner": spec["partner"], "dialect": dialect,
        "steps": summ.get("steps"),
        "hashes": {"junior_gate": read_json(gate_dir(reg) / "gate.json")["dialects"][-1]["hashes"][spec["partner"]],
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
    reg = registration(out)
    rows = []
    for seed in reg["seeds"]:
        for arm, spec in reg["arms"].items():
            if result_file(out, seed, arm).exists():
                state = "result written"
            else:
                ck = run_root(out, seed, arm) / "scratch" / "train" / spec["train"]
                steps = sorted(int(p.name[5:]) for p in ck.glob("step-*") if p.name[5:].isdigit()) if ck.exists() else []
                state = f"training, last checkpoint step {steps[-1]}" if steps else "not started"
            rows.append({"seed": seed, "arm": arm, "state": state})
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
    seeds = list(reg["seeds"]) if seeds is None else seeds
    arms = list(reg["arms"]) if arms is None else arms
    unknown = [a for a in arms if a not in reg["arms"]]
    if unknown:
        raise BadInputError(f"control: unknown arm(s) {unknown}; registered: {list(reg['arms'])}")
    todo = [(s, a) for s in seeds for a in arms if not result_file(out, s, a).exists()]
    done: list[Path] = []

    def one(sa):
        s, a = sa
        t0 = time.perf_counter()
        log(f"seed {s} {a}: started")
        dest = run_one(reg, dialect, s, a)
        log(f"seed {s} {a}: result written in {time.perf_counter() - t0:.0f}s -> {dest}")
        if commit:
            setting = f" setting {reg['setting']}" if reg.get("setting") else ""
            _git_commit([dest], f"Junior control{setting}: result of seed {s}, arm {a} (registered run, {reg['steps']} "
                                f"steps; per-problem counts, analysis means and training series)", log)
        return dest

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for dest in pool.map(one, todo):
            done.append(dest)
    return done


# --------------------------------------------------------------------------------------------------
# Claims, from the committed results alone
# --------------------------------------------------------------------------------------------------

def load_results(out: Path) -> dict[int, dict[str, dict]]:
    """seed -> arm -> result document (every results/seed-<S>/<arm>.json)."""
    got: dict[int, dict[str, dict]] = {}
    for f in sorted((Path(out) / "results").glob("seed-*/*.json")):
        d = read_json(f)
        got.setdefault(int(d["seed"]), {})[d["arm"]] = d
    return got


def complete_seeds(reg: dict, results: dict) -> list[int]:
    """Registered seeds whose every arm has a result, in registered order."""
    return [s for s in reg["seeds"] if all(a in results.get(s, {}) for a in reg["arms"])]


def _value(doc: dict, metric: str, step: str, bench: str, pid: str) -> float:
    """One problem's value of `metric` at checkpoint `step` in one result document (NaN when absent)."""
    import math

    if metric in ("dialect_share", "solo/pass@1", "step/pass@1", "step/pass@8", "solo/pass@8"):
        mode = "solo" if metric in ("dialect_share",) else metric.split("/")[0]
        c = doc["evaluation"]["checkpoints"][step][mode][bench].get(pid)
        if c is None:
            return math.nan
        n, correct, dial = c
        if metric == "dialect_share":
            return dial / n
        k = int(metric.split("@")[1])
        from tandem.metrics.passk import pass_at_k

        return pass_at_k(n, correct, k) if k <= n else math.nan
    name = {"junior_ce": "junior_ce", "kl_mean": "kl_mean", "kl_junior_mean": "kl_junior_mean",
            "overlap": "overlap"}[metric]
    v = (doc["analysis"].get(step, {}).get(bench, {}).get(pid) or {}).get(name)
    return math.nan if v is None else float(v)


def values_for(results: dict, seeds: list[int], arm: str, metric: str, step: str):
    """benchmark -> values_MP (seeds x problems) of `metric` for `arm` at checkpoint `step`."""
    import numpy as np

    first = results[seeds[0]][arm]["evaluation"]["checkpoints"][step]["solo"]
    out = {}
    for b, probs in first.items():
        pids = sorted(probs)
        out[b] = np.array([[_value(results[s][arm], metric, step, b, p) for p in pids] for s in seeds], dtype=float)
    return out


def dose_series(reg: dict, results: dict, seeds: list[int]) -> dict:
    """arm -> {steps, per_seed (seed -> share per checkpoint), mean} of the solo dialect share; and the
    per-step rollout series (seed -> step -> share)."""
    from tandem.control import dose_slope
    from tandem.metrics.intervals import point_estimate

    out = {}
    for arm in reg["arms"]:
        have = [s for s in seeds if arm in results.get(s, {})]
        if not have:
            continue
        steps = sorted(results[have[0]][arm]["evaluation"]["checkpoints"], key=int)
        per_seed = {str(s): [point_estimate(values_for(results, [s], arm, "dialect_share", k)) for k in steps]
                    for s in have}
        slopes = {s: dose_slope([int(k) for k in steps], v) for s, v in per_seed.items()}
        rollout = {str(s): {k: v.get("dialect_share_rollout") for k, v in results[s][arm]["training"].items()}
                   for s in have}
        out[arm] = {"steps": [int(k) for k in steps], "per_seed": per_seed,
                    "mean": [sum(v[i] for v in per_seed.values()) / len(per_seed) for i in range(len(steps))],
                    "slope_per_100_steps": slopes, "rollout": rollout}
    return out


def claims(out: Path = CONTROL_DIR) -> dict:
    """claims.json, report.md and report.html from the committed results (and registration and gate)."""
    import math

    import numpy as np

    from tandem.metrics.verdicts import RegisteredClaim, decide, evaluate, holm_adjust
    from tandem.control import bug_indicators

    reg = registration(out)
    gate_doc = read_json(gate_dir(reg) / "gate.json")
    results = load_results(out)
    seeds = complete_seeds(reg, results)
    stat = reg["statistics"]
    final = str(reg["steps"])
    doc: dict = {"registration": _rel(Path(out) / "registration.yaml"), "setting": reg.get("setting", "1"),
                 "dialect": gate_doc.get("dialect"),
                 "seeds": seeds, "seeds_registered": reg["seeds"],
                 "complete": len(seeds) == len(reg["seeds"]),
                 "verdicts_final": len(seeds) == len(reg["seeds"]),
                 "claims": [], "secondary": [], "bug_indicators": {}, "dose": {}}
    if len(seeds) < int(reg["min_seeds_for_verdict"]):
        doc["note"] = (f"{len(seeds)} of the registered seeds have every arm's result; verdicts need at least "
                       f"{reg['min_seeds_for_verdict']}")
        doc["dose"] = dose_series(reg, results, sorted(results))
        _write_claims(out, doc, reg, gate_doc)
        return doc
    rows = []
    for c in reg["claims"]:
        rc = RegisteredClaim(id=c["id"], claim=c["id"], statement=c["statement"], metric=c["metric"], test=c["test"],
                             a=c["a"], b=c["b"], sesoi=c.get("sesoi"), sesoi_relative=c.get("sesoi_relative"))
        arms = {a: values_for(results, seeds, a, c["metric"], final) for a in (c["a"], c["b"])}
        row = evaluate(rc, arms, int(stat["n_boot"]), float(stat["level"]), int(stat["boot_seed"]))
        rows.append((c, rc, row))
    adj = holm_adjust([r["p_one_sided"] for _, _, r in rows])
    for (c, rc, row), p in zip(rows, adj):
        v = decide(p, float(stat["alpha_one_sided"]), row["estimate"], row["ci"][0], row["ci"][1], rc.direction,
                   row["threshold"])
        doc["claims"].append({"id": c["id"], "statement": c["statement"], "metric": c["metric"],
                              "comparison": f"{c['a']} - {c['b']}", "estimate": row["estimate"],
                              "ci_low": row["ci"][0], "ci_high": row["ci"][1],
                              "seed_t": row["seed_t"], "p_one_sided": row["p_one_sided"], "p_holm": p,
                              "threshold": row["threshold"], "arms": row["arms"],
                              "verdict": {"holds": "holds", "does not hold": "fails"}.get(v, "inconclusive")})
    for c in reg["secondary"]:
        if c["test"] == "per_arm":
            continue
        rc = RegisteredClaim(id=c["id"], claim=c["id"], statement=c["statement"], metric=c["metric"],
                             test="less" if c["test"] == "less" else "greater", a=c["a"], b=c["b"])
        arms = {a: values_for(results, seeds, a, c["metric"], final) for a in (c["a"], c["b"])}
        if any(np.isnan(v).all() for vals in arms.values() for v in vals.values()):
            doc["secondary"].append({"id": c["id"], "statement": c["statement"], "estimate": None,
                                     "note": "not measured for these arms"})
            continue
        row = evaluate(rc, arms, int(stat["n_boot"]), float(stat["level"]), int(stat["boot_seed"]))
        entry = {"id": c["id"], "statement": c["statement"], "metric": c["metric"],
                 "comparison": f"{c['a']} - {c['b']}", "estimate": row["estimate"], "ci_low": row["ci"][0],
                 "ci_high": row["ci"][1], "seed_t": row["seed_t"], "arms": row["arms"]}
        if c["test"] == "noninferior":
            entry["verdict"] = "holds" if row["ci"][0] > -float(c["margin"]) else "not shown"
        doc["secondary"].append(entry)
    dose = dose_series(reg, results, seeds)
    doc["dose"] = dose
    # the bug indicators, from the same numbers
    share = {a: d["mean"] for a, d in dose.items()}
    naive_first = [results[s]["tandem-naive"]["training"] for s in seeds]
    k = int(reg["bug_indicators"]["B3_first_steps"])
    first = [v["reward"] for tr in naive_first for st_, v in sorted(tr.items(), key=lambda kv: int(kv[0]))[:k]
             if v.get("reward") is not None]
    fr = float(np.mean(first)) if first else None
    fr_se = float(np.std(first, ddof=1) / math.sqrt(len(first))) if len(first) > 1 else None
    gate_d = gate_doc["dialects"][-1]
    by_claim = {c["id"]: c for c in doc["claims"]}
    hashes_ok = all(len({h for k2, h in results[s][a]["hashes"].items() if k2.startswith("junior_") and
                         k2 not in ("junior_weights_before", "junior_weights_after")}) == 1
                    for s in seeds for a in reg["arms"])
    doc["bug_indicators"] = bug_indicators({
        "senior_share": {f"{a} seed {s}": results[s][a]["senior_fraction"] for s in seeds for a in reg["arms"]
                         if reg["arms"][a]["train"] == "tandem"},
        "junior_hashes_equal": hashes_ok,
        "junior_unchanged": all(results[s][a]["junior_unchanged"] for s in seeds for a in reg["arms"]),
        "first_reward": fr, "first_reward_se": fr_se, "gate_word_SJ": gate_d["measures"]["SJ_word"]["pass@1"],
        "gate_cost": gate_d["values"]["cost_SJ"],
        "move": {a: v[-1] - v[0] for a, v in share.items()}, "final_share": {a: v[-1] for a, v in share.items()},
        "J1_holds": by_claim["J1"]["verdict"] == "holds", "H1_estimate": by_claim["H1"]["estimate"],
    }, reg["bug_indicators"])
    _write_claims(out, doc, reg, gate_doc)
    return doc


def _write_claims(out: Path, doc: dict, reg: dict, gate_doc: dict) -> None:
    from tandem.report.control import build_report
    from tandem.report.render import figure_filename, render_html, render_markdown

    write_json(Path(out) / "claims.json", doc)
    rep = build_report(doc, reg, gate_doc)
    figs = Path(out) / "figures"
    figs.mkdir(exist_ok=True)
    for f in rep.figures():
        (figs / figure_filename(f.name)).write_bytes(f.png)
    with atomic_path(Path(out) / "report.md") as tmp:
        Path(tmp).write_text(render_markdown(rep, "figures"))
    with atomic_path(Path(out) / "report.html") as tmp:
        Path(tmp).write_text(render_html(rep))


def claims_summary(doc: dict) -> str:
    lines = [f"junior control: {len(doc['seeds'])} complete seed(s) of {len(doc['seeds_registered'])}"
             + ("" if doc.get("verdicts_final") else " (verdicts not final)")]
    for c in doc["claims"]:
        lines.append(f"  {c['id']}: {c['comparison']} {c['metric']} = {c['estimate']:+.3f} "
                     f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] -> {c['verdict']}")
    fired = [k for k, v in doc.get("bug_indicators", {}).items() if v.get("fired")]
    if doc.get("bug_indicators"):
        lines.append("  bug indicators fired: " + (", ".join(fired) if fired else "none"))
    if doc.get("note"):
        lines.append("  " + doc["note"])
    return "\n".join(lines)
