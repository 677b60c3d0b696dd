"""Synthetic problems: solution styles drawn by their shares, read back from the text, and the default draw."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tandem.data.synthetic import (STYLES, ProblemShape, draw_style, generate, in_order, make_problem,
                                    solution_style)


def test_each_style_renders_and_reads_back():
    for style in STYLES:
        p = make_problem(random.Random(3), 4, max_operand=20, max_value=99, style=style)
        steps = p.solution.split("\n\n")
        assert len(steps) == 5 and steps[-1] == f"\\boxed{{{p.answer}}}"
        assert p.style == style and solution_style(p.solution) == style
    compact = make_problem(random.Random(3), 4, max_operand=20, max_value=99, style="compact")
    verbose = make_problem(random.Random(3), 4, max_operand=20, max_value=99, style="verbose")
    assert " " not in compact.solution and compact.answer == verbose.answer  # same problem, another dialect
    assert len(compact.solution) < len(verbose.solution) / 2


def test_default_shares_keep_the_single_draw_of_the_two_style_mix():
    # shares {verbose: 0.7, terse: 0.3} cut one uniform draw exactly where `u < 0.7` always did
    for seed in range(200):
        u = random.Random(seed).random()
        assert draw_style(random.Random(seed)) == ("verbose" if u < 0.7 else "terse")


def test_shares_set_the_style_mix_and_rows_keep_their_fields():
    shares = {"verbose": 0.6, "terse": 0.3, "compact": 0.1}
    probs = generate(3000, 2, 8, seed=1, shape=ProblemShape(20, 99, shares))
    counts = Counter(p.style for p in probs)
    for style, share in shares.items():
        assert abs(counts[style] / len(probs) - share) < 0.03
    assert all(solution_style(p.solution) == p.style for p in probs)
    assert set(probs[0].to_dict()) == {"id", "problem", "answer", "solution", "n_steps", "source"}


def test_a_style_without_share_never_appears_and_bad_shares_are_refused():
    probs = generate(500, 2, 4, seed=2, shape=ProblemShape(styles={"terse": 1.0}))
    assert {p.style for p in probs} == {"terse"}
    with pytest.raises(ValueError, match="positive share"):
        draw_style(random.Random(0), {"verbose": 0.0})
    with pytest.raises(ValueError, match="unknown solution style"):
        make_problem(random.Random(0), 2, style="poetic")


def test_other_text_is_not_a_style():
    assert solution_style("The answer is 4.") == "other"
    assert solution_style("") == "other"


def test_new_styles_keep_the_draws_of_existing_share_mixes_and_the_problems():
    """A style appended to STYLES takes no draw from mixes that do not name it, and a style changes only the
    solution text: the same seed gives the same problems whatever the styles (the jargon control's S and J see
    the same problems)."""
    keyed = generate(40, 1, 3, seed=0, shape=ProblemShape(9, 30, {"verbose": 0.7, "terse": 0.3}))
    jargon = generate(40, 1, 3, seed=0, shape=ProblemShape(9, 30, {"annotated": 0.6, "verbose": 0.25, "terse": 0.15}))
    assert [p.problem for p in keyed] == [p.problem for p in jargon]
    assert [p.answer for p in keyed] == [p.answer for p in jargon]
    assert {p.style for p in jargon} == {"annotated", "verbose", "terse"}



def test_shuffled_questions_keep_the_problem_and_its_solution_and_read_back_in_order():
    """make_problem's `shuffled`: the same problem with the operation lines in random order; the solution keeps
    the ordinals' order, and in_order gives back the given text."""
    moved = 0
    for seed in range(60):
        n = 2 + seed % 7
        g = make_problem(random.Random(seed), n, 20, 99, style="verbose")
        s = make_problem(random.Random(seed), n, 20, 99, style="verbose", shuffled=True)
        assert in_order(g.problem) == g.problem
        lines, given = s.problem.split("\n"), g.problem.split("\n")
        assert lines[0] == given[0] and lines[-1] == given[-1] and sorted(lines) == sorted(given)
        assert (s.solution, s.answer, s.n_steps) == (g.solution, g.answer, g.n_steps)
        assert in_order(s.problem) == g.problem
        moved += s.problem != g.problem
    assert moved > 40  # most questions of 2-8 lines come out of order


def test_a_shuffled_copy_of_an_excluded_problem_is_excluded():
    """generate compares a shuffled question in order, so no shuffled problem is an excluded one reordered."""
    given = generate(40, 2, 2, seed=4, shape=ProblemShape(3, 9))
    exclude = {p.problem for p in given}
    shuffled = generate(300, 2, 2, seed=4, shape=ProblemShape(3, 9, shuffled=True), exclude=exclude)
    assert not exclude & {in_order(p.problem) for p in shuffled}
    again = generate(300, 2, 2, seed=4, shape=ProblemShape(3, 9, shuffled=True))
    assert exclude & {in_order(p.problem) for p in again}  # without the exclusion some would be there
