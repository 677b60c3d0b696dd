"""Stage `report`: read the metrics, write `reports/report.html` (self-contained) and `reports/report.md`.

The report opens with the claims table (`tandem.metrics.claims` on the run's per-problem measures,
`tasks/measures.py`: one seed, so the intervals bootstrap over problems only) and its warnings; the same
measures give the 95% intervals shown in the final-checkpoint tables and as error bars in figures 2 and 3.
Figures and tables come from `tandem.report` (paper figures 2, 3, 4, 7 and tables 1, 2), plus training
reward curves, the promotion comparison against the last promoted checkpoint, a few escaped example
generations and the run metadata (git commit, dvc.lock hash, params, package versions, seeds, hardware,
wall times). When W&B is on (`train.report_to: wandb` and a mode other than disabled), the same figures
are logged to a W&B run of the pipeline run's group (`tasks.tracking.log_report`).
"""

from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tandem.checkpoints import generations_file
from tandem.config import Params
from tandem.errors import BadInputError
from tandem.metrics.claims import arm_intervals, claims_for, evaluate_claims
from tandem.report.build import ReportData, build_report
from tandem.report.document import Figure, TextBlock
from tandem.report.figures import arm_label
from tandem.report.render import figure_filename, render_html, render_markdown
from tandem.redact import redact
from tasks import promotion, tracking
from tasks.common import Layout, atomic_path, read_json, read_jsonl, read_metrics
from tasks.measures import run_measures, stack_seeds

PACKAGES = ("torch", "transformers", "trl", "accelerate", "math-verify", "prefect", "dvc", "great-expectations",
            "wandb", "numpy", "matplotlib")
REWARD_COLUMNS = ("reward", "reward_mean", "rewards/mean", "train/reward", "mean_reward")
N_BOOT, BOOT_SEED = 2000, 0  # bootstrap draws and their seed: the same metrics give the same intervals


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    lay = Layout.of(params)
    inputs = {"eval": lay.metrics / "eval.json", "analysis": lay.metrics / "analysis.json",
              "base": lay.metrics / "base.json", "data": lay.metrics / "data.json",
              "plots": lay.plots, "generations": lay.generations,
              # per-problem analysis values (read by tasks/measures.py under out_root; optional)
              "per_problem": lay.plots / "analysis" / "per_problem.csv"}
    outputs = {"html": lay.reports / "report.html", "markdown": lay.reports / "report.md",
               "figures": lay.reports / "figures"}
    return inputs, outputs


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------

def _read_optional(path: Path) -> dict:
    return read_metrics(path) if Path(path).exists() else {}  # with the run's timings (wall times)


def _floats(values: list[str]) -> list[float]:
    out = []
    for v in values:
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            out.append(float("nan"))
    return out


def train_tables(plots: Path, arms: list[str]) -> dict[str, dict[str, list[float]]]:
    """arm -> column -> values, from `metrics/plots/train_<arm>.csv` or `metrics/plots/train/<arm>.csv`."""
    out = {}
    for arm in arms:
        for p in (Path(plots) / f"train_{arm}.csv", Path(plots) / "train" / f"{arm}.csv",
                  Path(plots) / "train" / f"train_{arm}.csv"):
            if p.exists():
                with open(p, newline="", encoding="utf-8") as f:
                    rows = list(csv.DictReader(f))
                if rows:
                    out[arm] = {c: _floats([r.get(c, "") for r in rows]) for c in rows[0]}
                break
    return out


def reward_column(tables: dict[str, dict[str, list[float]]]) -> str | None:
    """The mean-reward column shared by the training tables (known names first, then any '*reward*')."""
    cols = set.intersection(*(set(t) for t in tables.values())) if tables else set()
    for name in REWARD_COLUMNS:
        if name in cols:
            return name
    rest = sorted(c for c in cols if "reward" in c.lower() and "std" not in c.lower())
    return rest[0] if rest else None


def _pick(rows: list[dict], correct: bool) -> dict:
    """A sample that is correct (score > 0) or wrong, when there is one; else the first."""
    return next((r for r in rows if (float(r.get("score") or 0) > 0) == correct), rows[0])


def examples(eval_data: dict, generations: Path, max_examples: int) -> list[TextBlock]:
    """Solo generations on the `max_examples` problems where the models disagree most: the base (step 0) and each
    arm's last checkpoint, ranked by the spread of their pass rates on the problem (most different first);
    for each model one completion, correct where it solves the problem most often among the models, wrong
    otherwise. When the models agree everywhere, the first problems."""
    if max_examples <= 0:
        return []
    benches = sorted(eval_data.get("settings", {}).get("benchmarks", {}))
    models: list[tuple[str, str, int]] = []  # (label, arm whose tree holds it, step)
    for arm, data in eval_data.get("arms", {}).items():
        steps = sorted(c.get("step", 0) for c in data.get("checkpoints", []))
        if steps and steps[0] == 0 and not models:
            models.append(("base", arm, 0))
        if steps and steps[-1] > 0:
            models.append((f"{arm_label(arm)} step-{steps[-1]}", arm, steps[-1]))
    candidates = []  # (spread, bench, problem id, {model: rows})
    for b in benches:
        by_model: dict[str, dict[str, list[dict]]] = {}
        for label, arm, step in models:
            f = generations_file(generations, arm, step, "solo", b)
            if f.exists():
                for row in read_jsonl(f):
                    by_model.setdefault(label, {}).setdefault(str(row.get("id")), []).append(row)
        if len(by_model) < 2:
            continue
        for pid in sorted(set.intersection(*(set(v) for v in by_model.values()))):
            rates = {m: sum(float(r.get("score") or 0) > 0 for r in v[pid]) / len(v[pid]) for m, v in by_model.items()}
            candidates.append((max(rates.values()) - min(rates.values()), b, pid,
                               {m: by_model[m][pid] for m in by_model}, rates))
    candidates.sort(key=lambda c: -c[0])  # stable: benchmark and problem order among equal spreads
    out = []
    for _, b, pid, rows_by_model, rates in candidates[:max_examples]:
        best = max(rates.values())
        for m, rows in rows_by_model.items():
            row = _pick(rows, correct=rates[m] == best)
            label = (f"{m}, {b}, problem {pid}: {sum(float(r.get('score') or 0) > 0 for r in rows)}/{len(rows)} "
                     f"samples correct (gold {row.get('answer')}); sample {row.get('sample')}: score "
                     f"{row.get('score')}, finish {row.get('finish_reason')}")
            out.append(TextBlock(label, str(row.get("text", ""))))
    return out


def claims_and_intervals(params: Params, eval_data: dict) -> tuple[list[dict] | None, dict | None, str]:
    """The claims rows and the per-arm intervals from this run's per-problem measures (one seed), or
    (None, None, why) when they cannot be computed, so the report still renders and says why."""
    ks = eval_data.get("settings", {}).get("ks") or []
    if not ks:
        return None, None, "metrics/eval.json records no pass@k."
    try:
        measures = stack_seeds([run_measures(Layout.of(params).root, list(params.train.arms))])
        rows = evaluate_claims(measures, claims_for(max(ks)), n_boot=N_BOOT, seed=BOOT_SEED)
        return rows, arm_intervals(measures, n_boot=N_BOOT, seed=BOOT_SEED), ""
    except (BadInputError, OSError, KeyError, ValueError) as e:  # a report without claims beats no report
        return None, None, f"the per-problem measures could not be computed ({type(e).__name__}: {e})."


# --------------------------------------------------------------------------------------------------
# Run metadata
# --------------------------------------------------------------------------------------------------

def _git_commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=20)
        if head.returncode != 0:  # e.g. the GPU image, which records its build commit instead
            return os.environ.get("TANDEM_GIT_COMMIT", "not a git checkout")
        # --no-optional-locks: reading the status must not rewrite the index
        dirty = subprocess.run(["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True, timeout=60)
        return head.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return os.environ.get("TANDEM_GIT_COMMIT", "git unavailable")


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if Path(path).exists() else "absent"


def _versions() -> str:
    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name} -")
    return ", ".join(out)


def _hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"{os.cpu_count()} x {cpu}"]
    try:
        mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal"))
        parts.append(f"{mem_kb / 2**20:.1f} GiB RAM")
    except (OSError, StopIteration, ValueError):
        pass
    if "torch" in sys.modules:  # only report GPUs when torch is already loaded (importing it costs seconds)
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            parts.append(", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
    return "; ".join(parts)


_TIME_KEYS = ("wall_seconds", "seconds", "wall_s", "elapsed_seconds")


def _find_seconds(doc: Any, depth: int = 2) -> float | None:
    """The first wall-time key at the top level of `doc` (a number, or a breakdown with its `total`, as the base
    stage writes), else one level down (e.g. a 'pretrain' block)."""
    if not isinstance(doc, dict):
        return None
    for key in _TIME_KEYS:
        value = doc.get(key)
        if isinstance(value, dict):
            value = value.get("total")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    if depth > 1:
        for v in doc.values():
            found = _find_seconds(v, depth - 1)
            if found is not None:
                return found
    return None


def _arm_seconds(summ: dict) -> tuple[float | None, bool]:
    """A train arm's wall time, its last run as its tokens (`task_tokens`) count it: (seconds, whether they are
    estimated as steps x seconds per step); (None, False) when not recorded."""
    if isinstance(summ.get("wall_seconds_this_run"), (int, float)):
        return summ["wall_seconds_this_run"], False
    secs = _find_seconds(summ, 1)
    if secs is None and isinstance(summ.get("step_seconds"), (int, float)) and summ.get("steps"):
        return summ["step_seconds"] * summ["steps"], True
    return secs, False


def _eval_seconds(ev: dict) -> list[float]:
    """Each benchmark's compute time of every checkpoint and mode the evaluation lists (cached entries too)."""
    return [b.get("seconds") or 0 for a in ev.get("arms", {}).values() for c in a.get("checkpoints", [])
            for m in c.get("modes", {}).values() for b in (m.get("benchmarks") or {}).values()]


def _wall_times(docs: dict[str, dict], train_arms: dict[str, dict]) -> str:
    """Stage wall times as the stage metrics record them (not this report's run), e.g. 'base 42.0 s'. The
    metrics files hold no timings (they must depend on the inputs alone): `docs` are read with `read_metrics`,
    which merges each file's `*.timing.json` sidecar back in."""
    out = []
    for stage in ("prepare", "base"):
        secs = _find_seconds(docs.get(stage))
        if secs is not None:
            out.append(f"{stage} {secs:.1f} s")
    for arm, summ in train_arms.items():
        secs, estimated = _arm_seconds(summ)
        if estimated:
            out.append(f"train {arm} ~{secs:.1f} s ({summ['steps']} steps x {summ['step_seconds']:.2f} s)")
        elif secs is not None:
            out.append(f"train {arm} {secs:.1f} s")
    secs = _eval_seconds(docs.get("evaluate") or {})
    if secs:  # each cache entry's compute time, counted once per checkpoint listing
        out.append(f"evaluate {sum(secs):.1f} s (sum over listed entries, cached ones included)")
    secs_an = _find_seconds(docs.get("analyze"), 1)
    if secs_an is not None:
        out.append(f"analyze {secs_an:.1f} s")
    return ", ".join(out) or "not recorded"


def _gpu_accounting(params: Params, docs: dict[str, dict], train_arms: dict[str, dict]) -> str:
    """The GPUs (of the machine the report runs on, as `hardware` says), and per stage the GPU-seconds and
    generated tokens per GPU-second, from the wall times the stages recorded (their timing sidecars) and the
    tokens their outputs list; a CPU run says it held zero GPUs (`tandem.accounting.accounting_line`)."""
    from tandem.accounting import accounting_line, gpu_inventory, task_accounting
    from tasks.accounting import held_gpus, task_tokens

    inventory = gpu_inventory(held_gpus())
    if inventory["count"] == 0:
        return accounting_line(inventory, {})
    ev = docs.get("evaluate") or {}
    units = list(dict.fromkeys(f"evaluate-{a}-step-{c.get('step')}-{m}" for a, arm in (ev.get("arms") or {}).items()
                               for c in arm.get("checkpoints") or [] for m in c.get("modes") or {}))
    tokens = task_tokens(Layout.of(params).root, ["base", *(f"train@{a}" for a in train_arms), *units])
    eval_tokens = [tokens[u] for u in units if tokens[u] is not None]
    seconds = {"base": _find_seconds(docs.get("base")),
               **{f"train {arm}": _arm_seconds(summ)[0] for arm, summ in train_arms.items()},
               "evaluate": sum(_eval_seconds(ev)) or None}
    toks = {"base": tokens.get("base"), "evaluate": sum(eval_tokens) if eval_tokens else None,
            **{f"train {a}": tokens.get(f"train@{a}") for a in train_arms}}
    per_task = {k: task_accounting(v, inventory["count"], toks.get(k)) for k, v in seconds.items() if v is not None}
    return accounting_line(inventory, per_task)


def metadata(params: Params, docs: dict[str, dict], train_arms: dict[str, dict] | None = None) -> dict[str, Any]:
    root = Path.cwd()
    seeds = f"seed {params.seed}"
    if "seed" in docs.get("evaluate", {}).get("settings", {}):
        seeds += f"; evaluation seed {docs['evaluate']['settings']['seed']}"
    return redact({  # secrets from the environment never reach the report (tandem/redact.py)
        "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git commit": _git_commit(root),
        "dvc.lock sha256": _sha256(root / "dvc.lock"),
        "seeds": seeds,
        "python": platform.python_version(),
        "packages": _versions(),
        "hardware": _hardware(),
        "wall times": _wall_times(docs, train_arms or {}),
        "GPUs": _gpu_accounting(params, docs, train_arms or {}),
    })


# --------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------

def log_figures_to_wandb(params: Params, figures: list[Figure], figure_dir: Path) -> bool:
    """Log the report's figures to W&B (a run of job type `report` in the pipeline run's group) when tracking is
    on; never fails the stage (returns False instead)."""
    try:
        return tracking.log_report(params, [(f.name, figure_dir / figure_filename(f.name), f.caption)
                                            for f in figures]) is not None
    except Exception as e:  # tracking is optional: the report on disk is the result
        print(f"report: W&B logging skipped ({type(e).__name__}: {e})", file=sys.stderr)
        return False


def _data_docs_link(params: Params, html: Path) -> str | None:
    """The prepare stage's Data Docs index relative to the report (None when there are none)."""
    index = Layout.of(params).data_docs / "index.html"
    return Path(os.path.relpath(index, html.parent)).as_posix() if index.exists() else None


def _data_docs_page(params: Params, html: Path) -> str | None:
    """The validation page in the Data Docs relative to the report (the prepare stage rebuilds the docs, so
    there is one, in a folder named after the validated data's fingerprint: tasks/validation.py)."""
    pages = sorted((Layout.of(params).data_docs / "validations").rglob("*.html"))
    return Path(os.path.relpath(pages[-1], html.parent)).as_posix() if pages else None


def run(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    """Build the report from the metrics files; returns paths, figure count and the promotion decision."""
    di, do = default_io(params)
    inputs, outputs = {**di, **(inputs or {})}, {**do, **(outputs or {})}
    for key in ("eval", "analysis"):
        if not Path(inputs[key]).exists():
            raise FileNotFoundError(f"report: {inputs[key]} is missing; run the "
                                    f"{'evaluate' if key == 'eval' else 'analyze'} stage first")
    eval_data, analysis = read_json(inputs["eval"]), read_json(inputs["analysis"])
    # metrics/train_<arm>.json (one per arm, next to the other metrics): arm -> headline numbers
    train_docs = {arm: _read_optional(Path(inputs["base"]).parent / f"train_{arm}.json") for arm in params.train.arms}
    # the run metadata's wall times come from the timing sidecars (`_read_optional` merges them); the tables and
    # figures read the metrics alone
    docs = {"prepare": _read_optional(inputs["data"]), "base": _read_optional(inputs["base"]),
            "train": {a: d for a, d in train_docs.items() if d}, "evaluate": _read_optional(inputs["eval"]),
            "analyze": _read_optional(inputs["analysis"])}
    train_arms = {arm: v for arm, v in docs["train"].items() if isinstance(v, dict)}
    curves = train_tables(inputs["plots"], list(eval_data.get("arms", {})))
    decision = promotion.decision_for(params, eval_data)
    claims, intervals, claims_note = claims_and_intervals(params, eval_data)
    rep = build_report(ReportData(
        title=params.report.title, eval_data=eval_data, analysis=analysis, train_curves=curves,
        reward_key=reward_column(curves), decision=decision, metadata=metadata(params, docs, train_arms),
        params_text=yaml.safe_dump(params.to_dict(where=False), sort_keys=False),  # not where tasks ran
        examples=examples(eval_data, inputs["generations"], params.report.max_examples),
        claims=claims, claims_seeds=1, claims_note=claims_note, intervals=intervals,
        validation=docs["prepare"].get("validation"), data_docs=_data_docs_link(params, Path(outputs["html"])),
        data_docs_page=_data_docs_page(params, Path(outputs["html"]))))
    fig_dir = Path(outputs["figures"])
    with atomic_path(fig_dir) as tmp:
        tmp.mkdir(parents=True)
        for f in rep.figures():
            (tmp / figure_filename(f.name)).write_bytes(f.png)
    with atomic_path(outputs["markdown"]) as tmp:
        tmp.write_text(render_markdown(rep, figure_dir=os.path.relpath(fig_dir, Path(outputs["markdown"]).parent)),
                       encoding="utf-8")
    with atomic_path(outputs["html"]) as tmp:
        tmp.write_text(render_html(rep), encoding="utf-8")
    wandb_logged = log_figures_to_wandb(params, rep.figures(), fig_dir)
    return {"html": str(outputs["html"]), "markdown": str(outputs["markdown"]), "figures": len(rep.figures()),
            "promote": decision.promote, "promotion_reason": decision.reason, "wandb": wandb_logged,
            "claims": len(claims) if claims is not None else 0}


def artifact_markdown(params: Params, summary: dict) -> str:
    """The Prefect markdown artifact: the report itself (headline numbers, promotion, every table), readable
    in the UI without access to the machine that ran the flow. Figures are only in the HTML report, which is
    a DVC output (`dvc pull report` fetches it anywhere)."""
    from tandem.report.build import summary_lines
    from tandem.report.render import md_escape

    md_path = Path(summary["markdown"])
    lay = Layout.of(params)
    eval_data = _read_optional(lay.metrics / "eval.json")
    analysis = _read_optional(lay.metrics / "analysis.json")
    lines = [f"# {md_escape(params.report.title)}", ""]
    lines += [f"- {md_escape(s)}" for s in summary_lines(eval_data, analysis)]
    lines += ["", f"**Promotion gate**: {'passes' if summary.get('promote') else 'does not pass'}: "
                  f"{md_escape(summary.get('promotion_reason', ''))}", "",
              "Figures: in the self-contained HTML report, a DVC output of the report stage "
              "(`dvc pull report && open reports/report.html`).", "", "---", ""]
    body = md_path.read_text() if md_path.exists() else "(reports/report.md is missing)"
    # image links point at files on the worker's disk: name the figure instead; other links (the Data Docs) too
    body = re.sub(r"!\[([^\]]*)\]\([^)]*\)", lambda m: f"*(figure: {m.group(1) or 'see the HTML report'})*", body)
    body = re.sub(r"\[([^\]]*)\]\(<([^>]*)>\)", lambda m: f"{m.group(1)}: `reports/{m.group(2)}` (a DVC output)", body)
    return "\n".join(lines) + "\n" + body


def existing_summary(params: Params) -> dict:
    """What `run` returns, for a report already on disk and current (the flow skipped the stage)."""
    inputs, outputs = default_io(params)
    decision = promotion.decision_for(params, read_json(inputs["eval"]))
    return {"html": str(outputs["html"]), "markdown": str(outputs["markdown"]),
            "promote": decision.promote, "promotion_reason": decision.reason}
