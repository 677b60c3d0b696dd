"""Which library settings change the base's bytes: a short pretraining under each, hashed, in a process of its own.

Each setting (environment variables read when torch loads: torch's kernel path `ATEN_CPU_CAPABILITY`, oneMKL's
branch `MKL_CBWR` and instruction cap `MKL_ENABLE_INSTRUCTIONS`, oneDNN's `ONEDNN_MAX_CPU_ISA`) trains the default
model (params.yaml's model section) for `--steps` steps on the first `--rows` prepared training problems with one
torch thread, then prints the hash of its weights (`tandem.train.numerics.weights_hash`, first 16 hex digits), the final loss and the training time.
Two settings with one hash do the same arithmetic; run it on two machines to compare them (docs/results.md,
"Pinning the arithmetic instead").

    python benchmarks/numerics.py                      # the settings below
    python benchmarks/numerics.py --env "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE" --env ""

Needs `data/prepared/train.jsonl` and `models/base` (its tokenizer): run `make run` (or `dvc pull`) first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = (
    "ATEN_CPU_CAPABILITY=avx512",
    "ATEN_CPU_CAPABILITY=avx2",
    "ATEN_CPU_CAPABILITY=default",
    "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2",
    "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE",
    "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=SSE4_2",
    "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=SSE41",
)


def child(steps: int, rows: int) -> dict:
    """In the measured process: pretrain, hash the weights."""
    import dataclasses

    import torch

    from tandem import models as M
    from tandem.train.numerics import weights_hash
    from tasks.common import load_params

    torch.set_num_threads(1)
    mc = dataclasses.replace(load_params(REPO / "params.yaml").model, pretrain_steps=steps, pretrain_target=0.0,
                             pretrain_level=0.0, curve_points=0)
    tok = M.load_tokenizer(REPO / "models" / "base")
    with open(REPO / "data" / "prepared" / "train.jsonl") as f:
        problems = [json.loads(line) for _, line in zip(range(rows), f)]
    model = M.build_tiny_model(tok, mc, 0)
    out = M.pretrain(model, tok, [(r["prompt"], r["solution"]) for r in problems], mc, progress=False, seed=0)
    return {"hash": weights_hash(model)[:16], "final_loss": out["final_loss"], "seconds": round(out["seconds"], 1),
            "capability": torch.backends.cpu.get_cpu_capability()}


def measure(setting: str, steps: int, rows: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
    env.update(dict(kv.split("=", 1) for kv in setting.split()))
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps), "--rows", str(rows)], env=env,
                         cwd=REPO, capture_output=True, text=True, check=True)
    return {"setting": setting or "(none)", **json.loads(out.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", action="append", help="one setting: space-separated NAME=VALUE pairs (repeatable; "
                    "default: the settings listed in this script)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.steps, a.rows)))
        return 0
    print("| setting | weights hash | final loss | seconds | torch kernels |\n|---|---|---|---|---|")
    for setting in a.env if a.env is not None else SETTINGS:
        r = measure(setting, a.steps, a.rows)
        print(f"| {r['setting']} | {r['hash']} | {r['final_loss']} | {r['seconds']} | {r['capability']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
