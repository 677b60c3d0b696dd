"""A tokenizer saved after `load_tokenizer` does not depend on the environment it was loaded in: transformers
keeps the load-time `local_files_only` (True under HF_HUB_OFFLINE=1) and would write it into every checkpoint's
tokenizer_config.json, so the same run made offline and online would publish different files."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.models import load_tokenizer

S = Path(__file__).resolve().parents[1] / "studies" / "junior-control" / "models" / "coded" / "S"


def test_a_saved_tokenizer_is_the_same_offline_and_online(tmp_path, monkeypatch):
    saved = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("HF_HUB_OFFLINE", mode)
        tok = load_tokenizer(S)
        tok.save_pretrained(tmp_path / mode)
        saved[mode] = (tmp_path / mode / "tokenizer_config.json").read_text()
    assert "local_files_only" not in json.loads(saved["1"])
    assert saved["1"] == saved["0"]
