"""The registered study's report (tandem.report.study): the claims table first with every registered column, the
KL-Reg rows as the paper's ablation, one number format per column, the flags (not robust, provisional, not
measured), then the positive control, the secondary rows and every measure per arm."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from tandem.report.render import render_html, render_markdown
from tandem.report.study import study_report
from tandem.study import claims, registration, results
from tests.tasks.fake_results import write_fake_results

from tests.study.test_claims import ROOT

SIG3 = r"[+-]?(\d+\.\d*|\d+|\d\.\d+e[+-]\d+)"


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    write_fake_results(out / "results", seeds=(0, 1, 2), benchmarks={"arith-short": 12, "arith-long": 12})
    reg = yaml.safe_load((ROOT / "studies" / "registration.yaml").read_text())
    reg["study"]["seeds"], reg["statistics"]["n_boot"] = [0, 1, 2], 200
    (out / "registration.yaml").write_text(yaml.safe_dump(reg))
    return claims._plain(claims.compute(results.read_results(out / "results", [1, 2, 4, 8]),
                                        registration.load(out / "registration.yaml")))


def test_sections_in_order_and_the_claims_table_first(doc):
    rep = study_report(doc)
    assert [s.title for s in rep.sections] == ["Claims", "Positive control", "Secondary rows", "Every measure per arm",
                                               "Data"]
    table = rep.sections[0].tables[0]
    assert table.headers[:10] == ["id", "claim", "measure", "comparison", "verdict", "difference [95% crossed CI]",
                                  "seed t-interval", "Holm p", "smallest effect of interest",
                                  "what the interval excludes"]
    assert [r[0] for r in table.rows] == ["C1", "C2", "C3", "C4a", "C4b", "A1", "A2"]
    assert {r[1] for r in table.rows if r[0].startswith("A")} == {"ablation: KL-Reg"}
    assert any("the paper's KL-Reg ablation" in p for p in rep.sections[0].paragraphs)
    assert rep.sections[0].figures[0].name == "study-claims" and rep.sections[0].figures[0].png[:4] == b"\x89PNG"
    md = render_markdown(rep)
    assert md.index("## Claims") < md.index("## Positive control") < md.index("## Every measure per arm")
    assert "Primary rows (one family, Holm-adjusted)" in render_html(rep)


def test_one_number_format_per_column(doc):
    table = study_report(doc).sections[0].tables[0]
    diff = re.compile(rf"^{SIG3} \[{SIG3}, {SIG3}\]$")
    for row in table.rows:
        assert diff.match(row[5]), row[5]
        assert re.fullmatch(rf"\[{SIG3}, {SIG3}\]", row[6]), row[6]
        assert re.fullmatch(r"\d\.\d+(e-\d+)?|1\.0", row[7]), row[7]  # two significant digits
        # three significant digits everywhere in the difference column, whatever the magnitude
        for num in re.findall(r"[+-]\d[\d.e+-]*", row[5]):
            digits = re.sub(r"e[+-]\d+$", "", num).lstrip("+-").replace(".", "").lstrip("0")
            assert len(digits) == 3, (num, row[5])


def test_flags_and_unmeasured_rows_are_shown(doc):
    d = copy.deepcopy(doc)
    d["claims"][1].update(not_robust=True, missing=["seed 2"])
    d["claims"][5].update(verdict="not measured", estimate=None, ci=None, seed_t=None, p_holm=None,
                          missing=["kl_reg: no seed with kl_mean at final"])
    d["data"].update(complete=False, missing=["seed-2/kl_reg.csv"])
    sec = study_report(d).sections[0]
    rows = {r[0]: r for r in sec.tables[0].rows}
    assert "not robust" in rows["C2"][4] and "provisional: seed 2 missing" in rows["C2"][4]
    assert rows["A1"][4].startswith("not measured (kl_reg") and rows["A1"][5] == "\u2013"
    assert sec.paragraphs[0].startswith("WARNING: partial results; missing seed-2/kl_reg.csv")


def test_the_control_secondary_rows_and_every_measure(doc):
    rep = study_report(doc)
    control = rep.sections[1]
    assert len(control.tables[0].rows) == 4 and {r[-1] for r in control.tables[0].rows} <= {"yes", "no"}
    assert control.paragraphs[1].startswith("Result: every check detects")
    sec_rows = rep.sections[2].tables[0].rows
    assert [r[0] for r in sec_rows][-2:] == ["C1 at best_by_validation", "C2 at best_by_validation"]
    assert rep.sections[2].tables[0].headers[7] == "p (one-sided)"
    tables = {t.caption: t for t in rep.sections[3].tables}
    final = tables["Measures by arm, final checkpoint [95% crossed CI]"]
    assert final.headers == ["measure", "base", "TRL (tandem)", "GRPO", "KL-Reg", "control"]
    assert [r[0] for r in final.rows][:4] == ["solo pass@1", "solo pass@2", "solo pass@4", "solo pass@8"]
    assert "compact share" in [r[0] for r in final.rows]
    assert "Evaluated step per arm and seed" in tables
