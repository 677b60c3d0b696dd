"""The rollout service never outlives the stage that started it: after `kill -9` of the stage no service or
engine process is left, and neither is its shared-memory inbox (pushed weights, counters), the engines' shared
memory (vLLM's message queues) nor its temporary run directory (the log). Slow (one service start); needs `.venv-vllm` like tests/rollout/test_vllm_service.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.rollout.vllm.lifecycle import group_members
from vllm_fixtures import need_vllm, shm_mapped_by, tiny_dirs

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STAGE = r"""
import json, os, sys, time
from tandem.rollout.vllm.client import LaunchOptions, VLLMService
from tandem.rollout.vllm.knobs import EngineKnobs
svc = VLLMService.start(sys.argv[1], sys.argv[1], options=LaunchOptions(
    knobs=EngineKnobs(dtype="float32", max_model_len=256, kv_blocks=16), start_timeout=1800))
print(json.dumps({"pid": svc.proc.pid, "inbox": str(svc.inbox), "run_dir": str(svc.run_dir)}), flush=True)
time.sleep(600)
"""


def test_no_process_or_residue_after_kill_9_of_the_stage(tmp_path):
    need_vllm()
    from tandem.rollout import toy

    tok = toy.byte_bpe_tokenizer()
    d = tiny_dirs(tmp_path, tok)["senior"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    stage = subprocess.Popen([sys.executable, "-c", STAGE, str(d)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(stage.stdout.readline())
        pid = info["pid"]
        assert Path(info["inbox"]).is_dir() and Path(info["run_dir"]).is_dir() and group_members(pid)
        segments = shm_mapped_by(group_members(pid))
        os.kill(stage.pid, signal.SIGKILL)
        stage.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (group_members(pid) or Path(info["inbox"]).exists()
                                               or any(p.exists() for p in segments)):
            time.sleep(0.5)
        assert not group_members(pid), f"service processes left after the stage was killed: {group_members(pid)}"
        assert not Path(info["inbox"]).exists() and not Path(info["run_dir"]).exists()
        assert not [p for p in segments if p.exists()], "the engines' shared memory was left in /dev/shm"
    finally:
        if stage.poll() is None:
            stage.kill()
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
