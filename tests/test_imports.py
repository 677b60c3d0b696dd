"""Every module of the `tandem` library imports with prefect, dvc, great_expectations and wandb blocked."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import tandem

BLOCKED = ("prefect", "dvc", "great_expectations", "wandb")


def _all_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(tandem.__path__, prefix="tandem."))


def test_library_has_modules():
    mods = _all_modules()
    assert "tandem.config" in mods and len(mods) >= 3


def test_every_module_imports_with_orchestration_blocked():
    # A fresh interpreter: `sys.modules[name] = None` makes `import name` raise ImportError there and makes
    # availability probes (importlib.util.find_spec) report the package absent.
    code = (
        "import sys, importlib\n"
        f"for name in {BLOCKED!r}: sys.modules[name] = None\n"
        f"mods = {_all_modules()!r}\n"
        "for m in mods:\n"
        "    importlib.import_module(m)\n"
        f"leaked = [n for n in sys.modules if n.split('.')[0] in {BLOCKED!r} and sys.modules[n] is not None]\n"
        "assert not leaked, leaked\n"
        "print('ok', len(mods))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


def test_blocking_really_blocks():
    # Guard against a test that cannot fail: the same mechanism does stop a direct import.
    code = "import sys\nsys.modules['wandb'] = None\ntry:\n import wandb\nexcept ImportError:\n print('blocked')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "blocked"


def test_library_never_imports_the_pipeline():
    # Layers read in one direction (cli -> flows -> tasks -> tandem): a static scan of every import statement in
    # tandem/, so even an import inside a function body (which the runtime check above cannot see) is caught.
    import ast

    root = Path(tandem.__file__).resolve().parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in ("tasks", "flows", "cli") + BLOCKED:
                    offenders.append(f"{path.relative_to(root.parent)}:{node.lineno} imports {name}")
    assert not offenders, "\n".join(offenders)
