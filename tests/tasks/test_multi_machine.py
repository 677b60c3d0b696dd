"""Training across machines (`train.num_machines`, tasks/launch.py): the settings and the environment a machine
reads its place from, the `accelerate launch` command, and the acceptance run on this CPU: two "machines" on
loopback (two stage processes, each launching one gloo worker, on one shared out_root) train one arm; a SIGKILL of
one machine's stage mid-run stops the other with one line; a restart of both resumes from the last checkpoint
and publishes the same checkpoint bytes as an uninterrupted one-machine run of the same two processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.common import read_metrics

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
for p in (TESTS, Path(__file__).parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tandem.config import params_from_dict  # noqa: E402
from tandem.errors import UserError  # noqa: E402
from tasks import launch  # noqa: E402

TWO = {"num_processes": 2, "num_machines": 2, "shared_storage": True}


def test_more_than_one_machine_needs_shared_storage_and_an_even_split():
    with pytest.raises(ValueError, match="need train.shared_storage: true") as e:
        params_from_dict({"train": {"num_processes": 2, "num_machines": 2}})
    with pytest.raises(ValueError, match="must split evenly over train.num_machines"):
        params_from_dict({"train": {"num_processes": 3, "num_machines": 2, "shared_storage": True}})
    p = params_from_dict({"train": TWO})
    assert p.train.num_machines == 2 and params_from_dict({}).train.num_machines == 1
    assert "\n" not in str(e.value)  # one line


def test_a_machine_reads_its_place_from_the_environment():
    p = params_from_dict({"train": TWO})
    one = params_from_dict({"train": {"num_processes": 2}})
    assert launch.machines(one, {"PET_NODE_RANK": "1"}) == launch.Machines(1, 0, "127.0.0.1", 0)  # ignored
    env = {"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.0.0.5", "PET_MASTER_PORT": "29500"}
    assert launch.machines(p, env) == launch.Machines(2, 1, "10.0.0.5", 29500)
    plain = {"NODE_RANK": "0", "MASTER_ADDR": "head", "MASTER_PORT": "1234"}  # e.g. a SLURM job script
    assert launch.machines(p, plain) == launch.Machines(2, 0, "head", 1234)
    assert launch.machines(p, {**plain, "PET_NODE_RANK": "1"}).rank == 1  # torch elastic's name wins
    with pytest.raises(UserError, match="lacks PET_MASTER_ADDR or MASTER_ADDR, PET_MASTER_PORT or MASTER_PORT"):
        launch.machines(p, {"NODE_RANK": "0"})
    with pytest.raises(UserError, match="machine rank '2' must be 0-1"):
        launch.machines(p, {**plain, "NODE_RANK": "2"})
    with pytest.raises(UserError, match="port 'x'"):
        launch.machines(p, {**plain, "MASTER_PORT": "x"})


def test_the_launch_command_names_the_machines(tmp_path, monkeypatch):
    one = launch.launch_command(params_from_dict({"train": {"num_processes": 2}}), tmp_path / "w.json")
    assert one[one.index("--num_machines") + 1] == "1" and "--machine_rank" not in one  # as on one machine
    monkeypatch.setenv("PET_NODE_RANK", "1")
    monkeypatch.setenv("PET_MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("PET_MASTER_PORT", "29500")
    cmd = launch.launch_command(params_from_dict({"train": {**TWO, "num_processes": 4}}), tmp_path / "w.json")
    opt = {k: cmd[cmd.index(k) + 1] for k in ("--num_processes", "--num_machines", "--machine_rank",
                                               "--main_process_ip", "--main_process_port")}
    assert opt == {"--num_processes": "4", "--num_machines": "2", "--machine_rank": "1",
                   "--main_process_ip": "10.0.0.5", "--main_process_port": "29500"}


# --------------------------------------------------------------------------------------------------
# The acceptance run: two machines on loopback, SIGKILL of one, restart, bit-identical
# --------------------------------------------------------------------------------------------------

STEPS, SAVE = 4, 2
MP = {"steps": STEPS, "save_every": SAVE, "group_size": 2, "max_new_tokens": 8, "kl_rows": 2, "val_every": 0,
      "report_to": "none", "num_processes": 2, "updates_per_batch": 2, "micro_batch_size": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine(params: Path, rank: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
    code = (f"import sys; sys.path[:0] = [{str(REPO)!r}]\n"
            f"from tasks.train import main; sys.exit(main([{str(params)!r}]))\n")
    env.update({"WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"})
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers follow the launcher through prctl")
def test_two_machines_on_loopback_resume_bit_identically_after_a_sigkill(tmp_path):
    import test_durable as D
    import test_train_stage as T
    from train_fixtures import alive, descendants

    from tandem.checkpoints import complete_checkpoints

    boxing = T.build_boxing_base(tmp_path / "boxing")
    clean, shared = tmp_path / "one-machine", tmp_path / "shared"
    p_clean = T._project(clean, boxing, **MP)
    p_two = T._project(shared, boxing, **MP, num_machines=2, shared_storage=True)
    ref = T._start(p_clean)  # the same two processes on one machine, uninterrupted

    port = _free_port()
    main, other = _machine(p_two, 0, port), _machine(p_two, 1, port)
    arm_dir = shared / "scratch" / "train" / "tandem"
    deadline, tree = time.time() + 400, []
    while not (arm_dir / f"step-{SAVE}").exists():
        for proc in (main, other):
            assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.time() < deadline, "no checkpoint appeared"
        tree = descendants(other.pid) or tree
        time.sleep(0.02)
    tree = descendants(other.pid) or tree
    other.send_signal(signal.SIGKILL)  # machine 1's stage, with its launcher and worker under it
    other.communicate(timeout=30)
    out, _ = main.communicate(timeout=300)  # machine 0 loses its peer and stops with one message
    assert main.returncode == 1, out[-4000:]
    # (tasks.train.main raises it; the command line prints a WorkerFailedError as this one line, exit 1)
    assert "WorkerFailedError: train: rank 0 of the 2-process run of arm 'tandem' on 2 machines lost a process of " \
           "another machine" in out, out[-4000:]
    end = time.time() + 30
    while any(alive(p) for p in tree) and time.time() < end:
        time.sleep(0.1)
    assert len(tree) >= 2 and not [p for p in tree if alive(p)], "machine 1's workers outlived its stage"
    assert [s for s, _ in complete_checkpoints(arm_dir)][-1] < STEPS
    assert not (shared / "metrics" / "train_tandem.json").exists()
    last = [s for s, _ in complete_checkpoints(arm_dir)][-1]

    port = _free_port()
    main, other = _machine(p_two, 0, port), _machine(p_two, 1, port)
    T._finish(main, timeout=600)
    follower = T._finish(other, timeout=120)
    T._finish(ref, timeout=600)
    assert '"machine_rank": 1' in follower and not (shared / "scratch" / "machines" / "train-tandem-1").exists()

    summary = read_metrics(shared / "metrics" / "train_tandem.json")
    assert summary["world_size"] == 2 and summary["resumed_from"] == f"step-{last}" and summary["steps"] == STEPS
    want = [f"step-{n}" for n in range(SAVE, STEPS + 1, SAVE)]
    ck_one, ck_two = clean / "models" / "checkpoints" / "tandem", shared / "models" / "checkpoints" / "tandem"
    assert [p.name for _, p in complete_checkpoints(ck_two)] == want
    for name in want:  # byte for byte (the path-bearing training_args.bin aside), weights and optimizer included
        assert D._digests(ck_two / name) == D._digests(ck_one / name), name
    assert not list((shared / "scratch").glob(".shared-*"))  # the storage probe is removed
