"""No function of the command line (`cli/`) or of the rollout package (`tandem/rollout/`) takes more than eight
parameters.

`self`/`cls` are not counted, `*args`/`**kwargs` are. What travels together is one frozen value
(`RolloutRequest`, `ModelPair`, `HFOptions`, `LaunchOptions`, `BenchWorkload`, `TinyShape`, the cli's option
tables). The vLLM service's engine start and the per-row turn drivers are left to their own reshaping (`SKIP`).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("cli", "tandem/rollout")
SKIP = ("tandem/rollout/vllm/service.py", "tandem/rollout/vllm/turns.py")
MAX_PARAMS = 8


def count_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    first = (a.posonlyargs + a.args)[:1]
    return n - (1 if first and first[0].arg in ("self", "cls") else 0)


def too_many(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(REPO)}:{n.lineno} {n.name} takes {count_params(n)}" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and count_params(n) > MAX_PARAMS]


def test_counter_counts_what_it_should():
    tree = ast.parse("class C:\n    def m(self, a, /, b, *c, d, **e): ...\ndef f(a, b=1): ...")
    counts = {n.name: count_params(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert counts == {"m": 5, "f": 2}


def test_no_function_takes_more_than_eight_parameters():
    files = [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))
             if str(p.relative_to(REPO)) not in SKIP]
    assert len(files) > 20
    bad = [line for p in files for line in too_many(p)]
    assert not bad, "\n".join(bad)
