"""Level sweep of the tiny base: where the base lands if pretraining stops at each probed skill level.

The default base pretrains with the target schedule and the level stop (`model.pretrain_level`): full learning
rate until greedy accuracy on validation problems reaches the target, then level probes every
`pretrain_level_every` steps on `pretrain_level_problems` problems while the rate decays to its floor, until one
reaches the level: the end. This benchmark runs that recipe once per (kernel path, seed) with the level set to
`--top`, and saves the model at the first level probe at or above each level of `--levels`: each saved model is the
very model the recipe with that level builds, since the probes read the model and never touch the training's
random state. Each saved model is then evaluated as the base stage
evaluates the base (greedy and sampled accuracy on the prepared benchmarks), so one pretraining run per
(kernel, seed) shows the base's spread at every level.

Each run works in `runs/levels/<kernel>-s<seed>/` (the prepare stage, then this base stage), one torch thread,
`ATEN_CPU_CAPABILITY=<kernel>`; a run with `levels.json` already there is not run again. The table prints per
level the steps and base numbers over the runs measured so far.

    python benchmarks/base_levels.py --kernels avx2 --seeds 0 1 2                # measure
    python benchmarks/base_levels.py --table                                     # the table only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ROOT = Path("runs") / "levels"
LEVELS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8)
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


def write_params(root: Path, seed: int, top: float, model: dict | None = None) -> Path:
    """params.yaml with `seed`, `out_root` = `root` and the level at `top` (its other settings as params.yaml,
    but the `model` section's keys given, such as the step cap, the level floor, the level probes' decoding or
    the pretraining loss)."""
    p = yaml.safe_load((REPO / "params.yaml").read_text())
    p["seed"], p["out_root"] = seed, root.as_posix()
    p["model"].update({"pretrain_level": top, "curve_points": 0, **(model or {})})
    (REPO / root).mkdir(parents=True, exist_ok=True)
    (REPO / root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    return root / "params.yaml"


def child(params_path: str, levels: list[float]) -> None:
    """In the run's process: the base stage with a probe that saves the model at each level's first crossing,
    then each saved model evaluated as the base stage evaluates the base."""
    from tandem import models as M
    from tasks import base as B
    from tasks.common import load_params

    params = load_params(params_path)
    mc = params.model
    root = REPO / params.out_root
    saved: list[dict] = []
    original = M.pretrain

    def pretrain(model, tokenizer, texts, cfg, progress=True, seed=0, curve_fn=None, target_fn=None):
        def probe(m, n: int, phase: str) -> float:
            acc = target_fn(m, n, phase)
            for level in levels if phase == "level" else ():
                if acc >= level and all(s["level"] != level for s in saved):
                    dest = root / "levels" / f"{level:.2f}"
                    M.save_model(m, tokenizer, dest)
                    saved.append({"level": level, "probe": round(acc, 4), "dir": str(dest.relative_to(REPO))})
            return acc
        out = original(model, tokenizer, texts, cfg, progress, seed, curve_fn, probe)
        for s in saved:
            s["step"] = next(p["step"] for p in out["target"]["probes"]
                             if p["phase"] == "level" and p["accuracy"] >= s["level"])
        return out

    M.pretrain = pretrain
    t0 = time.perf_counter()
    metrics = B.run(params)
    pre = metrics["pretrain"]
    eval_sets = B._eval_sets(root / "data" / "prepared" / "eval", mc.eval_problems)
    for s in saved:
        acc = B._evaluate(params, REPO / s["dir"], eval_sets)
        s.update({"greedy_macro": acc["greedy"]["macro"], "sampled_macro": acc["sampled"]["macro"],
                  "greedy": {k: v for k, v in acc["greedy"].items() if k != "macro"}})
    doc = {"seed": params.seed, "kernel": os.environ.get("ATEN_CPU_CAPABILITY", ""),
           "level_decoding": mc.pretrain_level_decoding,
           "target_reached_at_step": pre["target"]["reached_at_step"], "steps": pre["steps"],
           "stopped_by": pre["stopped_by"], "probes": pre["target"]["probes"], "levels": saved,
           "seconds": round(time.perf_counter() - t0, 1)}
    (root / "levels.json").write_text(json.dumps(doc, indent=2) + "\n")


def measure(kernel: str, seed: int, top: float, levels: list[float], model: dict | None = None,
            base: Path = ROOT) -> None:
    root = base / f"{kernel}-s{seed}"
    params = write_params(root, seed, top, model)
    env = {**os.environ, **ENV, "ATEN_CPU_CAPABILITY": kernel, "PYTHONPATH": str(REPO)}
    with open(REPO / root / "levels.log", "w") as log:
        subprocess.run([sys.executable, "-m", "cli", "stage", "prepare", "--params", str(params)], cwd=REPO,
                       env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        subprocess.run([sys.executable, __file__, "--child", str(params), "--levels", *map(str, levels)],
                       cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    print(f"{root}: done", flush=True)


def table(base: Path = ROOT) -> str:
    docs = [json.loads(p.read_text()) for p in sorted((REPO / base).glob("*-s*/levels.json"))]
    lines = ["| level | runs reaching it | step reached (min-max) | base greedy macro (min-max) | "
             "base sampled macro (min-max) |", "|---|---|---|---|---|"]
    levels = sorted({s["level"] for d in docs for s in d["levels"]})
    for level in levels:
        rows = [s for d in docs for s in d["levels"] if s["level"] == level]
        g, sm, st = ([r[k] for r in rows] for k in ("greedy_macro", "sampled_macro", "step"))
        lines.append(f"| {level:.2f} | {len(rows)} of {len(docs)} | {min(st):,}-{max(st):,} | "
                     f"{min(g):.3f}-{max(g):.3f} | {min(sm):.3f}-{max(sm):.3f} |")
    runs = ", ".join(f"{d['kernel']}-s{d['seed']} (target {d['target_reached_at_step']}, stop {d['steps']})"
                     for d in docs)
    return "\n".join(lines) + f"\n\nruns: {runs}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--kernels", nargs="+", default=["avx2"], choices=("default", "avx2", "avx512"))
    ap.add_argument("--levels", type=float, nargs="+", default=list(LEVELS))
    ap.add_argument("--top", type=float, default=0.85, help="the level the sweep runs to (or the step cap)")
    ap.add_argument("--steps", type=int, help="the step cap (default: params.yaml's model.pretrain_steps)")
    ap.add_argument("--floor", type=float, help="the level phase's rate floor (default: params.yaml's "
                    "model.pretrain_level_floor); give another --root with it")
    ap.add_argument("--decoding", choices=("greedy", "evaluation", "likelihood"),
                    help="what the level probes measure (default: params.yaml's model.pretrain_level_decoding); "
                    "give another --root with it")
    ap.add_argument("--loss", choices=("completion", "sequence"),
                    help="the tokens pretraining's loss covers (default: params.yaml's model.pretrain_loss); give "
                    "another --root with it")
    ap.add_argument("--order", choices=("given", "shuffled"),
                    help="the pretraining questions' line order (default: params.yaml's "
                    "model.pretrain_question_order); give another --root with it")
    ap.add_argument("--root", type=Path, default=ROOT, help=f"where the runs go (default {ROOT})")
    ap.add_argument("--table", action="store_true", help="print the table of the runs measured so far")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        sys.path.insert(0, str(REPO))
        child(a.child, a.levels)
        return 0
    if not a.table:
        model = {k: v for k, v in {"pretrain_steps": a.steps, "pretrain_level_floor": a.floor,
                                   "pretrain_level_decoding": a.decoding, "pretrain_loss": a.loss,
                                   "pretrain_question_order": a.order}.items()
                 if v is not None}
        for kernel in a.kernels:
            for seed in a.seeds:
                if not (REPO / a.root / f"{kernel}-s{seed}" / "levels.json").exists():
                    measure(kernel, seed, a.top, a.levels, model, a.root)
    print(table(a.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
