"""Which measure of a base predicts its solo pass@1: greedy accuracy, sampled accuracy or the reference pass rate.

The level stop of the tiny base's pretraining ends at the first probe at or above a level; what the probe
measures decides what the stop holds. This benchmark reads, for each model a level sweep saved
(`benchmarks/base_levels.py`: `runs/<sweep>/<kernel>-s<seed>/levels/<level>` and the run's final
`models/base`), its solo pass@1 on the record's benchmarks (from `benchmarks/solo_spread.py`'s `--out` files,
all 100 problems per benchmark), its greedy and sampled macro on the benchmarks and its greedy probe on the
validation problems (the sweep's `levels.json`), and computes its reference pass rate on the run's first 200
validation problems at the evaluation's decoding (`tandem/likelihood.py`, as `model.pretrain_level_decoding:
likelihood` probes it). It prints each measure's correlation with solo pass@1 over the models, and the fit of
solo pass@1 on the reference pass rate with its residuals.

    python benchmarks/solo_spread.py runs/levels/*-s*/levels/0.* runs/levels/*-s*/models/base \\
        --out runs/solo_spread_levels.json --counts 24 100
    python benchmarks/pass_rate.py runs/levels/*-s*/levels/0.* runs/levels/*-s*/models/base \\
        --solo runs/solo_spread_levels.json

Pass rates go to `--out` (default runs/pass_rate.json); a model already there is not scored again. One torch
thread; about 10 s a model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path("runs") / "pass_rate.json"


def run_root(model_dir: Path) -> Path:
    """The sweep run a saved model belongs to: `.../<run>/levels/<level>` or `.../<run>/models/base`."""
    return model_dir.parent.parent


def pass_rate(model_dir: Path, params_file: Path, n: int = 200) -> float:
    """The reference pass rate of `model_dir` on its run's first `n` validation problems, each reference
    written in every style of `data.solution_styles`, at `evaluate`'s decoding."""
    import torch

    from tandem.data.synthetic import restyle
    from tandem.likelihood import Decoding, reference_pass_rate
    from tandem.models import load_model, load_tokenizer
    from tasks.common import load_params, read_jsonl

    torch.set_num_threads(1)
    params = load_params(params_file)
    val = read_jsonl(REPO / run_root(model_dir) / "data" / "prepared" / "val.jsonl")[:n]
    styles = [s for s, w in params.data.solution_styles.items() if w > 0]
    ev = params.evaluate
    model, tok = load_model(REPO / model_dir), load_tokenizer(REPO / model_dir)
    return reference_pass_rate(model, tok, [r["prompt"] for r in val],
                               [[restyle(r["solution"], s) for s in styles] for r in val],
                               Decoding(ev.temperature, ev.top_k, ev.top_p),
                               params.model.eval_batch_size)["pass_rate"]


def sweep_measures(model_dir: Path) -> dict:
    """Greedy probe (validation), greedy and sampled macro (benchmarks) of a saved model, from levels.json
    (none for a run that stopped before writing it)."""
    path = REPO / run_root(model_dir) / "levels.json"
    if not path.exists():  # a sweep run stopped before its end
        return {}
    doc = json.loads(path.read_text())
    for s in doc["levels"]:
        if Path(s["dir"]) == model_dir:
            return {"greedy probe": s["probe"], "greedy macro": s["greedy_macro"], "sampled macro": s["sampled_macro"]}
    base = json.loads((REPO / run_root(model_dir) / "metrics" / "base.json").read_text())["accuracy"]
    probes = [p for p in doc["probes"] if p["phase"] == "level"]
    return {"greedy probe": probes[-1]["accuracy"] if probes else None, "greedy macro": base["greedy"]["macro"],
            "sampled macro": base["sampled"]["macro"]}


def report(rows: dict[str, dict]) -> str:
    names = ["reference pass rate", "sampled macro", "greedy macro", "greedy probe"]
    lines = [f"{len(rows)} models; correlation with solo pass@1 (100 problems per benchmark):"]
    for name in names:
        pairs = [(r[name], r["solo"]) for r in rows.values() if r.get(name) is not None]
        if len(pairs) > 2:
            try:
                r = statistics.correlation([p[0] for p in pairs], [p[1] for p in pairs])
            except statistics.StatisticsError:  # one of them the same for every model
                lines.append(f"  {name}: no correlation (constant over the {len(pairs)} models)")
                continue
            lines.append(f"  {name}: r = {r:.3f} over {len(pairs)}")
    xs = [r["reference pass rate"] for r in rows.values()]
    ys = [r["solo"] for r in rows.values()]
    if len(xs) > 2:
        fit = statistics.linear_regression(xs, ys)
        res = [y - (fit.intercept + fit.slope * x) for x, y in zip(xs, ys)]
        lines.append(f"  solo pass@1 = {fit.intercept:.3f} + {fit.slope:.3f} x reference pass rate; residual sd "
                     f"{statistics.stdev(res):.3f}, range {min(res):+.3f} to {max(res):+.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path, help="saved model directories of level sweeps")
    ap.add_argument("--solo", type=Path, nargs="+", required=True, help="benchmarks/solo_spread.py --out files")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="the evaluation's decoding and styles")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.solo_spread import macro

    solo: dict[str, dict] = {}
    for f in a.solo:
        solo.update(json.loads((REPO / f).read_text()))
    out = REPO / a.out
    done = json.loads(out.read_text()) if out.exists() else {}
    rows = {}
    for m in a.models:
        key = m.as_posix()
        if key not in solo:
            print(f"{key}: no solo pass@1 in {', '.join(map(str, a.solo))}; skipped", file=sys.stderr)
            continue
        if key not in done:
            done[key] = pass_rate(m, a.params)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(done, indent=1) + "\n")
        rows[key] = {"solo": macro(solo[key], 100), "reference pass rate": done[key], **sweep_measures(m)}
        print(f"{key}: reference pass rate {done[key]:.3f}, solo pass@1 {rows[key]['solo']:.3f}", flush=True)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
