"""The checkpoint layout: where training puts `step-<N>` folders, what makes one complete, and who reads them.

    models/checkpoints/<arm>/step-<N>/      a complete checkpoint (N >= 1): config.json, weights, tandem_state.json
    scratch/train/<arm>/step-<N>/          the same, where training writes and resumes (published as copies)
    scratch/train/<arm>/checkpoint-<N>/    trl's staging name while it writes; never read
    results/generations/<arm>/step-<N>/<mode>/<benchmark>.jsonl   the evaluate stage's saved samples

Training writes into the staging name, adds `tandem_state.json` (the run's fingerprint and step, and the size
and SHA-256 of every other file of the checkpoint: `write_state`) and renames the folder to `step-<N>` in one
step (`commit_dir`); the train stage publishes copies of those folders (`copy_verified`), never links, so
damage to a published file cannot reach the resume state. One rule (`is_complete`) decides what every reader trusts: training resuming a run,
evaluation listing an arm's checkpoints, the analysis and the report. Nothing is substituted silently: a
`step-<N>` folder that is not complete is an error naming it (`list_checkpoints`, `resume_checkpoint`), never
skipped in favour of the step before, a folder the arm's training summary lists but that is gone is an error
naming it (`check_published`), and a file that no longer matches its recorded checksum is an error
naming the file (`verify_checkpoint`: on resume every file, on evaluation the model's files, on publication
every file as it is copied). Step 0 is the base model itself (`list_checkpoints`, which lists every step or
only the base and the last). The comparison of files with recorded checksums (`checksum_problems`) also checks
a published base or junior against its manifest (`tandem.models.verify_manifest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import CheckpointError
from tandem.timing import split_timing
from tandem.transactions import fsync_dir, fsync_path, remove, swap_in

STATE_FILE = "tandem_state.json"
FILES_KEY = "files"  # in the state: {relative path: {"bytes": N, "sha256": hex}} of every other file
STAGING_PREFIX = "checkpoint-"  # what trl/transformers writes; renamed to step-<N> once complete
STEP_PREFIX = "step-"
OLD_PREFIX = ".old-"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# files only a resumed training run reads; evaluation verifies the rest (the model, its config and tokenizer)
RESUME_ONLY = ("optimizer", "scheduler", "rng_state", "scaler", "trainer_state.json", "training_args.bin")
_CHUNK = 1 << 22
log = logging.getLogger("tandem.checkpoints")
UNRECORDED = ("records no file checksums (an older checkpoint layout): used without verification; retrain the "
              "arm to have it verified")


def step_name(step: int) -> str:
    """The folder name of step `step` (`step-<N>`)."""
    return f"{STEP_PREFIX}{int(step)}"


def parse_step(name: str) -> int | None:
    """N for a folder named exactly `step-<N>`, else None (`step-x`, `.step-3.tmp`, `checkpoint-3`)."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The files whose bytes define the model: `*.safetensors`, else `*.bin` (sorted by name)."""
    d = Path(model_dir)
    return sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin"))


def incomplete_reason(path: str | os.PathLike) -> str | None:
    """None when `path` is a complete checkpoint folder, else what it lacks."""
    p = Path(path)
    if not p.is_dir():
        return "not a directory"
    missing = [n for n in (STATE_FILE, "config.json") if not (p / n).is_file()]
    if not weight_files(p):
        missing.append("weight files (*.safetensors)")
    return f"missing {', '.join(missing)}" if missing else None


def is_complete(path: str | os.PathLike) -> bool:
    """True when `path` is a finished checkpoint: a `step-<N>` folder (N >= 1) with the training marker
    (`tandem_state.json`, written just before the rename), `config.json` and weight files."""
    step = parse_step(Path(path).name)
    return step is not None and step > 0 and incomplete_reason(path) is None


def _step_entries(arm_dir: Path) -> list[tuple[int, Path]]:
    if not arm_dir.is_dir():
        return []
    found = [(parse_step(p.name), p) for p in arm_dir.iterdir()]
    return sorted((s, p) for s, p in found if s is not None and s > 0)  # step 0 is the base, never a checkpoint


def complete_checkpoints(arm_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete `step-<N>` checkpoint under `arm_dir`, by step."""
    return [(s, p) for s, p in _step_entries(Path(arm_dir)) if incomplete_reason(p) is None]


def damaged_checkpoints(arm_dir: str | os.PathLike) -> list[tuple[Path, str]]:
    """(path, what it lacks) of every `step-<N>` entry under `arm_dir` that is not a complete checkpoint."""
    out = []
    for _, p in _step_entries(Path(arm_dir)):
        reason = incomplete_reason(p)
        if reason is not None:
            out.append((p, reason))
    return out


def read_state(path: str | os.PathLike) -> dict:
    """The `tandem_state.json` of a checkpoint folder (arm, fingerprint, step, file checksums, ...)."""
    f = Path(path) / STATE_FILE
    try:
        state = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{f}: cannot be read as JSON ({type(e).__name__}: {str(e)[:200]}); the checkpoint's "
                              f"record is damaged") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f}: holds no JSON object; the checkpoint's record is damaged")
    return state


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _files(path: Path, record: str = STATE_FILE) -> list[tuple[str, Path]]:
    """(relative path, path) of every file (or symlink) in a folder but its record file `record` (a checkpoint's
    state file; a published model's manifest)."""
    out = []
    for p in path.rglob("*"):
        if (p.is_dir() and not p.is_symlink()) or (p.parent == path and p.name == record):
            continue
        out.append((p.relative_to(path).as_posix(), p))
    return sorted(out)


def folder_files(path: str | os.PathLike, record: str = STATE_FILE) -> dict[str, Path]:
    """{relative path: path} of every file (or symlink) of a folder but its record file `record`."""
    return dict(_files(Path(path), record))


def file_checksums(path: str | os.PathLike, record: str = STATE_FILE) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of every file of a checkpoint folder (or a published model folder)
    but its record file `record`."""
    path = Path(path)
    out = {}
    for rel, p in _files(path, record):
        st = os.lstat(p)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{p}: not a regular file; a checkpoint holds plain files only")
        out[rel] = {"bytes": st.st_size, "sha256": _sha256(p)}
    return out


def checksum_problems(path: str | os.PathLike, recorded: dict[str, dict], present: dict[str, Path],
                      when: str = "saved") -> list[str]:
    """What differs between the files `present` ({relative path: path}) of folder `path` and the checksums
    `recorded` for them ({relative path: {"bytes", "sha256"}}), one phrase per file naming it: missing, not
    recorded, no longer a regular file, another size or other bytes (SHA-256) than when `when`."""
    path = Path(path)
    problems = [f"{path / r}: missing" for r in sorted(set(recorded) - set(present))]
    problems += [f"{path / r}: not written by training (no recorded checksum)" if when == "saved" else
                 f"{path / r}: not in the record (no recorded checksum)" for r in sorted(set(present) - set(recorded))]
    for r in sorted(set(recorded) & set(present)):
        p, want = present[r], recorded[r]
        st = os.lstat(p)
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{p}: no longer a regular file")
        elif st.st_size != want.get("bytes"):
            problems.append(f"{p}: {st.st_size} bytes, {want.get('bytes')} when {when}")
        else:
            try:
                if _sha256(p) != want.get("sha256"):
                    problems.append(f"{p}: other bytes than when {when} (SHA-256 differs)")
            except OSError as e:
                problems.append(f"{p}: cannot be read ({e.strerror or e})")
    return problems


def files_key(path: str | os.PathLike, present: dict[str, Path], *extra) -> tuple | None:
    """A key that changes with any file of `present` ({relative path: path}): (resolved folder, `extra`, each
    file's name, size and modification time); None when a file cannot be stat'ed. What a verification
    remembers, so a big model is hashed once per process while its files stay as they were."""
    try:
        return (str(Path(path).resolve()), *extra, tuple((r, os.lstat(p).st_size, os.lstat(p).st_mtime_ns)
                                                         for r, p in sorted(present.items())))
    except OSError:
        return None


def shown(problems: list[str], limit: int = 5) -> str:
    """Problems joined into one line, the first `limit` of them and how many more."""
    return "; ".join(problems[:limit]) + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")


def write_state(path: str | os.PathLike, state: dict) -> None:
    """Write the marker that, once the folder carries its `step-<N>` name, makes it a complete checkpoint,
    with the checksums of every file already in the folder."""
    state = {**state, FILES_KEY: file_checksums(path)}
    (Path(path) / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def drop_clock(path: str | os.PathLike, names: tuple[str, ...]) -> None:
    """Rewrite the JSON files `names` of checkpoint folder `path` without their timing values
    (`tandem.timing.split_timing`), and the state file's recorded checksums of the rewritten files with them, so
    the folder still verifies. For a published copy: its bytes then depend on the run's inputs alone."""
    path = Path(path)
    state = read_state(path)
    recorded = state.get(FILES_KEY)
    for name in names:
        if name == STATE_FILE or not (path / name).is_file():
            continue
        kept, timing = split_timing(json.loads((path / name).read_text()))
        if timing is None:
            continue
        (path / name).write_text(json.dumps(kept, indent=2, sort_keys=True) + "\n")
        if isinstance(recorded, dict) and name in recorded:
            recorded[name] = {"bytes": (path / name).stat().st_size, "sha256": _sha256(path / name)}
    if STATE_FILE in names:
        state, _ = split_timing(state)
    (path / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def drop_files(path: str | os.PathLike, prefixes: tuple[str, ...]) -> list[str]:
    """Remove the files of checkpoint folder `path` whose names start with `prefixes`, and their records from the
    state file's checksums, so the folder still verifies; returns the names removed."""
    path = Path(path)
    state = read_state(path)
    recorded = state.get(FILES_KEY)
    gone = sorted(f.name for f in path.iterdir() if f.is_file() and f.name.startswith(prefixes))
    for name in gone:
        (path / name).unlink()
        if isinstance(recorded, dict):
            recorded.pop(name, None)
    if gone:
        (path / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    return gone


def resume_only(rel: str) -> bool:
    """Whether a checkpoint file is read only when training resumes (optimizer, scheduler, RNG, trainer state)."""
    return Path(rel).name.startswith(RESUME_ONLY)


_VERIFIED: set[tuple] = set()


def verify_checkpoint(path: str | os.PathLike, scope: str = "all", advice: str = "") -> None:
    """Check the files of a checkpoint against the checksums recorded when it was saved; raise
    `CheckpointError` naming every file that is missing, unexpected, of another size or other bytes.

    `scope="model"` checks what loading the model reads (every file but `RESUME_ONLY` ones), `"all"` every
    file. `advice` ends the message (what to do). Remembered per process while sizes and times stay the same.
    """
    if scope not in ("all", "model"):
        raise ValueError(f"verify_checkpoint: scope={scope!r} must be 'all' or 'model'")
    path = Path(path)
    recorded = read_state(path).get(FILES_KEY)
    if recorded is None:  # an older layout: said once per checkpoint and process, never silently
        if (str(path), "unrecorded") not in _VERIFIED:
            log.warning("%s: %s %s", path, STATE_FILE, UNRECORDED)
            _VERIFIED.add((str(path), "unrecorded"))
        return
    if not isinstance(recorded, dict) or not recorded:
        raise CheckpointError(f"{path}: {STATE_FILE} holds no valid file checksums; the checkpoint's record is "
                              f"damaged. {advice}".strip())
    wanted = {r: v for r, v in recorded.items() if scope == "all" or not resume_only(r)}
    present = {r: p for r, p in _files(path) if scope == "all" or not resume_only(r)}
    key = files_key(path, present, scope)
    if key in _VERIFIED:
        return
    problems = checksum_problems(path, wanted, present)
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the checksums recorded when it was saved: "
                              f"{shown(problems)}. {advice}".strip())
    if key is not None:
        _VERIFIED.add(key)


def latest_checkpoint(arm_dir: str | os.PathLike, fingerprint: str | None = None) -> Path | None:
    """The last complete checkpoint (of the run with `fingerprint`, when given), or None."""
    for _, p in reversed(complete_checkpoints(arm_dir)):
        if fingerprint is None or read_state(p).get("fingerprint") == fingerprint:
            return p
    return None


def _fingerprint_of(p: Path) -> str | None:
    try:
        return json.loads((p / STATE_FILE).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def clean_arm_dir(arm_dir: str | os.PathLike, fingerprint: str) -> list[str]:
    """Remove staging leftovers of a crash and checkpoints of a different run; returns what was removed.

    A `step-<N>` folder whose record is missing or unreadable is not removed: it is not known to belong to
    another run (`resume_checkpoint` refuses it, naming it)."""
    arm_dir = Path(arm_dir)
    removed: list[str] = []
    if not arm_dir.is_dir():
        return removed
    for p in arm_dir.iterdir():
        stale = p.name.startswith((STAGING_PREFIX, OLD_PREFIX))
        if p.is_dir() and parse_step(p.name) is not None:
            theirs = _fingerprint_of(p)
            stale = theirs is not None and theirs != fingerprint
        if stale:
            remove(p)
            removed.append(p.name)
    return removed


def resume_checkpoint(arm_dir: str | os.PathLike, fingerprint: str) -> Path | None:
    """The checkpoint a run with `fingerprint` resumes from, every file verified; None when there is none.

    Raises `CheckpointError` when a `step-<N>` folder of this run (or of no known run) is incomplete or
    damaged: resuming from the step before it would hide the damage."""
    arm_dir = Path(arm_dir)
    fix = ("Remove the named folder to resume from the checkpoint before it (those steps are trained again), or "
           "set train.resume: never to start the arm over")
    damaged = [(p, why) for p, why in damaged_checkpoints(arm_dir) if _fingerprint_of(p) in (None, fingerprint)]
    if damaged:
        listed = "; ".join(f"{p} ({why})" for p, why in damaged)
        raise CheckpointError(f"train: {listed}: not a complete checkpoint. {fix}")
    found = latest_checkpoint(arm_dir, fingerprint)
    if found is not None:
        verify_checkpoint(found, "all", advice=fix)
    return found


def commit_dir(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make `staging` appear as `final` in one step, flushed to disk first (replacing an older `final`)."""
    staging, final = Path(staging), Path(final)
    # data on disk before the rename publishes it: a power cut must not leave a named but empty checkpoint
    fsync_path(staging)
    swap_in(staging, final)
    fsync_dir(final.parent)


def copy_verified(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy checkpoint `src` to the new folder `dst` file by file, checking every file's bytes against the
    checksums recorded in `src` as they are copied (one read per file); raises `CheckpointError` naming the
    file that differs. The state file is copied as is."""
    src, dst = Path(src), Path(dst)
    recorded = read_state(src).get(FILES_KEY)
    advice = (f"The resume copy is damaged: remove {src} and every later step-<N> folder beside it, then rerun the "
              f"stage, which trains those steps again from the checkpoint before")
    if recorded is None:  # an older layout: copied as it is, and said so
        log.warning("%s: %s %s", src, STATE_FILE, UNRECORDED)
        for rel, p in _files(src):
            if not stat.S_ISREG(os.lstat(p).st_mode):
                raise CheckpointError(f"{p}: not a regular file. {advice}")
        shutil.copytree(src, dst)
        return
    if not isinstance(recorded, dict) or not recorded:
        raise CheckpointError(f"{src}: {STATE_FILE} holds no valid file checksums; the checkpoint's record is "
                              f"damaged. {advice}")
    present = dict(_files(src))
    if set(present) != set(recorded):
        extra, gone = sorted(set(present) - set(recorded)), sorted(set(recorded) - set(present))
        raise CheckpointError(f"checkpoint {src} does not match its record: missing {gone or 'none'}, "
                              f"unrecorded {extra or 'none'}. {advice}")
    dst.mkdir(parents=True)
    for rel in sorted(recorded):
        s, d = present[rel], dst / rel
        st = os.lstat(s)
        if not stat.S_ISREG(st.st_mode) or st.st_size != recorded[rel].get("bytes"):
            what = "no longer a regular file" if not stat.S_ISREG(st.st_mode) else \
                f"{st.st_size} bytes, {recorded[rel].get('bytes')} when saved"
            raise CheckpointError(f"{s}: {what}. {advice}")
        d.parent.mkdir(parents=True, exist_ok=True)
        h, n = hashlib.sha256(), 0
        with open(s, "rb") as fi, open(d, "wb") as fo:
            for block in iter(lambda: fi.read(_CHUNK), b""):
                h.update(block)
                n += len(block)
                fo.write(block)
        if n != recorded[rel].get("bytes") or h.hexdigest() != recorded[rel].get("sha256"):
            raise CheckpointError(f"{s}: other bytes than when checkpoint {src.name} was saved (SHA-256 differs). "
                                  f"{advice}")
        os.utime(d, ns=(os.stat(s).st_atime_ns, os.stat(s).st_mtime_ns))
    (dst / STATE_FILE).write_bytes((src / STATE_FILE).read_bytes())


@dataclass(frozen=True)
class Checkpoint:
    """One model to evaluate: an arm's step (0 = the base model) and its directory."""

    arm: str
    step: int
    path: Path

    @property
    def name(self) -> str:
        return step_name(self.step)


# `evaluate.checkpoints`: every saved step; the base and the last; or the base, the best by validation and the last
CHECKPOINT_SELECTIONS = ("all", "final", "final_and_best")
VAL_KEY, LOG_STEP_KEY = "val/accuracy", "tandem/step"  # the trainer's validation and training-step log keys


def best_by_validation(found: list[tuple[int, Path]]) -> int | None:
    """The saved step with the highest in-training validation accuracy (ties: the later step), read from the
    last checkpoint's log history (`trainer_state.json`); None when no saved step was validated."""
    if not found:
        return None
    state = found[-1][1] / "trainer_state.json"
    if not state.is_file():
        return None
    history = json.loads(state.read_text()).get("log_history", [])
    saved = {s for s, _ in found}
    scored = [(float(h[VAL_KEY]), int(h.get(LOG_STEP_KEY, h.get("step", -1)))) for h in history
              if h.get(VAL_KEY) is not None]
    scored = [(acc, s) for acc, s in scored if s in saved]
    return max(scored)[1] if scored else None


def list_checkpoints(checkpoints_dir: str | os.PathLike, arm: str, base_dir: str | os.PathLike,
                     which: str = "all", verify: bool = True) -> list[Checkpoint]:
    """The base as step 0, then every complete `<checkpoints_dir>/<arm>/step-<N>/` in increasing N
    (`which="all"`), only the last of them (`which="final"`), or the best by in-training validation and the
    last (`which="final_and_best"`, one entry when they coincide or no step was validated).

    An arm never trained has only step 0. A `step-<N>` folder that is not complete is an error naming it,
    whichever selection is asked for (with "final" an incomplete last step would otherwise quietly make the
    one before it "the final model"); `verify` checks the listed checkpoints' model files against their
    recorded checksums.
    """
    if which not in CHECKPOINT_SELECTIONS:
        raise ValueError(f"list_checkpoints: which={which!r} must be one of {list(CHECKPOINT_SELECTIONS)}")
    arm_dir = Path(checkpoints_dir) / arm
    fix = (f"Rerun `tandem stage train --arm {arm}`, which publishes the arm's checkpoints again from its resume "
           f"copies, or remove the folder to go on without that step")
    damaged = damaged_checkpoints(arm_dir)
    if damaged:
        listed = "; ".join(f"{p} ({why})" for p, why in damaged)
        raise CheckpointError(f"{listed}: not a complete checkpoint, and no earlier step is used in its place. {fix}")
    found = complete_checkpoints(arm_dir)
    if which == "final":
        found = found[-1:]
    elif which == "final_and_best":
        best = best_by_validation(found)
        found = [(s, p) for s, p in found if s == best or (s, p) == found[-1]] if found else []
    if verify:
        for _, p in found:
            verify_checkpoint(p, "model", advice=fix)
    return [Checkpoint(arm, 0, Path(base_dir))] + [Checkpoint(arm, s, p) for s, p in found]


def check_published(checkpoints_dir: str | os.PathLike, arm: str, listed: list[str], record: str | os.PathLike) -> None:
    """Raise `CheckpointError` naming each `step-<N>` folder that `record` (the arm's training summary, whose
    `checkpoints` are `listed`) says training published but that is not under `<checkpoints_dir>/<arm>/`: the
    step before it would otherwise be read as the arm's final model without a word."""
    arm_dir = Path(checkpoints_dir) / arm
    names = [n for n in listed if isinstance(n, str) and (parse_step(n) or 0) > 0]
    gone = [n for n in names if not os.path.lexists(arm_dir / n)]
    if gone:
        last = max(names, key=parse_step)
        final = f" (the final one, {last})" if last in gone else ""
        raise CheckpointError(
            f"{', '.join(str(arm_dir / n) for n in gone)}: missing, but the arm's training summary {record} lists "
            f"{'it' if len(gone) == 1 else 'them'} among its published checkpoints{final}; no earlier step is used "
            f"in its place. Rerun `tandem stage train --arm {arm}`, which publishes the arm's checkpoints again "
            f"from its resume copies")


def generations_file(generations_dir: str | os.PathLike, arm: str, step: int, mode: str, benchmark: str) -> Path:
    """Where the evaluate stage saves the samples of (arm, step, mode, benchmark)."""
    return Path(generations_dir) / arm / step_name(step) / mode / f"{benchmark}.jsonl"
