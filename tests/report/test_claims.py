"""The claims section (tandem.report.claims) and its place in the report (tandem.report.build): first, before
the summary; a visible warning for a difference whose interval contains 0 and for a single seed; the reason
shown when there are no claims."""

from __future__ import annotations

from tandem.report.build import ReportData, build_report
from tandem.report.claims import claims_section, noise_warnings
from tandem.report.render import formatted_rows, render_html, render_markdown

from tests.report.fake_metrics import fake_analysis, fake_eval


def _row(metric: str, diff: float, lo: float, hi: float, verdict: str, direction: str = "greater") -> dict:
    r = {"claim": "2. handoff robustness", "statement": "s", "metric": metric, "comparison": "tandem - grpo",
         "direction": direction, "margin": 0.05 if direction == "equivalent" else None, "difference": diff,
         "ci_low": lo, "ci_high": hi, "verdict": verdict, "within_noise": lo <= 0 <= hi}
    for arm, v in (("tandem", 0.5 + diff), ("grpo", 0.5), ("kl_reg", 0.45), ("base", 0.3)):
        r[arm], r[f"{arm}_ci"] = v, [v - 0.05, v + 0.05]
    return r


NOISY = _row("step/pass@1", 0.02, -0.03, 0.07, "inconclusive")
CLEAR = _row("kl_mean", -0.2, -0.25, -0.15, "holds", "less")


def _report(**kw):
    return build_report(ReportData(title="t", eval_data=fake_eval(), analysis=fake_analysis(), **kw))


def test_claims_come_first_then_the_summary():
    rep = _report(claims=[CLEAR, NOISY], claims_seeds=3)
    assert [s.title for s in rep.sections[:2]] == ["Claims", "Summary"]
    md = render_markdown(rep)
    assert md.index("## Claims") < md.index("## Summary")
    assert "Claims: tandem against GRPO and KL-Reg" in render_html(rep)
    assert rep.sections[0].figures and rep.sections[0].figures[0].name == "claims-intervals"


def test_a_difference_within_noise_is_warned_about_and_a_clear_one_is_not():
    paras = _report(claims=[CLEAR, NOISY], claims_seeds=3).sections[0].paragraphs
    noise = [p for p in paras if p.startswith("WARNING: within noise")]
    assert len(noise) == 1 and "step/pass@1 tandem - grpo" in noise[0] and "kl_mean" not in noise[0]
    assert not any("one training seed" in p for p in paras)  # three seeds
    assert not any(p.startswith("WARNING") for p in _report(claims=[CLEAR], claims_seeds=3).sections[0].paragraphs)


def test_one_seed_is_warned_about_even_when_every_claim_is_clear():
    paras = _report(claims=[CLEAR], claims_seeds=1).sections[0].paragraphs
    assert any(p.startswith("WARNING: one training seed") for p in paras)
    assert "1 holds (1 comparisons)." in paras
    assert noise_warnings([CLEAR], 1) == [p for p in paras if p.startswith("WARNING")]


def test_without_claims_the_section_says_why():
    rep = _report(claims_note="the generations are missing.")
    assert rep.sections[0].title == "Claims" and not rep.sections[0].tables
    assert rep.sections[0].paragraphs[0].startswith("No claims table: the generations are missing.")
    assert "no difference in this report can be told apart from noise" in rep.sections[0].paragraphs[0]


def test_claims_table_puts_verdict_and_difference_first_and_the_estimates_after():
    missing = {**_row("overlap", 0, 0, 0, "not measured"), "difference": None, "ci_low": None, "ci_high": None,
               "tandem": None, "tandem_ci": None, "within_noise": None}
    sec = claims_section([NOISY, missing], seeds=2)
    table, estimates = sec.tables
    assert table.headers == ["claim", "metric", "comparison", "verdict", "difference [95% CI]"]
    rows = formatted_rows(table)
    assert rows[0][3:] == ["inconclusive", "+0.0200 [-0.0300, +0.0700]"]
    assert rows[1][3:] == ["not measured", "\u2013"]
    assert "bootstrap over seeds and problems" in table.note
    assert estimates.headers == ["measure", "base", "tandem", "GRPO", "KL-Reg"]
    est = formatted_rows(estimates)
    assert est[0] == ["step/pass@1", "0.300 [0.250, 0.350]", "0.520 [0.470, 0.570]", "0.500 [0.450, 0.550]",
                      "0.450 [0.400, 0.500]"]
    assert est[1][2] == "\u2013"  # the arm that was not measured


def test_a_rows_estimates_share_one_number_format():
    # a KL row: 0.000989 next to 0.001 was two formats; now every value of the row has the same decimals
    kl = {**_row("kl_mean", -1.1e-5, -2e-5, -1e-6, "holds", "less"), "tandem": 0.000989, "tandem_ci": [0.0009, 0.00108],
          "grpo": 0.001, "grpo_ci": [0.00091, 0.0011], "kl_reg": 0.001, "kl_reg_ci": [0.00092, 0.00109],
          "base": 0.0, "base_ci": [0.0, 0.0]}
    est = formatted_rows(claims_section([kl], seeds=1).tables[1])[0]
    assert est[1:] == ["0.00000 [0.00000, 0.00000]", "0.00099 [0.00090, 0.00108]", "0.00100 [0.00091, 0.00110]",
                       "0.00100 [0.00092, 0.00109]"]


def test_an_equivalence_that_holds_is_no_warning_but_one_that_straddles_the_margin_is():
    match = _row("solo/pass@1", 0.01, -0.02, 0.04, "holds", "equivalent")  # inside +-0.05: the claim holds
    unsure = _row("solo/pass@4", 0.03, -0.01, 0.08, "inconclusive", "equivalent")  # crosses the margin
    text = " ".join(noise_warnings([match, unsure], seeds=3))
    assert "solo/pass@4" in text and "solo/pass@1" not in text


def test_small_differences_keep_their_significant_digits():
    tiny = _row("kl_mean", -2.5e-4, -4.1e-4, -1.2e-4, "holds", "less")
    row = formatted_rows(claims_section([tiny], seeds=3).tables[0])[0]
    assert row[-1] == "-0.000250 [-0.000410, -0.000120]"
