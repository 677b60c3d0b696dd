"""Run the study settings (`params.study.yaml`) for several arms and seeds, then tabulate solo validation
accuracy against the base.

The study is where learning must show (issue #4): each arm's senior should end above the base model's
validation accuracy by more than the seed-to-seed noise. One run per (arm, seed) goes through the normal
train stage (`tandem stage train --arm A`) in its own output root `studies/seed-<S>/`, whose params.yaml is the
study params file with only `seed` and `out_root` changed (a complete file: the record of that run). The root
links the main pipeline's prepared data and base model (the study file's data and model sections equal
params.yaml's), so study runs never touch the default run's checkpoints or each other's.
Runs execute in parallel (`--jobs`, one torch thread each) and resume: a rerun continues unfinished arms
(`train.resume: auto`) and skips finished ones.

    python scripts/study.py                                   # params.study.yaml, arms tandem grpo, seeds 0 1
    python scripts/study.py --seeds 0 1 2 --params my.study.yaml   # other settings: another complete file

After training, every run's final checkpoint and the base are scored on the same validation problems, greedy
and sampled (`--samples` per problem at `--temperature`, the same sampling seeds for every model, so the
comparison is paired). RL first sharpens the sampled distribution, so sampled accuracy moves before greedy.
Writes `studies/summary.json` and `studies/summary.md` (per run: base and final accuracy, gain; per arm: mean
gain, seed spread, paired standard error and whether the gain clears the noise).
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
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file (python scripts/study.py): make tandem/ and tasks/ importable

from tasks.common import load_params, read_jsonl  # noqa: E402  (light: no torch)


def prepare_root(params_file: Path, studies: Path, seed: int) -> Path:
    """studies/seed-<S>/ with params.yaml (the study file, this seed, this root) and links to the shared data
    and base."""
    load_params(params_file)  # a complete, valid file before anything is written
    raw = yaml.safe_load(params_file.read_text())
    main_root = (params_file.parent / raw.get("out_root", ".")).resolve()
    root = (studies / f"seed-{seed}").resolve()
    raw.update(seed=seed, out_root=str(root))
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
            rc = subprocess.call([sys.executable, "-m", "cli", "stage", "train", "--arm", arm,
                                  "--params", str(root / "params.yaml")], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                 env=env)
        if rc != 0:
            raise SystemExit(f"study: {arm} in {root} failed (exit {rc}); see {log}")
        print(f"study: {root.name} {arm} done in {time.time() - t0:.0f} s", flush=True)
    return json.loads(summary.read_text())


def score_model(model_dir: Path, rows: list[dict], temperature: float, samples: int, max_new_tokens: int) -> dict:
    """Greedy and sampled per-problem accuracy of one model on `rows` (fixed sampling seed: paired across models)."""
    import torch

    from tandem.generation import accuracy
    from tandem.models import load_model, load_tokenizer

    torch.set_num_threads(1)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    msgs, golds = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    greedy = accuracy(model, tok, msgs, golds, max_new_tokens, temperature=0.0, batch_size=100)
    sampled = accuracy(model, tok, msgs, golds, max_new_tokens, temperature=temperature, batch_size=100,
                       seed=1234, n_samples=samples)
    return {"greedy": greedy["per_problem"], "sampled": sampled["per_problem"]}


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _paired_se(a: list[float], b: list[float]) -> float:
    d = [y - x for x, y in zip(a, b)]
    return statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0


def tabulate(base: dict, finals: dict[tuple[str, int], dict], train: dict[tuple[str, int], dict]) -> tuple[dict, str]:
    """Per run and per arm: accuracy of the base and the final checkpoint, gain, and whether it clears the noise.

    `base` and each `finals` value hold per-problem scores ({"greedy": [...], "sampled": [...]}) on the same
    problems. A gain is a result when its seed mean exceeds both the seed-to-seed spread of the final accuracy
    and twice the paired standard error of one run, and no seed lost accuracy.
    """
    runs, arms = [], {}
    for (arm, seed), f in sorted(finals.items()):
        row = {"arm": arm, "seed": seed}
        for kind in ("greedy", "sampled"):
            b, x = _mean(base[kind]), _mean(f[kind])
            row[kind] = {"base": b, "final": x, "gain": x - b, "paired_se": _paired_se(base[kind], f[kind])}
        t = train.get((arm, seed), {})
        row.update(reward_first=t.get("reward_first"), reward_last=t.get("reward_last"), steps=t.get("steps"),
                   step_seconds=t.get("step_seconds"))
        runs.append(row)
    for arm in sorted({r["arm"] for r in runs}):
        mine = [r for r in runs if r["arm"] == arm]
        arms[arm] = {"seeds": len(mine)}
        for kind in ("greedy", "sampled"):
            gains = [r[kind]["gain"] for r in mine]
            spread = statistics.stdev([r[kind]["final"] for r in mine]) if len(mine) > 1 else 0.0
            se = max(r[kind]["paired_se"] for r in mine)
            noise = max(spread, 2 * se)
            arms[arm][kind] = {"base": mine[0][kind]["base"], "final_mean": _mean([r[kind]["final"] for r in mine]),
                               "gain_mean": _mean(gains), "final_seed_std": spread, "paired_se": se, "noise": noise,
                               "gain_exceeds_noise": _mean(gains) > noise and min(gains) > 0}
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["| arm | seed | greedy base -> final (gain) | sampled base -> final (gain) | train reward first -> last |",
             "|---|---|---|---|---|"]
    for r in runs:
        g, s_ = r["greedy"], r["sampled"]
        lines.append(f"| {r['arm']} | {r['seed']} | {fmt(g['base'])} -> {fmt(g['final'])} ({g['gain']:+.3f}) | "
                     f"{fmt(s_['base'])} -> {fmt(s_['final'])} ({s_['gain']:+.3f}) | "
                     f"{fmt(r['reward_first'])} -> {fmt(r['reward_last'])} |")
    lines += ["", "| arm | seeds | accuracy | mean gain | seed std of final | paired SE | gain > noise |",
              "|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        for kind in ("greedy", "sampled"):
            k = a[kind]
            lines.append(f"| {arm} | {a['seeds']} | {kind} | {k['gain_mean']:+.3f} | {fmt(k['final_seed_std'])} | "
                         f"{fmt(k['paired_se'])} | {'yes' if k['gain_exceeds_noise'] else 'no'} |")
    return {"runs": runs, "arms": arms}, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params.study.yaml",
                    help="complete params file of the study (its out_root's base and data are reused)")
    ap.add_argument("--arms", nargs="+", default=["tandem", "grpo"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    ap.add_argument("--out", default="studies", help="directory for the per-seed roots and the summary")
    ap.add_argument("--samples", type=int, default=4, help="sampled generations per validation problem")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (the paper evaluates at 0.7)")
    ap.add_argument("--val-problems", type=int, default=0, help="validation problems to score (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    a = ap.parse_args(argv)
    studies = (ROOT / a.out).resolve()
    roots = {s: prepare_root((ROOT / a.params).resolve(), studies, s) for s in a.seeds}
    jobs = [(arm, s) for s in a.seeds for arm in a.arms]
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        done = dict(zip(jobs, pool.map(lambda j: run_one(roots[j[1]], j[0]), jobs)))
    from tandem.evaluation import list_checkpoints

    root0 = roots[a.seeds[0]]
    rows = read_jsonl(root0 / "data" / "prepared" / "val.jsonl")[: a.val_problems or None]
    print(f"study: scoring the base and {len(done)} final checkpoints on {len(rows)} validation problems", flush=True)
    dirs = {j: list_checkpoints(roots[j[1]] / "models" / "checkpoints", j[0], root0 / "models" / "base")[-1].path
            for j in jobs}
    # processes, not threads: model loading and sampling touch torch's global state (default dtype, RNG)
    with ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        args = (rows, a.temperature, a.samples, a.max_new_tokens)
        base_f = pool.submit(score_model, root0 / "models" / "base", *args)
        final_f = {j: pool.submit(score_model, dirs[j], *args) for j in jobs}
        base, finals = base_f.result(), {j: f.result() for j, f in final_f.items()}
    summary, table = tabulate(base, finals, done)
    summary["settings"] = {"val_problems": len(rows), "samples": a.samples, "temperature": a.temperature,
                           "max_new_tokens": a.max_new_tokens, "checkpoints": {f"{k[0]}/seed-{k[1]}": os.path.relpath(v, ROOT)
                                                                               for k, v in dirs.items()}}
    (studies / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (studies / "summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
