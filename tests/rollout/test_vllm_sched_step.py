"""`benchmarks/sched_step.py`: two real `TandemScheduler`s stepped as a tandem rollout's engine cores, in vLLM's
environment. Every chunk the stop rule ends must be where the frontend's schedule switches authors, every row
must end at its budget (the harness raises otherwise), and the four cases (two vocabulary sizes x two history
lengths) must run the same schedule token by token; the figures must be there and finite."""

from __future__ import annotations

import json
import math
import os
import subprocess

from tandem.rollout.vllm.client import REPO_ROOT
from vllm_fixtures import VLLM_PY, need_vllm


def test_sched_step_bench_runs_one_schedule_in_every_case():
    need_vllm()
    cmd = [str(VLLM_PY), str(REPO_ROOT / "benchmarks" / "sched_step.py"), "--rows", "6", "--tokens", "120",
           "--history", "16", "400", "--repeats", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["schedules_equal"] is True
    assert 0.3 < res["senior_share"] < 0.7 and 0.1 < res["chunks_per_token"] < 0.5
    for vocab in ("qwen3", "small"):
        for role in ("senior", "junior"):
            for what in ("step", "row"):
                x = res[f"{vocab}_long_over_short_{role}_{what}"]
                assert math.isfinite(x) and x > 0
            for hist in ("short", "long"):
                assert res[f"{vocab}_{hist}_{role}_us_per_step"] > 0
                assert res[f"{vocab}_{hist}_{role}_rows_per_step"] >= 1
