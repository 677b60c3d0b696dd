"""The fake stages (tests/flows/fake_stages.py) inside the workers of a local Ray cluster: Ray runs `install` in every
worker process it starts (`worker_process_setup_hook`), which points the flow's stage lookup at the fakes and
records, for every stage call, where it ran (node, process, the GPUs Ray assigned, `CUDA_VISIBLE_DEVICES`) as one
JSON line in the file named by $TANDEM_TEST_RAY_LOG."""

from __future__ import annotations

import json
import os

from tests.flows import fake_stages

LOG_ENV = "TANDEM_TEST_RAY_LOG"


def where() -> dict:
    """The Ray node and GPUs of the calling process (the driver has no GPUs of its own)."""
    import ray

    ctx = ray.get_runtime_context()
    return {"node": ctx.get_node_id(), "pid": os.getpid(), "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "group": os.environ.get("TANDEM_RUN_GROUP")}


class PlacedRecorder(fake_stages.Recorder):
    """A Recorder that also appends each call and where it ran to $TANDEM_TEST_RAY_LOG."""

    def hit(self, name: str) -> None:
        super().hit(name)
        with open(os.environ[LOG_ENV], "a") as f:
            f.write(json.dumps({"call": name, **where()}) + "\n")


def install() -> None:
    import flows.pipeline as fp

    fake_stages.ACTIVE = fake_stages.modules(PlacedRecorder())
    fp._stage = fake_stages.stage
