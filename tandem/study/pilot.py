"""The registered pilot's decision rules (studies/registration.md), as pure functions.

- `decide_room`: the four room criteria (R1 solo gain, R2 drift or junior cross-entropy, R3 handoff cost, R4
  zero-variance groups) of GRPO against the base at one length, from the measured values;
- `choose_beta`: the KL-Reg candidate whose KL to the base is closest, on a log scale, to half of GRPO's;
- `decide`: the whole decision (variants in registered order, lengths shortest first, the first with room; then
  the beta) from the measured values of a result document: what `tandem study --recompute --out studies/pilot`
  reruns on the committed `result.json`;
- `study_file_text`, `set_value`: the chosen variant's file with the registered study changes;
- `result_markdown`: `result.md` from the result document.

The measurements (training, evaluation, the per-problem measures) are the driver's (tasks/study/pilot.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Mapping

from tandem.errors import BadInputError

CRITERIA = ("R1", "R2", "R3", "R4")


def decide_room(values: Mapping[str, float], criteria: Mapping[str, float]) -> dict:
    """{R1..R4: passed} and `room` (all four) from one length's measured values."""
    passed = {
        "R1": values["solo_gain"] >= criteria["R1_solo_gain"],
        "R2": values["kl_to_base"] >= criteria["R2_kl"] or values["junior_ce_ratio"] >= criteria["R2_junior_ce_ratio"],
        "R3": values["handoff_cost"] >= criteria["R3_handoff_cost"],
        "R4": values["zero_variance_groups"] <= criteria["R4_zero_variance"],
    }
    return {"passed": passed, "room": all(passed.values())}


def choose_beta(kl_grpo: float, candidates: dict[float, float]) -> tuple[float, float]:
    """The beta whose KL is closest to half of GRPO's on a log scale: (beta, its KL / (GRPO's KL / 2))."""
    target = kl_grpo / 2
    if not target > 0:
        raise BadInputError(f"pilot: GRPO's KL to the base is {kl_grpo}; there is no drift to halve")
    best = min(candidates, key=lambda b: abs(math.log(max(candidates[b], 1e-12) / target)))
    return best, candidates[best] / target


def decide(doc: dict, criteria: Mapping[str, float]) -> dict:
    """The result document with every decision redone from its measured values and `criteria`: each length's
    criteria and room, the chosen variant (the first length with room, variants in the document's order), the
    KL-Reg beta from the recorded candidates' KLs, and the verdict."""
    out = {**doc, "criteria": dict(criteria), "variants": {}, "chosen": None}
    for name, v in doc["variants"].items():
        rows = [{"step": r["step"], "values": r["values"], **decide_room(r["values"], criteria)} for r in v["lengths"]]
        out["variants"][name] = {**v, "lengths": rows}
        hit = next((r for r in rows if r["room"]), None)
        if hit is not None:
            out["chosen"] = {"variant": name, "params": v["params"], "steps": hit["step"]}
            break
    out.pop("verdict", None)
    out.pop("study_file", None)
    if out["chosen"] is not None:
        c, k = out["chosen"], (doc.get("chosen") or {}).get("kl_reg")
        if k is None:
            raise BadInputError("pilot: the recorded result has no KL-Reg candidates for the chosen variant")
        kl_grpo = next(r for r in out["variants"][c["variant"]]["lengths"] if r["step"] == c["steps"])["values"]["kl_to_base"]
        kls = {float(b): kl for b, kl in k["candidates"].items()}
        beta, ratio = choose_beta(kl_grpo, kls)
        c.update(kl_reg={"grpo_kl": kl_grpo, "target": kl_grpo / 2, "candidates": {f"{b:g}": kl for b, kl in kls.items()},
                         "beta": beta, "kl_over_target": ratio, "within_factor_1_5": 1 / 1.5 <= ratio <= 1.5})
        out["verdict"] = f"room: {c['variant']} at {c['steps']} steps; KL-Reg beta {beta:g}"
        if doc.get("study_file"):
            out["study_file"] = doc["study_file"]
    else:
        out["verdict"] = "no room at toy scale: no registered variant met every criterion"
    return out


def set_value(text: str, dotted: str, value: str, comment: str) -> str:
    """`text` (a params file) with the scalar or inline-list setting `section.key` replaced by `value` and a
    comment; comments and layout elsewhere are kept."""
    section, key = dotted.split(".")
    lines, sec = text.split("\n"), None
    for i, line in enumerate(lines):
        m = re.match(r"^([A-Za-z_]+):", line)
        if m:
            sec = m.group(1)
        elif sec == section and re.match(rf"^  {re.escape(key)}:", line):
            lines[i] = f"  {key}: {value}  # {comment}"
            while i + 1 < len(lines) and re.match(r"^(   |  - )", lines[i + 1]):  # a block value's lines
                del lines[i + 1]
            return "\n".join(lines)
    raise BadInputError(f"pilot: {dotted} not found in the variant's params file")


def study_file_text(variant_file: Path, steps: int, beta: float, reg) -> str:
    """The chosen variant's params file with the registered study changes (`reg`: a PilotRegistration)."""
    text = variant_file.read_text()
    text = re.sub(r"\A(#.*\n)+", (
        "# The registered study's params file (studies/registration.md): the pilot's chosen variant "
        f"({variant_file.name}) with\n# the registered study changes only. Generated by `tandem study pilot` from the "
        "pilot's result and committed before\n# the study's first run; `tandem study run --registered` runs it. "
        "A complete params file.\n"), text)
    arms = reg.study["arms"]
    changes = {"train.arms": ("[" + ", ".join(arms) + "]", "REGISTERED: the study's arms"),
               "train.steps": (str(steps), "REGISTERED: the pilot's chosen length"),
               "train.kl_beta": (f"{beta:g}", "REGISTERED: the pilot's KL-Reg beta (halves GRPO's drift)"),
               "train.save_every": ("50", "REGISTERED: checkpoints for the best-by-validation row"),
               "evaluate.checkpoints": ("final_and_best", "REGISTERED: the final and the best-by-validation checkpoint"),
               "analyze.reference_arm": ("grpo", "the most-drifted token types are GRPO's")}
    for dotted, (value, comment) in changes.items():
        text = set_value(text, dotted, value, comment)
    return text


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def result_markdown(doc: dict) -> str:
    c = doc["criteria"]
    lines = ["# The pilot's result", "",
             f"Registered in `{doc['registration']}`; seed {doc['seed']}; GRPO against the base, macro over the "
             "benchmarks (`tandem study pilot` writes this file from `result.json`).", "",
             f"**Verdict: {doc['verdict']}.**", "",
             f"Criteria: R1 solo pass@1 gain >= {c['R1_solo_gain']}; R2 KL to the base >= {c['R2_kl']} nats/token "
             f"or junior CE >= {c['R2_junior_ce_ratio']}x the base's own; R3 solo minus step pass@1 >= "
             f"{c['R3_handoff_cost']}; R4 zero-variance groups <= {c['R4_zero_variance']}.", "",
             "| variant | steps | solo pass@1 base -> GRPO (R1 gain) | KL to base | junior CE base -> GRPO (ratio) "
             "| step pass@1 (R3 cost) | zero-variance groups | R1 | R2 | R3 | R4 | room |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in doc["variants"].items():
        for r in v["lengths"]:
            x, p = r["values"], r["passed"]
            yes = {True: "yes", False: "no"}
            lines.append(f"| {name} | {r['step']} | {_fmt(x['solo_pass1_base'])} -> {_fmt(x['solo_pass1'])} "
                         f"({x['solo_gain']:+.3f}) | {x['kl_to_base']:.4f} | {x['junior_ce_base']:.4f} -> "
                         f"{x['junior_ce']:.4f} ({x['junior_ce_ratio']:.2f}x) | {_fmt(x['step_pass1'])} "
                         f"({x['handoff_cost']:+.3f}) | {x['zero_variance_groups']:.2f} | "
                         + " | ".join(yes[p[k]] for k in CRITERIA) + f" | {yes[r['room']]} |")
    ch = doc.get("chosen")
    if ch and "kl_reg" in ch:
        k = ch["kl_reg"]
        lines += ["", f"KL-Reg on {ch['variant']} at {ch['steps']} steps: GRPO's KL {k['grpo_kl']:.4f}, target (half) "
                  f"{k['target']:.4f}; candidates " + ", ".join(f"beta {b}: KL {kl:.4f}" for b, kl in k["candidates"].items())
                  + f". Chosen beta **{k['beta']:g}** (its KL is {k['kl_over_target']:.2f}x the target"
                  + ("" if k["within_factor_1_5"] else "; outside the factor 1.5 the registration names") + ")."]
    if doc.get("study_file"):
        lines += ["", f"The study's params file: `{doc['study_file']}`."]
    return "\n".join(lines) + "\n"
