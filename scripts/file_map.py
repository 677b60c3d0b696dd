"""The file map, generated: one row per tracked file, its text taken from the file itself.

The map lives in docs/file-map.md, between its file-map markers. A Python file is described by the first
paragraph of its module docstring (so the map cannot drift from the code); any other file by an entry of
`OTHER_FILES` below. Data and generated records are grouped, not listed.

    python scripts/file_map.py --check   # exit 1 (with the differences) when docs/file-map.md is out of date
    python scripts/file_map.py --write   # rewrite the map between the markers of docs/file-map.md (created if absent)
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = Path("docs") / "file-map.md"  # relative to ROOT
START, END = "<!-- file-map:start -->", "<!-- file-map:end -->"
# What docs/file-map.md says above the map when --write creates it.
HEADER = """# File map

Every tracked file in one line, generated from the files themselves (`python scripts/file_map.py --write`;
`tests/test_docs.py` fails when the map is out of date): a Python file's row is the first paragraph of its
module docstring, any other file's row is its entry in `OTHER_FILES` of `scripts/file_map.py`. Data and
generated records are grouped.

"""

# Grouped rather than listed file by file: shipped data, test fixtures, recorded metrics, infra templates.
GROUPED = {
    "data/raw/**": "shipped math datasets (`data/raw/PROVENANCE.md`: sources, commits, licences)",
    "tests/fixtures/**": "small files the tests read",
    "metrics/**": "the committed record of the last full default run (`dvc metrics show`)",
    "dvc-remote/**": "the default DVC remote `record` (`.dvc/config`): the committed record's artifacts by content "
                     "hash, so a clone gets them with `dvc pull`",
    "docs/gpu/vllm-*": "records of scripts/gpu_check_vllm.sh (benchmarks/vllm_gpu.py) from users' GPUs: stock vLLM "
                       "solo against tandem, JSON and its Markdown table",
    "infra/accelerate/*": "accelerate / DeepSpeed launch configurations for multi-GPU training",
    "infra/work-pools/*": "Prefect work-pool base job templates",
    "infra/kuberay/*": "a Ray cluster on Kubernetes (KubeRay) for cluster.runner ray: CPU head, GPU workers, one shared volume",
    "studies/pilot/*.yaml": "the registered pilot's params files: each task variant's GRPO run and its KL-Reg candidates (seed 100)",
    "studies/results/**": "the registered study's per-problem values, one CSV per seed x arm (what `tandem study --recompute` reads)",
    "studies/tasks/**": "the registered study tasks' base models and their metrics (shared by the pilot and the study)",
    "studies/junior-control/models/**": "the junior control's gated senior base S and naive junior J (model files), "
                                        "which every seed x arm trains from",
    "studies/junior-control/results/**": "the junior control's per-seed x arm results (per-problem counts, analysis "
                                         "means, training series): what `tandem study --recompute` reads",
    "studies/junior-control/figures/**": "the junior control report's figures",
    "studies/junior-control/coded-100/results/**": "setting 2 of the junior control: per-seed x arm results, read at "
                                                   "step 100",
    "studies/junior-control/coded-100/figures/**": "setting 2's report figures",
    "studies/*/gate-dialects/*.json": "a positive control's gate, one registered dialect's measurement and decision, "
                                      "kept as soon as it is measured (`tandem study gate`)",
    "studies/jargon-smollm2/gate.*": "the SmolLM2 jargon control's gate on the base models (G1-G5 per dialect; "
                                     "JSON and Markdown), written by `tandem study gate`",
    "studies/jargon-smollm2/setting-2/results/**": "setting 2 of the SmolLM2 jargon control: per-seed x arm results, "
                                                   "committed as each lands (`tandem study control --commit`)",
    "studies/jargon-smollm2/setting-2/claims.json": "setting 2's claims, bug indicators and dose series "
                                                    "(`tandem study --recompute`)",
    "studies/jargon-smollm2/setting-2/report.*": "setting 2's report, dose curve first (Markdown and HTML)",
    "studies/jargon-smollm2/setting-2/figures/*": "setting 2's report figures",
    "studies/jargon-smollm2/setting-2/rebuilds/*/gate.*": "setting 2's gate measured again on a rebuild of S and J "
    "(amendment A1): the taken dialect, the registered criteria, on the rebuild's hashes",
    "studies/jargon-smollm2/setting-2/gate.*": "setting 2's gate on its base models (G1-G5 per dialect, within "
                                               "problems; JSON and Markdown), written by `tandem study gate`",
}

# Files without a docstring: what each one is, in one line.
OTHER_FILES = {
    ".ci/run": "CI entry point: installs what the tests need from scratch, then runs exactly `make test`",
    ".dvc/.gitignore": "DVC's own ignore rules for its cache and temporary files",
    ".dvc/config": "DVC settings: the default remote `record`, the committed directory `dvc-remote/`",
    ".dvcignore": "paths DVC does not scan",
    ".gitignore": "build outputs, caches and run artifacts kept out of git",
    "LICENSE": "the MIT licence",
    "Makefile": "the README's two commands (`make run`, `make test`) plus setup, repro, bench",
    "README.md": "the front door: what tandem is, the two commands, the pipeline, params, where to read on",
    "docs/architecture.md": "layers, stage contract, artifact layout, the axis-letter glossary",
    "docs/gpu/h200-mid.json": "scripts/gpu_check_bare.py's JSON lines from an H200, ~220M model (docs/results.md#gpu-checks)",
    "docs/gpu/h200-qwen3-4b.json": "the same at Qwen3-4B's shape (`--shape qwen3-4b`); tests/test_plan.py reads both",
    "tandem/rollout/premises.json": "the GPU cost model's premises, measured on vLLM's CPU build: engine steps, scheduled "
                                    "rows, computed tokens and chunks per generated token of each engine, CPU per unit "
                                    "(`tandem bench rollout --backend vllm --vocab qwen3 --write-premises`)",
    "docs/file-map.md": "this map: one line per tracked file (`python scripts/file_map.py --write`)",
    "docs/metrics.md": "every metric's formula, units and direction; JSON/CSV schemas",
    "docs/operations.md": "deployments, work pools, schedule, promotion, W&B, DVC views, environment, failure behaviour, GPUs",
    "docs/results.md": "the current figures: what was measured, on what, and how to rerun it",
    "docs/rollout.md": "the tandem rollout engine: definition, catch-up, noise, exactness, performance",
    "docs/studies.md": "the study package: `tandem study` commands, a registration's fields, the one result format, registering a new control",
    "docs/vllm-measurements.md": "every measurement of the vLLM tandem path, with the code each ran on",
    "docs/training.md": "the train stage: arms, loss mask, the GRPO objective, logging, checkpoints, resume",
    "dvc.lock": "DVC's record of the last reproduced pipeline (hashes of every input and output)",
    "dvc.yaml": "the pipeline as DVC stages (train: one stage per arm) with every input declared",
    "infra/Dockerfile": "image for the GPU work pool",
    "infra/Dockerfile.dockerignore": "what the image build leaves out",
    "infra/README.md": "running on a schedule and beyond one machine; object-store DVC remote",
    "infra/prefect.yaml": "Prefect deployments: scheduled retraining (cron), GPU retraining, checkpoint evaluation",
    "params.yaml": "the embedded default's parameters: every setting of every stage (what `make run` runs)",
    "params.paper.yaml": "the paper's settings for Qwen3-4B-Instruct-2507 on GPUs (complete params file)",
    "params.paper-dedicated.yaml": "the paper's settings with a dedicated rollout service, one GPU per model: a layout `tandem plan` prices (complete params file)",
    "params.real.yaml": "a real pretrained model (SmolLM2-135M-Instruct from a PyPI wheel) through the whole pipeline on a CPU",
    "params.study.yaml": "the study run: the default run's data and base, hundreds of training steps (complete params file)",
    "pyproject.toml": "package metadata, pinned stack, extras (pipeline, test), pytest markers",
    "scripts/gpu_check.sh": "the one GPU check: rollout backends against each other, then training steps through the real stages",
    "scripts/gpu_check_vllm.sh": "the vLLM GPU check for a user's own GPU: makes .venv-vllm, runs benchmarks/vllm_gpu.py (stock solo against tandem, Qwen3-4B shape, 128 x 3,000) and prints its table",
    "scripts/gpu_bundle.sh": "builds the folder (wheels, library, run.sh) that `scripts/gpu_check_bare.py` needs on a bare GPU machine, refusing over 64 MiB",
    "studies/jargon-smollm2/params.yaml": "the SmolLM2 jargon control's params file (from params.real.yaml): S = warm-up + dialect phase, J = the warm-up",
    "studies/jargon-smollm2/registration.md": "the registered SmolLM2 jargon control, committed before anything of it ran: setting, arms, gate G1-G5, the two jargons, claims, bug indicators, budget",
    "studies/jargon-smollm2/registration.yaml": "the same registration in the form the control driver reads (kind: junior-control)",
    "studies/jargon-smollm2/setting-2/params.yaml": "setting 2 of the SmolLM2 jargon control: setting 1's params file with every running value in 0-9 (data.max_value 9)",
    "studies/jargon-smollm2/setting-2/registration.md": "setting 2 of the SmolLM2 jargon control, registered before anything of it ran: why setting 1's jargons failed, reversed on values 0-9, a gate taken within problems, claims, bug indicators, budget",
    "studies/jargon-smollm2/setting-2/amendments.md": "setting 2's amendments, each registered before anything it governs ran: A1, the remaining runs train from a rebuild of S and J whose own gate passed (the gated ones were lost with the machine that built them)",
    "studies/jargon-smollm2/setting-2/amendments.yaml": "the same amendments in the form `tandem study control` reads (tandem.study.registration.Amendment)",
    "studies/jargon-smollm2/setting-2/registration.yaml": "the same registration in the form `tandem study gate|control` reads (kind: junior-control, estimator paired_problems)",
    "studies/junior-control/params.yaml": "the junior positive control's params file: what every one of its runs starts from",
    "studies/junior-control/registration.md": "the registered junior positive control: setting, arms, gate G1-G5, claims, bug indicators, seeds",
    "studies/junior-control/registration.yaml": "the same registration in the form `tandem study gate|control|--recompute` reads",
    "studies/junior-control/gate.json": "the junior control's gate on the base models (G1-G5 per dialect, every measurement), written by `tandem study gate`",
    "studies/junior-control/gate.md": "the gate in words and tables (from gate.json)",
    "studies/junior-control/claims.json": "the junior control's claims, bug indicators and dose series (`tandem study --recompute`)",
    "studies/junior-control/report.md": "the junior control's report, dose curve first (Markdown)",
    "studies/junior-control/report.html": "the junior control's report, dose curve first (self-contained HTML)",
    "studies/junior-control/coded-100/registration.md": "setting 2 of the junior control, registered before it ran: the same S and J read at step 100 on fresh seeds, and why",
    "studies/junior-control/coded-100/registration.yaml": "setting 2's registration as `tandem study ... --out studies/junior-control/coded-100` reads it",
    "studies/junior-control/coded-100/claims.json": "setting 2's claims, bug indicators and dose series",
    "studies/junior-control/coded-100/report.md": "setting 2's report, dose curve first (Markdown)",
    "studies/junior-control/coded-100/report.html": "setting 2's report, dose curve first (self-contained HTML)",
    "studies/first-study/README.md": "how to read the first study's record (verdicts by interval alone; what they do not show)",
    "studies/first-study/claims.json": "the first study (`tandem study run --seeds 3`, params.study.yaml): claims with estimates, paired differences, 95% intervals and verdicts",
    "studies/first-study/report.md": "the first study's report: claims table, error bars, every measure per arm with its interval",
    "studies/first-study/report.html": "the same report as one self-contained HTML page",
    "studies/first-study/figures/claims-intervals.png": "the first study's error-bar figure (each arm's estimate and 95% interval per measure)",
    "studies/registration.md": "the registered pilot and study: task variants, room criteria, claims, smallest effects, statistics",
    "studies/registration.yaml": "the same registration in the form `tandem study pilot` and `tandem study run --registered` read",
    "studies/pilot/result.md": "the pilot's result: room criteria per variant and length, the decision, the KL-Reg beta",
    "studies/pilot/result.json": "the pilot's result as data (`tandem study pilot` writes it; `tandem study --recompute --out studies/pilot` redoes its decisions)",
    "studies/study.yaml": "the registered study's params file (the chosen variant with the study's changes)",
    "tests/flows/tiny_params.yaml": "a minimal params file for the flow and server tests",
}


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted(f for f in out.splitlines() if (ROOT / f).exists())


def docstring_summary(path: Path) -> str | None:
    """The first paragraph of a module docstring, on one line."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except SyntaxError:
        return None
    if not doc:
        return None
    para = doc.strip().split("\n\n")[0]
    return " ".join(line.strip() for line in para.splitlines())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# Folders whose size the map states (lines of tracked Python, counted by `build`), and what each holds.
COUNTED = {
    "tandem/": "the library",
    "tandem/rollout/vllm/": "the vLLM rollout path as it runs in production: the service, its client, the "
                            "engine-core scheduler, worker and sockets (no benchmark, step bench, cost model or "
                            "A/B session kind: those are in `benchmarks/` and `tandem/rollout/cost.py`)",
    "benchmarks/": "measurement, outside the library: each file prints ratios measured in one process",
}


def sizes(files: list[str]) -> str:
    """The COUNTED folders' Python files and lines, as a table."""
    rows = ["| folder | Python files | lines | holds |", "|---|---|---|---|"]
    for folder, what in COUNTED.items():
        py = [f for f in files if f.startswith(folder) and f.endswith(".py")]
        lines = sum(len((ROOT / f).read_text().splitlines()) for f in py)
        rows.append(f"| `{folder}` | {len(py)} | {lines:,} | {_cell(what)} |")
    return "\n".join(rows)


def build() -> tuple[str, list[str]]:
    """(the map's markdown: the COUNTED sizes, then one row per file; problems): a problem is a file with
    nothing to say about it."""
    rows, problems, groups_seen = [], [], []
    for f in tracked_files():
        group = next((g for g in GROUPED if fnmatch.fnmatch(f, g)), None)
        if group:
            if group not in groups_seen:
                groups_seen.append(group)
            continue
        if f.endswith(".py"):
            what = docstring_summary(ROOT / f)
            if what is None:
                problems.append(f"{f}: no module docstring (every file opens with one saying what it is)")
                continue
        elif f in OTHER_FILES:
            what = OTHER_FILES[f]
        else:
            problems.append(f"{f}: not described (add it to OTHER_FILES in scripts/file_map.py)")
            continue
        rows.append(f"| `{f}` | {_cell(what)} |")
    for g in groups_seen:
        rows.append(f"| `{g}` | {_cell(GROUPED[g])} |")
    return sizes(tracked_files()) + "\n\n" + "\n".join(["| file | what |", "|---|---|", *rows]), problems


def current(text: str) -> str:
    """The map between the markers of `text` (docs/file-map.md's contents)."""
    if START not in text or END not in text:
        raise SystemExit(f"{MAP.as_posix()} lacks the markers {START} ... {END}")
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def write(table: str) -> None:
    """Put `table` between the markers of docs/file-map.md, creating the file (with `HEADER`) if absent."""
    path = ROOT / MAP
    text = path.read_text(encoding="utf-8") if path.exists() else f"{HEADER}{START}\n{END}\n"
    if START not in text or END not in text:
        raise SystemExit(f"{MAP.as_posix()} lacks the markers {START} ... {END}")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    path.write_text(f"{before}{START}\n{table}\n{END}{after}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="fail when docs/file-map.md is out of date")
    mode.add_argument("--write", action="store_true", help="rewrite the map in docs/file-map.md")
    args = ap.parse_args(argv)
    table, problems = build()
    for p in problems:
        print(p, file=sys.stderr)
    if args.write:
        write(table)
        return 1 if problems else 0
    path = ROOT / MAP
    if not path.exists():
        print(f"{MAP.as_posix()} is missing: run `python scripts/file_map.py --write`", file=sys.stderr)
        return 1
    have = current(path.read_text(encoding="utf-8"))
    if have != table:
        import difflib

        sys.stdout.writelines(difflib.unified_diff(have.splitlines(True), table.splitlines(True),
                                                   f"{MAP.as_posix()} (file map)", "generated", n=0))
        print(f"\n{MAP.as_posix()} is out of date: run `python scripts/file_map.py --write`", file=sys.stderr)
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
