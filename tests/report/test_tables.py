"""The report's tables (tandem.report.tables): the 95% interval columns of the final-checkpoint tables when
intervals are given, and the unchanged tables without them."""

from __future__ import annotations

from tandem.report import tables as T
from tandem.report.render import formatted_rows

from tests.report.fake_metrics import fake_analysis, fake_eval

IV = {"base": {"solo/pass@1": (0.1, 0.3), "step/pass@1": (0.05, 0.2), "junior_ce": (0.35, 0.45),
               "overlap": (0.85, 0.95)},
      "tandem": {"solo/pass@1": (0.2, 0.4), "kl_mean": (0.08, 0.12), "junior_ce": (0.5, 0.6), "overlap": (0.7, 0.8)},
      "grpo": {"solo/pass@1": (0.25, 0.5)}}


def _col(table, header):
    """model -> the column's cell as rendered (None where the table holds none)."""
    i = table.headers.index(header)
    return {r[0]: None if r[i] is None else text[i] for r, text in zip(table.rows, formatted_rows(table))}


def test_passk_table_adds_the_interval_of_pass_at_1():
    ev = fake_eval()
    plain = T.passk_table(ev, "solo", "c")
    t = T.passk_table(ev, "solo", "c", IV)
    assert "pass@1 95% CI" not in plain.headers and plain.note == ""
    assert t.headers == plain.headers[:6] + ["pass@1 95% CI"] + plain.headers[6:]
    assert _col(t, "pass@1 95% CI") == {"base": "[0.100, 0.300]", "TRL (tandem)": "[0.200, 0.400]",
                                        "GRPO": "[0.250, 0.500]", "KL-Reg": None}  # None renders as a dash
    assert "bootstrap over the benchmark problems" in t.note
    step = T.passk_table(ev, "step", "c", IV)
    assert _col(step, "pass@1 95% CI")["base"] == "[0.050, 0.200]" and step.headers[-1] == "senior share"


def test_legibility_and_drift_tables_add_their_intervals():
    an = fake_analysis()
    leg = T.legibility_table(an, IV)
    assert _col(leg, "junior CE 95% CI") == {"base": "[0.350, 0.450]", "TRL (tandem)": "[0.500, 0.600]",
                                             "GRPO": None, "KL-Reg": None}
    assert _col(leg, "overlap 95% CI")["TRL (tandem)"] == "[0.700, 0.800]"
    assert leg.headers.index("junior CE 95% CI") == leg.headers.index("junior CE (nats/token)") + 1
    drift = T.drift_table(an, IV)
    assert _col(drift, "KL mean 95% CI") == {"TRL (tandem)": "[0.080, 0.120]", "GRPO": None, "KL-Reg": None}
    for t in (leg, drift):
        assert all(len(r) == len(t.headers) for r in t.rows)


def test_without_intervals_the_tables_are_as_before():
    an = fake_analysis()
    assert T.legibility_table(an).headers[:4] == ["model", "step", "junior CE (nats/token)", "overlap"]
    assert T.drift_table(an).headers[:3] == ["arm", "step", "KL mean"] and T.drift_table(an).note == ""
    assert "95% intervals" not in T.ablation_table(fake_eval(), an).note
    assert "95% intervals" in T.ablation_table(fake_eval(), an, 1, IV).note


def test_one_number_format_per_column():
    from tandem.report.document import Table

    t = Table("c", ["model", "KL", "pass@1", "tokens", "step"],
              [["a", 0.000989, 0.5, 87.69791, 8], ["b", 0.001, 1.0, 126.0, 16], ["c", None, 0.125, 46.9, 0]])
    rows = formatted_rows(t)
    assert [r[1] for r in rows] == ["0.00099", "0.00100", "\u2013"]  # 3 significant digits of the largest
    assert [r[2] for r in rows] == ["0.500", "1.000", "0.125"]
    assert [r[3] for r in rows] == ["87.698", "126.000", "46.900"] and [r[4] for r in rows] == ["8", "16", "0"]
