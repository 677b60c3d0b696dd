"""benchmarks/base_errors.py: the first wrong step of a solution decides its kind."""

from __future__ import annotations

import pytest

REF = "First, two more are found: 5 + 2 = 7\n\nSecond, eleven are lost: 7 - 11 = 0\n\nThird: 0 + 19 = 19\n\n\\boxed{19}"


@pytest.mark.parametrize("generated,kind", [
    (REF, "right"),
    (REF.replace("5 + 2 = 7", "5 + 3 = 8").replace("7 - 11", "8 - 11"), "wrong operand"),
    (REF.replace("0 + 19 = 19", "0 + 19 = 29"), "carry"),
    (REF.replace("0 + 19 = 19", "0 + 19 = 18"), "arithmetic"),
    (REF.replace("7 - 11 = 0", "9 - 11 = 0"), "previous result"),
    (REF.replace("7 - 11 = 0", "7 + 11 = 18"), "previous result"),
    ("The answer is 19.", "other"),
    (REF.split("\n\nThird")[0], "other"),
])
def test_the_first_wrong_step_decides_the_kind(generated, kind):
    from cli.main import load_benchmark

    assert load_benchmark("base_errors").kind_of(REF, generated) == kind
