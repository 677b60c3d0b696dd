"""Complete params files for tests: the tiny test pipeline's settings with a test's own values on top.

A params file must state every setting (`tasks.common.load_params` is strict), so a test that writes one
starts from `tests/flows/tiny_params.yaml` (complete) and overrides what it needs, section by section.
"""

from __future__ import annotations

from pathlib import Path

import yaml

TINY = Path(__file__).resolve().parent / "flows" / "tiny_params.yaml"


def complete_params(overrides: dict | None = None, base: Path = TINY) -> dict:
    """`base` (a complete params file) with `overrides` merged in: sections key by key, top-level keys whole."""
    raw = yaml.safe_load(Path(base).read_text())
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return raw
