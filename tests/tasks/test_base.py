"""Tests for the `base` stage: corpus isolation, the tiny build end to end, local-path and hub sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.config import params_from_dict
from tandem.data.prompts import user_message
from tandem.data.synthetic import ProblemShape, generate

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 0, "intermediate_size": 64,
        "vocab_size": 400, "n_pretrain": 300, "pretrain_steps": 12, "pretrain_batch_size": 8,
        "pretrain_max_seconds": 0.0, "eval_problems": 4, "eval_max_new_tokens": 12, "curve_points": 2,
        "curve_problems": 2, "pretrain_target": 0.0, "pretrain_cooldown": 0, "pretrain_level": 0.0}


def _write(path: Path, problems) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer,
                                "prompt": user_message(p.problem), "source": p.source, "n_steps": p.n_steps,
                                "solution": p.solution}) + "\n")


def _params(root: Path, **model):
    # benchmarks as _prepare writes them: the pretraining corpus spans the training and benchmark step counts
    data = {"max_steps": 4, "benchmarks": {"arith-short": [2, 3], "arith-long": [4, 4]}}
    return params_from_dict({"seed": 0, "out_root": str(root), "data": data,
                             "model": {**TINY, **model}})


def _prepare(root: Path, val=None) -> None:
    """Prepared splits in the prepare stage's row shape (written directly: no GX import in these tests)."""
    prepared = root / "data" / "prepared"
    _write(prepared / "train.jsonl", generate(20, 2, 4, seed=1, prefix="t"))
    _write(prepared / "val.jsonl", val if val is not None else generate(10, 2, 4, seed=1, prefix="v"))
    _write(prepared / "eval" / "arith-short.jsonl", generate(6, 2, 3, seed=1, prefix="s"))
    _write(prepared / "eval" / "arith-long.jsonl", generate(6, 4, 4, seed=1, prefix="l"))


def test_pretraining_corpus_excludes_every_prepared_problem(tmp_path):
    from tasks import base

    params = _params(tmp_path)
    # val holds exactly the problems the pretraining generator would draw first: they must be skipped
    first = generate(40, 2, 4, params.seed, ProblemShape(params.data.max_operand, params.data.max_value),
                     prefix=base.PRETRAIN_PREFIX)
    _prepare(tmp_path, val=first)
    excluded = base._prepared_problems(tmp_path / "data" / "prepared")
    assert {p.problem for p in first} <= excluded and len(excluded) == 20 + 40 + 12
    corpus = base.pretraining_corpus(params, excluded)
    assert len(corpus) == params.model.n_pretrain
    assert not {p.problem for p in corpus} & excluded


def test_a_shuffled_pretraining_corpus_shuffles_its_questions_only(tmp_path):
    """model.pretrain_question_order shuffled: the corpus's questions out of order, none of them a prepared
    problem in any order; the same draws' solutions as in the given order would have."""
    from tandem.data.synthetic import in_order
    from tasks import base

    _prepare(tmp_path)
    excluded = base._prepared_problems(tmp_path / "data" / "prepared")
    corpus = base.pretraining_corpus(_params(tmp_path, pretrain_question_order="shuffled"), excluded)
    given = base.pretraining_corpus(_params(tmp_path), excluded)
    assert sum(p.problem != in_order(p.problem) for p in corpus) > len(corpus) // 3
    assert all(p.problem == in_order(p.problem) for p in given)
    assert not {in_order(p.problem) for p in corpus} & excluded


def test_missing_prepared_data_is_a_clear_error(tmp_path):
    from tasks import base

    params = _params(tmp_path)
    with pytest.raises(FileNotFoundError, match="prepare"):
        base.run(params, *base.default_io(params))


@pytest.mark.slow
def test_tiny_base_stage_end_to_end(tmp_path):
    from tandem.models import load_model, load_tokenizer
    from tasks import base

    _prepare(tmp_path)
    params = _params(tmp_path)
    inputs, outputs = base.default_io(params)
    assert outputs["model"] == tmp_path / "models" / "base" and outputs["metrics"] == tmp_path / "metrics" / "base.json"
    metrics = base.run(params, inputs, outputs)

    mdir = outputs["model"]
    names = {p.name for p in mdir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "chat_template.jinja", "tandem_source.json", "tandem_manifest.json"} <= names
    from tandem.models import verify_manifest

    manifest = json.loads((mdir / "tandem_manifest.json").read_text())  # what was published, verified on load
    assert set(manifest["files"]) == names - {"tandem_manifest.json"} and verify_manifest(mdir)
    assert manifest["tensors"]["model.safetensors"]["model.embed_tokens.weight"]["dtype"] == "F32"
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
    assert not [p for p in mdir.parent.iterdir() if p.name.startswith(".")]  # no temporary dir left behind
    tok = load_tokenizer(mdir)
    assert tok.padding_side == "left" and tok.chat_template
    gen = json.loads((mdir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id and gen["pad_token_id"] == tok.pad_token_id
    assert load_model(mdir).config.num_hidden_layers == 2

    from tasks.common import read_metrics

    on_disk = json.loads(outputs["metrics"].read_text())
    assert "seconds" not in on_disk and "resources" not in on_disk  # the run's timings: in the sidecar
    assert read_metrics(outputs["metrics"]) == json.loads(json.dumps(metrics))
    pre = metrics["pretrain"]
    assert pre["steps"] == 12 and pre["final_loss"] < pre["first_loss"] and pre["params"] > 0
    assert [c["step"] for c in pre["curve"]] == [6, 12]
    assert set(pre["curve"][0]["greedy"]) == {"arith-short", "arith-long"}
    assert set(pre["solution_tokens"]) == {"2", "3", "4"}
    acc = metrics["accuracy"]
    for mode in ("greedy", "sampled"):
        assert set(acc[mode]) == {"arith-short", "arith-long", "macro"}
        assert all(0.0 <= v <= 1.0 for v in acc[mode].values())
    assert acc["benchmarks"]["arith-short"]["n"] == 4
    assert metrics["seconds"]["total"] > 0


@pytest.mark.slow
def test_path_source_copies_a_local_model(tmp_path):
    from tandem.config import ModelConfig
    from tandem.models import SOURCE_FILE, build_tiny_model, save_model, train_tokenizer
    from tasks import base

    _prepare(tmp_path)
    src = tmp_path / "elsewhere"
    probs = generate(50, 2, 4, seed=3)
    tok = train_tokenizer([user_message(p.problem) + "\n\n" + p.solution for p in probs], 300)
    save_model(build_tiny_model(tok, ModelConfig(**{k: TINY[k] for k in (
        "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")})), tok, src)
    (src / "pytorch_model.bin").write_bytes(b"not loaded, not copied")
    params = _params(tmp_path, source="path", path=str(src))
    inputs, outputs = base.default_io(params)
    assert inputs["model_path"] == src
    metrics = base.run(params, inputs, outputs)
    names = {p.name for p in outputs["model"].iterdir()}
    assert "model.safetensors" in names and "pytorch_model.bin" not in names
    assert json.loads((outputs["model"] / SOURCE_FILE).read_text())["path"] == str(src.resolve())
    assert "pretrain" not in metrics and "arith-long" in metrics["accuracy"]["greedy"]


def test_path_source_rejects_a_directory_without_safetensors(tmp_path):
    from tasks import base

    _prepare(tmp_path)
    src = tmp_path / "bad"
    src.mkdir()
    (src / "config.json").write_text("{}")
    params = _params(tmp_path, source="path", path=str(src))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        base.run(params, *base.default_io(params))
    assert not (tmp_path / "models" / "base").exists()


def test_hub_source_offline_fails_cleanly(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    from tasks import base

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    _prepare(tmp_path)
    params = _params(tmp_path, source="hub", hub_id="someone/not-cached-model", revision="main")
    with pytest.raises(RuntimeError, match="model.source: path"):
        base.run(params, *base.default_io(params))
    assert not (tmp_path / "models" / "base").exists()


@pytest.mark.slow
def test_warm_up_trains_a_fetched_model_in_place_and_records_it(tmp_path):
    from safetensors.torch import load_file

    from tandem.config import ModelConfig
    from tandem.models import SOURCE_FILE, build_tiny_model, save_model, train_tokenizer
    from tasks import base

    _prepare(tmp_path)
    src = tmp_path / "elsewhere"
    probs = generate(50, 2, 4, seed=3)
    tok = train_tokenizer([user_message(p.problem) + "\n\n" + p.solution for p in probs], 300)
    save_model(build_tiny_model(tok, ModelConfig(**{k: TINY[k] for k in (
        "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")})), tok, src)
    params = _params(tmp_path, source="path", path=str(src), sft_steps=3, sft_batch_size=4, sft_lr=1e-3)
    inputs, outputs = base.default_io(params)
    metrics = base.run(params, inputs, outputs)
    assert metrics["warmup"]["steps"] == 3 and metrics["warmup"]["tokens"] > 0
    before, after = load_file(src / "model.safetensors"), load_file(outputs["model"] / "model.safetensors")
    assert any(not (before[k] == after[k]).all() for k in before)  # the copy was trained, the source untouched
    assert json.loads((outputs["model"] / SOURCE_FILE).read_text())["warmup"]["examples"] == 12
    # run metadata: parameter count, generation speed and peak memory of the stage
    assert metrics["model"]["n_params"] > 0 and metrics["model"]["vocab_size"] == len(tok)
    assert metrics["generation"]["tokens_per_second"] > 0
    assert metrics["resources"]["process_max_rss_mb"] > 0
    assert metrics["timing"]["total"] >= metrics["timing"]["build"] > 0


def test_a_warm_up_trains_on_the_completion_whatever_the_pretraining_loss(tmp_path, monkeypatch):
    """model.pretrain_loss is the tiny base's: a fetched model's supervised phase always scores the solution."""
    from tandem import models as M
    from tasks import base

    _prepare(tmp_path)
    src = _path_model(tmp_path)
    (src / M.SOURCE_FILE).write_text("{}")  # what fetching it would have recorded
    seen = []

    def fake_pretrain(model, tok, pairs, cfg, **kw):
        seen.append(cfg.pretrain_loss)
        return {"steps": cfg.pretrain_steps}

    monkeypatch.setattr(M, "pretrain", fake_pretrain)
    params = _params(tmp_path, source="path", path=str(src), sft_steps=2, sft_batch_size=2, pretrain_loss="sequence")
    base._warm_up(params, tmp_path / "data" / "prepared", src)
    assert seen == ["completion"]


def _path_model(tmp_path: Path) -> Path:
    """A tiny untrained model directory for the fetched-model path (source: path)."""
    from tandem.config import ModelConfig
    from tandem.models import build_tiny_model, save_model, train_tokenizer

    src = tmp_path / "elsewhere"
    probs = generate(50, 2, 4, seed=3)
    tok = train_tokenizer([user_message(p.problem) + "\n\n" + p.solution for p in probs], 300)
    save_model(build_tiny_model(tok, ModelConfig(**{k: TINY[k] for k in (
        "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")})), tok, src)
    return src


@pytest.mark.slow
def test_a_dialect_phase_follows_the_warm_up_and_the_junior_rebuilds_the_warm_up_without_it(tmp_path):
    """S = warm-up + dialect phase (base stage), J = the same warm-up without it (junior.source warmup): J's
    weights are exactly the base's after its warm-up, and each phase's hash is recorded."""
    from tandem.evaluation import content_hash
    from tandem.models import SOURCE_FILE
    from tasks import base, junior

    _prepare(tmp_path)
    src = _path_model(tmp_path)
    params = params_from_dict({
        "seed": 0, "out_root": str(tmp_path),
        "data": {"max_steps": 4, "benchmarks": {"arith-short": [2, 3], "arith-long": [4, 4]}},
        "model": {**TINY, "source": "path", "path": str(src), "sft_steps": 2, "sft_batch_size": 4, "sft_lr": 1e-3,
                  "dialect_steps": 2, "dialect_styles": {"annotated": 1.0}},
        "junior": {"source": "warmup"}})
    bm = base.run(params, *base.default_io(params))
    S = tmp_path / "models" / "base"
    rec = json.loads((S / SOURCE_FILE).read_text())
    assert rec["dialect"]["styles"] == {"annotated": 1.0} and rec["dialect"]["prefix"] == "dialect"
    assert bm["warmup"]["hash"] == rec["warmup"]["hash"] != bm["dialect"]["hash"] == content_hash(S)
    jm = junior.run(params, *junior.default_io(params))
    J = tmp_path / "models" / "junior"
    assert jm["source"] == "warmup" and jm["matches_base_warmup"] and not jm["is_base"]
    assert jm["hash"] == content_hash(J) == bm["warmup"]["hash"] != content_hash(S)


def test_a_dialect_phase_and_a_warm_up_junior_need_a_fetched_model_with_a_warm_up():
    from tandem.config import ParamsError

    with pytest.raises(ParamsError, match="dialect phase follows the warm-up"):
        params_from_dict({"model": {"source": "tiny", "dialect_steps": 3}})
    with pytest.raises(ParamsError, match="source warmup rebuilds"):
        params_from_dict({"model": {"source": "gguf", "gguf_file": "x.gguf", "sft_steps": 0},
                          "junior": {"source": "warmup"}})
    ok = params_from_dict({"model": {"source": "gguf", "gguf_file": "x.gguf", "sft_steps": 2, "dialect_steps": 1},
                           "junior": {"source": "warmup"}})
    assert ok.model.dialect_styles == {"annotated": 1.0} and ok.junior.source == "warmup"


@pytest.mark.parametrize("decoding", ["greedy", "evaluation"])
def test_level_probes_decode_as_pretrain_level_decoding_says(tmp_path, monkeypatch, decoding):
    """The target probes decode greedily; the level probes greedily too, or with one seeded sample at the
    evaluation's temperature, top-p and top-k (model.pretrain_level_decoding)."""
    from tandem import generation, models
    from tasks import base

    _prepare(tmp_path)
    params = _params(tmp_path, pretrain_target=0.3, pretrain_level=0.8, pretrain_level_decoding=decoding)
    decodes = []

    def accuracy(model, tokenizer, messages, golds, decode, **kw):
        decodes.append((len(messages), decode))
        return {"accuracy": 0.5}

    class Stop(Exception):
        pass

    def pretrain(model, tokenizer, texts, cfg, progress=True, seed=0, curve_fn=None, target_fn=None):
        target_fn(model, 3, "target")
        target_fn(model, 4, "level")
        raise Stop

    monkeypatch.setattr(generation, "accuracy", accuracy)
    monkeypatch.setattr(models, "pretrain", pretrain)
    with pytest.raises(Stop):
        base.run(params, *base.default_io(params))
    (n_target, target), (n_level, level) = decodes
    ev = params.evaluate
    assert (n_target, n_level) == (3, 4) and target.temperature == 0.0 and target.seed == level.seed == params.seed
    if decoding == "greedy":
        assert level == target
    else:
        assert (level.temperature, level.top_p, level.top_k, level.n_samples) == (ev.temperature, ev.top_p,
                                                                                 ev.top_k, 1)
        assert level.max_new_tokens == target.max_new_tokens


def test_likelihood_level_probes_score_each_validation_reference_in_every_corpus_style(tmp_path, monkeypatch):
    """model.pretrain_level_decoding likelihood: a level probe is the reference pass rate at the evaluation's
    decoding over the first n validation problems, each reference written in every style with a share; the
    target probes still decode greedily."""
    from tandem import generation, likelihood, models
    from tandem.data.synthetic import restyle
    from tasks import base

    _prepare(tmp_path)
    params = _params(tmp_path, pretrain_target=0.3, pretrain_level=0.8, pretrain_level_decoding="likelihood")
    seen = {}

    def accuracy(model, tokenizer, messages, golds, decode, **kw):
        seen["target"] = (len(messages), decode.temperature)
        return {"accuracy": 0.5}

    def reference_pass_rate(model, tokenizer, messages, references, decoding, batch_size=64):
        seen["level"] = (messages, references, decoding)
        return {"pass_rate": 0.25, "per_problem": [0.25] * len(messages)}

    class Stop(Exception):
        pass

    def pretrain(model, tokenizer, texts, cfg, progress=True, seed=0, curve_fn=None, target_fn=None):
        seen["values"] = (target_fn(model, 3, "target"), target_fn(model, 4, "level"))
        raise Stop

    monkeypatch.setattr(generation, "accuracy", accuracy)
    monkeypatch.setattr(likelihood, "reference_pass_rate", reference_pass_rate)
    monkeypatch.setattr(models, "pretrain", pretrain)
    with pytest.raises(Stop):
        base.run(params, *base.default_io(params))
    val = [json.loads(line) for line in (tmp_path / "data" / "prepared" / "val.jsonl").read_text().splitlines()][:4]
    messages, references, decoding = seen["level"]
    ev = params.evaluate
    styles = [s for s, w in params.data.solution_styles.items() if w > 0]
    assert seen["target"] == (3, 0.0) and seen["values"] == (0.5, 0.25)
    assert messages == [r["prompt"] for r in val]
    assert references == [[restyle(r["solution"], s) for s in styles] for r in val] and len(styles) == 2
    assert (decoding.temperature, decoding.top_k, decoding.top_p) == (ev.temperature, ev.top_k, ev.top_p)
