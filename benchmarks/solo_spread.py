"""Solo pass@1 of base models on more evaluation problems: does the spread over bases shrink with the problem count?

The closing message compares a run's solo pass@1 with the record's band (`metrics/band.json`), measured on the
default run's `evaluate.max_problems` problems per benchmark. This benchmark evaluates each given base model
(a directory: the level sweep's `runs/levels/<kernel>-s<seed>/models/base`, the record's `models/base`, ...)
solo, exactly as the evaluate stage does (params.yaml's `evaluate` decoding and samples, the same sampling
seeds), on every prepared problem of each benchmark, and prints, for the first N problems per benchmark
(N in `--counts`), each model's macro pass@1 and the spread over the models. If the spread were the few
problems', it would shrink as N grows; if it stays, it is the bases'.

Each model's per-problem pass rates go to `--out` (default runs/solo_spread.json); a model already there is
not evaluated again. One torch thread, as the pipeline's evaluation.

    python benchmarks/solo_spread.py models/base runs/levels/*-s*/models/base
    python benchmarks/solo_spread.py --table            # the table of what is in --out
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path("runs") / "solo_spread.json"
COUNTS = (8, 24, 48, 100)


def evaluate(model_dir: Path, params_file: Path) -> dict[str, list[float]]:
    """Benchmark -> per-problem solo pass rate (the share of `evaluate.n_samples` samples scored correct)."""
    import torch

    from tandem.evaluation import run_benchmark
    from tandem.generation import stable_seed
    from tandem.models import load_tokenizer
    from tandem.rewards import score_many
    from tasks.common import load_params
    from tasks.evaluate import _load, decoder_for, default_io, load_benchmarks, settings_of

    torch.set_num_threads(1)
    params = load_params(params_file)
    params = dataclasses.replace(params, evaluate=dataclasses.replace(params.evaluate, max_problems=0,
                                                                      progress=False))
    inputs, _ = default_io(params)
    benches = load_benchmarks(params, inputs)
    settings = settings_of(params)
    tok = load_tokenizer(model_dir, trust_remote_code=params.model.trust_remote_code)
    model = _load(model_dir, params, keep=set())
    decoder = decoder_for(params, model, model, tok, roots=(params.out_root, model_dir, model_dir))
    ev = params.evaluate
    out = {}
    for b, rows in benches.items():
        records = run_benchmark(decoder, rows, "solo", settings, seed=stable_seed(params.seed, "solo", b),
                                score_fn=lambda t, g: score_many(t, g, timeout=ev.score_timeout, workers=1))
        per: dict[str, list[float]] = {}
        for r in records:
            per.setdefault(r["id"], []).append(float(r["score"]))
        out[b] = [sum(v) / len(v) for v in per.values()]  # the benchmark's problem order (records follow rows)
    return out


def macro(rates: dict[str, list[float]], n: int) -> float:
    """Macro pass@1 over benchmarks on each benchmark's first `n` problems."""
    return sum(sum(v[:n]) / len(v[:n]) for v in rates.values()) / len(rates)


def table(results: dict[str, dict[str, list[float]]], counts) -> str:
    names = list(results)
    lines = ["| problems per benchmark | lowest | highest | range | sd | " + " | ".join(names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names)]
    for n in counts:
        xs = [macro(results[m], n) for m in names]
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        lines.append(f"| {n} | {min(xs):.3f} | {max(xs):.3f} | {max(xs) - min(xs):.3f} | {sd:.3f} | "
                     + " | ".join(f"{x:.3f}" for x in xs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path, help="base model directories")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"),
                    help="the params whose prepared benchmarks and evaluate settings are used (default params.yaml)")
    ap.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--table", action="store_true", help="print the table of what --out holds")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    if not args.table:
        if not args.models:
            ap.error("give base model directories (or --table)")
        for d in args.models:
            if not (d / "config.json").exists():
                ap.error(f"{d} is not a model directory (no config.json)")
        for d in args.models:
            if str(d) in results:
                continue
            results[str(d)] = evaluate(d, args.params)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results))
            print(f"{d}: " + ", ".join(f"{n}: {macro(results[str(d)], n):.3f}" for n in args.counts), flush=True)
    if not results:
        print(f"nothing measured yet in {args.out}", file=sys.stderr)
        return 1
    shortest = min(len(v) for r in results.values() for v in r.values())
    print(table(results, [n for n in args.counts if n <= shortest]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
