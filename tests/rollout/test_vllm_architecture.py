"""The rollout service's engines and the models' architectures (tandem/rollout/vllm/client.py): the senior's engine
starts from the junior's directory when the two share an architecture (the paper's pair), from the senior's own
otherwise (a tiny junior beside a larger base), and a process's one service refuses a pair of other
architectures in one line instead of failing at its first weight load. No vLLM: `VLLMService.start` is replaced."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from tandem.rollout import toy
from tandem.rollout.vllm import client


def _save(path, shape: toy.TinyShape, seed: int = 0):
    model = toy.tiny_qwen3(64, seed=seed, shape=shape)
    model.save_pretrained(path)
    return model


SMALL = toy.TinyShape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
WIDE = toy.TinyShape(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)


@pytest.fixture
def dirs(tmp_path):
    base, twin, junior = tmp_path / "base", tmp_path / "twin", tmp_path / "tiny-junior"
    module = _save(base, WIDE)
    _save(twin, WIDE, seed=1)  # other weights, the same architecture
    _save(junior, SMALL)
    return SimpleNamespace(base=base, twin=twin, junior=junior, module=module)


def test_architecture_reads_a_directory_and_a_module_alike(dirs):
    assert client.architecture(dirs.base) == client.architecture(dirs.module)
    assert client.architecture(dirs.base)["hidden_size"] == 64
    assert client.architecture_difference(client.architecture(dirs.base), client.architecture(dirs.twin)) == ""
    diff = client.architecture_difference(client.architecture(dirs.base), client.architecture(dirs.junior))
    assert "hidden_size 64 vs 32" in diff and "num_hidden_layers 2 vs 1" in diff
    with pytest.raises(ValueError, match="no config.json"):
        client.architecture(dirs.base / "missing")


def test_the_senior_engine_starts_from_a_directory_of_its_own_architecture(dirs):
    assert client.senior_start_dir(dirs.base, dirs.twin) == dirs.twin  # one architecture: the junior's directory
    assert client.senior_start_dir(dirs.base, dirs.junior) == dirs.base  # another: the senior's own
    arch = client.architecture(dirs.module)
    assert client.senior_start_dir(None, dirs.twin, arch) == dirs.twin
    with pytest.raises(ValueError, match="no model directory to start its engine from"):
        client.senior_start_dir(None, dirs.junior, arch)


@dataclass
class _Rollout:
    vllm_url: str = ""
    vllm_python: str = "py"
    vllm_host: str = "127.0.0.1"
    vllm_dtype: str = "auto"
    vllm_max_model_len: int = 0
    vllm_start_timeout: float = 1.0


@pytest.fixture
def started(monkeypatch):
    calls = []

    def start(senior_dir, junior_dir, *, roots=(), options=None):
        calls.append((senior_dir, junior_dir))
        return SimpleNamespace(proc=None, owned=True, stop=lambda: None)

    monkeypatch.setattr(client.VLLMService, "start", staticmethod(start))
    monkeypatch.setattr(client, "placement_for", lambda rollout, n: None)
    monkeypatch.setattr(client.LaunchOptions, "from_config", classmethod(lambda cls, r, p: None))
    monkeypatch.setattr(client, "_SHARED", {})
    return calls


def test_one_service_per_process_starts_each_engine_from_its_architecture_and_refuses_another_pair(dirs, started):
    ro = _Rollout()
    svc = client.shared_service(ro, dirs.junior, senior_dir=dirs.base)
    assert started == [(dirs.base, dirs.junior)]
    assert svc.architectures["senior"]["hidden_size"] == 64 and svc.architectures["junior"]["hidden_size"] == 32
    assert client.shared_service(ro, dirs.junior, senior_dir=dirs.base) is svc  # reused: started once
    with pytest.raises(ValueError, match="junior engine of another architecture"):
        client.shared_service(ro, dirs.twin, senior_dir=dirs.twin)  # a (wide, wide) pair on the (wide, small) one


def test_the_papers_pair_starts_both_engines_from_the_junior_directory(dirs, started):
    client.shared_service(_Rollout(), dirs.twin, senior_dir=dirs.base)
    assert started == [(dirs.twin, dirs.twin)]
