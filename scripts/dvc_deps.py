"""The code dependencies of every DVC stage, computed from its real import closure: check or rewrite dvc.yaml.

A stage runs `tandem stage <name>`: the `stage` command of `cli/main.py` imports `tasks/<name>.py`, which
imports the library. The closure follows, statically (`ast`, nothing is imported), every `import` and
`from ... import` of every repo module reached, at module level and inside functions (a lazy import runs when
the stage calls it), plus `importlib.import_module("<constant>")`, plus the `__init__.py` of every package on
the way (importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py`). Only modules of the repo's packages
(`cli`, `flows`, `tandem`, `tasks`) are followed; third-party code is pinned by the environment, not by DVC.
Of `cli/main.py` only the module-level imports count: its other commands import the flow and benchmarks
lazily, which a stage never runs.

A directory is declared only when every Python file under it is in the closure (DVC then hashes the whole
directory, which stays truthful); otherwise its files are listed one by one.

    python scripts/dvc_deps.py --check    # exit 1 and list each stage whose code deps differ from its closure
    python scripts/dvc_deps.py --write    # rewrite the code deps of every stage in dvc.yaml (comments kept)
    python scripts/dvc_deps.py            # print each stage's computed code deps

`--write` replaces, in each stage's `deps:` list, the entries under the code packages and keeps every other
entry (data, models) and every comment where it was.

The `params:` of the stages in `GENERATED_PARAMS` are generated too, from the one statement of what shapes a
run (tandem/run_keys.py: `train@<arm>` declares the keys that shape an arm's outputs, never the list of the
other arms or the rollout service's address); `--write` replaces that list and `--check` reports a difference.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tandem.run_keys, when run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from tandem.run_keys import train_stage_params  # noqa: E402
CODE_ROOTS = ("cli", "flows", "tandem", "tasks")
ENTRY = "cli.main"  # what `tandem stage <name>` runs; module-level imports only (see the docstring)
GENERATED_PARAMS = {"train": train_stage_params}  # stage -> its `params:` list (see the docstring)


# --------------------------------------------------------------------------------------------------
# Import closure
# --------------------------------------------------------------------------------------------------

def module_file(root: Path, name: str) -> Path | None:
    """The file of repo module `name` (`a/b.py` or `a/b/__init__.py`), or None when it is not a repo module."""
    parts = name.split(".")
    if not parts or parts[0] not in CODE_ROOTS:
        return None
    for cand in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if cand.is_file():
            return cand
    return None


def _walk(tree: ast.AST, lazy: bool):
    """Every node of `tree`; without `lazy`, not the bodies of functions (they run only when called)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not lazy and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            stack.append(child)


def imported_names(path: Path, module: str, lazy: bool = True) -> set[str]:
    """Module names `path` (module `module`) imports; `from a import b` yields both `a` and `a.b`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _walk(tree, lazy):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


def import_closure(entries: list[tuple[str, bool]], root: Path = ROOT) -> set[str]:
    """Repo files (POSIX paths relative to `root`) run by importing `entries` ((module, follow lazy imports))."""
    seen: set[str] = set()
    files: set[str] = set()
    todo = list(entries)
    while todo:
        name, lazy = todo.pop()
        key = f"{name}:{lazy}"
        if key in seen:
            continue
        seen.add(key)
        path = module_file(root, name)
        if path is None:
            continue
        files.add(path.relative_to(root).as_posix())
        parts = name.split(".")
        todo += [(".".join(parts[:i]), True) for i in range(1, len(parts))]  # parent packages run first
        todo += [(n, True) for n in imported_names(path, name, lazy)]
    return files


def compact(files: set[str], root: Path = ROOT) -> list[str]:
    """`files` with every directory whose Python files are all in `files` written as that directory."""
    def covered(d: Path) -> bool:
        pys = [p for p in d.rglob("*.py") if "__pycache__" not in p.parts]
        return bool(pys) and all(p.relative_to(root).as_posix() in files for p in pys)

    out: list[str] = []
    done: set[str] = set()
    for f in sorted(files, key=lambda f: (f.count("/"), f)):
        if f in done:
            continue
        parts = Path(f).parts
        for i in range(1, len(parts)):  # the shallowest fully covered directory holding f
            d = root.joinpath(*parts[:i])
            if d.name not in CODE_ROOTS and covered(d):  # a top-level package is never declared whole
                out.append(Path(*parts[:i]).as_posix())
                done.update(p.relative_to(root).as_posix() for p in d.rglob("*.py"))
                break
        else:
            out.append(f)
            done.add(f)
    return sorted(set(out))


def stage_code_deps(stage: str, root: Path = ROOT) -> list[str]:
    """The code deps of stage `stage` (`tasks/<stage>.py` run through `tandem stage`)."""
    return compact(import_closure([(ENTRY, False), (f"tasks.{stage}", True)], root), root)


# --------------------------------------------------------------------------------------------------
# dvc.yaml
# --------------------------------------------------------------------------------------------------

def is_code(dep: str) -> bool:
    return dep.split("/")[0] in CODE_ROOTS


def stages_of(dvc_yaml: dict) -> dict[str, dict]:
    """Stage name -> its definition (the `do` block of a `foreach` stage)."""
    return {name: (st["do"] if "foreach" in st else st) for name, st in dvc_yaml["stages"].items()}


def check(root: Path = ROOT) -> list[str]:
    """One line per stage whose declared code deps differ from its import closure."""
    problems = []
    for name, st in stages_of(yaml.safe_load((root / "dvc.yaml").read_text())).items():
        declared = {d for d in st.get("deps", []) if is_code(d)}
        want = set(stage_code_deps(name, root))
        for d in sorted(want - declared):
            problems.append(f"{name}: imports {d}, which dvc.yaml does not declare")
        for d in sorted(declared - want):
            problems.append(f"{name}: declares {d}, which is not (or not wholly) in its import closure")
        if name in GENERATED_PARAMS and st.get("params", []) != GENERATED_PARAMS[name]():
            problems.append(f"{name}: its params differ from tandem/run_keys.py's list")
    return problems


_STAGE = re.compile(r"^  ([A-Za-z_][\w-]*):\s*$")
_DEPS = re.compile(r"^(\s+)deps:\s*$")
_PARAMS = re.compile(r"^(\s+)params:\s*$")
_ITEM = re.compile(r"^(\s+)- (\S+)\s*$")


def rewrite(text: str, root: Path = ROOT) -> str:
    """dvc.yaml `text` with each stage's code deps replaced by its closure and the generated params lists
    written (other lines untouched)."""
    lines = text.splitlines()
    out: list[str] = []
    stage = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _STAGE.match(line)
        if m:
            stage = m.group(1)
        generated = _DEPS.match(line) or (_PARAMS.match(line) and stage in GENERATED_PARAMS)
        if generated and stage is not None:
            out.append(line)
            i += 1
            block = []
            while i < len(lines) and (_ITEM.match(lines[i]) or lines[i].strip().startswith("#")):
                block.append(lines[i])
                i += 1
            indent = next((_ITEM.match(b).group(1) for b in block if _ITEM.match(b)), " " * 6)
            if _DEPS.match(line):
                kept = [b for b in block if not (_ITEM.match(b) and is_code(_ITEM.match(b).group(2)))]
                entries = stage_code_deps(stage, root)
            else:
                kept, entries = [b for b in block if not _ITEM.match(b)], GENERATED_PARAMS[stage]()
            at = next((k for k, b in enumerate(kept) if _ITEM.match(b)), len(kept))  # generated first, after comments
            kept[at:at] = [f"{indent}- {d}" for d in entries]
            out += kept
            continue
        out.append(line)
        i += 1
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml's code deps differ from the closures")
    g.add_argument("--write", action="store_true", help="rewrite the code deps (and generated params) in dvc.yaml")
    a = ap.parse_args(argv)
    path = ROOT / "dvc.yaml"
    if a.write:
        new = rewrite(path.read_text())
        path.write_text(new)
        problems = check()
        assert not problems, problems
        print(f"{path}: code deps of every stage rewritten from its import closure, "
              f"params of {', '.join(GENERATED_PARAMS)} from tandem/run_keys.py")
        return 0
    if a.check:
        problems = check()
        for p in problems:
            print(p)
        if problems:
            print("fix: python scripts/dvc_deps.py --write", file=sys.stderr)
        return 1 if problems else 0
    for name in stages_of(yaml.safe_load(path.read_text())):
        print(f"{name}: {' '.join(stage_code_deps(name))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
