"""Seeded generator of multi-step arithmetic word problems with `\n\n`-separated steps and `\boxed{}` answers.

A problem starts a person with a small count of objects and applies 2-8 operations (+k, -k, x2, x3) with
single-digit operands, every intermediate value kept within [0, max_value]. Many small steps are learnable
by a ~1M-parameter model; two-digit operands are not (see shared notes, toy pilot). The reference solution
writes one step per paragraph, in one of two styles (verbose or terse), and ends with `\boxed{answer}`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass

NAMES = ["Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jack", "Kim", "Leo", "Mia", "Ned",
         "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara"]
OBJECTS = ["apples", "books", "coins", "marbles", "pens", "shells", "stamps", "cards", "eggs", "plums"]


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str
    solution: str
    n_steps: int
    source: str = "synthetic"

    def to_dict(self) -> dict:
        return asdict(self)


def _ops(rng: random.Random, start: int, n_steps: int, max_operand: int, max_value: int) -> list[tuple[str, int, int, int]]:
    """Draw `n_steps` operations keeping every value in [0, max_value]; returns (op, operand, before, after)."""
    value, out = start, []
    for _ in range(n_steps):
        choices = []
        if value + 1 <= max_value:
            choices.append("+")
        if value >= 1:
            choices.append("-")
        if 1 <= value and value * 2 <= max_value:
            choices.append("x")
        op = rng.choice(choices)
        if op == "+":
            k = rng.randint(1, min(max_operand, max_value - value))
            new = value + k
        elif op == "-":
            k = rng.randint(1, min(max_operand, value))
            new = value - k
        else:
            ks = [m for m in (2, 3) if value * m <= max_value and m <= max(max_operand, 2)]
            k = rng.choice(ks)
            new = value * k
        out.append((op, k, value, new))
        value = new
    return out


def _verbs(op: str, k: int, obj: str) -> tuple[str, str]:
    """(question clause, verbose solution clause) for one operation."""
    if op == "+":
        return f"gets {k} more {obj}", f"gets {k} more"
    if op == "-":
        return f"gives away {k} {obj}", f"gives away {k}"
    word = {2: "doubles", 3: "triples"}[k]
    return f"{word} the {obj}", f"{word} them"


def make_problem(rng: random.Random, n_steps: int, max_operand: int = 9, max_value: int = 40,
                 style: str | None = None) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    start = rng.randint(2, min(15, max_value))
    ops = _ops(rng, start, n_steps, max_operand, max_value)
    clauses = [f"{name} has {start} {obj}."]
    for i, (op, k, _, _) in enumerate(ops):
        q, _ = _verbs(op, k, obj)
        clauses.append(f"Then {name} {q}." if i else f"{name} {q}.")
    clauses.append(f"How many {obj} does {name} have now?")
    problem = " ".join(clauses)
    style = style or rng.choice(["verbose", "terse"])
    steps = []
    for op, k, before, after in ops:
        sym = {"+": "+", "-": "-", "x": "x"}[op]
        eq = f"{before} {sym} {k} = {after}"
        if style == "verbose":
            _, v = _verbs(op, k, obj)
            steps.append(f"{name} {v}: {eq}.")
        else:
            steps.append(eq)
    answer = str(ops[-1][3])
    steps.append(f"The answer is \\boxed{{{answer}}}." if style == "verbose" else f"\\boxed{{{answer}}}")
    solution = "\n\n".join(steps)
    pid = "syn-" + hashlib.sha1(problem.encode()).hexdigest()[:12]
    return Problem(id=pid, problem=problem, answer=answer, solution=solution, n_steps=n_steps)


def generate(n: int, min_steps: int, max_steps: int, seed: int, max_operand: int = 9, max_value: int = 40,
             exclude: set[str] | None = None, prefix: str = "") -> list[Problem]:
    """`n` distinct problems with a step count uniform in [min_steps, max_steps], deterministic in `seed`.

    Problems whose text is in `exclude` (problem strings) are skipped, so splits never share a problem.
    """
    rng = random.Random(f"{seed}-{min_steps}-{max_steps}-{prefix}")
    seen = set(exclude or ())
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could only generate {len(out)} distinct problems of {n} requested "
                             f"({min_steps}-{max_steps} steps): the space is too small")
        p = make_problem(rng, rng.randint(min_steps, max_steps), max_operand, max_value)
        if p.problem in seen:
            continue
        seen.add(p.problem)
        out.append(p)
    return out
