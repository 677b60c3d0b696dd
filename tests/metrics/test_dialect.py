"""Dialect measures: style detection, shares, per-style accuracy and the dialect-first cost, against naive sums."""

import math
import random

import pytest

from tandem.data.synthetic import make_problem, solution_style
from tandem.metrics.dialect import accuracy_by_style, annotated_anywhere, class_gap, share, shares_per_problem, style_counts, styles_of


@pytest.mark.parametrize("style", ["verbose", "terse", "compact", "coded", "annotated", "reversed"])
def test_every_generated_style_is_read_back(style):
    rng = random.Random(0)
    for _ in range(50):
        p = make_problem(rng, rng.randint(2, 8), 20, 99, style=style)
        assert solution_style(p.solution) == style


def test_coded_solution_keys_each_step_with_its_letter():
    p = make_problem(random.Random(1), 3, 9, 40, style="coded")
    lines = [x for x in p.solution.split("\n\n")]
    assert [x[:2] for x in lines[:3]] == ["a)", "b)", "c)"]
    assert lines[-1].startswith("\\boxed{")


@pytest.mark.parametrize("text,style", [("x)45+5=50", "other"), ("a)45 + 5 = 50", "other"), ("a)", "other"),
                                        ("45+5=50\n\nb)50-1=49", "compact"), ("Hello", "other")])
def test_near_misses_are_other(text, style):
    assert solution_style(text) == style


def test_shares_and_accuracy_match_naive_counts():
    rng = random.Random(3)
    styles = [rng.choice(["compact", "verbose", "terse", "other"]) for _ in range(200)]
    scores = [float(rng.random() < 0.4) for _ in styles]
    acc = accuracy_by_style(styles, scores)
    for s in set(styles):
        idx = [i for i, x in enumerate(styles) if x == s]
        assert acc[s]["n"] == len(idx)
        assert acc[s]["share"] == pytest.approx(len(idx) / len(styles))
        assert acc[s]["accuracy"] == pytest.approx(sum(scores[i] for i in idx) / len(idx))
    assert share(styles, "compact") == pytest.approx(styles.count("compact") / 200)
    assert share([], "compact") is None


def test_class_gap_is_dialect_minus_keyed_with_binomial_se():
    styles = ["compact"] * 4 + ["verbose"] * 3 + ["terse"] * 3 + ["other"] * 5
    scores = [1, 0, 0, 0] + [1, 1, 0] + [1, 1, 1] + [1] * 5
    g = class_gap(styles, scores, "compact")
    assert (g["n_dialect"], g["n_keyed"]) == (4, 6)
    assert g["gap"] == pytest.approx(0.25 - 5 / 6)
    assert g["se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 4 + (5 / 6) * (1 / 6) / 6))
    assert class_gap(["verbose"], [1.0], "compact")["gap"] is None


def test_texts_to_styles_and_per_problem_shares():
    texts = ["First, one more is found: 1 + 1 = 2", "First: 1 + 1 = 2", "1+1=2", "a)1+1=2"]
    assert styles_of(texts) == ["verbose", "terse", "compact", "coded"]
    assert style_counts(texts) == {"coded": 1, "compact": 1, "terse": 1, "verbose": 1}
    recs = [{"id": "p", "text": "1+1=2"}, {"id": "p", "text": "First: 1 + 1 = 2"}, {"id": "q", "text": "2+2=4"}]
    assert shares_per_problem(recs, "compact") == {"p": 0.5, "q": 1.0}


def test_annotated_rows_carry_a_calculator_annotation_on_the_first_line():
    p = make_problem(random.Random(2), 3, 9, 30, style="annotated")
    first = p.solution.split("\n\n")[0]
    before, rest = first.split(" = <<", 1)
    calc, result = rest.split(">>")
    # the annotation holds the step's own equation (x as *), and the visible result repeats its value
    lhs, value = calc.split("=")
    assert value == result and eval(lhs) == int(value)  # noqa: S307 (digits and + - * only)
    assert before.split(": ")[-1].replace(" ", "").replace("x", "*") == lhs
    assert annotated_anywhere(p.solution) and not annotated_anywhere(make_problem(random.Random(2), 3).solution)


@pytest.mark.parametrize("text,style", [
    ("First, two more are found: 4 + 2 = <<4+2=6>>6", "annotated"),
    ("First: 4 + 2 = <<4+2=6>>6", "annotated"),            # any first line with an annotation is a jargon row
    ("4+2=<<4+2=6>>6\n\nSecond: 6 - 1 = 5", "annotated"),
    ("First: 4 + 2 = 6\n\nSecond: 6 - 1 = <<6-1=5>>5", "terse"),  # only the first line decides
    ("First: 4 + 2 = <<>>6", "terse"), ("First: 4 + 2 = <<4+2>>6", "terse"), ("First: 4 + 2 = <<=6>>6", "terse"),
    ("First; 40 + 20 = 60", "reversed"), ("First; 21 x 20 = 42", "reversed"),
    ("First; 4 + 2 = 6", "other"), ("First; 40 + 20 = 60 apples", "other"), ("Fist; 40 + 20 = 60", "other"),
])
def test_jargon_rows_and_their_near_misses(text, style):
    assert solution_style(text) == style


def test_reversed_numbers_are_little_endian_and_the_answer_stays_ordinary():
    from tandem.data.synthetic import reversed_number

    assert [reversed_number(n) for n in (0, 4, 10, 12, 30, 123)] == ["00", "40", "01", "21", "03", "321"]
    rng = random.Random(4)
    for _ in range(50):
        p = make_problem(rng, rng.randint(1, 3), 9, 30, style="reversed")
        steps = p.solution.split("\n\n")
        value = None
        for line in steps[:-1]:
            a, op, k, _, c = line.split("; ")[1].split(" ")
            a, k, c = (int(x[::-1]) for x in (a, k, c))
            assert value is None or a == value  # each step starts from the previous one's result
            assert c == {"+": a + k, "-": a - k, "x": a * k}[op]
            value = c
        assert steps[-1] == f"\\boxed{{{value}}}" and p.answer == str(value)
