"""Tests for tandem.rewards and its worker pool (tandem.score_pool): boxed extraction, math-verify scoring, the integer fast path, and the
time-limited worker pool (adversarial input, threads, crashed workers, shutdown)."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem import rewards, score_pool
from tandem.rewards import extract_boxed, parses, parses_many, score, score_many

# an exponent tower that math-verify's comparison evaluates for far longer than any test allows
HANGS = r"The answer is \boxed{9^{9^{9^{9}}}}"


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    score_pool.shutdown_pool()


# --------------------------------------------------------------------------------------------------
# extract_boxed
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),                    # nested braces stay inside
    (r"first \boxed{1} then \boxed{2}", "2"),                   # the last box counts
    (r"\fbox{7}", "7"),
    (r"\boxed {  5 }", "5"),                                    # space before the brace, padding stripped
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),                          # escaped braces are not structure
    (r"\boxed{3} and then \boxed{\frac{1}{", "3"),              # an unclosed box (cut off) is skipped
    (r"\boxed{\boxed{8}}", "8"),
    (r"\boxed{}", ""),
    ("no box here: 42", None),
    (r"\boxed{unclosed", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_matches_a_naive_scan():
    """Against a naive reference: take each `\\boxed{` from the right and count braces character by character."""
    def naive(text):
        pos = len(text)
        while True:
            pos = text.rfind("\\boxed{", 0, pos)
            if pos < 0:
                return None
            depth, i = 0, pos + len("\\boxed")
            while i < len(text):
                if text[i] == "\\":
                    i += 2
                    continue
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[pos + len("\\boxed{"):i].strip()
                i += 1

    samples = [r"a \boxed{x^{2}} b", r"\boxed{1}\boxed{2}\boxed{3", r"\boxed{\left\{ 1 \right\}}",
               r"x \boxed{a{b{c}}d} y \boxed{e}", r"\boxed{{}}", "plain"]
    rng = random.Random(0)
    pieces = ["\\boxed{", "{", "}", "a", "\\{", "\\}", " "]
    samples += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(3000)]
    for s in samples:
        assert extract_boxed(s) == naive(s), s


def test_extract_boxed_is_linear_on_unclosed_boxes():
    text = r"\boxed{1}" + r"\boxed{{" * 20000
    t0 = time.perf_counter()
    assert extract_boxed(text) == "1"
    assert time.perf_counter() - t0 < 2.0  # a quadratic scan takes minutes here


# --------------------------------------------------------------------------------------------------
# score
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, gold, expected", [
    (r"\boxed{\frac12}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac12", 1.0),
    (r"\boxed{\dfrac{1}{2}}", "1/2", 1.0),
    (r"\boxed{x=3}", "3", 1.0),
    (r"\boxed{3}", "x=3", 1.0),
    (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", 1.0),
    (r"\boxed{\text{(C)}}", r"\text{(C)}", 1.0),
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{(2, 1)}", "(1,2)", 0.0),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"\boxed{-1}", "-1", 1.0),
    (r"\boxed{1}", "-1", 0.0),
    (r"\boxed{-7}", "7", 0.0),
    (r"I think \boxed{4}. No wait: \boxed{5}", "5", 1.0),    # several boxes: the last one counts
    (r"I think \boxed{5}. No wait: \boxed{4}", "5", 0.0),
    ("The answer is 5.", "5", 0.0),                           # no box: no answer
    (r"\boxed{}", "5", 0.0),
    (r"\boxed{\frac{}", "5", 0.0),                            # unclosed: unparseable
    (r"\boxed{\frac{1}{}", r"\frac12", 0.0),
    (r"\boxed{@#!}", "5", 0.0),
])
def test_score_real_cases(completion, gold, expected):
    assert score(completion, gold) == expected


@pytest.mark.parametrize("answer, gold", [
    ("5", "5"), ("5", "6"), ("012", "12"), ("-0", "0"), ("-3", "3"), ("-3", "-3"), ("0", "0"),
    ("123456789012345", "123456789012345"), ("123456789012345678", "123456789012345679"),
    ("999999999999999999", "999999999999999999"), (" 7 ", "7"),
])
def test_integer_fast_path_agrees_with_math_verify(answer, gold):
    fast = rewards._fast_score(answer, gold)
    assert fast is not None, "the fast path should take plain integers"
    assert fast == rewards._verify(answer.strip(), gold)


@pytest.mark.parametrize("answer, gold", [("5.0", "5"), ("1,000", "1000"), ("+5", "5"), ("5", r"\frac{10}{2}")])
def test_fast_path_declines_non_integers(answer, gold):
    assert rewards._fast_score(answer, gold) is None
    assert score(rf"\boxed{{{answer}}}", gold) == 1.0  # math-verify still finds them equal


def test_score_works_off_the_main_thread():
    """math-verify's own timeouts use signal.alarm and raise off the main thread; ours are switched off."""
    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(score, r"\boxed{\frac{1}{2}}", "0.5").result() == 1.0


@pytest.mark.parametrize("answer, ok", [
    ("3", True), (r"\frac{1}{2}", True), (r"\text{east}", True), (r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"\frac{", False), ("", False), ("   ", False), (None, False), (r"\sqrt{", False),
])
def test_parses(answer, ok):
    assert parses(answer) is ok


# --------------------------------------------------------------------------------------------------
# score_many / parses_many: the worker pool
# --------------------------------------------------------------------------------------------------

CASES = [
    (r"\boxed{\frac12}", "0.5"), (r"\boxed{x=3}", "3"), (r"\boxed{(2,1)}", "(1,2)"), (r"\boxed{42}", "42"),
    (r"\boxed{41}", "42"), ("no answer", "1"), (r"\boxed{\text{east}}", r"\text{east}"), (r"\boxed{\frac{}", "1"),
]


def test_score_many_matches_score():
    comps, golds = zip(*CASES)
    assert score_many(list(comps), list(golds), timeout=5.0) == [score(c, g) for c, g in CASES]


def test_score_many_bounds_a_hanging_sample():
    """The tower hangs math-verify; it scores 0 after the limit and the other samples are still scored."""
    restarts = score_pool.pool_restarts()
    score_many([r"\boxed{0.5}"], [r"\frac12"])  # start the workers outside the timed part
    t0 = time.monotonic()
    out = score_many([HANGS, r"\boxed{\frac12}", r"\boxed{3}"], ["5", "0.5", "4"], timeout=1.0)
    elapsed = time.monotonic() - t0
    assert out == [0.0, 1.0, 0.0]
    assert elapsed < 15, f"a hanging sample held the pool for {elapsed:.1f} s"
    assert score_pool.pool_restarts() == restarts + 1  # the stuck worker was replaced
    assert score_many([r"\boxed{\frac{2}{4}}"], ["0.5"]) == [1.0]  # and the pool still works


def test_score_many_from_threads():
    """Called from worker threads (as Prefect's task runners do), concurrently; results stay in order."""
    comps, golds = zip(*CASES)
    expected = [score(c, g) for c, g in CASES]
    with ThreadPoolExecutor(3) as ex:
        futures = [ex.submit(score_many, list(comps), list(golds), 5.0) for _ in range(3)]
        results = [f.result(timeout=60) for f in futures]
    assert results == [expected] * 3
    out = []
    t = threading.Thread(target=lambda: out.append(parses_many([r"\frac{", "3", r"\frac{1}{2}"])))
    t.start()
    t.join(60)
    assert out == [[False, True, True]]


def test_score_many_integer_fast_path_skips_the_pool():
    score_pool.shutdown_pool()
    out = score_many([rf"\boxed{{{i}}}" for i in range(1000)], [str(i % 10) for i in range(1000)])
    assert out == [float(i % 10 == i) for i in range(1000)]
    assert score_pool._POOL is None  # no worker was started


def test_a_killed_worker_is_replaced():
    assert score_many([r"\boxed{0.5}"], [r"\frac12"]) == [1.0]
    for w in score_pool._POOL._workers:
        w.proc.kill()
        w.proc.wait()
    assert score_many([r"\boxed{0.5}", r"\boxed{x=2}"], [r"\frac12", "2"]) == [1.0, 1.0]


def test_shutdown_pool_stops_the_workers():
    score_many([r"\boxed{0.5}"], [r"\frac12"])
    procs = [w.proc for w in score_pool._POOL._workers]
    score_pool.shutdown_pool()
    assert score_pool._POOL is None
    assert all(p.poll() is not None for p in procs)


def test_score_many_checks_its_arguments():
    with pytest.raises(ValueError, match="2 completions but 1 golds"):
        score_many(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="timeout"):
        score_many([r"\boxed{x}"], ["x"], timeout=0)
