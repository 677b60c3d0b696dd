"""The run's metadata (`results/run.json`) and how a run compares with the committed record.

`write_run_metadata` keeps, per task, the wall time and peak memory of the last run that really ran it, with
the machine it ran on (`tandem.machine`): a rerun that finds every stage up to date changes nothing, and a
run of some stages updates only theirs. Beside them, the GPU accounting (`tandem.accounting`): the GPUs the
run held (`gpu`: count and type; zero on a CPU run, said as such) and per task the GPUs, GPU-seconds, generated
tokens and tokens per GPU-second (`accounting`); `tasks/accounting.py` collects what it is computed from.
results/run.json is neither a DVC output nor committed, so none of this enters the comparison with the record.

The committed record is what HEAD's `dvc.lock` pins (every output's hash) and HEAD's `metrics/`. After a DVC
project run `compare_with_record` sets the workspace's dvc.lock beside it, stage by stage, and
`record_summary` says in a few lines whether the run reproduced the record bit for bit, which outputs differ,
each headline number beside the record's band (`metrics/band.json`, committed with the record: where the default
run lands over seeds and kernel paths, `scripts/record_band.py`) and whether it landed inside, and what to do
(keep the run, or go back to the record). Only stages the
run computed can reproduce anything: a stage skipped as up to date left dvc.lock's entry as it was, so a run
that computed none (every stage current) says that it ran nothing, never that it reproduced the record.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from tandem.config import Params
from tasks.accounting import held_gpus, task_tokens
from tasks.common import read_json, write_json

RUN_FILE = Path("results") / "run.json"
# The record's band: per headline number, the range the default run spans over seeds and CPU kernel paths,
# measured and committed with the record (`scripts/record_band.py`, docs/results.md "The record's band").
BAND_FILE = Path("metrics") / "band.json"
# Stages whose outputs record the run's context, not only its inputs: the report's metadata names the time it
# was generated, the git commit and the hash of dvc.lock, so it differs on every run by design.
CONTEXT_STAGES = {"report": "the report records when, at which commit and from which dvc.lock it was made"}


# --------------------------------------------------------------------------------------------------
# results/run.json
# --------------------------------------------------------------------------------------------------

def _accounting(timing: dict[str, float], ran: set[str], gpus: dict, tokens: dict[str, int | None],
                machines: dict[str, int], reserved: dict[str, int] | None = None) -> dict[str, dict]:
    """Each task that ran: its GPUs (the run's, on each of its machines; a task run on a Ray cluster: the GPUs it
    reserved there, marked `on: ray`), GPU-seconds, tokens, tokens per GPU-s."""
    from tandem.accounting import task_accounting

    reserved = reserved or {}
    out = {}
    for k, v in timing.items():
        if k not in ran:
            continue
        if k in reserved:
            out[k] = {**task_accounting(v, reserved[k], tokens.get(k)), "on": "ray"}
        else:
            out[k] = task_accounting(v, gpus["per_machine"] * machines.get(k, 1), tokens.get(k))
    return out


def run_gpus(params: Params, ran: Sequence[str]) -> dict:
    """`write_run_metadata`'s `gpus` for the tasks in `ran`: the GPUs this machine holds, a training arm holding
    them on each of its `train.num_machines` machines, and a task on a Ray cluster what it reserved there
    (`tasks.cluster.reserved_gpus`)."""
    from tasks.cluster import reserved_gpus

    return {"names": held_gpus(), "machines": {f"train@{a}": params.train.num_machines for a in params.train.arms},
            "reserved": reserved_gpus(params, list(ran))}


def write_run_metadata(root: Path, timing: dict[str, float], peaks: dict[str, float], process: dict,
                       ran: list[str], extra: dict | None = None, gpus: dict | None = None) -> dict:
    """Merge this run's per-task wall times, peak memory and GPU accounting into `<root>/results/run.json` and
    return it.

    `ran` names the tasks that did work in this run; tasks that were skipped (DVC found them current) keep the
    values of the run that last ran them. When nothing ran, the file is left as it is. `gpus`: the GPUs the run
    held (`{"names": [...], "machines": {task: n}, "reserved": {task: n}}`, a task on several machines holding them
    on each, a task run on a Ray cluster the GPUs it reserved there; default: the GPUs this process sees, on one
    machine)."""
    from tandem.accounting import gpu_inventory
    from tandem.machine import describe

    path = Path(root) / RUN_FILE
    try:
        prev = read_json(path) if path.exists() else {}
    except ValueError:  # a damaged file is replaced, not merged
        prev = {}
    if not ran and prev:
        return prev
    ran_set = set(ran)
    old_t = {k: v for k, v in (prev.get("timing") or {}).items() if k not in ran_set}
    old_p = {k: v for k, v in ((prev.get("resources") or {}).get("peak_rss_mb_by_task") or {}).items()
             if k not in ran_set}
    new_t = {**old_t, **{k: v for k, v in timing.items() if k in ran_set}}
    new_p = {**old_p, **{k: v for k, v in peaks.items() if k in ran_set}}
    last_ran = {**(prev.get("last_ran") or {}), **{k: time.strftime("%Y-%m-%dT%H:%M:%S%z") for k in ran}}
    gpus = gpus if gpus is not None else {"names": held_gpus()}
    inventory = gpu_inventory(gpus["names"])
    acc = {**{k: v for k, v in (prev.get("accounting") or {}).items() if k not in ran_set},
           **_accounting(timing, ran_set, inventory, task_tokens(root, ran), gpus.get("machines") or {},
                         gpus.get("reserved"))}
    doc = {"timing": new_t,
           "resources": {"peak_rss_mb_by_task": new_p, **process,
                         "run_peak_rss_mb": max([*new_p.values(), process.get("process_max_rss_mb") or 0,
                                                 process.get("children_max_rss_mb") or 0])},
           "last_ran": last_ran, "machine": describe(), "gpu": inventory, "accounting": acc, **(extra or {})}
    write_json(path, doc)
    return doc


# --------------------------------------------------------------------------------------------------
# The committed record
# --------------------------------------------------------------------------------------------------

# Headline numbers shown when they move: (label, metrics file, key path; `*` = every arm)
HEADLINE = (("base greedy macro", "metrics/base.json", ("accuracy", "greedy", "macro")),
            ("base sampled macro", "metrics/base.json", ("accuracy", "sampled", "macro")),
            ("solo pass@1 {arm}", "metrics/eval.json", ("summary", "*", "solo/pass@1")))


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)


def _outs(lock: dict) -> dict[str, dict[str, str]]:
    """stage -> output path -> its hash, from a parsed dvc.lock."""
    out: dict[str, dict[str, str]] = {}
    for name, st in ((lock or {}).get("stages") or {}).items():
        out[name] = {o["path"]: str(o.get("md5") or o.get("hash") or "") for o in st.get("outs") or []
                     if isinstance(o, dict) and "path" in o}
    return out


def _get(doc: Any, keys: tuple[str, ...]) -> Any:
    for k in keys:
        if not isinstance(doc, dict) or k not in doc:
            return None
        doc = doc[k]
    return doc


@dataclass
class Comparison:
    """A run's dvc.lock against the committed one: stages whose outputs all match, stages with differing
    outputs (and which), and the headline numbers of both."""

    commit: str
    same: list[str] = field(default_factory=list)
    differs: dict[str, list[str]] = field(default_factory=dict)
    headline: list[tuple[str, Any, Any]] = field(default_factory=list)
    ran: list[str] | None = None  # the stages this run computed, in dvc.lock's order; None: not known
    band: dict[str, tuple[float, float]] | None = None  # the record's band (BAND_FILE); None: none committed

    @property
    def identical(self) -> bool:
        """Every output matches, apart from those of CONTEXT_STAGES."""
        return not any(stage not in CONTEXT_STAGES for stage in self.differs)

    @property
    def checked(self) -> list[str] | None:
        """The stages this run computed whose outputs the record can check (CONTEXT_STAGES aside)."""
        return None if self.ran is None else [s for s in self.ran if s not in CONTEXT_STAGES]

    @property
    def ran_nothing(self) -> bool:
        """This run computed no output the record can check (every such stage was up to date)."""
        return self.checked is not None and not self.checked

    @property
    def reproduced(self) -> bool:
        """The run computed outputs and every one matches the record (CONTEXT_STAGES aside)."""
        return self.identical and not self.ran_nothing


def compare_with_record(root: Path, ran: Sequence[str] | None = None) -> Comparison | None:
    """Compare `<root>/dvc.lock` and `<root>/metrics` with HEAD's; None when there is no committed record (not a
    git checkout, or HEAD has no dvc.lock). `ran` names the stages this run computed (the flow's result); the
    others were up to date, so their match says nothing about reproduction."""
    root = Path(root).resolve()
    top = _git(root, "rev-parse", "--show-toplevel")
    if top.returncode != 0 or not (root / "dvc.lock").exists():
        return None
    prefix = str(root.relative_to(Path(top.stdout.strip()).resolve()))
    prefix = "" if prefix == "." else prefix + "/"
    committed = _git(root, "show", f"HEAD:{prefix}dvc.lock")
    if committed.returncode != 0:
        return None
    head = _git(root, "rev-parse", "--short", "HEAD").stdout.strip()
    old, new = _outs(yaml.safe_load(committed.stdout)), _outs(yaml.safe_load((root / "dvc.lock").read_text()))
    cmp = Comparison(commit=head)
    order = sorted(set(old) | set(new), key=lambda s: list(new).index(s) if s in new else len(new))
    for stage in order:
        a, b = old.get(stage, {}), new.get(stage, {})
        changed = sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))
        if changed:
            cmp.differs[stage] = changed
        else:
            cmp.same.append(stage)
    if ran is not None:
        cmp.ran = [s for s in order if s in set(ran)]
    shown = _git(root, "show", f"HEAD:{prefix}{BAND_FILE.as_posix()}")
    cmp.band = read_band(shown.stdout) if shown.returncode == 0 else None
    for label, rel, keys in HEADLINE:
        shown = _git(root, "show", f"HEAD:{prefix}{rel}")
        before = json.loads(shown.stdout) if shown.returncode == 0 else {}
        after = read_json(root / rel) if (root / rel).exists() else {}
        if "*" in keys:
            i = keys.index("*")
            arms = sorted(set(_get(before, keys[:i]) or {}) | set(_get(after, keys[:i]) or {}))
            for arm in arms:
                k = keys[:i] + (arm,) + keys[i + 1:]
                cmp.headline.append((label.format(arm=arm), _get(before, k), _get(after, k)))
        else:
            cmp.headline.append((label, _get(before, keys), _get(after, keys)))
    return cmp


def read_band(text: str) -> dict[str, tuple[float, float]]:
    """The `band` of a band file's JSON text: headline label -> (low, high). A malformed file raises ValueError
    naming what is wrong (the comparison then says it could not compare)."""
    doc = json.loads(text)
    band = doc.get("band") if isinstance(doc, dict) else None
    if not isinstance(band, dict):
        raise ValueError(f"{BAND_FILE}: no `band` object (headline label -> [low, high])")
    out: dict[str, tuple[float, float]] = {}
    for label, lh in band.items():
        if not (isinstance(lh, list) and len(lh) == 2 and all(isinstance(x, (int, float)) for x in lh)
                and lh[0] <= lh[1]):
            raise ValueError(f"{BAND_FILE}: band {label!r} is {lh!r}, not [low, high] with low <= high")
        out[label] = (float(lh[0]), float(lh[1]))
    return out


def in_band(value: Any, band: tuple[float, float]) -> bool:
    """Whether a headline number lies in [low, high] (compared at the 4 decimals the metrics files keep)."""
    return isinstance(value, (int, float)) and band[0] - 5e-5 <= value <= band[1] + 5e-5


def _band_lines(cmp: Comparison) -> list[str]:
    """Each headline number of this run beside the record's value and band, and the verdict: every number
    within the record's band, or which fell outside (and which have no band)."""
    band = cmp.band or {}
    rows, outside, unbanded = [], [], []
    for label, a, b in cmp.headline:
        if label not in band:
            unbanded.append(label)
            rows.append(f"    {label}: {_num(b)} (record {_num(a)}; no band measured)")
            continue
        lo, hi = band[label]
        inside = in_band(b, (lo, hi))
        if not inside:
            outside.append(label)
        rows.append(f"    {label}: {_num(b)} (record {_num(a)}; band {lo:.3f}-{hi:.3f}: "
                    f"{'inside' if inside else 'OUTSIDE'})")
    lines = ["  headline numbers, this run (the record's value and band, metrics/band.json):", *rows]
    if not outside and not unbanded:
        lines.append("  Every headline number landed within the record's band: this run lands where the default "
                     "run lands across seeds and CPU kernel paths.")
    else:
        if outside:
            lines.append(f"  {len(outside)} of {len(cmp.headline)} headline numbers landed outside the record's "
                         f"band: {', '.join(outside)}.")
        else:
            lines.append("  Every headline number with a band landed within the record's band.")
        if unbanded:
            lines.append(f"  No band was measured for: {', '.join(unbanded)}.")
    return lines


def _num(v: Any) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def _ran_nothing(cmp: Comparison) -> str:
    """The verdict of a run that computed nothing the record can check: no reproduction, and how to get one."""
    only = [s for s in cmp.ran or [] if s in CONTEXT_STAGES]
    if only:
        return (f"This run recomputed no output the record can check: it ran only {', '.join(only)} (whose "
                "outputs record the run's context), every other stage was up to date in dvc.lock, so it reproduced "
                "nothing. ")
    return "This run ran nothing: every stage was up to date in dvc.lock, so it reproduced nothing. "


def record_summary(cmp: Comparison, machine_line: str = "") -> str:
    """A few lines for the terminal: reproduced, ran nothing, or what differs and what to do about it."""
    context = [f"{s} ({CONTEXT_STAGES[s]})" for s in cmp.differs if s in CONTEXT_STAGES]
    if cmp.identical and cmp.ran_nothing:
        return (_ran_nothing(cmp) + f"Its outputs are the ones the committed record (dvc.lock at {cmp.commit}) "
                "pins; `tandem run --force` reruns every stage (the evaluation past its result cache) and "
                "compares them again.")
    if cmp.identical:
        # a partial run vouches only for what it recomputed: name the stages it took as they were
        kept = [s for s in cmp.same if cmp.ran is not None and s not in cmp.ran]
        rerun = (f"; recomputed: {', '.join(cmp.checked)}; up to date, not rerun: {', '.join(kept)}"
                 if kept else "")
        return (f"This run reproduced the committed record (dvc.lock at {cmp.commit}) bit for bit: every output "
                f"hash matches ({len(cmp.same)} stages{rerun})"
                + (f", apart from {'; '.join(context)}." if context else "."))
    within = (cmp.band is not None and bool(cmp.headline)
              and all(label in cmp.band and in_band(b, cmp.band[label]) for label, _, b in cmp.headline))
    head = (_ran_nothing(cmp) + "The outputs it found (an earlier run's) differ" if cmp.ran_nothing
            else "This run landed within the record's band, not on its bytes: its outputs differ" if within
            else "This run differs")
    lines = [f"{head} from the committed record (dvc.lock at {cmp.commit}):"]
    if cmp.same:
        lines.append(f"  same outputs:    {', '.join(cmp.same)}")
    if sum(len(p) for p in cmp.differs.values()) <= 8:
        lines.append("  other outputs:   " + "; ".join(f"{s} ({', '.join(p)})" for s, p in cmp.differs.items()))
    else:  # a whole new run: the stages say enough (`git diff HEAD -- dvc.lock` lists every output)
        lines.append("  other outputs:   " + ", ".join(f"{s} ({len(p)})" for s, p in cmp.differs.items()))
    moved = [f"{label} {_num(a)} -> {_num(b)}" for label, a, b in cmp.headline if a != b]
    if cmp.band is not None and cmp.headline:
        lines += _band_lines(cmp)
    elif moved:
        lines.append("  headline numbers (record -> this run): " + "; ".join(moved))
    lines += [
        "  Outputs differ when inputs or code differ, or on another machine: its CPU and math kernels"
        + (f" ({machine_line})" if machine_line else "") + " round differently, and training amplifies that",
        "  (docs/results.md names the record's machine and its band over seeds and kernel paths: how far a rerun "
        "may land).",
        "  dvc.lock and metrics/ now describe this run: commit them to keep it, or go back to the record with",
        "  `git checkout -- dvc.lock metrics && dvc checkout` (`dvc pull` fetches its artifacts if they are missing).",
    ]
    return "\n".join(lines)
