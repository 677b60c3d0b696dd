"""Secrets from the environment (W&B, HF tokens) never reach a file under the output root, a log or a report.

The slow test runs the whole pipeline on the tiny test config with W&B on (offline, so it writes its run files
under `runs/`) and planted `WANDB_API_KEY` / `HF_TOKEN` values, then reads every file under the output root,
binary ones included, and the run's console output. The fast tests check the redaction helpers where run
metadata, metrics and logs are recorded.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.redact import REDACTED, RedactingFilter, is_secret_name, redact, secret_values

REPO = Path(__file__).resolve().parents[2]
PLANTED = {"WANDB_API_KEY": "planted0wandb0key0d41d8cd98f00b204e9800998ecf8427e",
           "HF_TOKEN": "hf_plantedTokenZXCVBNMasdfghjkl0123456789"}


def _files_holding(root: Path, needles: list[str]) -> dict[str, list[str]]:
    hits: dict[str, list[str]] = {}
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            found = [n for n in needles if n.encode() in data]
            if found:
                hits[str(p.relative_to(root))] = found
    return hits


@pytest.mark.slow
def test_a_pipeline_run_leaves_no_trace_of_planted_secrets(tmp_path):
    params = yaml.safe_load((REPO / "tests" / "flows" / "tiny_params.yaml").read_text())
    params["out_root"] = str(tmp_path / "out")
    params["train"].update({"report_to": "wandb", "wandb_mode": "offline"})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, **PLANTED, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "TANDEM_DEBUG": ""}
    res = subprocess.run([sys.executable, "-m", "cli", "run", "--direct", "-p", str(tmp_path / "params.yaml")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    root = tmp_path / "out"
    files = [p for p in root.rglob("*") if p.is_file()]
    assert (root / "reports" / "report.html").exists() and list((root / "runs").rglob("*.wandb")), \
        "W&B wrote no run files: the test would prove nothing"
    assert len(files) > 50
    assert _files_holding(root, list(PLANTED.values())) == {}
    for value in PLANTED.values():
        assert value not in res.stdout and value not in res.stderr


def test_the_scan_finds_a_planted_value_in_a_binary_file(tmp_path):
    """The control for the test above: the scan reads every byte of every file."""
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "er" / "blob.bin").write_bytes(b"\x00\xff" + PLANTED["HF_TOKEN"].encode() + b"\x00")
    assert _files_holding(tmp_path, list(PLANTED.values())) == {"deep/er/blob.bin": [PLANTED["HF_TOKEN"]]}


def test_redact_removes_secret_values_and_secret_keys(monkeypatch):
    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false-but-long")  # a setting, not a secret
    assert set(PLANTED.values()) <= set(secret_values())
    doc = {"cmd": f"wandb login {PLANTED['WANDB_API_KEY']}", "nested": [{"x": PLANTED["HF_TOKEN"] + "!"}],
           "HF_TOKEN": "anything", "api_key": "k", "pad_token": "<pad>", "max_new_tokens": 16,
           "TOKENIZERS_PARALLELISM": "false-but-long"}
    out = redact(doc)
    assert out == {"cmd": f"wandb login {REDACTED}", "nested": [{"x": REDACTED + "!"}], "HF_TOKEN": REDACTED,
                   "api_key": REDACTED, "pad_token": "<pad>", "max_new_tokens": 16,
                   "TOKENIZERS_PARALLELISM": "false-but-long"}
    assert is_secret_name("AWS_SECRET_ACCESS_KEY") and is_secret_name("PREFECT_API_KEY")
    assert not is_secret_name("TOKENIZERS_PARALLELISM") and not is_secret_name("WANDB_MODE")


def test_metrics_and_report_metadata_are_redacted(monkeypatch, tmp_path):
    from tandem.config import params_from_dict
    from tasks import report
    from tasks.common import write_json

    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    write_json(tmp_path / "m.json", {"note": f"token {PLANTED['HF_TOKEN']}"})
    assert PLANTED["HF_TOKEN"] not in (tmp_path / "m.json").read_text()
    # a value that reaches the run metadata (here through the git commit probe) is redacted there too
    monkeypatch.setattr(report, "_git_commit", lambda root: f"abc ({PLANTED['WANDB_API_KEY']})")
    meta = report.metadata(params_from_dict({}), {})
    assert PLANTED["WANDB_API_KEY"] not in repr(meta) and REDACTED in meta["git commit"]


def test_log_records_are_redacted(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", PLANTED["HF_TOKEN"])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    log = logging.getLogger("tandem.test.redact")
    log.addHandler(handler)
    try:
        log.warning("downloading with token %s", PLANTED["HF_TOKEN"])
    finally:
        log.removeHandler(handler)
    assert PLANTED["HF_TOKEN"] not in stream.getvalue() and REDACTED in stream.getvalue()


def test_cli_tracebacks_never_show_local_values():
    from cli.main import app

    assert app.pretty_exceptions_show_locals is False
