"""One way to derive a study run's params: a complete params file (as a dict) with registered changes applied.

A change is a mapping whose keys are top-level settings (`seed`, `out_root`: set) or sections (a mapping of
settings: merged key by key, keys keep their place). `derive` applies changes in order to a copy. The changes
themselves come from one place each:

- `seed_changes`: a multi-seed study's seed root (the study file with only `seed` and `out_root` changed);
- `gate_changes`: a positive control's gate root for one dialect (the senior's seed and build sections, the
  dialect's own build sections, the dialect's styles, the junior section with its source);
- `run_changes`: one seed x arm of a positive control (its seed and root, a later setting's overrides, the arm's
  pipeline arm, and the partner: `junior.source: base` when it is S).

The driver (tasks/study/stages.py `write_params`) writes and validates the result; nothing here touches files.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping


def derive(raw: Mapping[str, Any], *changes: Mapping[str, Any]) -> dict:
    """A copy of `raw` with every change applied in order (sections merged, top-level settings set)."""
    out = copy.deepcopy(dict(raw))
    for change in changes:
        for key, value in change.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = {**out[key], **copy.deepcopy(dict(value))}
            else:
                out[key] = copy.deepcopy(value)
    return out


def seed_changes(seed: int, root: str) -> list[dict]:
    return [{"seed": seed, "out_root": root}]


def gate_changes(reg, dialect, root: str) -> list[dict]:
    """`reg`: a tandem.study.registration.ControlRegistration; `dialect`: one of its dialects. The dialect's own
    params sections (a longer dialect phase, say) apply after the senior's. Its senior styles are the warm-up
    corpus's (`senior.build: styles`, data.solution_styles) or the base stage's dialect phase's (`senior.build: dialect_phase`, model.dialect_styles; data.solution_styles stays the params
    file's keyed warm-up mix, which J shares)."""
    styles = dict(dialect.senior_styles)
    where = {"model": {"dialect_styles": styles}} if reg.senior.build == "dialect_phase" else \
        {"data": {"solution_styles": styles}}
    return [{"out_root": root, "seed": reg.senior.seed}, dict(reg.senior.sections), dict(dialect.params), where,
            dict(reg.junior.sections)]


def run_changes(reg, seed: int, arm: str, root: str) -> list[dict]:
    """The changes from a dialect's gate params to one seed x arm's run."""
    spec = reg.arms[arm]
    return [{"seed": seed, "out_root": root}, dict(reg.params_overrides),
            {"train": {"arms": [spec.train]}, "analyze": {"reference_arm": spec.train}},
            {"junior": {"source": "base"}} if spec.partner == "S" else {}]
