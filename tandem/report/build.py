"""Assemble the whole results report (`Report`) from loaded metrics; no file I/O here.

`tasks/report.py` reads the files and writes the outputs; a notebook can call `build_report` on a `ReportData`
built from the same dicts. The claims section comes first (`tandem.report.claims`: the claims table with intervals, error bars and
the within-noise warnings, or the reason there are no claims), then the summary. Sections follow the paper: solo accuracy (fig. 2), tandem accuracy (fig. 3), drift (fig. 4), the
KL-Reg comparison (fig. 7), legibility (table 1), the ablation (table 2), then training curves, the
promotion gate, example generations (escaped by the renderers), the data validation (with a link to its Data
Docs) and the run metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.report import figures as F
from tandem.report import tables as T
from tandem.report.claims import claims_section
from tandem.report.document import Figure, Link, Report, Section, TextBlock
from tandem.report.promotion import Decision, comparison_rows
from tandem.report.render import format_cell


def _fig(section: Section, name: str, caption: str, png: bytes | None, missing: str) -> None:
    if png is None:
        section.paragraphs.append(missing)
    else:
        section.figures.append(Figure(name, caption, png))


def _table(section: Section, table) -> None:
    if table is not None:
        section.tables.append(table)


def summary_lines(eval_data: dict, analysis: dict) -> list[str]:
    """One sentence per headline number: solo and tandem pass@1 of the base and every arm's last checkpoint."""
    s = eval_data.get("settings", {})
    k = (s.get("ks") or [1])[0]
    lines = []
    for mode in s.get("modes", []):
        parts = []
        for arm, data in eval_data.get("arms", {}).items():
            cks = sorted(data.get("checkpoints", []), key=lambda c: c.get("step", 0))
            if not cks:
                continue
            if not parts and cks[0].get("step", 0) == 0:
                parts.append(f"base {format_cell(T._mode_macro(cks[0], mode, f'pass@{k}'))}")
            if cks[-1].get("step", 0) > 0:
                parts.append(f"{F.arm_label(arm)} {format_cell(T._mode_macro(cks[-1], mode, f'pass@{k}'))} "
                             f"(step {cks[-1]['step']})")
        if parts:
            lines.append(f"{mode} pass@{k} (macro over {len(s.get('benchmarks', {}))} benchmarks): "
                         + "; ".join(parts) + ".")
    for arm, summ in (analysis.get("summary") or {}).items():
        lines.append(f"{F.arm_label(arm)} at step {summ.get('final_step')}: KL to base "
                     f"{format_cell(summ.get('kl_mean'))} nats/token, junior CE {format_cell(summ.get('junior_ce'))}, "
                     f"overlap {format_cell(summ.get('overlap'))}.")
    return lines


@dataclass(frozen=True)
class ReportData:
    """The loaded metrics a report is built from (the report stage reads them from files; a notebook may
    build one from the same dicts).

    `claims`: rows of `tandem.metrics.claims.evaluate_claims` over `claims_seeds` seeds, shown first; when None,
    the Claims section says why (`claims_note`). `intervals` ({arm or "base": {metric: (low, high)}}) add 95%
    intervals to the final-checkpoint tables and error bars to the pass@k-against-k panels. `validation` (the
    `validation` block of metrics/data.json), `data_docs` (a relative link to its Great Expectations Data
    Docs) and `data_docs_page` (to the run's validation page in them) make the data validation section.
    """

    title: str
    eval_data: dict
    analysis: dict
    train_curves: dict[str, dict[str, list[float]]] | None = None
    reward_key: str | None = None
    decision: Decision | None = None
    metadata: dict[str, Any] | None = None
    params_text: str = ""
    examples: list[TextBlock] | None = None
    notes: list[str] | None = None
    claims: list[dict] | None = None
    claims_seeds: int = 1
    claims_note: str = ""
    intervals: T.Intervals | None = None
    validation: dict | None = None
    data_docs: str | None = None
    data_docs_page: str | None = None


def build_report(src: ReportData) -> Report:
    """The report's sections from the loaded metrics in `src`."""
    eval_data, analysis, intervals, decision = src.eval_data, src.analysis, src.intervals, src.decision
    s = eval_data.get("settings", {})
    k = (s.get("ks") or [1])[0]
    subtitle = (f"{len(eval_data.get('arms', {}))} arm(s), {len(s.get('benchmarks', {}))} benchmark(s), "
                f"{s.get('n_samples', '?')} samples per problem, modes: {', '.join(s.get('modes', []))}")
    rep = Report(title=src.title, subtitle=subtitle)

    if src.claims is not None:
        rep.sections.append(claims_section(src.claims, src.claims_seeds))
    else:
        rep.sections.append(Section("Claims", paragraphs=[
            "No claims table: " + (src.claims_note or "no per-problem measures were given.") + " Without intervals, "
            "no difference in this report can be told apart from noise."]))

    bars = (" Error bars: 95% bootstrap intervals over problems (intervals: final checkpoints and the base only; "
            "the per-checkpoint curves have none, so they keep the full 0-1 axis).") if intervals else \
        " The per-checkpoint curves have no intervals, so they keep the full 0-1 axis."
    summ = Section("Summary", paragraphs=summary_lines(eval_data, analysis) + list(src.notes or []))
    rep.sections.append(summ)

    solo = Section("Solo accuracy (figure 2)")
    _fig(solo, "fig2-solo-passk", "Figure 2: solo pass@k of each arm's last checkpoint against the base (left) "
         f"and solo pass@{k} at every checkpoint (right)." + bars, F.solo_passk_figure(eval_data, intervals),
         "No solo evaluation in metrics/eval.json.")
    _table(solo, T.passk_table(eval_data, "solo", "Solo pass@k (macro) and per-benchmark pass@1", intervals))
    _table(solo, T.checkpoint_table(eval_data, k))
    rep.sections.append(solo)

    tandem = Section("Tandem accuracy with the frozen junior (figure 3)")
    tandem.paragraphs.append("step: the senior writes the first reasoning step, then authorship alternates at "
                             "every blank line (handoff robustness). word: the training schedule, a coin flip "
                             "after each word-initial token.")
    _fig(tandem, "fig3-tandem-passk", "Figure 3: pass@k of senior + frozen junior per schedule, and per checkpoint." + bars,
         F.tandem_passk_figure(eval_data, intervals), "No tandem (step or word) evaluation in metrics/eval.json.")
    for mode in ("step", "word"):
        _table(tandem, T.passk_table(eval_data, mode, f"Tandem ({mode} schedule) pass@k (macro)", intervals))
    rep.sections.append(tandem)

    drift = Section("Drift from the base (figure 4)")
    _fig(drift, "fig4-drift", "Figure 4: distribution of per-token KL(senior || base) on each arm's own solo "
         "generations (left) and each arm's log-ratio on the reference arm's most-drifted token types (right; "
         "below the diagonal = pulled back toward the base).", F.drift_figure(analysis),
         "No drift analysis in metrics/analysis.json.")
    _table(drift, T.drift_table(analysis, intervals))
    rep.sections.append(drift)

    klreg = Section("KL-Reg comparison (figure 7)")
    _fig(klreg, "fig7-klreg", "Figure 7: drift (mean per-token KL to the base) against handoff robustness "
         f"(step-schedule pass@{k}), one point per checkpoint; the filled marker is each arm's last checkpoint.",
         F.klreg_figure(eval_data, analysis, k),
         "Needs the step-schedule evaluation and the drift analysis.")
    rep.sections.append(klreg)

    leg = Section("Legibility (table 1)")
    _table(leg, T.legibility_table(analysis, intervals))
    if not leg.tables:
        leg.paragraphs.append("No legibility analysis in metrics/analysis.json.")
    rep.sections.append(leg)

    abl = Section("Ablation (table 2)")
    _table(abl, T.ablation_table(eval_data, analysis, k, intervals))
    if not abl.tables:
        abl.paragraphs.append("No trained checkpoint was evaluated.")
    rep.sections.append(abl)

    train = Section("Training")
    if src.train_curves and src.reward_key:
        _fig(train, "train-reward", f"Training reward ({src.reward_key}) per step.",
             F.train_curves_figure(src.train_curves, src.reward_key), "The training tables hold no reward values.")
    else:
        train.paragraphs.append("No training table with a reward column was found.")
    rep.sections.append(train)

    if decision is not None:
        promo = Section("Promotion (scheduled retraining)")
        verdict = "passes" if decision.promote else "does not pass (the promoted checkpoint stays)"
        promo.paragraphs.append(f"Promotion gate: {verdict}. {decision.reason}. A run with promotion on "
                                "(the scheduled deployment) records a passing checkpoint as the new promoted one.")
        promo.tables.append(T.Table(f"This run's best checkpoint against the last promoted one "
                                    f"(tolerance {decision.tolerance:g})",
                                    ["metric", "last promoted", "this run", "change"], comparison_rows(decision)))
        rep.sections.append(promo)

    if src.examples:
        rep.sections.append(Section("Example generations", paragraphs=[
            "The problems on which the models' solo pass rates differ most (the base and each arm's last "
            "checkpoint); for each model one completion: a correct one from the models that solve the problem "
            "most often, a wrong one from the others.",
            "Model output, shown verbatim and escaped: it is untrusted text."], texts=list(src.examples)))

    data = Section("Data validation (Great Expectations)")
    validation = src.validation
    if validation:
        data.paragraphs.append(
            f"Validation {'passed' if validation.get('passed') else 'FAILED'}: {validation.get('rows_checked')} rows "
            f"checked against {validation.get('expectations')} expectations, {validation.get('failures')} failures.")
    if src.data_docs:
        data.links.append(Link("The validation as Great Expectations Data Docs (every expectation and its result)",
                               src.data_docs))
    if src.data_docs_page:
        # GX draws the index's list with scripts from CDNs; the validation page itself is plain HTML
        data.links.append(Link("This run's validation page (readable offline)", src.data_docs_page))
    if not data.paragraphs and not data.links:
        data.paragraphs.append("No validation record (run the prepare stage).")
    rep.sections.append(data)

    meta = Section("Run metadata")
    if src.metadata:
        meta.tables.append(T.key_value_table("Provenance, environment and timing", src.metadata))
    if src.params_text:
        meta.texts.append(TextBlock("params (resolved)", src.params_text))
    rep.sections.append(meta)
    return rep
