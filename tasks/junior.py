"""Stage `junior`: the frozen partner of tandem rollouts, handoff evaluation and the legibility measures.

`junior.source`:
- `base` (the default, the paper's self-pairing): the senior's base is the junior. Nothing is built or copied:
  `models/junior/` holds only a marker (`tandem.models.JUNIOR_FILE`) and every stage loads `models/base/`.
- `tiny`: a junior of its own, pretrained here with the base's recipe (`model.*`: architecture, schedule, target)
  and the base's tokenizer, but its own seed (`junior.seed`) and reference-solution styles
  (`junior.solution_styles`): e.g. one that never saw the dialect the senior writes (the positive control,
  studies/junior-control/).
- `path` / `hub` / `gguf`: a local directory, a hub snapshot or a GGUF import, as the base stage does them.
- `warmup`: the base's own source (`model.*`) and supervised warm-up, rebuilt here without the base's dialect
  phase (`model.dialect_steps`): the senior's starting point before its jargon (the SmolLM2 jargon control,
  studies/jargon-smollm2/). `metrics/junior.json` records its hash beside the warm-up hash the base stage
  recorded before its dialect phase, and whether the two are equal (`matches_base_warmup`).

Any junior that is not the base must share the base's tokenizer (one token history serves both models); one
that does not is refused in one line. A junior of its own is published with its manifest
(`tandem_manifest.json`: every file's size and SHA-256, every tensor's name, dtype and shape; its weights checked
finite first), which every load verifies. `metrics/junior.json` records the source, the junior's content hash
(training, evaluation and analysis record the same hash), and, for a built junior, its greedy and sampled
accuracy per benchmark and the share and accuracy of each solution style in its sampled solutions.
`python -m tasks.junior [params.yaml]` runs it directly.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tandem.config import Params
from tandem.threads import torch_threads as cpu_threads
from tasks import headline
from tasks.base import TinyRecipe, _build_tiny, _eval_sets, _evaluate, _warm_up, fetch_model, publish_manifest
from tasks.common import Layout, atomic_path, load_params, write_json, write_metrics


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    lay = Layout.of(params)
    inputs: dict[str, Path] = {"prepared": lay.prepared, "eval": lay.prepared / "eval", "base_model": lay.base_model}
    if params.junior.source == "path":
        inputs["model_path"] = Path(params.junior.path)
    if params.junior.source == "gguf" and not params.junior.gguf_file.startswith("package:"):
        inputs["gguf_file"] = Path(params.junior.gguf_file)
    if params.junior.source == "warmup":  # the base's own source, as the base stage reads it
        if params.model.source == "path":
            inputs["model_path"] = Path(params.model.path)
        if params.model.source == "gguf" and not params.model.gguf_file.startswith("package:"):
            inputs["gguf_file"] = Path(params.model.gguf_file)
    outputs = {"model": lay.junior_model, "metrics": lay.metrics / "junior.json",
               "headline": lay.metrics / "headline" / "junior.json"}
    return inputs, outputs


def _styles(params: Params, model_dir: Path, eval_sets: dict[str, list[dict]]) -> dict:
    """Share and accuracy of each solution style in the junior's sampled solutions (temperature 1, the base
    stage's sampled accuracy), pooled over the benchmarks."""
    from tandem.generation import Draws, default_score_fn, eos_token_ids, generate_and_score
    from tandem.metrics.dialect import accuracy_by_style, styles_of
    from tandem.models import load_model, load_tokenizer
    from tandem.rollout.core import SamplingParams
    from tandem.rollout.factory import make_engine
    from tandem.rollout.request import RolloutSettings
    from tandem.rollout.schedule import ScheduleSpec

    mc = params.model
    model = load_model(model_dir, mc.dtype, mc.trust_remote_code)
    tok = load_tokenizer(model_dir, mc.trust_remote_code)
    engine = make_engine(model, None, tok, "hf")
    settings = RolloutSettings(ScheduleSpec("solo"), SamplingParams(temperature=1.0, top_p=1.0, top_k=0,
                                                                    max_new_tokens=mc.eval_max_new_tokens),
                               batch_size=mc.eval_batch_size)
    rows = [{**r, "id": f"{b}/{r['id']}"} for b, rs in eval_sets.items() for r in rs]
    records = generate_and_score(engine, tok, rows, settings, Draws(mc.eval_samples, params.junior.seed),
                                 default_score_fn(), eos_token_ids(tok, model))
    return accuracy_by_style(styles_of(r["text"] for r in records), [r["score"] for r in records])


def _base_warmup_hash(base: Path) -> str | None:
    """The content hash the base stage recorded after its warm-up, before any dialect phase (None: not recorded)."""
    from tandem.models import SOURCE_FILE

    f = base / SOURCE_FILE
    return (json.loads(f.read_text()).get("warmup") or {}).get("hash") if f.exists() else None


def run(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    """Mark the base as the junior, or build, check and evaluate a junior of its own; returns the metrics."""
    from tandem.evaluation import content_hash
    from tandem.models import check_junior_tokenizer, check_model_dir, write_base_junior

    t0 = time.perf_counter()
    di, do = default_io(params)
    inputs, outputs = {**di, **(inputs or {})}, {**do, **(outputs or {})}
    jc, base = params.junior, Path(inputs["base_model"])
    check_model_dir(base)
    metrics: dict = {"source": jc.source, "base_hash": content_hash(base)}
    if jc.is_base:  # the paper's self-pairing: nothing to build
        with atomic_path(outputs["model"]) as tmp:
            write_base_junior(tmp)
        metrics["hash"] = metrics["base_hash"]
        metrics["is_base"] = True
    else:
        eval_sets = _eval_sets(Path(inputs["eval"]), params.model.eval_problems)
        with cpu_threads(params.model.cpu_threads):
            with atomic_path(outputs["model"]) as tmp:
                if jc.source == "tiny":
                    metrics["seed"], metrics["solution_styles"] = jc.seed, dict(jc.solution_styles)
                    metrics["pretrain"] = _build_tiny(params, Path(inputs["prepared"]), tmp, eval_sets,
                                                      TinyRecipe(jc.seed, jc.solution_styles, tokenizer_from=base))
                elif jc.source == "warmup":
                    metrics.update(fetch_model(params.model, inputs.get("model_path"), tmp,
                                               params.model.trust_remote_code))
                    metrics["warmup"] = _warm_up(params, Path(inputs["prepared"]), tmp)
                    metrics["base_warmup_hash"] = _base_warmup_hash(base)
                    metrics["matches_base_warmup"] = metrics["warmup"]["hash"] == metrics["base_warmup_hash"]
                else:
                    metrics.update(fetch_model(jc, inputs.get("model_path"), tmp, params.model.trust_remote_code))
                check_model_dir(tmp)
                check_junior_tokenizer(base, tmp, params.model.trust_remote_code)
                publish_manifest(tmp)  # finite weights, then the record every later load verifies
            junior = Path(outputs["model"])
            metrics["hash"] = content_hash(junior)
            metrics["is_base"] = metrics["hash"] == metrics["base_hash"]
            acc = _evaluate(params, junior, eval_sets)
            metrics["model"], metrics["generation"] = acc.pop("model"), acc.pop("generation")
            metrics["accuracy"] = acc
            metrics["styles"] = _styles(params, junior, eval_sets)
    metrics["seconds"] = {"total": round(time.perf_counter() - t0, 1)}
    write_metrics(outputs["metrics"], metrics)
    write_json(outputs["headline"], headline.junior(metrics))
    what = "the base" if jc.is_base else (f"{jc.source}, greedy {metrics['accuracy']['greedy']['macro']}, sampled "
                                          f"{metrics['accuracy']['sampled']['macro']}")
    print(f"junior: {what} (hash {metrics['hash'][:12]})", file=sys.stderr, flush=True)
    return metrics


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params", nargs="?", default="params.yaml")
    print(json.dumps(run(load_params(ap.parse_args(argv).params)), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
