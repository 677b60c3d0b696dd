"""`tandem study --recompute --out <folder>`: a committed study's claims rebuilt from its committed files alone.

What the folder holds decides what is recomputed (no params, no models, no training):

- a positive control (`registration.yaml`, `kind: junior-control`): `claims.json`, the report and the dose figure
  from `results/seed-<S>/<arm>.json`, the registration and the gate it uses (`gate.md` re-rendered from
  `gate.json` where the gate is its own);
- a registered study (`registration.yaml` with `pilot:` and `study:`): `claims.json` and the report from
  `results/seed-<S>/<arm>.csv`;
- the pilot's result (`result.json` naming its registration): every decision redone from the recorded measures
  under the registered criteria, written back to `result.json` and `result.md`;
- a multi-seed study's record with no per-problem results (`claims.json` of `tandem study run`): read and
  summarised, nothing rewritten; its claims cannot be recomputed (its per-seed data were not kept), and the
  summary says so.

Every result file is read through tandem/study/results.py, every claim through tandem/study/claims.py.
"""

from __future__ import annotations

from pathlib import Path

from tandem.errors import BadInputError
from tandem.study import registration as R
from tandem.study.claims import compute, control_document, dumps
from tandem.study.results import read_control_results, read_results
from tasks.common import atomic_path, read_json, write_json
from tasks.study.stages import CODE_ROOT, rel


def _write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def _write_report(out: Path, rep) -> None:
    from tandem.report.render import figure_filename, render_html, render_markdown

    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    for f in rep.figures():
        with atomic_path(figs / figure_filename(f.name)) as tmp:
            Path(tmp).write_bytes(f.png)
    _write_text(out / "report.md", render_markdown(rep, "figures"))
    _write_text(out / "report.html", render_html(rep))


def control(out: Path) -> dict:
    """A positive control's claims.json, report and figure (and its own gate.md) from its committed files."""
    from tandem.report.control import build_report
    from tandem.study.control import gate_markdown
    from tasks.study.control import registration

    reg = registration(out)
    gate_doc = read_json(reg.gated.dir / "gate.json")
    if reg.gate_from is None:
        _write_text(Path(out) / "gate.md", gate_markdown(gate_doc))
    _refuse_without_results(Path(out), "seed-*/*.json", gate_doc)
    res = read_control_results(Path(out) / "results", reg.evaluation.get("ks", [1, 2, 4, 8]))
    # the gates of the rebuilds any run trained from (amendment `rebuild`), by the path each result names
    rebuilds = {d["build"]["gate"]: read_json(CODE_ROOT / d["build"]["gate"])
                for d in res.docs.values() if "build" in d}
    doc = control_document(reg, res, gate_doc, rel(reg.path, CODE_ROOT),
                           rel(reg.gated.dir / "gate.json", CODE_ROOT), rebuilds)
    write_json(Path(out) / "claims.json", doc)
    _write_report(Path(out), build_report(doc, gate_doc))
    return doc


def _refuse_without_results(out: Path, pattern: str, gate_doc: dict | None = None) -> None:
    """One line instead of a claims.json of zero seeds when `out/results` holds no result file yet."""
    if any((out / "results").glob(pattern)):
        return
    if gate_doc is not None and not gate_doc.get("passed"):
        why = "its gate did not pass, so nothing trained (gate.md is its published result)"
    else:
        runs = (f"tandem study control --out {rel(out, CODE_ROOT)}" if gate_doc is not None
                else "tandem study run --registered")
        why = f"no seed x arm has finished yet (results/{pattern}); `{runs}` runs them"
    raise BadInputError(f"study: {rel(out, CODE_ROOT)} has no results to compute claims from: {why}")


def registered(out: Path) -> dict:
    """A registered study's claims.json and report from its per-problem CSVs."""
    from tandem.report.study import study_report
    from tandem.study.claims import _plain

    reg = R.load(Path(out), CODE_ROOT)
    _refuse_without_results(Path(out), "seed-*/*.csv")
    res = read_results(Path(out) / "results", reg.study.get("evaluation", {}).get("ks", [1, 2, 4, 8]))
    doc = _plain(compute(res, reg))  # the report shows exactly what the file holds
    _write_text(Path(out) / "claims.json", dumps(doc))
    _write_report(Path(out), study_report(doc, reg.path.name))
    return doc


def pilot(out: Path) -> dict:
    """The pilot's decisions redone from `result.json`'s recorded measures; result.json and result.md written."""
    from tandem.study.pilot import decide, result_markdown

    recorded = read_json(Path(out) / "result.json")
    reg = R.load(CODE_ROOT / recorded["registration"], CODE_ROOT)
    if not isinstance(reg, R.PilotRegistration):
        raise BadInputError(f"study: {recorded['registration']} is not a pilot's registration")
    doc = decide(recorded, reg.criteria)
    write_json(Path(out) / "result.json", doc)
    _write_text(Path(out) / "result.md", result_markdown(doc))
    return doc


def record(out: Path) -> dict:
    """A multi-seed study kept as its claims.json only: read, nothing rewritten (there is nothing to recompute it
    from, and its report is the record as it was published)."""
    return read_json(Path(out) / "claims.json")


def kind(out: Path) -> str:
    """control, registered, pilot or record: what `out` holds (a one-line error when it is none of them)."""
    out = Path(out)
    if (out / "registration.yaml").is_file():
        reg = R.load(out, CODE_ROOT)
        return "control" if isinstance(reg, R.ControlRegistration) else "registered"
    if (out / "result.json").is_file() and "registration" in read_json(out / "result.json"):
        return "pilot"
    if (out / "claims.json").is_file() and "params_file" in read_json(out / "claims.json"):
        return "record"
    raise BadInputError(f"study: {out} holds no registration.yaml, pilot result.json or study claims.json to "
                        "recompute")


def recompute(out: str | Path) -> tuple[str, dict]:
    """(kind, document) after rebuilding `out`'s claims (or result) from its committed files."""
    k = kind(Path(out))
    return k, {"control": control, "registered": registered, "pilot": pilot, "record": record}[k](Path(out))


def summary(k: str, doc: dict) -> str:
    """Terminal lines for a recomputed document."""
    from tandem.study.claims import summary as study_summary
    from tandem.study.control import claims_summary
    from tasks.study.runs import claims_summary as record_summary

    if k == "control":
        return claims_summary(doc)
    if k == "registered":
        return study_summary(doc)
    if k == "pilot":
        return f"pilot: {doc['verdict']}"
    return (record_summary(doc) + "\n  (a record: its per-seed data were not kept, so these claims are the "
            "committed ones, read as they are; nothing was rewritten)")
