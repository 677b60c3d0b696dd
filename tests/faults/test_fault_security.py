"""Security rules checked on the source tree and at run time: safetensors only, no remote code unless params
enable it, every server the project starts listens on 127.0.0.1 by default, model output stays escaped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CODE_DIRS = ("tandem", "tasks", "flows", "cli", "scripts", "benchmarks", "infra")


def _project_files(*suffixes: str) -> list[Path]:
    out = []
    for d in CODE_DIRS:
        for p in (REPO / d).rglob("*"):
            if p.is_file() and (p.suffix in suffixes or p.name in suffixes) and "__pycache__" not in p.parts:
                out.append(p)
    return out


def _call_args(text: str, start: int) -> str:
    """The argument text of a call whose opening parenthesis ends at `start` (balanced parentheses)."""
    depth, i = 1, start
    while depth and i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def test_no_pickle_loading_of_weights():
    """torch.load unpickles arbitrary objects: allowed only with weights_only=True."""
    bad = []
    for p in _project_files(".py"):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\btorch\.load\(", line) and "weights_only=True" not in line:
                bad.append(f"{p.relative_to(REPO)}:{n}")
            if re.search(r"\bpickle\.loads?\(", line):
                bad.append(f"{p.relative_to(REPO)}:{n}")
    assert bad == []


def test_models_load_as_safetensors_only():
    """Every model load in the project asks for safetensors (a .bin checkpoint is refused, not unpickled); the one
    other format read is GGUF (`model.source: gguf`), a tensor container that, like safetensors, holds no code."""
    bad, seen = [], 0
    for p in _project_files(".py"):
        text = p.read_text()
        for m in re.finditer(r"AutoModel\w*\.from_pretrained\(", text):
            seen += 1
            args = _call_args(text, m.end())
            if "use_safetensors=True" not in args and "gguf_file=" not in args:
                bad.append(f"{p.relative_to(REPO)}: {text[m.start():m.start() + 80]}")
    assert seen >= 2 and bad == []  # the scan sees the project's model loads


def test_a_pickle_only_model_directory_is_refused(tmp_path):
    from tandem.models import load_model

    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_remote_code_only_when_params_enable_it():
    from tandem.config import ModelConfig

    assert ModelConfig().trust_remote_code is False
    bad = [f"{p.relative_to(REPO)}:{n}" for p in _project_files(".py")
           for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"trust_remote_code\s*=\s*True", line)]
    assert bad == []
    for name in ("params.yaml", "params.paper.yaml"):
        assert re.search(r"trust_remote_code:\s*false", (REPO / name).read_text()), name


def test_servers_listen_on_localhost_by_default():
    """No server start in the project binds all interfaces unless a deployment asks for it explicitly."""
    bad = []
    for p in _project_files(".py", ".sh", ".yaml", ".yml", "Dockerfile", "Makefile"):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            if re.search(r"--host[ =]\"?\$\{[A-Z_]+:-0\.0\.0\.0\}|--host[ =]0\.0\.0\.0|host\s*=\s*[\"']0\.0\.0\.0", line):
                bad.append(f"{p.relative_to(REPO)}:{n}: {line.strip()}")
    assert bad == []
    for p in (REPO / "Makefile", REPO / "infra" / "README.md"):
        for line in p.read_text().splitlines():
            if "server start" in line:
                assert "--host 127.0.0.1" in line, line
    service = (REPO / "tandem" / "rollout" / "vllm" / "httpd.py").read_text()  # the service's flags
    assert 'ap.add_argument("--host", default="127.0.0.1"' in service


def test_prefects_temporary_server_binds_localhost():
    """`tandem run` without PREFECT_API_URL starts Prefect's temporary server: it must not face the network."""
    import inspect

    from prefect.server.api import server
    from prefect.settings import get_current_settings

    assert get_current_settings().server.api.host == "127.0.0.1"
    src = inspect.getsource(server.SubprocessASGIServer)
    assert '"127.0.0.1"' in src and "0.0.0.0" not in src


def test_model_output_in_the_report_is_escaped():
    from tandem.report.document import Report, Section, Table, TextBlock
    from tandem.report.render import render_html

    evil = "<script>alert('x')</script><img src=x onerror=alert(1)>"
    sec = Section("Examples")
    sec.texts.append(TextBlock("a generated completion", evil))  # where model output lands
    sec.tables.append(Table("generations", ["id", "completion"], [["r1", evil]]))
    html = render_html(Report(title="t", sections=[sec]))
    assert "<script>alert" not in html and "onerror=alert(1)>" not in html
    assert "&lt;script&gt;" in html
