"""Measure the record's band: where the default run's headline numbers land over seeds and CPU kernel paths.

A rerun of the default run on another machine does not repeat the record's bytes: the math kernels round
differently there and training amplifies it (tandem/machine.py). What it should land within is the band this
script measures on one machine: the default `params.yaml` with each seed of `--seeds`, each on each of torch's
CPU kernel paths of `--kernels` (`ATEN_CPU_CAPABILITY`: `default` is the portable scalar code a CPU without
AVX2 runs, `avx2`, `avx512`; a path the CPU lacks falls back, so this script refuses it), each run in an output
root of its own, `runs/band/<kernel>-s<seed>/` (never over the record), one at a time with one torch thread.
`--through base` (the default) builds the base only (prepare and base stages: the base's greedy and sampled
macro); `--through eval` runs the whole pipeline (`tandem run --direct`: also solo pass@1 of every arm).

The band of each headline number (the labels of `tasks.record.HEADLINE`) is [lowest, highest] over the runs
that measured it; `metrics/band.json` keeps it with every run's numbers, its kernel path and the machine, and
the closing message of `tandem run` sets a run's numbers beside it (`tasks.record.record_summary`). A run
already measured is not run again (delete its folder to rerun it).

    python scripts/record_band.py --seeds 0 1 2 --kernels default avx2 avx512       # measure, then write
    python scripts/record_band.py --write-only                                      # write from runs/band/*
    python scripts/record_band.py --write-only --also runs/levels                   # and the level sweep's runs

`--also DIR` counts the runs of `benchmarks/base_levels.py` under DIR as well (its `levels.json` marks a finished
run; a run that went on through the later stages also gives solo pass@1), but only those whose params are the
default recipe's with their own seed and output root, the learning curve aside (`curve_points` reads the model,
never changes it): a sweep run with another level or cap is refused by name.
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
sys.path.insert(0, str(REPO))

from tasks.record import BAND_FILE, HEADLINE, _get  # noqa: E402

BAND_ROOT = Path("runs") / "band"
KERNELS = ("default", "avx2", "avx512")
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


def _root(kernel: str, seed: int) -> Path:
    return BAND_ROOT / f"{kernel}-s{seed}"


def write_params(root: Path, seed: int) -> Path:
    """params.yaml with `seed` and `out_root` = `root`: the default run, elsewhere."""
    p = yaml.safe_load((REPO / "params.yaml").read_text())
    p["seed"], p["out_root"] = seed, root.as_posix()
    (REPO / root).mkdir(parents=True, exist_ok=True)
    path = root / "params.yaml"
    (REPO / path).write_text(yaml.safe_dump(p, sort_keys=False))
    return path


def measure(kernel: str, seed: int, through: str) -> None:
    """One run of the default recipe with `seed` on kernel path `kernel`, in its own output root."""
    root = _root(kernel, seed)
    params = write_params(root, seed)
    env = {**os.environ, **ENV, "ATEN_CPU_CAPABILITY": kernel, "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "cli"]
    cmds = ([cli + ["stage", "prepare", "--params", str(params)], cli + ["stage", "base", "--params", str(params)]]
            if through == "base" else [cli + ["run", "--direct", "--params", str(params)]])
    t0 = time.perf_counter()
    with open(REPO / root / "band.log", "w") as log:
        for cmd in cmds:
            subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    run = {"seed": seed, "kernel": kernel, "through": through, "seconds": round(time.perf_counter() - t0, 1)}
    (REPO / root / "band-run.json").write_text(json.dumps(run, indent=2) + "\n")
    print(f"{root}: {run['seconds']} s", flush=True)


def same_recipe(root: Path) -> str | None:
    """Why the run in `root` is not the default recipe (None when it is): its params.yaml against params.yaml
    with the run's own seed and output root, the learning curve's settings aside."""
    def flat(p: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in p.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and prefix == "" else {f"{prefix}{k}": v})
        return out
    skip = {"seed", "out_root", "model.curve_points", "data.eval_seed"}
    mine = flat(yaml.safe_load((REPO / "params.yaml").read_text()))
    theirs = {**LATER_KEYS, **flat(yaml.safe_load((REPO / root / "params.yaml").read_text()))}
    diff = sorted(k for k in set(mine) | set(theirs) if k not in skip and mine.get(k) != theirs.get(k))
    # the benchmarks' seed as drawn: a params file from before data.eval_seed drew them with the run's seed
    seed = theirs["seed"]
    if _eval_seed(mine, seed) != _eval_seed(theirs, seed):
        diff.append("data.eval_seed")
    if diff and set(diff) <= CAP and _cap_never_acted(root, mine, theirs):
        diff = []
    return f"{root}: not the default recipe ({', '.join(diff)} differ)" if diff else None


CAP = {"model.pretrain_steps", "model.pretrain_warmup"}
# keys added after some runs were made, with what a params file without them did
LATER_KEYS = {"model.pretrain_level_decoding": "greedy", "model.pretrain_loss": "completion",
              "model.pretrain_question_order": "given"}


def _eval_seed(flat_params: dict, seed: int) -> int:
    """The seed a run's evaluation benchmarks were drawn with (tasks.prepare.eval_seed; -1 or absent: its own)."""
    es = flat_params.get("data.eval_seed", -1)
    return seed if es < 0 else es


def _cap_never_acted(root: Path, mine: dict, theirs: dict) -> bool:
    """A run under another step cap built the default recipe's base when both warm up for the same number of
    steps (`tandem.models.warmup_steps`; the only other use of the cap is the cooldown it forces
    pretrain_cooldown steps before its end) and the run reached the level before either cap's forced
    cooldown could start: up to there both schedules are the same function of the step."""
    from tandem.models import warmup_steps

    def warm(p: dict) -> int:
        return warmup_steps(p["model.pretrain_warmup"], p["model.pretrain_steps"])
    base = json.loads((REPO / root / "metrics" / "base.json").read_text())
    target = (base.get("pretrain") or {}).get("target") or {}
    level_at = target.get("level_reached_at_step")
    first_forced = min(p["model.pretrain_steps"] for p in (mine, theirs)) - mine["model.pretrain_cooldown"]
    return warm(mine) == warm(theirs) and level_at is not None and level_at < first_forced


def collect(root: Path) -> dict | None:
    """A measured run's headline numbers (None when it did not finish)."""
    done = REPO / root / "band-run.json"
    sweep = REPO / root / "levels.json"
    if done.exists():
        row = json.loads(done.read_text())
    elif sweep.exists():
        if (why := same_recipe(root)):
            raise SystemExit(why)
        lv = json.loads(sweep.read_text())
        row = {"seed": lv["seed"], "kernel": lv["kernel"], "seconds": lv["seconds"], "by": "benchmarks/base_levels.py",
               "through": "eval" if (REPO / root / "metrics" / "eval.json").exists() else "base"}
    else:
        return None
    values: dict[str, float] = {}
    for label, rel, keys in HEADLINE:
        f = REPO / root / rel
        if not f.exists():
            continue
        doc = json.loads(f.read_text())
        if "*" in keys:
            i = keys.index("*")
            for arm in sorted(_get(doc, keys[:i]) or {}):
                v = _get(doc, keys[:i] + (arm,) + keys[i + 1:])
                if isinstance(v, (int, float)):
                    values[label.format(arm=arm)] = round(float(v), 4)
        elif isinstance(_get(doc, keys), (int, float)):
            values[label] = round(float(_get(doc, keys)), 4)
    base = json.loads((REPO / root / "metrics" / "base.json").read_text())
    target = (base.get("pretrain") or {}).get("target") or {}
    row.update({"root": root.as_posix(), "pretrain_steps": (base.get("pretrain") or {}).get("steps"),
                "target_reached_at_step": target.get("reached_at_step"), "values": values})
    return row


def band_of(runs: list[dict]) -> dict[str, list[float]]:
    """Headline label -> [lowest, highest] over the runs that measured it."""
    out: dict[str, list[float]] = {}
    for r in runs:
        for label, v in r["values"].items():
            lo, hi = out.get(label, [v, v])
            out[label] = [min(lo, v), max(hi, v)]
    return dict(sorted(out.items()))


def write_band(out: Path, also: list[Path] = ()) -> dict:
    """Collect every finished run under runs/band/ (and the folders of `also`) into the band file."""
    from tandem.machine import describe, summary

    runs = [r for folder in (BAND_ROOT, *also) for d in sorted((REPO / folder).glob("*-s*"))
            if (r := collect(d.relative_to(REPO)))]
    if not runs:
        raise SystemExit(f"no finished run under {BAND_ROOT}/: measure some first")
    doc = {"what": "where the default run (params.yaml) lands over seeds and CPU kernel paths: per headline number "
                   "of the closing comparison, [lowest, highest] over the runs below",
           "how": "python scripts/record_band.py (docs/results.md, \"The record's band\")",
           "machine": summary(describe()), "band": band_of(runs), "runs": runs}
    (REPO / out).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--through", choices=("base", "eval"), default="base")
    ap.add_argument("--write-only", action="store_true", help="write the band from the runs already measured")
    ap.add_argument("--out", type=Path, default=BAND_FILE)
    ap.add_argument("--also", type=Path, nargs="*", default=[],
                    help="folders of benchmarks/base_levels.py runs to count as well (the default recipe only)")
    a = ap.parse_args(argv)
    if not a.write_only:
        import torch

        best = torch.backends.cpu.get_cpu_capability().lower()
        for kernel in a.kernels:
            if KERNELS.index(kernel) > KERNELS.index(best if best in KERNELS else "default"):
                raise SystemExit(f"this CPU's best kernel path is {best}: it cannot run {kernel}")
        for kernel in a.kernels:
            for seed in a.seeds:
                if not (REPO / _root(kernel, seed) / "band-run.json").exists():
                    measure(kernel, seed, a.through)
    doc = write_band(a.out, a.also)
    for label, (lo, hi) in doc["band"].items():
        print(f"{label}: {lo:.3f}-{hi:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
