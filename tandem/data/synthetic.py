r"""Seeded generator of multi-step arithmetic word problems with `\n\n`-separated steps and `\boxed{}` answers.

A problem starts a person with a small count of objects and applies 2-8 operations (+k, -k, x2, x3) with
operands up to `max_operand` written as words, every intermediate value kept within [0, max_value]. Each
operation is its own line opened by an ordinal and then the operand ("Second, three coins are lost."); each
solution step opens with the same ordinal, then (verbose style, 70% of solutions) restates the operation,
then writes the equation; the last line is `\boxed{answer}`. Ordinal keys with the operand right behind them
make retrieval one induction step, which a ~0.3M-parameter model learns reliably within minutes on a CPU; the
default two-digit values (`max_value` 99) and operands up to twenty then set how good that model gets, and
long problems stay harder because per-step slips compound.

Solution styles (`STYLES`, drawn per problem with the shares `data.solution_styles` gives):
- `verbose`: "Third, five more are found: 45 + 5 = 50" (ordinal key, restatement, equation);
- `terse`: "Third: 45 + 5 = 50" (ordinal key, equation);
- `compact`: "45+5=50" (the equation alone, no spaces: no ordinal to match, so the step's operand is found by
  counting lines, and the text is about half as long as verbose). Rare in a base's pretraining data, it is the
  toy analogue of a drifted reasoning dialect: shorter (it fits a tight budget) and harder for a model that
  mostly saw the keyed styles to continue.
- `coded`: "c)45+5=50" (a letter key for the step's position, a, b, c, ..., then the compact equation): keyed for
  a model that learned the letters, as opaque as compact to one that never saw them. The second dialect of the
  junior positive control (studies/junior-control/registration.md).
- `annotated`: "Third, five more are found: 45 + 5 = <<45+5=50>>50" (the verbose step with GSM8K's calculator
  annotation `<<expression=result>>` before the result; `x` is written `*` inside it, as a calculator reads it):
  the jargon of West et al.'s tandem training, on the synthetic problems. Everything a keyed reader needs is
  still there, so a model that never saw the annotations may well continue such text at no cost.
- `reversed`: "Third; 54 + 50 = 05" (the ordinal, a semicolon, then the equation with every number written with
  at least two digits, ones digit first: 45 + 5 = 50 written little-endian; the `\boxed{}` answer stays in
  ordinary digits). A notation a reader who never learned it misreads with confidence: read as ordinary numbers
  the equation is often still true (40 + 20 = 60 for 4 + 2 = 6), but the running value it carries forward is
  wrong. The pre-listed second jargon of the SmolLM2 control (studies/jargon-smollm2/registration.md).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import asdict, dataclass

from tandem.config import SOLUTION_STYLES

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
    style: str = "verbose"

    def to_dict(self) -> dict:
        """The row fields a data file holds (the style is not one: `solution_style` reads it off the text)."""
        d = asdict(self)
        d.pop("style")
        return d


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


STYLES = SOLUTION_STYLES
# Default shares of the reference solution styles. Verbose away from one half on purpose: at 50/50 the first
# solution token (":" for terse, "," for verbose) is a coin flip for the model, so its greedy decoding switched
# style between neighbouring checkpoints and greedy accuracy jumped by tens of points. A clear majority keeps
# greedy decoding in one style (the verbose one, which restates the operation and so copies its operand
# locally), while sampling still shows both styles: a cheap, visible drift axis under RL.
DEFAULT_STYLES = {"verbose": 0.7, "terse": 0.3}


def draw_style(rng: random.Random, shares: dict[str, float] | None = None) -> str:
    """One style by its share: a single uniform draw, cut in `STYLES` order (so shares {verbose: 0.7, terse:
    0.3} consume exactly the draw `rng.random() < 0.7` always did)."""
    shares = DEFAULT_STYLES if shares is None else shares
    u, acc = rng.random(), 0.0
    chosen = None
    for name in STYLES:
        w = float(shares.get(name, 0.0))
        if w <= 0:
            continue
        chosen = name
        acc += w
        if u < acc:
            return name
    if chosen is None:
        raise ValueError(f"solution style shares {shares} give no style a positive share")
    return chosen  # u beyond the rounded sum: the last style with a share

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
LETTER_KEYS = "abcdefghijklmnopqrst"  # the coded style's key of step i (as many as ORDINALS)
ORDINALS = ["First", "Second", "Third", "Fourth", "Fifth", "Sixth", "Seventh", "Eighth", "Ninth", "Tenth",
            "Eleventh", "Twelfth", "Thirteenth", "Fourteenth", "Fifteenth", "Sixteenth", "Seventeenth",
            "Eighteenth", "Nineteenth", "Twentieth"]


def reversed_number(n: int) -> str:
    """`n` little-endian: its digits ones first, padded to at least two ("04" -> "40" for 4, "21" for 12)."""
    return str(n).zfill(2)[::-1]


# A GSM8K calculator annotation: `<<`, an expression, `=`, a result, `>>` (no `<`, `>` or newline inside).
ANNOTATION = re.compile(r"<<[^<>=\n]+=[^<>=\n]+>>")
# A `reversed` step: ordinal, semicolon, then an equation of numbers of two or more digits.
_REVERSED = re.compile(r"(\w+); (\d{2,}) [-+x] (\d{2,}) = (\d{2,})$")


def _number(k: int) -> str:
    return NUMBER_WORDS[k] if 0 <= k < len(NUMBER_WORDS) else str(k)


def _clauses(op: str, k: int, obj: str) -> tuple[str, str]:
    """(question clause, verbose restatement) for one operation; both open with the operand as a word.

    The operand comes right after the ordinal ("Third, five more ..."), so finding it is one induction step
    (match "Third ," in the question, read the next word); a tiny model learns that early and reliably,
    which leaves the arithmetic, not the retrieval, to set how good the base gets.
    """
    if op == "x":
        verb = {2: "double", 3: "triple"}[k]
        return f"{verb} the {obj}", f"{verb} them"
    one = k == 1
    noun = obj[:-1] if one and obj.endswith("s") else obj
    be = "is" if one else "are"
    if op == "+":
        return f"{_number(k)} more {noun} {be} found", f"{_number(k)} more {be} found"
    return f"{_number(k)} {noun} {be} lost", f"{_number(k)} {be} lost"


def make_problem(rng: random.Random, n_steps: int, max_operand: int = 9, max_value: int = 40,
                 style: str | None = None, styles: dict[str, float] | None = None,
                 shuffled: bool = False) -> Problem:
    """One problem: a start count, then one line per operation keyed by its ordinal ("Second, ...").

    `shuffled` puts the operation lines of the question in random order (the solution keeps the ordinals'
    order), so that only matching the ordinal finds a step's operation, never its line's position.

    The ordinal opens both the question line and the solution step, so each step finds its operation by
    matching one token, and operands are number words (a word is retrieved far more reliably than a digit
    by a tiny model; the equation then turns it into digits). The verbose style restates the operation
    before the equation, the terse style keeps the ordinal and the equation, the compact style writes the
    equation alone without spaces. `style` forces one; otherwise it is drawn with the `styles` shares.
    """
    if n_steps > len(ORDINALS):
        raise ValueError(f"at most {len(ORDINALS)} steps are supported (ordinals up to "
                         f"{ORDINALS[-1]!r}), got {n_steps}")
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    start = rng.randint(2, min(15, max_value))
    ops = _ops(rng, start, n_steps, max_operand, max_value)
    lines = [f"{name} has {start} {obj}."]
    body = [f"{ORDINALS[i]}, {_clauses(op, k, obj)[0]}." for i, (op, k, _, _) in enumerate(ops)]
    if shuffled:
        rng.shuffle(body)
    lines += body
    lines.append(f"How many {obj} does {name} have now?")
    problem = "\n".join(lines)
    style = style or draw_style(rng, styles)
    if style not in STYLES:
        raise ValueError(f"unknown solution style {style!r}; known: {', '.join(STYLES)}")
    steps = [render_step(i, op, k, before, after, style) for i, (op, k, before, after) in enumerate(ops)]
    answer = str(ops[-1][3])
    steps.append(f"\\boxed{{{answer}}}")
    solution = "\n\n".join(steps)
    pid = "syn-" + hashlib.sha1(problem.encode()).hexdigest()[:12]
    return Problem(id=pid, problem=problem, answer=answer, solution=solution, n_steps=n_steps, style=style)


def render_step(i: int, op: str, k: int, before: int, after: int, style: str) -> str:
    """Solution step `i` (0-based) of one operation, `before op k = after`, written in `style`."""
    eq = f"{before} {op} {k} = {after}"
    if style == "verbose":
        return f"{ORDINALS[i]}, {_clauses(op, k, '')[1]}: {eq}"
    if style == "terse":
        return f"{ORDINALS[i]}: {eq}"
    if style == "coded":
        return f"{LETTER_KEYS[i]}){before}{op}{k}={after}"
    if style == "annotated":
        calc = f"{before}{'*' if op == 'x' else op}{k}={after}"
        return f"{ORDINALS[i]}, {_clauses(op, k, '')[1]}: {before} {op} {k} = <<{calc}>>{after}"
    if style == "reversed":
        r = reversed_number
        return f"{ORDINALS[i]}; {r(before)} {op} {r(k)} = {r(after)}"
    return f"{before}{op}{k}={after}"


# A step's equation at the end of its line, in any style: `before op k = after` (spaces optional, a
# calculator annotation allowed before the result).
_EQUATION = re.compile(r"(\d+) ?([-+x]) ?(\d+) ?= ?(?:<<[^<>\n]*>>)?(\d+)$")


def restyle(solution: str, style: str) -> str:
    """The same solution written in another style: its steps' equations read off the text and each step
    rendered as `make_problem` renders `style` (the `\\boxed{}` line kept). What a reader of the reference
    solution would count as the same solution in another of the corpus's styles.

    Raises ValueError when a step is not an equation this generator writes."""
    if style not in STYLES:
        raise ValueError(f"unknown solution style {style!r}; known: {', '.join(STYLES)}")
    *steps, boxed = solution.split("\n\n")
    little_endian = solution_style(solution) == "reversed"
    out = []
    for i, line in enumerate(steps):
        m = _EQUATION.search(line)
        if m is None:
            raise ValueError(f"step {i + 1} of the solution is not an equation this generator writes: {line!r}")
        before, op, k, after = m.group(1), m.group(2), m.group(3), m.group(4)
        if little_endian:
            before, k, after = before[::-1], k[::-1], after[::-1]
        out.append(render_step(i, op, int(k), int(before), int(after), style))
    return "\n\n".join([*out, boxed])


def in_order(problem: str) -> str:
    """A question with its operation lines in the ordinals' order: the text a shuffled question has in order
    (what excluding a problem compares, so a shuffled copy of an excluded problem is excluded too)."""
    lines = problem.split("\n")
    body = lines[1:-1]
    if not all(line.split(",", 1)[0] in ORDINALS for line in body):
        return problem
    body.sort(key=lambda line: ORDINALS.index(line.split(",", 1)[0]))
    return "\n".join([lines[0], *body, lines[-1]])


def solution_style(text: str) -> str:
    """The style a solution is written in, read off its first step (its first line): "annotated" (the line
    carries a calculator annotation `<<expression=result>>`, whatever else it holds), "reversed" (an ordinal, a
    semicolon, then an equation of numbers of two or more digits), "verbose" (an ordinal, then a comma), "terse"
    (an ordinal, then a colon), "compact" (an equation with no ordinal), "coded" (a letter key and ")", then an
    equation) or "other"."""
    first = text.lstrip().split("\n", 1)[0]
    if ANNOTATION.search(first):
        return "annotated"
    head = first.split(" ", 1)[0]
    if head.endswith(";") and head[:-1] in ORDINALS:
        return "reversed" if _REVERSED.fullmatch(first.rstrip()) else "other"
    if head.rstrip(",:") in ORDINALS:
        return "verbose" if head.endswith(",") else "terse" if head.endswith(":") else "other"
    if len(first) > 2 and first[0] in LETTER_KEYS and first[1] == ")":
        rest = first[2:]
        return "coded" if rest[:1].isdigit() and "=" in rest and " " not in rest else "other"
    return "compact" if first[:1].isdigit() and "=" in first and " " not in first else "other"


@dataclass(frozen=True)
class ProblemShape:
    """What every problem of a set shares besides its step count: the largest operand, the largest running
    value, the shares of the solution styles (None: `make_problem`'s default) and whether the question's
    operation lines come in random order (`make_problem`'s `shuffled`)."""

    max_operand: int = 9
    max_value: int = 40
    styles: dict[str, float] | None = None
    shuffled: bool = False

    @classmethod
    def of(cls, data) -> "ProblemShape":
        """The shape a data config (`tandem.config.DataConfig`) asks for."""
        return cls(data.max_operand, data.max_value, data.solution_styles)


def generate(n: int, min_steps: int, max_steps: int, seed: int, shape: ProblemShape = ProblemShape(),
             exclude: set[str] | None = None, prefix: str = "") -> list[Problem]:
    """`n` distinct problems of `shape` with a step count uniform in [min_steps, max_steps], deterministic in
    `seed`.

    Problems whose text is in `exclude` (problem strings) are skipped, so splits never share a problem; a
    shuffled problem is compared in order (`in_order`), so it never is another set's problem in another order.
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
        p = make_problem(rng, rng.randint(min_steps, max_steps), shape.max_operand, shape.max_value,
                         styles=shape.styles, shuffled=shape.shuffled)
        key = in_order(p.problem) if shape.shuffled else p.problem
        if key in seen:
            continue
        seen.add(key)
        out.append(p)
    return out
