"""The rollout layouts for real, with vLLM's CPU build (`.venv-vllm`) on tiny models: a service placed on fake GPUs
starts each engine-core process with its own `CUDA_VISIBLE_DEVICES` and says so in /health (the CPU build
ignores the variable: the CUDA path, engines really landing there, needs a GPU check). Slow (a service start);
skips without `.venv-vllm` unless TANDEM_REQUIRE_VLLM=1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.rollout.placement import DEVICE_ENV, place_engines
from tandem.rollout.vllm.client import LaunchOptions, VLLMService
from tandem.rollout.vllm.knobs import EngineKnobs
from tandem.rollout.vllm.lifecycle import group_members
from vllm_fixtures import need_vllm, tiny_dirs

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def engine_core_envs(service_pid: int) -> list[str | None]:
    """`CUDA_VISIBLE_DEVICES` of each engine-core process of the service (vLLM titles them VLLM::EngineCore)."""
    out = []
    for pid in group_members(service_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "EngineCore" in cmd:
            vals = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(DEVICE_ENV.encode() + b"=")]
            out.append(vals[0] if vals else None)
    return out


def test_dedicated_engines_start_on_devices_of_their_own(tmp_path):
    need_vllm()
    from tandem.rollout import toy

    tok = toy.byte_bpe_tokenizer()
    dirs = tiny_dirs(tmp_path, tok)
    # four fake GPUs seen by the training processes: the trainer's two, then one per model
    placement = place_engines("dedicated", visible=["0", "1", "2", "3"], trainer_processes=2)
    svc = VLLMService.start(dirs["senior"], dirs["junior"], roots=[tmp_path], options=LaunchOptions(
        knobs=EngineKnobs(dtype="float32", max_model_len=256, kv_blocks=16), start_timeout=1800,
        placement=placement, log_path=tmp_path / "service.log"))
    try:
        info = svc.health()
        assert info["layout"] == "dedicated"
        assert info["devices"] == {"senior": f"{DEVICE_ENV}=2", "junior": f"{DEVICE_ENV}=3"}
        assert sorted(engine_core_envs(svc.proc.pid)) == ["2", "3"]  # one engine core per model, each its GPU
        log = (tmp_path / "service.log").read_text()
        assert f"engine senior started on {DEVICE_ENV}=2" in log and f"engine junior started on {DEVICE_ENV}=3" in log
    finally:
        svc.stop()
