"""The vLLM version fence and the engine settings the rollout service relies on (tandem/rollout/vllm/compat.py),
in the pipeline's environment: no vLLM needed (a fake `vllm` package stands in where one is imported)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.rollout.vllm import compat
from tandem.rollout.vllm.knobs import EngineKnobs
from tandem.rollout.vllm.service import engine_kwargs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("v", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.2rc1"])
def test_supported_versions_pass(v):
    compat.check_version(v)


@pytest.mark.parametrize("v", ["0.33.0", "0.34.0", "0.31.9", "1.32.0", "dev"])
def test_other_versions_are_refused_in_one_line_naming_both(v):
    with pytest.raises(compat.UnsupportedVLLMError) as e:
        compat.check_version(v)
    msg = str(e.value)
    assert "\n" not in msg and f"vLLM {v} is installed" in msg and "0.32.x" in msg


def _fake_vllm(tmp_path: Path, version: str) -> Path:
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    # records the environment vLLM was imported under: the runner choice must be set before the import
    (pkg / "__init__.py").write_text(
        f"import os\n__version__ = {version!r}\nRUNNER_AT_IMPORT = os.environ.get('VLLM_USE_V2_MODEL_RUNNER')\n")
    return pkg.parent


def test_the_service_refuses_a_vllm_outside_the_fence_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{_fake_vllm(tmp_path, '0.40.1')}{os.pathsep}{ROOT}",
           "TANDEM_VLLM_TOKEN": "x" * 32}
    p = subprocess.run([sys.executable, "-m", "tandem.rollout.vllm.service", "--senior", str(tmp_path),
                        "--junior", str(tmp_path), "--port", "0"], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert "vLLM 0.40.1 is installed" in lines[0] and "0.32.x" in lines[0]


def test_the_runner_choice_is_set_before_vllm_is_imported(tmp_path, monkeypatch):
    from tandem.rollout.vllm import service

    monkeypatch.syspath_prepend(str(_fake_vllm(tmp_path, "0.32.0")))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert service.check_vllm() == "0.32.0"
    assert sys.modules["vllm"].RUNNER_AT_IMPORT == "0" == os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    del sys.modules["vllm"]  # not monkeypatch.delitem: its undo would put the fake back after the test


@pytest.mark.parametrize("is_cpu", [True, False])
def test_engine_arguments_state_the_scheduling_and_the_tandem_pieces(is_cpu):
    for role in (0, 1):
        kw = engine_kwargs(EngineKnobs(), "/m", role, 3, "/s", "float32", is_cpu)
        assert kw["async_scheduling"] is False  # explicit on every platform, whatever vLLM's default
        assert kw["scheduler_cls"].endswith("sched.TandemScheduler")
        assert kw["worker_extension_cls"].endswith("worker.TandemWorker")
        assert kw["distributed_executor_backend"] == "uni" and kw["seed"] == 3
        assert ("logprobs_mode" in kw) == (role == 1)
        assert kw.get("block_size") == (32 if is_cpu else None)
    assert compat.ENGINE_ENV == {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def test_every_vllm_import_is_public_or_a_listed_touchpoint():
    listed = " ".join(t.vllm for t in compat.TOUCHPOINTS)
    missing = []
    files = sorted((ROOT / "tandem" / "rollout" / "vllm").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names if a.name.split(".")[0] == "vllm"]
            for m in mods:
                if m not in compat.PUBLIC_IMPORTS and m not in listed:
                    missing.append(f"{f.name}: {m}")
    assert not missing, f"vLLM imports neither public nor listed in compat.TOUCHPOINTS: {missing}"


class _Factory:
    def __init__(self, factory):
        self.factory = factory


class _Outputs:
    """Stands in for vLLM's `EngineCoreOutputs` (a msgspec struct): its fields and defaults, and a field a newer
    vLLM added (`weight_version`)."""

    __struct_fields__ = ("engine_index", "outputs", "scheduler_stats", "timestamp", "utility_output",
                         "finished_requests", "wave_complete", "start_wave", "weight_version")
    __struct_defaults__ = (0, _Factory(list), None, 0.0, None, None, None, None, None)

    def __init__(self, **kw):
        for name, default in zip(self.__struct_fields__, self.__struct_defaults__):
            setattr(self, name, kw.get(name, default.factory() if isinstance(default, _Factory) else default))


def test_a_step_message_is_dropped_only_when_it_says_nothing():
    from tandem.rollout.vllm.sched import says_nothing

    assert says_nothing(_Outputs(engine_index=1, timestamp=12.5))
    assert not says_nothing(_Outputs(outputs=["x"]))
    for field, value in (("finished_requests", {"r1"}), ("scheduler_stats", object()), ("wave_complete", 0),
                         ("start_wave", 3), ("utility_output", object()), ("weight_version", 2)):
        assert not says_nothing(_Outputs(**{field: value})), field


def _wheres(t) -> list[tuple[Path, list[str]]]:
    """The places a touchpoint's `where` names, comma-separated: (the module's file, tandem/rollout/vllm/<module>.py
    or benchmarks/<module>.py, and the class, function or method names after the module)."""
    out = []
    for where in (w.strip() for w in t.where.split(",")):
        if where.startswith("benchmarks/"):
            head, *rest = where.split("/", 1)[1].split(".")
            out.append((ROOT / "benchmarks" / f"{head}.py", rest))
        else:
            head, *rest = where.split(".")
            out.append((ROOT / "tandem" / "rollout" / "vllm" / f"{head}.py", rest))
    return out


def test_every_touchpoint_names_code_that_exists():
    """Each `where` of the service's own touchpoints names a module of tandem/rollout/vllm/ and, after it, a class,
    function or method defined there (so a move between modules updates the list)."""
    wrong = []
    for t in compat.TOUCHPOINTS:
        if t.where.startswith("benchmarks/"):
            continue
        for f, rest in _wheres(t):
            if not f.exists():
                wrong.append(f"{t.where}: no module {f.name}")
                continue
            names = {n.name for n in ast.walk(ast.parse(f.read_text()))
                     if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
            wrong += [f"{t.where}: {f.name} defines no {r}" for r in rest if r not in names]
    assert not wrong, wrong


def test_the_service_is_split_by_job_in_modules_under_400_lines():
    """The HTTP layer, the engines, the sessions and the service's state each in a module of their own."""
    vllm_dir = ROOT / "tandem" / "rollout" / "vllm"
    for name in ("service", "httpd", "engines", "sessions"):
        lines = len((vllm_dir / f"{name}.py").read_text().splitlines())
        assert lines <= 400, f"{name}.py has {lines} lines"


NO_PATCH_AT_IMPORT = r"""
import vllm.v1.worker.gpu_input_batch as gib
import vllm.v1.worker.gpu_model_runner as gmr
from vllm.v1.engine.core import EngineCore
before = (gib.InputBatch.add_request, gmr.GPUModelRunner._update_states, gmr.GPUModelRunner._sample)
import tandem.rollout.vllm.service, tandem.rollout.vllm.sched, tandem.rollout.vllm.worker  # noqa: E401
from tandem.rollout.vllm import returns, submit
assert (gib.InputBatch.add_request, gmr.GPUModelRunner._update_states, gmr.GPUModelRunner._sample) == before
assert not hasattr(EngineCore, submit.UTILITY) and not hasattr(EngineCore, returns.UTILITY)
assert not hasattr(gib.InputBatch, "_tandem_rows") and not hasattr(gmr.GPUModelRunner, "_tandem_cpu_rewind")
submit.install(); returns.install()  # the explicit calls (sched.TandemScheduler, at engine start) install them
assert hasattr(EngineCore, submit.UTILITY) and hasattr(EngineCore, returns.UTILITY)
print("ok")
"""


@pytest.mark.slow
def test_no_patch_is_installed_at_import():
    """Importing the service's modules in vLLM's environment patches nothing; the engine-core utilities appear
    only when installed explicitly (at engine start), the worker patches by `TandemWorker.tandem_install_patches`."""
    from vllm_fixtures import run_in_vllm

    run_in_vllm(NO_PATCH_AT_IMPORT, timeout=300)


# The modules whose code touches vLLM's objects (the service's and the benchmarks'), scanned for reliances
VLLM_MODULES = ("tandem/rollout/vllm/sched.py", "tandem/rollout/vllm/submit.py", "tandem/rollout/vllm/returns.py",
                "tandem/rollout/vllm/sessions.py", "tandem/rollout/vllm/worker.py", "tandem/rollout/vllm/engines.py",
                "tandem/rollout/vllm/service.py", "benchmarks/sched_step.py", "benchmarks/stop_rule.py",
                "benchmarks/vllm_replay.py", "benchmarks/vllm_stock.py", "benchmarks/vllm_ab_service.py")
# names the scan finds that are the project's own, not vLLM's (each with where it is defined)
OURS = {
    "_load": "engines.EngineHost._load", "_returns": "engines.EngineHost._returns",
    "_routers": "engines.EngineHost._routers", "_run": "engines.EngineHost._run", "_start": "engines.EngineHost._start",
    "_submitters": "engines.EngineHost._submitters", "open_sessions": "service.Service (its count of sessions)",
    "_FINISHES": "sessions._FINISHES", "_STOPS": "sessions._STOPS",
    "_engine_kwargs": "engines.EngineHost._engine_kwargs", "_run_rows": "service.Service._run_rows",
    "health": "service.Service.health", "replay": "benchmarks/vllm_ab_service.ABService.replay",
    "_hold_back": "sched.TandemScheduler._hold_back",
}
VLLM_BASES = {"Scheduler", "LogitsProcessor", "StatLoggerBase"}


def _identifiers(tree: ast.AST) -> set[str]:
    """Every name the code spells: attributes, names, definitions, keyword arguments, imported names, strings."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
        elif isinstance(n, ast.alias):
            out.add(n.asname or n.name.split(".")[-1])
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            out.add(n.value)
    return out


def test_every_touchpoint_lists_the_vllm_names_its_code_uses():
    """Each touchpoint names the vLLM names it relies on, and each is spelled in the code at its `where` (a name
    the code stopped using fails here, so the table cannot keep stale entries)."""
    missing = []
    for t in compat.TOUCHPOINTS:
        assert t.names, f"{t.where}: no vLLM names listed"
        found = set().union(*(_identifiers(ast.parse(f.read_text())) for f in {f for f, _ in _wheres(t)}))
        missing += [f"{t.where}: {n}" for n in t.names if n not in found]
    assert not missing, f"touchpoint names not found in their code: {missing}"


def _reliances(tree: ast.AST, own: set[str]) -> set[str]:
    """The vLLM names a module relies on beyond imports, as its syntax shows them: the methods a subclass of a
    vLLM class defines (overrides), the attributes it reads from self that its module never sets (inherited
    state), `super().name` calls, attributes written onto objects other than self (vLLM's objects and classes),
    `setattr` names given as strings, and private attributes it reads that its module does not define."""
    found: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases}
        if bases & VLLM_BASES:
            found |= {m.name for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and not m.name.startswith("__")}
            found |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                      and n.value.id == "self" and isinstance(n.ctx, ast.Load) and n.attr not in own}
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Call) \
                and getattr(n.func.value.func, "id", "") == "super" and not n.func.attr.startswith("__"):
            found.add(n.func.attr)
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") not in ("self", "cls"):
                    found.add(t.attr)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setattr" and len(n.args) > 1 \
                and isinstance(n.args[1], ast.Constant):
            found.add(n.args[1].value)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") \
                and n.attr not in own:
            found.add(n.attr)
    return found


def _own(tree: ast.AST) -> set[str]:
    """What a module defines: its functions and classes, and the attributes it sets on self."""
    own: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                own |= {y.attr for y in ast.walk(t) if isinstance(y, ast.Attribute)
                        and getattr(y.value, "id", "") in ("self", "cls")}
    return own


def test_no_vllm_reliance_found_in_the_code_is_left_out_of_the_table():
    """The service's and the benchmarks' vLLM-facing modules scanned for reliances (`_reliances`): each is a name
    of some touchpoint, or the project's own (`OURS`, where it is defined)."""
    listed = {n for t in compat.TOUCHPOINTS for n in t.names}
    unlisted = []
    for rel in VLLM_MODULES:
        tree = ast.parse((ROOT / rel).read_text())
        unlisted += [f"{rel}: {n}" for n in sorted(_reliances(tree, _own(tree))) if n not in listed and n not in OURS]
    assert not unlisted, f"vLLM reliances not in compat.TOUCHPOINTS: {unlisted}"


def test_the_reliance_scan_sees_an_override_a_write_and_a_private_read():
    code = ("class S(Scheduler):\n    def _private_step(self):\n        return self.kv_cache_manager\n"
            "def f(req, core):\n    req._mark = 1\n    return core._queue\n")
    assert _reliances(ast.parse(code), set()) == {"_private_step", "kv_cache_manager", "_mark", "_queue"}
