"""Training state that survives the loss of a worker: resume checkpoints on the run's DVC remote.

With `TANDEM_RESUME_REMOTE` set (a DVC remote of the project that holds `out_root`, or `default` for its default
remote; the deployments set it), the train stage pushes every checkpoint it saves (`scratch/train/<arm>/step-<N>/`,
the resume state) to that remote, and a worker that starts the same run (same run fingerprint) first pulls the
checkpoints the remote holds and the training resumes from the last of them, exactly as it resumes from its own
disk (every file is checked against the checksums recorded when it was saved). Nothing is pushed or pulled
without the variable: the resume state then lives on the worker's disk alone.

The transfer is DVC's remote machinery: the remote's filesystem as DVC configures it (`Repo.cloud.get_remote`:
its URL, credentials and endpoint from `.dvc/config` and the environment; S3 through the `dvc-s3` plugin, the
`s3` extra). On the remote: `<remote>/tandem-resume/<fingerprint>/<arm>/step-<N>/...`, and beside them
`latest.json` (`{"step": N}`), written only after the step's files are all there, so a worker killed mid-push
leaves the previous step as the one to resume from.

`TANDEM_EPHEMERAL_WORKER=1` says the worker's disk goes away with it (the work pools set it: a Kubernetes pod's
`emptyDir`, a process worker's temporary directory). Pushing to a folder remote from such a worker would put
the state on a disk that is lost with the worker: `check_push_target` refuses it in one line, for the resume
state and for the flow's `dvc push` alike.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import UserError

RESUME_REMOTE_ENV = "TANDEM_RESUME_REMOTE"
EPHEMERAL_ENV = "TANDEM_EPHEMERAL_WORKER"
PREFIX = "tandem-resume"
LATEST = "latest.json"


def ephemeral() -> bool:
    """Whether this worker's disk goes away with it (`TANDEM_EPHEMERAL_WORKER`, set by the work pools)."""
    return os.environ.get(EPHEMERAL_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_folder_url(url: str) -> bool:
    """A DVC remote URL that names a directory of this machine (a path, or `file://`), not a shared store."""
    return "://" not in url or url.startswith("file://")


def _repo(start: str | os.PathLike, why: str = f"{RESUME_REMOTE_ENV} is set"):
    from dvc.repo import Repo

    try:
        return Repo(Repo.find_root(str(Path(start).resolve())))
    except Exception as e:  # NotDvcRepoError and kin: say it in one line
        raise UserError(f"{why}, but {start} is in no DVC project ({type(e).__name__}): the state goes to a "
                        "remote of the DVC project that holds out_root") from e


def remote_url(repo, name: str | None) -> tuple[str, str]:
    """(the remote's name, its URL) in `repo`'s DVC config; None or `default` = the default remote."""
    conf = repo.config
    name = conf["core"].get("remote") if name in (None, "", "default") else name
    if not name or name not in conf["remote"]:
        known = ", ".join(conf["remote"]) or "none"
        raise UserError(f"DVC remote {name or '(default)'!r} is not configured in {repo.root_dir} (remotes: {known}); "
                        "add one with `dvc remote add -d NAME URL`")
    return name, str(conf["remote"][name]["url"])


def check_push_target(name: str, url: str, what: str) -> None:
    """Refuse, in one line, to push `what` to a folder remote from an ephemeral worker."""
    if ephemeral() and is_folder_url(url):
        raise UserError(f"{what}: the DVC remote {name!r} is a folder ({url}) and this worker is ephemeral "
                        f"({EPHEMERAL_ENV}=1): what it pushes there is lost with the worker. Point the run at a "
                        "shared store (`dvc remote add -d store s3://BUCKET/PATH`, the `s3` extra), or run on a "
                        "machine whose disk persists")


def check_remote_push(root: str | os.PathLike, name: str | None) -> None:
    """Refuse, in one line, a `dvc push` to the remote `name` (None: the default) of the DVC project at `root` when
    it is a folder and this worker is ephemeral; nothing to check on a worker whose disk persists."""
    if not ephemeral():
        return
    repo = _repo(root, "pushing")
    try:
        check_push_target(*remote_url(repo, name), "dvc push")
    finally:
        repo.close()


@dataclass(frozen=True)
class ResumeStore:
    """Where one project's resume state lives on its DVC remote: DVC's filesystem of the remote and its root."""

    name: str
    url: str
    fs: Any
    root: str

    @classmethod
    def from_env(cls, out_root: str | os.PathLike) -> "ResumeStore | None":
        """The store `TANDEM_RESUME_REMOTE` names (None when unset); a folder remote on an ephemeral worker is
        refused in one line."""
        wanted = os.environ.get(RESUME_REMOTE_ENV, "").strip()
        if not wanted:
            return None
        repo = _repo(out_root)
        try:
            name, url = remote_url(repo, wanted)
            check_push_target(name, url, "train: resume state")
            remote = repo.cloud.get_remote(name, command="push")
            return cls(name, url, remote.fs, remote.fs.join(remote.path, PREFIX))
        finally:
            repo.close()

    def _arm(self, fingerprint: str, arm: str) -> str:
        return self.fs.join(self.root, fingerprint, arm)

    def push_step(self, fingerprint: str, arm: str, step_dir: Path) -> None:
        """Upload one complete checkpoint folder, then point `latest.json` at it."""
        from tandem.checkpoints import read_state

        step_dir = Path(step_dir)
        files = sorted(p for p in step_dir.rglob("*") if p.is_file())
        dest = self.fs.join(self._arm(fingerprint, arm), step_dir.name)
        self.fs.put([str(p) for p in files],
                    [self.fs.join(dest, *p.relative_to(step_dir).parts) for p in files])
        step = int(read_state(step_dir)["step"])
        self.fs.pipe_file(self.fs.join(self._arm(fingerprint, arm), LATEST), json.dumps({"step": step}).encode())

    def latest_step(self, fingerprint: str, arm: str) -> int | None:
        """The last step whose checkpoint was pushed in full, or None."""
        path = self.fs.join(self._arm(fingerprint, arm), LATEST)
        if not self.fs.exists(path):
            return None
        return int(json.loads(self.fs.cat_file(path))["step"])

    def pull(self, fingerprint: str, arm: str, arm_dir: Path) -> int | None:
        """Fetch into `arm_dir` every pushed checkpoint up to the latest that `arm_dir` lacks (each lands as
        `checkpoint-<N>/` and is renamed `step-<N>/` once complete); returns the latest pushed step or None."""
        from tandem.checkpoints import STAGING_PREFIX, commit_dir, parse_step, step_name

        latest = self.latest_step(fingerprint, arm)
        if latest is None:
            return None
        base = self._arm(fingerprint, arm)
        steps = sorted(s for s in (parse_step(self.fs.name(p)) for p in self.fs.ls(base)) if s is not None)
        arm_dir = Path(arm_dir)
        arm_dir.mkdir(parents=True, exist_ok=True)
        for step in (s for s in steps if s <= latest):
            if (arm_dir / step_name(step)).exists():
                continue
            staging = arm_dir / f"{STAGING_PREFIX}{step}"
            shutil.rmtree(staging, ignore_errors=True)
            src = self.fs.join(base, step_name(step))
            files = list(self.fs.find(src))
            rel = [self.fs.relparts(f, src) for f in files]
            if any(not parts or any(p in ("", ".", "..") for p in parts) for parts in rel):
                raise UserError(f"DVC remote {self.name!r}: {src} holds a file whose name climbs out of its folder; "
                                "nothing was pulled from it")
            self.fs.get(files, [str(staging.joinpath(*parts)) for parts in rel])
            commit_dir(staging, arm_dir / step_name(step))
        return latest
