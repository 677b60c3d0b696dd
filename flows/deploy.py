"""Serve the deployments of infra/prefect.yaml from this process: scheduled retraining without a work pool.

`prefect deploy` + a worker (infra/README.md) is the way for shared or GPU infrastructure. On a single
machine, `python -m flows.deploy serve` is enough: it registers the same deployments (same entrypoints,
parameters and cron schedules, read from infra/prefect.yaml so the two never drift) and runs their flow runs
in this process until interrupted. Needs a Prefect API (`PREFECT_API_URL`, e.g. `prefect server start`).

A promotion is a git tag on a commit whose dvc.lock pins the promoted checkpoint, so a served deployment either
publishes (`--publish`: each run commits dvc.lock and metrics to the checkout's branch and pushes them and the
tags to `origin`) or does not promote (the default: the report still shows the promotion gate's verdict).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import yaml

PREFECT_YAML = Path(__file__).resolve().parents[1] / "infra" / "prefect.yaml"


def deployment_spec(name: str, path: Path = PREFECT_YAML) -> dict:
    """One deployment entry of infra/prefect.yaml, by name."""
    deps = {d["name"]: d for d in yaml.safe_load(Path(path).read_text())["deployments"]}
    if name not in deps:
        raise KeyError(f"no deployment {name!r} in {path} (have: {', '.join(sorted(deps))})")
    return deps[name]


def served_parameters(spec: dict, publish: bool = False) -> dict:
    """The flow parameters of a deployment served from this checkout: DVC sync `auto` (never adopt a params
    file over the developer's params.yaml); `publish` as asked, and promotion only together with it (a tag on
    a commit whose dvc.lock is not the run's would point at another model)."""
    params = {**spec.get("parameters", {}), "dvc": "auto"}
    sharing = {**params.get("sharing", {}), "publish": publish}
    if "push" in sharing:  # nothing leaves the checkout unless it publishes
        sharing["push"] = bool(sharing["push"]) and publish
    params["sharing"] = sharing
    if "promote" in params:
        params["promote"] = bool(params["promote"]) and publish
    return params


def runner_deployment(name: str, path: Path = PREFECT_YAML, publish: bool = False):
    """The deployment as a `RunnerDeployment` of the flow its entrypoint names, for `prefect.serve`."""
    import flows.pipeline as pipeline

    from prefect.schedules import Cron

    spec = deployment_spec(name, path)
    flow = getattr(pipeline, spec["entrypoint"].split(":")[1])
    schedules = [Cron(s["cron"], timezone=s.get("timezone")) for s in spec.get("schedules", [])
                 if s.get("active", True)]
    limit = spec.get("concurrency_limit")
    if isinstance(limit, dict):
        from prefect.client.schemas.objects import ConcurrencyLimitConfig

        limit = ConcurrencyLimitConfig(**limit)
    parameters = served_parameters(spec, publish)
    if "promote" in inspect.signature(flow.fn).parameters and "promote" not in parameters:
        parameters["promote"] = False
    return flow.to_deployment(name=f"{name}-local", parameters=parameters, schedules=schedules,
                              tags=list(spec.get("tags", [])) + ["served"], description=spec.get("description"),
                              concurrency_limit=limit)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve deployments from this process until interrupted")
    s.add_argument("--name", action="append", help="deployment name (repeatable; default scheduled-retraining)")
    s.add_argument("--publish", action="store_true",
                   help="commit each run's dvc.lock and metrics and push them, the DVC outputs and the promotion "
                        "tags (needs a git `origin` and a DVC remote); without it, runs never promote")
    a = ap.parse_args(argv)
    from prefect import serve

    deployments = [runner_deployment(n, publish=a.publish) for n in (a.name or ["scheduled-retraining"])]
    if not a.publish:
        print("serving without --publish: runs report the promotion gate but do not promote", file=sys.stderr)
    serve(*deployments)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
