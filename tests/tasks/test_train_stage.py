"""Stage `train` end to end in subprocesses: outputs, W&B off in tests, and resume after a SIGKILL.

The stage runs exactly as DVC runs it (a fresh interpreter, `tasks.train.main`) on a tiny base and a few
prepared rows. One run goes uninterrupted; another is killed with SIGKILL right after its first checkpoint
(in scratch/train/<arm>/, where runs resume) and rerun: it must finish with the same steps, the same
checkpoints and the same final weights, materialised in the declared output models/checkpoints/<arm>/. The
same holds with two training processes (accelerate launch, gloo on CPU) and two updates per rollout batch,
where the SIGKILL hits the launching stage process and must take its workers down with it.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.common import read_metrics
import yaml

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from params_files import complete_params  # noqa: E402
from train_fixtures import alive, build_base, build_boxing_base, descendants, write_prepared  # noqa: E402

STEPS, SAVE_EVERY = 6, 2


def _params(out_root: Path, **train) -> Path:
    raw = complete_params({
        "seed": 0, "out_root": str(out_root),
        "rollout": {"batch_size": 8},
        "train": {"arms": ["tandem"], "steps": STEPS, "prompts_per_step": 2, "group_size": 4,
                  "max_new_tokens": 12, "save_every": SAVE_EVERY, "learning_rate": 0.01, "warmup_steps": 1,
                  "kl_rows": 4, "report_to": "wandb", "val_every": 3, "val_problems": 4, "cpu_threads": 1,
                  **train},
    })
    path = out_root / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _project(root: Path, base_src: Path, **train) -> Path:
    import shutil

    shutil.copytree(base_src, root / "models" / "base")
    write_prepared(root / "data" / "prepared", n_train=32, n_val=8, answer="7")  # the boxing base hits it half the time
    return _params(root, **train)


def _start(params: Path) -> subprocess.Popen:
    code = (f"import sys; sys.path[:0] = [{str(REPO)!r}]\n"
            f"from tasks.train import main; sys.exit(main([{str(params)!r}]))\n")
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def base_src(tmp_path_factory) -> Path:
    return build_base(tmp_path_factory.mktemp("stage") / "base")


@pytest.fixture(scope="module")
def boxing_src(tmp_path_factory) -> Path:
    return build_boxing_base(tmp_path_factory.mktemp("stage") / "boxing")


def _moved(root: Path, step: int) -> bool:
    """Whether training changed the senior (a base that never earns a reward would pass resume checks vacuously)."""
    from tandem.models import load_model
    from tandem.train import weights_hash

    return (weights_hash(load_model(root / "models" / "checkpoints" / "tandem" / f"step-{step}"))
            != weights_hash(load_model(root / "models" / "base")))


@pytest.mark.slow
def test_stage_resumes_after_sigkill_like_an_uninterrupted_run(boxing_src, tmp_path):
    from tandem.models import load_model
    from tandem.checkpoints import complete_checkpoints
    from tandem.train import weights_hash

    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    p_clean, p_crash = _project(clean, boxing_src), _project(crashed, boxing_src)
    ref = _start(p_clean)

    # Kill the second run with SIGKILL as soon as its first checkpoint is committed (mid-run).
    victim = _start(p_crash)
    arm_dir = crashed / "scratch" / "train" / "tandem"
    deadline = time.time() + 240
    while not (arm_dir / f"step-{SAVE_EVERY}").exists():
        assert victim.poll() is None, victim.communicate()[0][-4000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    assert [s for s, _ in complete_checkpoints(arm_dir)][-1] < STEPS  # it really stopped mid-run
    assert not (crashed / "metrics" / "train_tandem.json").exists()
    assert not (crashed / "models" / "checkpoints" / "tandem").exists()  # the output appears only when complete

    _finish(ref)
    _finish(_start(p_crash))

    want = [f"step-{n}" for n in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)]
    summaries = {}
    for root in (clean, crashed):
        ck = root / "models" / "checkpoints" / "tandem"
        assert [p.name for _, p in complete_checkpoints(ck)] == want
        assert not [p for p in ck.iterdir() if p.name.startswith(("checkpoint-", ".old-"))]
        s = read_metrics(root / "metrics" / "train_tandem.json")
        summaries[root.name] = s
        assert s["steps"] == STEPS and s["junior_unchanged"] and s["loss_finite"] and s["checkpoints"] == want
        with open(root / "metrics" / "plots" / "train" / "tandem.csv") as f:
            table = list(csv.DictReader(f))
        assert [int(r["step"]) for r in table] == list(range(1, STEPS + 1))
        assert all(r["senior_fraction"] for r in table) and "time_step" not in table[0]
        with open(root / "metrics" / "plots" / "train" / "tandem.timing.csv") as f:  # step times beside it
            assert [bool(r["time_step"]) for r in csv.DictReader(f)] == [True] * STEPS
        assert [r["val_accuracy"] != "" for r in table] == [s % 3 == 0 for s in range(1, STEPS + 1)]
    assert summaries["clean"]["resumed_from"] is None
    assert summaries["crashed"]["resumed_from"] in {f"step-{n}" for n in range(SAVE_EVERY, STEPS, SAVE_EVERY)}
    # Deterministic resume: rollouts are seeded by step, data order and RNG come back from the checkpoint.
    a = load_model(clean / "models" / "checkpoints" / "tandem" / f"step-{STEPS}")
    b = load_model(crashed / "models" / "checkpoints" / "tandem" / f"step-{STEPS}")
    assert weights_hash(a) == weights_hash(b) and _moved(clean, STEPS)
    assert 0.0 < summaries["clean"]["reward_mean"] < 1.0
    assert summaries["clean"]["reward_mean"] == pytest.approx(summaries["crashed"]["reward_mean"])


MP_STEPS, MP_SAVE = 4, 2
MP = {"steps": MP_STEPS, "save_every": MP_SAVE, "group_size": 2, "max_new_tokens": 8, "kl_rows": 2, "val_every": 0,
      "report_to": "none", "num_processes": 2, "updates_per_batch": 2, "micro_batch_size": 1}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers follow the launcher through prctl")
def test_two_process_stage_resumes_after_sigkill_of_the_launcher(boxing_src, tmp_path):
    """2 processes x 2 updates per batch: the killed stage takes its workers down, the rerun resumes and ends
    with the weights of an uninterrupted 2-process run; metrics record world_size 2."""
    from tandem.models import load_model
    from tandem.checkpoints import complete_checkpoints
    from tandem.train import weights_hash

    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    p_clean, p_crash = _project(clean, boxing_src, **MP), _project(crashed, boxing_src, **MP)
    _finish(_start(p_clean), timeout=600)

    victim = _start(p_crash)
    arm_dir = crashed / "scratch" / "train" / "tandem"
    deadline, tree = time.time() + 400, []
    while not (arm_dir / f"step-{MP_SAVE}").exists():
        assert victim.poll() is None, victim.communicate()[0][-4000:]
        assert time.time() < deadline, "no checkpoint appeared"
        tree = descendants(victim.pid) or tree
        time.sleep(0.02)
    tree = descendants(victim.pid) or tree
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=30)
    assert len(tree) >= 3  # accelerate's launcher and its two workers
    end = time.time() + 30
    while any(alive(p) for p in tree) and time.time() < end:
        time.sleep(0.1)
    assert not [p for p in tree if alive(p)], "workers outlived the killed stage"
    assert [s for s, _ in complete_checkpoints(arm_dir)][-1] < MP_STEPS
    assert not (crashed / "metrics" / "train_tandem.json").exists()

    _finish(_start(p_crash), timeout=600)
    want = [f"step-{n}" for n in range(MP_SAVE, MP_STEPS + 1, MP_SAVE)]
    summaries = {}
    for root in (clean, crashed):
        ck = root / "models" / "checkpoints" / "tandem"
        assert [p.name for _, p in complete_checkpoints(ck)] == want
        assert not [p for p in ck.iterdir() if p.name.startswith(("checkpoint-", ".old-"))]
        # the ranks' RNG snapshots stay in the resume copy; the published copy leaves them out (PROCESS_STATE)
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (root / "scratch" / "train" / "tandem" /
                                                                         want[-1]).iterdir()}
        assert not [p for p in (ck / want[-1]).iterdir() if p.name.startswith("rng_state")]
        state = json.loads((ck / want[-1] / "tandem_state.json").read_text())
        assert state["step"] == MP_STEPS and state["optimizer_updates"] == 2 * MP_STEPS
        s = read_metrics(root / "metrics" / "train_tandem.json")
        summaries[root.name] = s
        assert s["world_size"] == 2 and s["steps"] == MP_STEPS and s["loss_finite"] and s["junior_unchanged"]
        with open(root / "metrics" / "plots" / "train" / "tandem.csv") as f:
            assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, MP_STEPS + 1))
    assert summaries["crashed"]["resumed_from"] == f"step-{MP_SAVE}"
    a = load_model(clean / "models" / "checkpoints" / "tandem" / f"step-{MP_STEPS}")
    b = load_model(crashed / "models" / "checkpoints" / "tandem" / f"step-{MP_STEPS}")
    assert weights_hash(a) == weights_hash(b) and _moved(clean, MP_STEPS)
    assert 0.0 < summaries["clean"]["reward_mean"] < 1.0


def test_default_io_declares_every_arm(tmp_path):
    from tandem.config import params_from_dict
    from tasks.train import default_io

    params = params_from_dict({"out_root": str(tmp_path), "train": {"arms": ["tandem", "grpo_g16"]}})
    inputs, outputs = default_io(params)
    assert inputs["base_model"] == tmp_path / "models" / "base"
    assert outputs["metrics_grpo_g16"] == tmp_path / "metrics" / "train_grpo_g16.json"
    assert outputs["plot_tandem"] == tmp_path / "metrics" / "plots" / "train" / "tandem.csv"
    assert outputs["checkpoints"] == tmp_path / "models" / "checkpoints"


def test_missing_inputs_fail_clearly(tmp_path, base_src):
    import shutil

    from tandem.config import params_from_dict
    from tasks.train import run

    params = params_from_dict({"out_root": str(tmp_path), "train": {"arms": ["grpo"], "report_to": "none"}})
    with pytest.raises(FileNotFoundError, match="models/base|does not exist"):
        run(params)
    shutil.copytree(base_src, tmp_path / "models" / "base")
    with pytest.raises(FileNotFoundError, match="prepare stage"):
        run(params)


def test_num_processes_launches_accelerate_and_a_failure_fails_the_stage(tmp_path, monkeypatch):
    import tasks.launch as launcher
    import tasks.train as stage
    from tandem.config import params_from_dict

    params = params_from_dict({"out_root": str(tmp_path), "train": {"arms": ["tandem"], "num_processes": 2,
                                                                    "report_to": "none"}})
    cmd = launcher.launch_command(params, tmp_path / "spec.json")
    assert cmd[1:4] == ["-m", "tasks.train", "--launch"] and "--multi_gpu" in cmd  # accelerate's launcher, wrapped
    assert cmd[cmd.index("--num_processes") + 1] == "2"
    assert cmd[-3:] == ["tasks.train", "--worker", str(tmp_path / "spec.json")]

    inputs, outputs = stage.default_io(params)
    seen = {}
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launcher, "launch_command", lambda p, spec: seen.update(spec=json.loads(spec.read_text()))
                        or [sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(RuntimeError, match="exit status 3"):
        stage.run_arm(params, "tandem", inputs, outputs)  # the entry of the CLI, dvc.yaml and the Prefect flow
    assert seen["spec"]["arm"] == "tandem" and seen["spec"]["params"]["train"]["num_processes"] == 2

    monkeypatch.setenv("WORLD_SIZE", "3")  # launched by hand with a count that is not train.num_processes
    with pytest.raises(RuntimeError, match="train.num_processes"):
        stage.run_arm(params, "tandem", inputs, outputs)
    if not __import__("torch").cuda.is_available():
        monkeypatch.delenv("WORLD_SIZE")
        fsdp = params_from_dict({"out_root": str(tmp_path), "train": {"num_processes": 2, "sharding": "fsdp"}})
        with pytest.raises(ValueError, match="needs GPUs"):
            stage.run_arm(fsdp, "tandem", inputs, outputs)
