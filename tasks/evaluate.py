"""Stage `evaluate`: every arm x checkpoint (base = step 0) x mode x benchmark, pass@k, saved generations.

Work is split into units, one per (arm, checkpoint, mode), each covering every benchmark; `plan` lists them
(deduplicated by the checkpoint's content hash, so the shared base runs once) and `run_unit` computes one,
which is what a Prefect flow maps over. Each (checkpoint hash, mode, benchmark, settings) result is cached
under its key in `scratch/evaluate/` (not a DVC output, so the stage stays in DVC's run-cache), so a rerun,
or a rerun after a crash, only computes what is missing; the cache, the unit planner and the model cache are
`tandem/eval_cache.py`. `collect` then assembles `metrics/eval.json`, the
per-arm CSV tables and the generations tree from the cache. `run` = every unit + `collect`. Definitions and schemas: docs/metrics.md.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tandem.checkpoints import check_published, generations_file, list_checkpoints
from tandem.config import Params
from tandem.eval_cache import JUNIOR, MODELS, ResultCache, plan_units
from tandem.data.prompts import user_message
from tandem.data.reader import DataFileError, FileProblem, read_problem_file
from tandem.evaluation import (FORMAT_VERSION, Decoder, EvalSettings, content_hash, result_key, rows_hash,
                               run_benchmark, summarize_benchmark)
from tandem.generation import eos_token_ids, stable_seed
from tandem.threads import torch_threads
from tandem.metrics.passk import macro_mean
from tandem.rollout.factory import rollout_engine
from tandem.run_keys import EVAL_RESULT_KEYS, EVAL_STREAM_KEYS, eval_estimate_fields, setting
from tasks import headline, tracking
from tasks.common import (Layout, junior_of, stage_outputs, timing_path, write_csv, write_json,
                          write_jsonl, write_metrics)
from tandem.errors import BadInputError

MACRO_FIELDS = ("senior_share", "mean_tokens")


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    lay = Layout.of(params)
    inputs = {"eval_data": lay.prepared / "eval", "base_model": lay.base_model, "junior_model": lay.junior_model,
              "checkpoints": lay.checkpoints}
    outputs = {"metrics": lay.metrics / "eval.json", "headline": lay.metrics / "headline" / "eval.json",
               "generations": lay.generations, "plots": lay.plots / "eval", "cache": lay.scratch / "evaluate"}
    return inputs, outputs


def _io(params: Params, inputs: dict | None, outputs: dict | None) -> tuple[dict, dict]:
    di, do = default_io(params)
    return {**di, **(inputs or {})}, {**do, **(outputs or {})}


# --------------------------------------------------------------------------------------------------
# Inputs: settings, benchmarks, the base model directory
# --------------------------------------------------------------------------------------------------

def settings_of(params: Params) -> EvalSettings:
    """The evaluation settings: each result key from its params key (`tandem.run_keys.EVAL_RESULT_KEYS`)."""
    return EvalSettings.of({f: setting(params, key) for f, key in EVAL_RESULT_KEYS.items()},
                           params.evaluate.batch_size)


def load_benchmarks(params: Params, inputs: dict) -> dict[str, list[dict]]:
    """Benchmark name -> rows (first `max_problems` of each): prepared files plus `evaluate.benchmark_files`."""
    ev = params.evaluate
    found: dict[str, Path] = {}
    eval_dir = Path(inputs["eval_data"])
    if eval_dir.is_dir():
        found.update({p.stem: p for p in sorted(eval_dir.glob("*.jsonl"))})
    root = Path(params.out_root)
    for name, f in ev.benchmark_files.items():
        p = Path(f)
        found[name] = p if p.is_absolute() or p.exists() else root / p
    wanted = list(ev.benchmarks) or sorted(found)
    missing = [b for b in wanted if b not in found]
    if missing or not wanted:
        raise FileNotFoundError(
            f"evaluate: benchmarks {missing or '(none)'} not found; prepared ones in {eval_dir}: "
            f"{sorted(p for p in found) or 'none'} (run the prepare stage, or set evaluate.benchmark_files)")
    read: dict[str, list[dict]] = {}
    problems: list[FileProblem] = []
    for b in wanted:
        if not found[b].exists():
            raise FileNotFoundError(f"evaluate: benchmark {b!r}: file {found[b]} does not exist")
        # the prepare stage's file-level rules (UTF-8, one JSON object per line, not truncated, bounded lines); a
        # prepared row holds its problem twice (problem and prompt) and a solution, so its bound is wider
        if b in ev.benchmark_files:
            what, bound = f"evaluate.benchmark_files.{b}", params.data.max_row_bytes
        else:
            what, bound = f"prepared benchmark {b}", 4 * params.data.max_row_bytes + (1 << 16)
        read[b], bad = read_problem_file(found[b], what, bound)
        problems += bad
    if problems:  # every file's problems in one report, before any model is loaded
        raise DataFileError(problems)
    out: dict[str, list[dict]] = {}
    for b in wanted:
        rows = read[b]
        for i, r in enumerate(rows):
            line = str(r.pop("_where", i + 1)).rsplit(":", 1)[-1]
            if "id" not in r or "answer" not in r or ("prompt" not in r and "problem" not in r):
                raise BadInputError(f"evaluate: {found[b]}:{line} (benchmark {b!r}) needs id, answer and problem "
                                    f"(or prompt)")
            if "prompt" not in r:
                r["prompt"] = user_message(r["problem"])
            r["answer"] = str(r["answer"])
        if ev.max_problems:
            rows = rows[: ev.max_problems]
        if not rows:
            raise BadInputError(f"evaluate: benchmark {b!r} ({found[b]}) has no rows")
        out[b] = rows
    return out


def base_dir(params: Params, inputs: dict) -> Path:
    """The base model: `models/base/` when the base stage produced it, else `model.path` (source 'path').

    The directory is checked before anything reads it (config, tokenizer and weight files present and well
    formed: `tandem.models.check_model_dir`), so a damaged base is one message naming the file."""
    from tandem.models import check_model_dir

    d = Path(inputs["base_model"])
    if d.is_dir() and any(d.iterdir()):
        check_model_dir(d)
        return d
    if params.model.source == "path" and params.model.path:
        check_model_dir(params.model.path)
        return Path(params.model.path)
    raise FileNotFoundError(f"evaluate: no base model at {d} (run the base stage, or set model.source: path "
                            f"and model.path to a Hugging Face model directory)")


def junior_dir(params: Params, inputs: dict) -> Path:
    """The junior: the partner of the step and word modes and the junior floor (`tasks.common.junior_of`)."""
    return junior_of(params, {**inputs, "base_model": base_dir(params, inputs)})


# --------------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------------

def training_summary(params: Params, arm: str) -> Path:
    """The train stage's summary of `arm` (`metrics/train_<arm>.json`). A guard, not an input: evaluate reads only
    which checkpoints it lists, to refuse a listed one that is missing, and writes nothing from it; the summary is
    published together with `models/checkpoints/<arm>`, which dvc.yaml declares (listing every arm's summary
    there would tie the stage to the arms of one params file)."""
    return Layout.of(params).metrics / f"train_{arm}.json"


def published_steps(params: Params, inputs: dict, arm: str) -> tuple[list[str], Path] | None:
    """The `step-<N>` folders the arm's training summary (`training_summary`, its `checkpoints`) says the train
    stage published, with the summary's path; None when there is no summary, or when the checkpoints evaluated
    are not the params' own (`inputs["checkpoints"]` elsewhere: no summary of this root describes them)."""
    import json

    if Path(inputs["checkpoints"]).resolve() != Layout.of(params).checkpoints.resolve():
        return None
    path = training_summary(params, arm)
    if not path.is_file():
        return None
    try:
        listed = json.loads(Path(path).read_text()).get("checkpoints")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise BadInputError(f"evaluate: {path}: the training summary cannot be read ({type(e).__name__}); rerun "
                            f"`tandem stage train --arm {arm}`") from None
    return (list(listed), Path(path)) if isinstance(listed, list) else None


def _all_checkpoints(params: Params, inputs: dict) -> dict[str, list]:
    """Every arm's checkpoints to evaluate (`evaluate.checkpoints`): an incomplete `step-<N>` folder is an error
    naming it, so is a folder the arm's training summary lists but that is missing (`check_published`: the
    step before would pass for the final one), and each listed checkpoint's model files are verified against
    the checksums recorded when it was saved (`tandem.checkpoints.list_checkpoints`)."""
    base = base_dir(params, inputs)
    out = {}
    for arm in params.train.arms:
        published = published_steps(params, inputs, arm)
        if published is not None:
            check_published(inputs["checkpoints"], arm, *published)
        out[arm] = list_checkpoints(inputs["checkpoints"], arm, base, params.evaluate.checkpoints)
    return out


def plan(params: Params, inputs: dict | None = None) -> list[dict]:
    """Units to compute, as plain dicts {arm, step, path, mode}; one per distinct (weights, mode).

    The junior floor is the junior in solo mode (step 0's unit when the junior is the base); identical weights under two
    names (every arm's step 0) are listed once.
    """
    inputs, _ = _io(params, inputs, None)
    import torch

    from tandem.plan import check_fits

    # the memory plan first (both models' KV caches for one engine call): refuse before any work, here because
    # both `run` and the Prefect flow start from the unit list
    check_fits(params, "evaluate", base_dir(params, inputs), "cuda" if torch.cuda.is_available() else "cpu")
    return plan_units(_all_checkpoints(params, inputs), params.evaluate.modes, junior_dir(params, inputs))


def result_cache(outputs: dict) -> ResultCache:
    """The stage's result cache (`outputs["cache"]`, in scratch/), written with the stage's durable writers."""
    return ResultCache(Path(outputs["cache"]), write_json, write_jsonl)


def _load(path: Path, params: Params, keep: set[str]):
    """The model at `path` from the process's model cache, keeping only the hashes in `keep` resident."""
    return MODELS.get(path, params.model.dtype, params.model.trust_remote_code, keep)


def run_unit(params: Params, unit: dict, inputs: dict | None = None, outputs: dict | None = None,
             progress: Callable[[int, int], None] | None = None, refresh: bool = False) -> dict:
    """Evaluate one (arm, checkpoint, mode) unit on every benchmark; cached benchmarks are not redone, unless
    `refresh` (`tandem run --force`) recomputes them all and stores the new results over the cached ones.

    Returns {benchmark: summary} (the summaries of docs/metrics.md, `<MODE>.benchmarks`). `progress(done,
    total)` hears the generations done out of the unit's total (cached ones count as done) as batches finish.
    """
    inputs, outputs = _io(params, inputs, outputs)
    ev = params.evaluate
    mode = unit["mode"]
    settings = settings_of(params)
    benches = load_benchmarks(params, inputs)
    base = base_dir(params, inputs)
    junior = junior_dir(params, inputs)
    senior_path = Path(unit["path"])
    junior_hash, senior_hash = content_hash(junior), content_hash(senior_path)
    cache = result_cache(outputs)
    todo = {}
    summaries = {}
    for b, rows in benches.items():
        key = result_key(senior_hash, mode, b, rows_hash(rows), settings, None if mode == "solo" else junior_hash)
        found = None if refresh else cache.summary(key)
        if found is not None:
            summaries[b] = found
        else:
            todo[b] = (key, rows)
    total = sum(len(rows) for rows in benches.values()) * settings.n_samples
    done = [total - sum(len(rows) for _, rows in todo.values()) * settings.n_samples]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    tick(0)
    if not todo:
        return summaries
    with torch_threads(ev.cpu_threads):
        summaries.update(_compute(params, unit, todo, Partner(base, junior, junior_hash), senior_hash, cache, tick))
    return {b: summaries[b] for b in benches}


@dataclass(frozen=True)
class Partner:
    """The models beside the unit's senior: the base (tokenizer, weight root) and the junior with its hash."""

    base: Path
    junior: Path
    junior_hash: str


def decoder_for(params: Params, senior, junior, tokenizer, roots: tuple) -> Decoder:
    """The evaluation's decoder: the rollout engine of `params.rollout` over senior and junior (`roots`: the
    directories the engine may read), ending at the senior's end-of-sequence tokens."""
    # evaluate.cpu_threads already governs threads here, so the engine leaves them as they are
    # a dedicated rollout service stays off the trainer's GPUs (placement only: it shapes no output)
    trainers = params.train.num_processes if params.rollout.backend == "vllm" else 1
    engine = rollout_engine(senior, junior, tokenizer, params.rollout, cpu_threads=0, roots=roots,
                            trainer_processes=trainers)
    return Decoder(engine, tokenizer, eos_token_ids(tokenizer, senior))


def _compute(params: Params, unit: dict, todo: dict, partner: Partner, senior_hash: str, cache: ResultCache,
             tick: Callable[[int], None]) -> dict:
    """Generate, score and cache the missing benchmarks of one unit."""
    from tqdm.auto import tqdm

    from tandem.models import load_tokenizer
    from tandem.rewards import score_many

    ev, mode, settings = params.evaluate, unit["mode"], settings_of(params)
    senior_path = Path(unit["path"])
    summaries = {}
    base, junior_path, junior_hash = partner.base, partner.junior, partner.junior_hash
    tokenizer = load_tokenizer(base, trust_remote_code=params.model.trust_remote_code)
    junior = _load(junior_path, params, keep={junior_hash})
    senior = _load(senior_path, params, keep={junior_hash})
    decoder = decoder_for(params, senior, junior, tokenizer, roots=(params.out_root, base, junior_path))
    for b, (key, rows) in todo.items():
        t0 = time.perf_counter()
        with tqdm(total=len(rows) * settings.n_samples, desc=f"{unit['arm']} step-{unit['step']} {mode} {b}",
                  unit="gen", disable=not ev.progress, file=sys.stderr, leave=True) as bar:
            records = run_benchmark(
                decoder, rows, mode, settings, seed=stable_seed(params.seed, mode, b),
                score_fn=lambda t, g: score_many(t, g, timeout=ev.score_timeout, workers=ev.score_workers),
                progress=lambda n: (bar.update(n), tick(n)))
        summary = summarize_benchmark(records, ev.ks)
        summary["seconds"] = round(time.perf_counter() - t0, 3)
        cache.store(key, records, {"format": FORMAT_VERSION, "key": key, "model_hash": senior_hash, "mode": mode,
                                   "benchmark": b, "junior_hash": None if mode == "solo" else junior_hash,
                                   "settings": settings.key_fields(mode), "summary": summary})
        summaries[b] = summary
    return summaries


# --------------------------------------------------------------------------------------------------
# Collection: eval.json, CSV tables, generations tree
# --------------------------------------------------------------------------------------------------

@dataclass
class _Collection:
    """What every block of `collect` reads: the benchmarks, settings, cache and base, and the generation files
    gathered so far ((cached records, path in the generations tree))."""

    benches: dict[str, list[dict]]
    settings: EvalSettings
    cache: ResultCache
    junior_hash: str
    ks: list[int]
    copies: list[tuple[Path, str]]


def _mode_block(col: _Collection, h: str, mode: str, arm: str, step: int) -> dict:
    out_b = {}
    for b, rows in col.benches.items():
        key = result_key(h, mode, b, rows_hash(rows), col.settings, None if mode == "solo" else col.junior_hash)
        summary, gen_p = col.cache.require(key, f"{arm} step {step} {mode} {b}")
        out_b[b] = {"key": key, **summary}
        col.copies.append((gen_p, str(generations_file("", arm, step, mode, b))))
    macro = {f"pass@{k}": macro_mean({b: s[f"pass@{k}"] for b, s in out_b.items()}) for k in col.ks}
    macro.update({f: macro_mean({b: s[f] for b, s in out_b.items()}) for f in MACRO_FIELDS})
    return {"macro": macro, "benchmarks": out_b}


def collect(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    """Assemble eval.json, the per-arm CSVs and the generations tree from the cache, log the results to W&B
    (`tasks.tracking.log_evaluation`); return the flat summary."""
    inputs, outputs = _io(params, inputs, outputs)
    ev = params.evaluate
    settings = settings_of(params)
    benches = load_benchmarks(params, inputs)
    junior_path = junior_dir(params, inputs)
    junior_hash = content_hash(junior_path)
    copies: list[tuple[Path, str]] = []
    col = _Collection(benches, settings, result_cache(outputs), junior_hash, list(ev.ks), copies)
    root = Path(params.out_root)

    def rel(p: Path) -> str:
        try:
            return str(Path(p).resolve().relative_to(root.resolve()))
        except ValueError:
            return str(p)

    junior = {"path": rel(junior_path), "hash": junior_hash, "source": params.junior.source,
              "modes": {"solo": _mode_block(col, junior_hash, "solo", JUNIOR, 0)}}
    arms: dict[str, Any] = {}
    for arm, ckpts in _all_checkpoints(params, inputs).items():
        rows = []
        for c in ckpts:
            h = content_hash(c.path)
            modes = {m: _mode_block(col, h, m, arm, c.step) for m in ev.modes}
            rows.append({"step": c.step, "path": rel(c.path), "hash": h, "modes": modes})
        arms[arm] = {"checkpoints": rows}
    summary: dict[str, Any] = {}
    for arm, a in arms.items():
        last = a["checkpoints"][-1]
        summary[arm] = {"final_step": last["step"]}
        for m in ev.modes:
            summary[arm].update({f"{m}/pass@{k}": last["modes"][m]["macro"][f"pass@{k}"] for k in ev.ks})
    summary[JUNIOR] = {f"solo/pass@{k}": junior["modes"]["solo"]["macro"][f"pass@{k}"] for k in ev.ks}
    # the result settings (`tandem.run_keys`), in the order eval.json has always listed them
    estimate = {k: settings.value(k) for k in eval_estimate_fields()}
    doc = {
        "settings": {"n_samples": estimate.pop("n_samples"), "ks": list(ev.ks), "modes": list(ev.modes), **estimate,
                     "max_problems": ev.max_problems, **{k: settings.value(k) for k in EVAL_STREAM_KEYS},
                     "benchmarks": {b: {"n_problems": len(r), "rows_hash": rows_hash(r)} for b, r in benches.items()}},
        "junior": junior, "arms": arms, "summary": summary,
    }
    # the four outputs change together (one transaction): eval.json never describes other generations
    targets = {k: Path(outputs[k]) for k in ("generations", "plots", "metrics", "headline")}
    with stage_outputs(params, "evaluate", targets) as staged:
        staged["generations"].mkdir()
        for src, dst in copies:
            (staged["generations"] / dst).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, staged["generations"] / dst)
        staged["plots"].mkdir()
        for arm in arms:
            write_csv(staged["plots"] / f"{arm}.csv", *_arm_table(arms[arm], junior, ev.modes, ev.ks, list(benches)))
        write_csv(staged["plots"] / "final.csv", *_final_table(arms, ev.modes, ev.ks, list(benches)))
        write_metrics(staged["metrics"], doc, timing_to=timing_path(outputs["metrics"]))  # compute times beside it
        write_json(staged["headline"], headline.evaluation(doc))
    tracking.log_evaluation(params)  # the evaluation's W&B run (a no-op unless train.report_to is wandb)
    flat = {f"{arm}/{k}": v for arm, s in summary.items() for k, v in s.items() if k != "final_step"}
    return flat


def _arm_table(arm: dict, junior: dict, modes: list[str], ks: list[int], benches: list[str]):
    cols = ["step", "hash"]
    for m in modes:
        cols += [f"{m}/pass@{k}" for k in ks] + [f"{m}/{f}" for f in MACRO_FIELDS]
        cols += [f"{m}/{b}/pass@{k}" for b in benches for k in ks]
    cols += [f"junior/pass@{k}" for k in ks]
    rows = []
    for c in arm["checkpoints"]:
        r: dict[str, Any] = {"step": c["step"], "hash": c["hash"][:12]}
        for m in modes:
            mb = c["modes"][m]
            r.update({f"{m}/pass@{k}": mb["macro"][f"pass@{k}"] for k in ks})
            r.update({f"{m}/{f}": mb["macro"][f] for f in MACRO_FIELDS})
            r.update({f"{m}/{b}/pass@{k}": mb["benchmarks"][b][f"pass@{k}"] for b in benches for k in ks})
        r.update({f"junior/pass@{k}": junior["modes"]["solo"]["macro"][f"pass@{k}"] for k in ks})
        rows.append(r)
    return cols, rows


def _final_table(arms: dict, modes: list[str], ks: list[int], benches: list[str]):
    """The base (step 0) and each arm's last checkpoint, one row per mode x benchmark, labelled for a bar chart
    (`dvc plots show`: pass@k per benchmark side by side)."""
    cols = ["label", "model", "step", "mode", "benchmark", *[f"pass@{k}" for k in ks]]
    models: list[tuple[str, dict]] = []
    for arm, a in arms.items():
        cks = a["checkpoints"]
        if cks and cks[0]["step"] == 0 and not models:
            models.append(("base", cks[0]))
        if cks and cks[-1]["step"] > 0:
            models.append((arm, cks[-1]))
    rows = [{"label": f"{m} / {b} / {name}", "model": name, "step": c["step"], "mode": m, "benchmark": b,
             **{f"pass@{k}": c["modes"][m]["benchmarks"][b][f"pass@{k}"] for k in ks}}
            for m in modes for b in benches for name, c in models]
    return cols, rows


def _run_units(params: Params, units: list[dict], inputs: dict, outputs: dict) -> None:
    for unit in units:
        run_unit(params, unit, inputs, outputs)


def run(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    """Compute every missing unit, then collect; returns {"<arm>/<mode>/pass@<k>": value} (last checkpoint).

    With `evaluate.workers` > 1 the units of different checkpoints run in that many spawned processes (each
    checkpoint's modes stay together so its weights load once); results meet in the on-disk cache.
    """
    inputs, outputs = _io(params, inputs, outputs)
    load_benchmarks(params, inputs)  # every benchmark file reads as problem rows before any model is loaded
    groups: dict[str, list[dict]] = {}
    for unit in plan(params, inputs):
        groups.setdefault(unit["path"], []).append(unit)
    workers = min(params.evaluate.workers, len(groups))
    if workers <= 1:
        _run_units(params, [u for g in groups.values() for u in g], inputs, outputs)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn, not fork: the parent may hold torch/tokenizers threads; largest groups first
        ordered = sorted(groups.values(), key=len, reverse=True)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for f in [pool.submit(_run_units, params, g, inputs, outputs) for g in ordered]:
                f.result()
    return collect(params, inputs, outputs)

