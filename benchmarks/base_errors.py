"""What a tiny base gets wrong: the first wrong step of its greedy solutions, sorted into kinds.

For each model directory, the greedy solution (decoded as the base stage decodes: `tandem.generation`) to each
of the first `--n` problems with `--steps` steps of a benchmark file is read step by step against the reference solution
(`a op b = c` per line). The first step that differs decides the problem's kind:

- wrong operand: the step's operand `b` is not the question's (the model copied another number word);
- arithmetic: the right operands and operation, a wrong result (`carry`: off by exactly 10, the tens digit);
- previous result: the step starts from another number than the last result (or applies another operation);
- other: no step differs but the final answer does, or a line without an equation.

    python benchmarks/base_errors.py models/base runs/levels/avx2-s0/levels/0.65

prints one table row per model (docs/results.md, "The base: robust to the seed and the machine").
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(r"(\d+) ([-+x/]) (\d+) = (\d+)")
KINDS = ("right", "wrong operand", "arithmetic", "carry", "previous result", "other")


def kind_of(reference: str, generated: str) -> str:
    """The kind of `generated`'s first wrong step against `reference` (both solutions as text)."""
    gold, mine = STEP.findall(reference), STEP.findall(generated)
    for g, m in zip(gold, mine):
        if g == m:
            continue
        if m[0] != g[0] or m[1] != g[1]:
            return "previous result"
        if m[2] != g[2]:
            return "wrong operand"
        return "carry" if abs(int(m[3]) - int(g[3])) == 10 else "arithmetic"
    if len(mine) == len(gold) and mine == gold:
        return "right"
    return "other"


def classify(model_dir: Path, rows: list[dict]) -> dict[str, int]:
    """Kind -> problems, decoding greedily as the base stage does (`tandem.generation`, the hf engine)."""
    import torch

    from tandem.generation import Draws, default_score_fn, eos_token_ids, generate_and_score
    from tandem.models import load_model, load_tokenizer
    from tandem.rollout.core import SamplingParams
    from tandem.rollout.factory import make_engine
    from tandem.rollout.request import RolloutSettings
    from tandem.rollout.schedule import ScheduleSpec

    torch.set_num_threads(1)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    settings = RolloutSettings(ScheduleSpec("solo"), SamplingParams(temperature=0.0, max_new_tokens=256),
                               batch_size=len(rows))
    records = generate_and_score(make_engine(model, None, tok, "hf"), tok, rows, settings, Draws(1, 0),
                                 default_score_fn(), eos_ids=eos_token_ids(tok, model))
    counts = dict.fromkeys(KINDS, 0)
    for r, rec in zip(rows, records):
        counts[kind_of(r["solution"], rec["text"])] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--bench", type=Path, default=REPO / "data" / "prepared" / "eval" / "arith-long.jsonl")
    ap.add_argument("--steps", type=int, default=8, help="the problems' step count")
    ap.add_argument("--n", type=int, default=25, help="the first N such problems")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    with open(a.bench) as f:
        rows = [r for r in map(json.loads, f) if r.get("n_steps") == a.steps][:a.n]
    print("| model | " + " | ".join(KINDS) + " |\n|---|" + "---|" * len(KINDS))
    for m in a.models:
        counts = classify(m, rows)
        print(f"| {m} | " + " | ".join(str(counts[k]) for k in KINDS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
