"""The memory plan: model shapes, the activation table against autograd's saved tensors, the paper preset on
8 x 80 GB, the refusal before any work, precision flags, and the plan against the measured peak of a CPU step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.config import ARMS, params_from_dict
from tandem.plan import (GIB, KNOWN_SHAPES, ModelShape, PlanError, activation_bytes_per_token, arm_group_and_beta,
                         VLLM_OVERHEAD_GIB, check_fits, check_node_gpus, gpus_needed, model_shape, plan_all,
                         plan_train_arm, shape_from_config)
from tandem.precision import load_dtypes, trainer_precision_kwargs

REPO = Path(__file__).resolve().parents[1]
NEW_TRAIN_KEYS = ("num_processes", "micro_batch_size", "updates_per_batch", "gradient_checkpointing", "precision",
                  "sharding", "gpu_memory_gib", "max_prompt_tokens")


def _params(path: str, **train):
    raw = yaml.safe_load((REPO / path).read_text())
    raw["train"].update(train)
    return params_from_dict(raw)


def _qwen3_config(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(**{"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
                          "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                          "head_dim": 128, "tie_word_embeddings": True, **kw})


# --------------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------------

def test_qwen3_4b_parameter_count_equals_transformers_model():
    import torch
    from transformers import Qwen3ForCausalLM

    shape = ModelShape(**KNOWN_SHAPES["Qwen/Qwen3-4B-Instruct-2507"])
    with torch.device("meta"):
        model = Qwen3ForCausalLM(_qwen3_config())
    assert shape.n_params == sum(p.numel() for p in model.parameters()) == 4_022_468_096
    assert shape_from_config(_qwen3_config().to_dict()) == shape  # config.json and the table agree


def test_shape_sources(tmp_path):
    tiny = params_from_dict({"model": {"source": "tiny", "hidden_size": 96, "num_layers": 2, "num_heads": 4,
                                       "head_dim": 0}})
    s = model_shape(tiny)
    assert (s.hidden, s.layers, s.head_dim, s.tied) == (96, 2, 24, True)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_qwen3_config(num_hidden_layers=5).to_dict()))
    assert model_shape(tiny, d).layers == 5  # the directory's config.json wins
    (d / "tandem_source.json").write_text(json.dumps({"source": "tiny"}))
    hub = params_from_dict({"model": {"source": "hub"}})
    assert model_shape(hub, d).layers == 36  # a tiny base left in the dir does not stand in for the hub model
    with pytest.raises(PlanError, match="built-in table"):
        model_shape(params_from_dict({"model": {"source": "hub", "hub_id": "someone/unknown"}}))


def test_arm_table_matches_training():
    from tandem.train import arm_spec

    p = params_from_dict({"train": {"arms": list(ARMS)}})
    for arm in ARMS:
        spec = arm_spec(arm, p.train, p.rollout)
        assert arm_group_and_beta(arm, p.train) == (spec.group_size, spec.beta)


# --------------------------------------------------------------------------------------------------
# Activations: the per-layer table against what autograd really saves
# --------------------------------------------------------------------------------------------------

def _saved_bytes(layers: int, autocast: bool, rows: int = 2, seq: int = 96) -> tuple[int, int]:
    """Bytes of distinct non-parameter storages autograd saves in a padded forward; (bytes, tokens)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=160, intermediate_size=448, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=40, max_position_embeddings=seq)
    model = Qwen3ForCausalLM(cfg).train()
    ids = torch.randint(0, 512, (rows, seq))
    attn = torch.ones(rows, seq, dtype=torch.long)
    attn[0, seq - 10:] = 0
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model.model(input_ids=ids, attention_mask=attn)
    return sum(seen.values()), rows * seq


@pytest.mark.parametrize("autocast", [False, True])
def test_activation_table_matches_saved_tensors(autocast):
    # per layer = difference between a 3-layer and a 1-layer model, so embedding/mask/rope terms cancel
    b3, n = _saved_bytes(3, autocast)
    b1, _ = _saved_bytes(1, autocast)
    shape = ModelShape(hidden=160, layers=1, heads=4, kv_heads=2, head_dim=40, intermediate=448, vocab=512,
                       tied=True)
    per_layer = (b3 - b1) / 2
    if autocast:  # autocast also saves each linear weight's bf16 cast: a per-weight, not per-token, term
        per_layer -= 2 * shape.layer_linear_params
    predicted = activation_bytes_per_token(shape, autocast) * n
    assert abs(predicted - per_layer) / per_layer < 0.05, (predicted, per_layer)


# --------------------------------------------------------------------------------------------------
# Presets, refusal, CLI
# --------------------------------------------------------------------------------------------------

def test_params_files_list_the_plan_settings():
    for f in ("params.yaml", "params.paper.yaml"):
        train = yaml.safe_load((REPO / f).read_text())["train"]
        assert set(NEW_TRAIN_KEYS) <= set(train), f"{f} lacks {set(NEW_TRAIN_KEYS) - set(train)}"


def test_paper_preset_fits_eight_80gb_gpus():
    p = _params("params.paper.yaml")
    assert p.train.updates_per_batch == 2 and p.train.precision == "bf16_mixed"
    res = plan_all(p, device="cuda", node_gpus=8)
    assert res["fits"] and res["gpus"] == res["gpus_needed"] == 8 and res["per_gpu_gib"] <= 80
    for arm, pj in res["train"].items():
        assert pj["fits"] and not pj["checks"], arm
    # the same preset as first written (one 128-row pass, no checkpointing, one GPU, bf16 weights) is far over
    bad = _params("params.paper.yaml", num_processes=1, micro_batch_size=0, gradient_checkpointing=False,
                  sharding="none", updates_per_batch=1)
    assert plan_all(bad, device="cuda")["per_gpu_gib"] > 1000


def test_more_memory_means_more_gib_never_less():
    base = _params("params.paper.yaml")
    shape = model_shape(base)
    def total(plan):  # peak = persistent + max(rollout, training); a smaller term may hide behind the larger
        return sum(plan.persistent.values()) + sum(plan.rollout.values()) + plan.training_phase_bytes

    ref = plan_train_arm(base, "tandem", shape)
    for change in ({"micro_batch_size": 2}, {"gradient_checkpointing": False},
                   {"num_processes": 4}, {"max_new_tokens": 4000}):
        new = plan_train_arm(_params("params.paper.yaml", **change), "tandem", shape)
        assert new.peak_bytes >= ref.peak_bytes, change
        assert total(new) > total(ref), change


def test_refusal_names_what_to_change():
    bad = _params("params.paper.yaml", micro_batch_size=8, gradient_checkpointing=False)
    with pytest.raises(PlanError) as e:
        check_fits(bad, "train", device="cuda")
    msg = str(e.value)
    assert "does not fit" in msg and "gradient_checkpointing" in msg and "micro_batch_size" in msg
    assert check_fits(_params("params.paper.yaml"), "train", device="cuda")["tandem"]["fits"]


def _fake_qwen3_4b_dir(tmp_path: Path) -> Path:
    """Qwen3-4B's config.json next to a well-formed weights file holding one 1-element tensor (the directory
    passes the pre-load file checks), so any attempt to load the model fails."""
    import torch
    from safetensors.torch import save_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(_qwen3_config().to_dict()))
    save_file({"x": torch.zeros(1)}, str(base / "model.safetensors"))
    (base / "tokenizer.json").write_text("{}")
    return base


def test_train_stage_refuses_before_loading_anything(tmp_path):
    """A base dir whose weights hold no model: loading it would fail, so the plan error proves it came first."""
    from tasks.train import run_arm

    base = _fake_qwen3_4b_dir(tmp_path)
    for name in ("train", "val"):
        (tmp_path / f"{name}.jsonl").write_text('{"id": "1", "prompt": "p", "answer": "1"}\n')
    p = _params("params.paper.yaml", micro_batch_size=8, gradient_checkpointing=False, arms=["tandem"])
    inputs = {"base_model": base, "train_data": tmp_path / "train.jsonl", "val_data": tmp_path / "val.jsonl"}
    with pytest.raises(PlanError, match="train.gradient_checkpointing"):
        run_arm(p, "tandem", inputs, {"checkpoints": tmp_path / "ck", "runs": tmp_path / "runs"})
    assert not (tmp_path / "ck").exists()


def test_evaluate_refuses_a_batch_whose_kv_cache_does_not_fit(tmp_path):
    from tasks.evaluate import plan as evaluate_units

    base = _fake_qwen3_4b_dir(tmp_path)
    raw = yaml.safe_load((REPO / "params.paper.yaml").read_text())
    raw["rollout"]["backend"] = "hf"
    raw["evaluate"]["batch_size"] = 100_000  # 100k rows x 4k tokens of KV: over any machine's memory
    with pytest.raises(PlanError, match="evaluate.batch_size"):
        evaluate_units(params_from_dict(raw), {"base_model": base, "checkpoints": tmp_path / "ck",
                                               "eval_data": tmp_path / "eval"})


def test_cli_plan_json_for_the_paper_preset():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "cli", "plan", "--params", "params.paper.yaml", "--json"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert res["fits"] is True and res["per_gpu_gib"] <= 80 and res["gpus"] == 8
    assert {"persistent_gib", "rollout_gib", "training_gib"} <= set(res["train"]["tandem"])
    ro = res["rollout"]  # both engines beside the trainer: 16 rows per engine, weight-bound steps
    assert ro["layout"] == "shared" and ro["rollout_gpus"] == ro["trainer_gpus"] == 8
    assert ro["rows_per_engine"] == 16 <= ro["resident_rows"] and ro["admission_waves"] == 1
    # weight-bound steps: below one GPU per model's; the figure itself is pinned against the premises file's
    # formulas by test_the_plans_layouts_recomputed_from_the_premises_file
    assert 0.0 < ro["predicted_tandem_over_solo"] < res["layouts"]["layouts"]["dedicated"]["predicted_tandem_over_solo"]


def test_cli_plan_prints_the_dedicated_rollout_layout():
    """params.paper-dedicated.yaml on one 8-GPU node: a rollout service with one GPU per model holding a step's 128
    rows resident, the trainer's 4 GPUs free of engines; the JSON line and the table both carry the layout, the
    GPUs the run needs and the ratio."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "cli", "plan", "--params", "params.paper-dedicated.yaml", "--gpus", "8"]
    out = subprocess.run(cmd + ["--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    ro = res["rollout"]
    assert res["fits"] is True and ro["layout"] == "dedicated" and ro["rollout_gpus"] == 2 and ro["trainer_gpus"] == 4
    assert res["gpus_needed"] == 6
    assert ro["rows_per_engine"] == 128 and ro["resident_rows"] >= 128 and ro["admission_waves"] == 1
    assert ro["gpu"] == "H200" and ro["engine_steps_per_token"]["solo"] == 1.0
    assert 0.5 < ro["predicted_tandem_over_solo"] < 1.0 and ro["rows_per_call"] == 128  # a step's rows, one call
    assert ro["engine_devices"] == {"senior": [4], "junior": [5]}
    assert "predicted_tandem_over_solo_per_call" not in ro
    assert "vllm_engines" not in res["train"]["tandem"]["persistent_gib"]
    text = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120).stdout
    assert "rollout: layout dedicated" in text and "rows resident" in text and "predicted tandem/solo" in text
    assert "senior's engine on GPU 4" in text and "junior's on GPU 5" in text and "not run" not in text
    assert "GPUs: the run needs 6 on one node (the node has 8)" in text
    # a node with fewer GPUs than the layout needs: one line, exit code 2
    short = subprocess.run(cmd[:-1] + ["5"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert short.returncode == 2 and short.stdout == ""
    assert short.stderr.strip() == (
        "plan: the run needs 6 GPUs on one node (train.num_processes 4, the rollout service on GPU(s) 4,5) but "
        "--gpus says the node has 5: lower train.num_processes (an update's rows, prompts_per_step x group_size / "
        "updates_per_batch, do not depend on it) or move rollout.vllm_devices")


def test_both_paper_presets_fit_one_eight_gpu_node_with_the_papers_update_batch():
    """Both presets run on one node of 8 GPUs, and each optimizer update sees the paper's mini-batch: 8 prompts
    x 8 samples = 64 rows, 2 updates per step of 16 prompts."""
    from tandem.geometry import BatchGeometry

    for name, need in (("params.paper.yaml", 8), ("params.paper-dedicated.yaml", 6)):
        p = _params(name)
        assert gpus_needed(p) == need and check_node_gpus(p, 8) == need, name
        geo = BatchGeometry.of(p.train)
        assert geo.rollout_rows == 128 and geo.updates == 2, name
        assert geo.processes * geo.rows_per_update == 64, name  # rows the optimizer sees per update
        with pytest.raises(PlanError, match=f"needs {need} GPUs on one node"):
            check_node_gpus(p, need - 1)
    # the dedicated layout's GPUs: past the trainer's, a device that overlaps it is refused in one line
    raw = yaml.safe_load((REPO / "params.paper-dedicated.yaml").read_text())
    raw["rollout"]["vllm_devices"] = [6, 9]
    assert gpus_needed(params_from_dict(raw)) == 10
    raw["rollout"]["vllm_devices"] = [3, 4]
    with pytest.raises(PlanError, match="names GPU 3, one of the trainer's"):
        gpus_needed(params_from_dict(raw))
    raw["rollout"]["vllm_devices"] = []  # empty: the two GPUs after the trainer's
    assert gpus_needed(params_from_dict(raw)) == 6
    # without vLLM, or in the shared layout, the trainer's GPUs are all the run needs
    raw["rollout"]["backend"] = "hf"
    assert gpus_needed(params_from_dict(raw)) == 4


def test_dedicated_layout_plans_a_step_of_rows_per_engine_and_starts_its_own_service():
    raw = yaml.safe_load((REPO / "params.paper-dedicated.yaml").read_text())
    p = params_from_dict(raw)
    shape = model_shape(p)
    plan = plan_train_arm(p, "tandem", shape, device="cuda")
    assert "vllm_engines" not in plan.persistent and any("holds all 128 rows" in n for n in plan.notes)
    # an engine that cannot hold the step's rows: refused, the advice names a share of one GPU per engine
    raw["rollout"]["vllm_gpu_memory"] = 0.3
    short = plan_train_arm(params_from_dict(raw), "tandem", shape, device="cuda")
    assert not short.fits and any("one GPU per engine" in c for c in short.checks), short.checks
    # no service to attach: the main process starts one on rollout.vllm_devices (tandem.rollout.placement)
    assert check_fits(p, "train", device="cuda")["tandem"]["fits"]
    raw["rollout"].update(vllm_gpu_memory=0.9, vllm_url="http://node7:8471")
    assert check_fits(params_from_dict(raw), "train", device="cuda")["tandem"]["fits"]
    # a share of half a GPU or more is for one GPU per engine only
    raw["rollout"]["vllm_layout"] = "shared"
    with pytest.raises(ValueError, match="vllm_layout shared"):
        params_from_dict(raw)


# --------------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------------

def test_precision_flags_and_load_dtypes():
    mixed = params_from_dict({"train": {"precision": "bf16_mixed"}}).train
    fp32 = params_from_dict({"train": {"precision": "fp32"}}).train
    assert trainer_precision_kwargs(mixed, "cuda", "bfloat16") == {
        "bf16": True, "fp16": False, "model_init_kwargs": {"dtype": "bfloat16"}}
    assert trainer_precision_kwargs(mixed, "cpu", "bfloat16")["bf16"] is False  # no CPU autocast
    assert trainer_precision_kwargs(fp32, "cuda", "float32")["bf16"] is False
    # fp32 master weights whatever the stored dtype; the frozen junior keeps model.dtype
    assert load_dtypes(mixed, "bfloat16", "cuda") == ("float32", "bfloat16")
    assert load_dtypes(fp32, "float64", "cpu") == ("float64", "float64")


# --------------------------------------------------------------------------------------------------
# The plan against a measured step
# --------------------------------------------------------------------------------------------------

PROBE = dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, vocab=4096, rows=4, prompt=128,
             completion=384)


def _measure(checkpointing: bool) -> int:
    args = [str(PROBE[k]) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "rows",
                                     "prompt", "completion")] + [str(int(checkpointing))]
    # freed tensors must go back to the OS, or the measured step would reuse the first step's memory unseen
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(REPO / "tests" / "memory_probe.py"), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["step_peak_bytes"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_matches_measured_peak_of_a_cpu_step(checkpointing):
    p = params_from_dict({
        "model": {"source": "tiny", "hidden_size": PROBE["hidden"], "num_layers": PROBE["layers"],
                  "num_heads": PROBE["heads"], "num_kv_heads": PROBE["kv_heads"], "head_dim": 0,
                  "intermediate_size": PROBE["intermediate"], "vocab_size": PROBE["vocab"]},
        "train": {"arms": ["grpo"], "prompts_per_step": 1, "group_size": PROBE["rows"],
                  "micro_batch_size": PROBE["rows"], "max_prompt_tokens": PROBE["prompt"],
                  "max_new_tokens": PROBE["completion"], "gradient_checkpointing": checkpointing}})
    plan = plan_train_arm(p, "grpo", model_shape(p), device="cpu")
    measured = _measure(checkpointing)
    ratio = plan.training_phase_bytes / measured
    print(f"checkpointing={checkpointing}: plan {plan.training_phase_bytes / 2**20:.1f} MiB, "
          f"measured {measured / 2**20:.1f} MiB, ratio {ratio:.3f}")
    assert 0.75 <= ratio <= 1.25, (plan.training, measured)
    assert plan.training_phase_bytes > 100 * 2**20  # big enough that allocator noise is small
    assert GIB > plan.training_phase_bytes


def test_vllm_backend_on_a_cpu_plans_the_cpu_engines_instead_of_refusing():
    """vLLM's CPU build (`make vllm-env`) serves the rollout on a CPU: each engine holds its bf16 weights, a KV
    cache of rollout.vllm_cpu_kv_cache_gb and its runtime, counted against the machine's RAM."""
    raw = yaml.safe_load((REPO / "params.real.yaml").read_text())
    raw["rollout"].update(backend="vllm", vllm_cpu_kv_cache_gb=1)
    p = params_from_dict(raw)
    shape = ModelShape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49_152,
                       tied=True, source="SmolLM2-135M")
    plan = plan_train_arm(p, "tandem", shape, device="cpu")
    engine = shape.n_params * 2 + 1 * GIB + VLLM_OVERHEAD_GIB * GIB
    assert plan.persistent["vllm_engines"] == pytest.approx(2 * engine)
    assert not plan.checks, plan.checks
    assert any(n.startswith("vLLM KV cache holds") for n in plan.notes), plan.notes
    raw["train"]["max_new_tokens"] = 60_000  # one sequence's KV cache outgrows 1 GiB: refused, naming the knob
    tight = plan_train_arm(params_from_dict(raw), "tandem", shape, device="cpu")
    assert any("rollout.vllm_cpu_kv_cache_gb" in c for c in tight.checks), tight.checks


def test_vllm_kv_for_every_row_at_full_length_or_a_failed_tandem_plan_naming_layouts():
    """Both engines must hold rows x (prompt + max_new_tokens): a tandem plan that does not is refused with the
    layouts that fit; a solo arm only notes it (rows wait for free slots, no parked sessions)."""
    p = _params("params.paper.yaml", num_processes=1, sharding="none")  # 128 rows on one GPU: 73.8 GiB of KV per engine
    shape = model_shape(p)
    tandem = plan_train_arm(p, "tandem", shape, device="cuda")
    msg = " ".join(tandem.checks)
    assert not tandem.fits and "vLLM KV cache holds" in msg and "of the 128 rows" in msg
    assert "layouts that fit" in msg and "rows per call" in msg and "capped at" in msg
    grpo = plan_train_arm(p, "grpo", shape, device="cuda")
    assert not any("vLLM KV" in c for c in grpo.checks)
    assert any("vLLM KV cache holds" in n and "solo rollouts" in n for n in grpo.notes)
    ok = plan_train_arm(_params("params.paper.yaml"), "tandem", shape, device="cuda")  # 16 rows per process
    assert not any("vLLM KV" in c for c in ok.checks) and any("holds all 16 rows" in n for n in ok.notes)


@pytest.mark.parametrize("record", ["h200-mid.json", "h200-qwen3-4b.json"])
def test_plan_matches_the_step_measured_on_an_h200(record):
    """The plan's training step against the CUDA memory that scripts/gpu_check_bare.py measured on an H200 (the
    records in docs/gpu/: two bf16_mixed tandem GRPO steps of a ~220M and a Qwen3-4B-shaped model): the plan is
    recomputed from the record's shape and batch with the current code, so a change to the plan is checked
    against a real GPU step, within the script's tolerance."""
    import importlib.util

    from tandem.plan import model_shape, plan_train_arm

    spec = importlib.util.spec_from_file_location("gpu_check_bare", REPO / "scripts" / "gpu_check_bare.py")
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)
    lines = json.loads((REPO / "docs" / "gpu" / record).read_text())
    start = lines[0]
    checks = {ln["check"]: ln for ln in lines if "check" in ln}
    train, memory = checks["tandem GRPO steps (bf16_mixed)"], checks["memory plan vs measured CUDA step peak"]
    assert start["device"] == "cuda" and "H200" in start["gpu"] and memory["steps_measured"] == 2
    sz = g.sizes(False, start.get("shape", "mid"))
    params = g.make_params("cpu", sz, train["seq_tokens"] - sz["train"]["max_new_tokens"])
    shape = model_shape(params)
    assert shape.n_params == train["n_params"]  # the record's model is the one planned here
    plan = plan_train_arm(params, "tandem", shape, device="cuda")
    plan_step = plan.peak_bytes - sum(plan.persistent.values())
    lo, hi = g.TOLERANCE
    assert lo <= plan_step / 2**20 / memory["measured_step_mib"] <= hi
    # what the step started from (weights, AdamW moments, junior) is the plan's persistent part less its margin
    assert abs(memory["plan_base_mib"] / memory["measured_base_mib"] - 1) < 0.1


def test_the_trainer_runs_the_optimizer_the_plan_prices(tmp_path):
    """GRPOConfig gets precision.OPTIMIZER (fused AdamW: no temporary copy of the weights), and the plan's CUDA
    optimizer step is then the gradients alone."""
    from tandem.plan import model_shape, plan_train_arm
    from tandem.precision import OPTIMIZER
    from tandem.train.run import ArmRun
    from tandem.train.trainer import grpo_config

    params = params_from_dict({"model": {"source": "tiny"}, "train": {"arms": ["tandem"], "steps": 2,
                                                                       "save_every": 2}})
    run = ArmRun("tandem", None, None, None, [], params.train, params.rollout, tmp_path / "tandem")
    assert OPTIMIZER == "adamw_torch_fused" and grpo_config(run).optim == OPTIMIZER
    shape = model_shape(params)
    plan = plan_train_arm(params, "tandem", shape, device="cuda")
    assert plan.training["optimizer_step"] == shape.n_params * 4  # float32 gradients, nothing else


def _naive_waves(rows: int, room: float, row_bytes: float) -> list[int]:
    fit = int(room // row_bytes)
    return [fit] * (rows // fit) + ([rows % fit] if rows % fit else [])


def _naive_call(prem: dict, shape: ModelShape, gpu, layout: str, rows: int, new: int, prompt: int,
                share: float) -> tuple:
    """(tandem s, solo s) of one call of `rows` rows: its admission waves (resident rows at `share` of the GPU,
    less the bf16 weights and 1.5 GiB) one after the other, each priced by `_naive_rollout`."""
    fixed, row_bytes = 2 * shape.n_params + 1.5 * GIB, (prompt + new) * shape.kv_bytes_per_token(2)
    mem = (140 if gpu.name == "H200" else 80) * GIB  # train.gpu_memory_gib of the presets
    tw = _naive_waves(rows, share * mem - fixed, row_bytes)
    solo_rows, solo_room = (rows, 2 * share * mem - fixed) if layout == "shared" else (-(-rows // 2),
                                                                                       share * mem - fixed)
    sw = _naive_waves(solo_rows, solo_room, row_bytes)
    tandem = sum(_naive_rollout(prem, shape, gpu, layout, n, new, prompt)[0] for n in tw)
    solo = sum(_naive_rollout(prem, shape, gpu, "shared", n, new, prompt)[1] for n in sw)  # rows on one GPU
    return tandem, solo


def _naive_rollout(prem: dict, shape: ModelShape, gpu, layout: str, rows: int, new: int, prompt: int) -> tuple:
    """(tandem s, solo s) of `rows` resident rows recomputed from the premises file's figures by the formulas of
    docs/rollout.md ("The GPU prediction"), written out without the library's pricing functions (solo: `rows` on
    each GPU when shared, half of them when dedicated)."""
    P, kv, bw, fl = shape.n_params, shape.kv_bytes_per_token(2), gpu.bandwidth, gpu.flops
    ctx, cpu = prompt + new / 2, prem["cpu_seconds"]
    parts = []
    for role in ("senior", "junior"):
        e = prem["engines"][role]
        k = rows / e["steps_per_row_token"]
        r, comp, chunks = k * e["rows_per_token"], k * e["computed_per_token"], k * e["chunks_per_token"]
        g = max(2 * P / bw + r * ctx * kv / bw, 2 * P * comp / fl)
        f = gpu.launch_gap + r * cpu["sched_per_row_tandem"] + chunks * cpu["per_chunk"]
        parts.append((new * e["steps_per_row_token"], g, f))
    if layout == "shared":
        t = sum(n * g for n, g, _ in parts) + max(n * f for n, _, f in parts)
    else:
        t = max(n * (g + f) for n, g, f in parts)
    t = max(t, rows * new * cpu["frontend_per_token"])
    s = prem["engines"]["solo"]
    solo_rows = rows if layout == "shared" else -(-rows // 2)
    k = solo_rows / s["steps_per_row_token"]
    step = max(2 * P / bw + k * s["rows_per_token"] * ctx * kv / bw, 2 * P * k * s["computed_per_token"] / fl,
               k * s["rows_per_token"] * cpu["sched_per_row_solo"])
    return t, new * s["steps_per_row_token"] * step


@pytest.mark.parametrize("preset", ["params.paper.yaml", "params.paper-dedicated.yaml"])
def test_the_plans_layouts_recomputed_from_the_premises_file(preset):
    """Both presets on an 8-GPU node: for each layout the plan's GPUs, rollout seconds per step, training seconds,
    trainer idle seconds, seconds per step and tandem/solo equal the formulas over the committed premises file's
    figures (tandem/rollout/premises.json), and the recommended layout is the one with the fewest seconds per
    step. The params' own layout is priced as it stands; the other at the paper presets' share with the most
    training processes the node leaves."""
    from tandem.plan import plan_all
    from tandem.rollout.cost import GPUS, PREMISES_FILE

    prem = json.loads(PREMISES_FILE.read_text())
    p = _params(preset)
    res = plan_all(p, REPO / "no-model-dir", "cuda", node_gpus=8)
    shape = ModelShape(**KNOWN_SHAPES[p.model.hub_id])
    gpu = GPUS["h100" if p.train.gpu_memory_gib == 80 else "h200"]
    t = p.train
    rows_per_step = t.prompts_per_step * t.group_size
    # either preset: the other layout at the paper presets' share (LAYOUT_SHARE), the same as its own
    expect = {"shared": {"trainer": 8, "gpus": 8, "rows": rows_per_step // 8, "share": 0.3},
              "dedicated": {"trainer": 4, "gpus": 6, "rows": rows_per_step, "share": 0.9}}
    c = res["layouts"]
    assert c["node_gpus"] == 8
    for layout, e in expect.items():
        got = c["layouts"][layout]
        assert got["gpus"] == e["gpus"] and got["trainer_gpus"] == e["trainer"] and got["vllm_gpu_memory"] == e["share"]
        assert got["rows_per_call"] == e["rows"] and got["calls_per_step"] == 1
        tandem_s, solo_s = _naive_call(prem, shape, gpu, layout, e["rows"], t.max_new_tokens, t.max_prompt_tokens,
                                       e["share"])
        assert got["rollout_s"] == pytest.approx(tandem_s, rel=1e-9)
        assert got["solo_rollout_s"] == pytest.approx(solo_s, rel=1e-9)
        assert got["predicted_tandem_over_solo"] == pytest.approx(solo_s / tandem_s, rel=1e-9)
        training = (6 + 2 + 2) * shape.n_params * rows_per_step * (t.max_prompt_tokens + t.max_new_tokens) / (
            e["trainer"] * gpu.flops)  # fwd+bwd, checkpointing's recompute, the old log-probs' pass
        assert got["training_s"] == pytest.approx(training, rel=1e-9)
        assert got["trainer_idle_s"] == pytest.approx(tandem_s if layout == "dedicated" else 0.0, rel=1e-9)
        assert got["step_s"] == pytest.approx(tandem_s + training, rel=1e-9)
    # the params' own layout is the rollout section's, to the figure
    own = c["layouts"][p.rollout.vllm_layout]
    assert own["params_layout"] and own["predicted_tandem_over_solo"] == pytest.approx(
        res["rollout"]["predicted_tandem_over_solo"], abs=1e-3)
    fitting = {k: v for k, v in c["layouts"].items() if v["fits"]}
    assert c["recommended"] == min(fitting, key=lambda k: fitting[k]["step_s"]) and c["recommended"] in c["why"]


def test_cli_plan_prints_each_layouts_seconds_and_the_recommendation():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "cli", "plan", "--params", "params.paper-dedicated.yaml", "--gpus", "8"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(subprocess.run(cmd + ["--json"], cwd=REPO, env=env, capture_output=True, text=True,
                                    timeout=120).stdout)["layouts"]
    text = out.stdout
    assert "layouts on a node of 8 GPUs" in text
    for name, r in res["layouts"].items():
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(name) and "per step" in ln)
        for key, nd in (("rollout_s", 1), ("training_s", 1), ("trainer_idle_s", 1), ("step_s", 1),
                        ("predicted_tandem_over_solo", 2)):
            assert f"{r[key]:.{nd}f}" in line, (key, line)
        assert f"{r['gpus']} GPUs" in line
    assert f"recommended: {res['recommended']} (" in text
