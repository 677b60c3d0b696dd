"""Run the `study` preset for several arms and seeds, then tabulate solo validation accuracy against the base.

The `study` preset is where learning must show (issue #4): each arm's senior should end above the base model's
greedy validation accuracy by more than the seed-to-seed noise. One run per (arm, seed) goes through the normal
train stage (`tandem stage train --arm A`) in its own output root `studies/seed-<S>/`, which links the main
pipeline's prepared data and base model, so study runs never touch the demo's checkpoints or each other's.
Runs execute in parallel (`--jobs`, one torch thread each) and resume: a rerun continues unfinished arms
(`train.resume: auto`) and skips finished ones.

    python scripts/study.py                       # arms tandem grpo, seeds 0 1, 2 jobs
    python scripts/study.py --seeds 0 1 2 --set train.steps=150

Writes `studies/summary.json` and `studies/summary.md` (per run: base accuracy, final and best accuracy, gain;
per arm: mean gain, seed spread and whether the gain clears the noise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _set(raw: dict, assignment: str) -> None:
    key, _, value = assignment.partition("=")
    node = raw
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = yaml.safe_load(value)


def prepare_root(params_file: Path, studies: Path, seed: int, sets: list[str]) -> Path:
    """studies/seed-<S>/ with params.yaml (preset study, this seed) and links to the shared data and base."""
    raw = yaml.safe_load(params_file.read_text())
    main_root = (params_file.parent / raw.get("out_root", ".")).resolve()
    root = (studies / f"seed-{seed}").resolve()
    raw.update(preset="study", seed=seed, out_root=str(root))
    for s in sets:  # applied after the preset by putting them into the preset itself
        key, _, value = s.partition("=")
        section, _, field = key.partition(".")
        if section in ("rollout", "train", "evaluate", "analyze", "report") and field:
            raw["presets"]["study"].setdefault(section, {})[field] = yaml.safe_load(value)
        else:
            _set(raw, s)
    for rel in ("data/prepared", "models/base"):
        src, dst = main_root / rel, root / rel
        if not src.exists():
            raise SystemExit(f"study: {src} does not exist: run `dvc repro base` (or `tandem stage base`) first")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(src, target_is_directory=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


def run_one(root: Path, arm: str) -> dict:
    summary = root / "metrics" / f"train_{arm}.json"
    log = root / f"train_{arm}.log"
    if not summary.exists():
        env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"))
        t0 = time.time()
        with open(log, "a") as f:
            rc = subprocess.call([sys.executable, "-m", "tandem.cli", "stage", "train", "--arm", arm,
                                  "--params", str(root / "params.yaml")], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                 env=env)
        if rc != 0:
            raise SystemExit(f"study: {arm} in {root} failed (exit {rc}); see {log}")
        print(f"study: {root.name} {arm} done in {time.time() - t0:.0f} s", flush=True)
    return json.loads(summary.read_text())


def tabulate(results: dict[tuple[str, int], dict], n_val: int) -> tuple[dict, str]:
    runs, per_arm = [], {}
    for (arm, seed), s in sorted(results.items()):
        base, last, best = s.get("val_accuracy_initial"), s.get("val_accuracy_last"), s.get("val_accuracy_best")
        gain = None if base is None or last is None else last - base
        runs.append({"arm": arm, "seed": seed, "base": base, "final": last, "best": best, "gain": gain,
                     "reward_first": s.get("reward_first"), "reward_last": s.get("reward_last"),
                     "steps": s.get("steps"), "step_seconds": s.get("step_seconds")})
    for arm in sorted({r["arm"] for r in runs}):
        gains = [r["gain"] for r in runs if r["arm"] == arm and r["gain"] is not None]
        finals = [r["final"] for r in runs if r["arm"] == arm and r["final"] is not None]
        base = next((r["base"] for r in runs if r["arm"] == arm and r["base"] is not None), None)
        spread = statistics.stdev(finals) if len(finals) > 1 else None
        # noise: the larger of the seed-to-seed spread and one binomial standard error of a single measurement
        se = math.sqrt(base * (1 - base) / n_val) if base is not None and n_val else None
        noise = max(x for x in (spread, se) if x is not None) if (spread or se) else None
        mean_gain = statistics.mean(gains) if gains else None
        per_arm[arm] = {"seeds": len(gains), "base": base, "final_mean": statistics.mean(finals) if finals else None,
                        "gain_mean": mean_gain, "final_seed_std": spread, "binomial_se": se, "noise": noise,
                        "gain_exceeds_noise": (mean_gain is not None and noise is not None and mean_gain > noise
                                               and min(gains) > 0)}
    lines = ["| arm | seed | base | final | best | gain | train reward first -> last |", "|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for r in runs:
        lines.append(f"| {r['arm']} | {r['seed']} | {fmt(r['base'])} | {fmt(r['final'])} | {fmt(r['best'])} | "
                     f"{fmt(r['gain'])} | {fmt(r['reward_first'])} -> {fmt(r['reward_last'])} |")
    lines += ["", "| arm | seeds | mean gain | seed std of final | binomial SE | gain > noise |", "|---|---|---|---|---|---|"]
    for arm, a in per_arm.items():
        lines.append(f"| {arm} | {a['seeds']} | {fmt(a['gain_mean'])} | {fmt(a['final_seed_std'])} | "
                     f"{fmt(a['binomial_se'])} | {'yes' if a['gain_exceeds_noise'] else 'no'} |")
    return {"runs": runs, "arms": per_arm, "n_val": n_val}, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params.yaml", help="main params file (its base and data are reused)")
    ap.add_argument("--arms", nargs="+", default=["tandem", "grpo"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    ap.add_argument("--out", default="studies", help="directory for the per-seed roots and the summary")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a params key for the study, e.g. train.steps=150 (repeatable)")
    a = ap.parse_args(argv)
    studies = (ROOT / a.out).resolve()
    roots = {s: prepare_root((ROOT / a.params).resolve(), studies, s, a.set) for s in a.seeds}
    jobs = [(arm, s) for s in a.seeds for arm in a.arms]
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        done = dict(zip(jobs, pool.map(lambda j: run_one(roots[j[1]], j[0]), jobs)))
    val = roots[a.seeds[0]] / "data" / "prepared" / "val.jsonl"
    train_cfg = yaml.safe_load((roots[a.seeds[0]] / "params.yaml").read_text())
    n_val = train_cfg["presets"]["study"].get("train", {}).get("val_problems") or sum(1 for _ in open(val))
    summary, table = tabulate(done, n_val)
    (studies / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (studies / "summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
