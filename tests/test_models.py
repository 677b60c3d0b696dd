"""Tests for tandem.models: tokenizer, chat template, tiny model, pretraining, save/load, hub errors."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tandem import models as M
from tandem.config import ModelConfig, ParamsError
from tandem.data.prompts import render_prompt, user_message
from tandem.data.synthetic import generate
from train_fixtures import SMALL



@pytest.fixture(scope="module")
def problems():
    return generate(300, 2, 5, seed=11, prefix="test-models")


@pytest.fixture(scope="module")
def tok(problems):
    return M.train_tokenizer([user_message(p.problem) + "\n\n" + p.solution for p in problems], 640)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

def test_tokenizer_round_trip(tok, problems):
    for p in problems[:50]:
        for text in (user_message(p.problem), p.solution, render_prompt(user_message(p.problem), tok)):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.decode(ids) == text
    assert 256 + len(M.SPECIAL_TOKENS) <= len(tok) <= 640


def test_numbers_are_space_then_single_digits(tok):
    toks = tok.tokenize("Ann has 127 apples.\n\n12 + 3 = 15")
    assert toks[:6] == ["Ann", "Ġhas", "Ġ", "1", "2", "7"]
    i = toks.index("Ċ")
    assert toks[i:i + 2] == ["Ċ", "Ċ"]  # a blank line is two newline tokens, never one merged token
    assert toks[i + 2:i + 4] == ["1", "2"]
    assert all(len(t) == 1 for t in toks if t.strip("Ġ").isdigit())
    # every digit run in the vocabulary is a single digit
    assert not [t for t in tok.get_vocab() if sum(c.isdigit() for c in t) > 1]


def test_word_starts_visible(tok):
    starts = set(M.word_start_ids(tok))
    ids = tok("Ben gives away 3 coins.", add_special_tokens=False)["input_ids"]
    toks = tok.convert_ids_to_tokens(ids)
    assert [i in starts for i in ids] == [t.startswith(("Ġ", "Ċ")) for t in toks]
    assert toks[0] == "Ben" and ids[0] not in starts  # the first word has no leading space
    assert sum(i in starts for i in ids) == 4  # gives, away, the bare space before 3, coins
    assert tok.convert_tokens_to_ids("Ġ") in starts and tok.convert_tokens_to_ids("Ċ") in starts


def test_special_tokens_and_padding_side(tok):
    assert tok.eos_token == M.EOS_TOKEN and tok.pad_token == M.PAD_TOKEN
    assert tok.eos_token_id != tok.pad_token_id
    for t in M.ROLE_TOKENS:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1
    assert tok.padding_side == "left"


def test_chat_template_renders(tok):
    prompt = render_prompt("What is 2 + 3?", tok)
    assert prompt == "<|user|>\nWhat is 2 + 3?<|im_end|>\n<|assistant|>\n"
    convo = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                     {"role": "assistant", "content": "a"}], tokenize=False)
    assert convo == "<|system|>\ns<|im_end|>\n<|user|>\nu<|im_end|>\n<|assistant|>\na<|im_end|>\n"
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_tokenizer_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="too small"):
        M.train_tokenizer(["a b c"], 100)


# --------------------------------------------------------------------------------------------------
# Pure pieces of pretraining
# --------------------------------------------------------------------------------------------------

def test_completion_loss_matches_naive():
    g = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(2, 5, 7, generator=g)
    labels_BT = torch.tensor([[-100, -100, 3, 4, 1], [-100, 2, 6, -100, -100]])
    total, n = 0.0, 0
    for b in range(2):
        for t in range(1, 5):
            if labels_BT[b, t] != -100:
                total += -torch.log_softmax(logits_BTV[b, t - 1], -1)[labels_BT[b, t]].item()
                n += 1
    assert M.completion_loss(logits_BTV, labels_BT).item() == pytest.approx(total / n, rel=1e-6)


def test_collate_masks_prompt_and_padding():
    ex = [M.Example(ids=[5, 6, 7, 8], n_prompt=2), M.Example(ids=[9, 10, 11], n_prompt=1)]
    b = M.collate(ex, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, 11, -100]]


def test_lr_factor_warmup_then_cosine_to_zero():
    assert M.lr_factor(0.0, 0.1) == pytest.approx(1e-3)
    assert M.lr_factor(0.05, 0.1) == pytest.approx(0.5)
    assert M.lr_factor(0.1, 0.1) == pytest.approx(1.0)
    assert M.lr_factor(0.55, 0.1) == pytest.approx(0.5)
    assert M.lr_factor(1.0, 0.1) == pytest.approx(0.0, abs=1e-12)
    xs = [M.lr_factor(0.1 + 0.9 * i / 50, 0.1) for i in range(51)]
    assert all(a >= b for a, b in zip(xs, xs[1:]))
    assert M.lr_factor(0.3, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3)))


def test_length_bucketed_batches_cover_every_example_once():
    rng = random.Random(0)
    lengths = [rng.randint(10, 200) for _ in range(256)]
    batches = M.length_bucketed_batches(256, lengths, 8, random.Random(1), pool_batches=4)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(256)) and all(len(b) == 8 for b in batches)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 60  # sorted pools: far tighter than random batches (~150 on this range)


def test_encode_examples_ends_with_eos(tok, problems):
    ex = M.encode_examples(tok, [(user_message(p.problem), p.solution) for p in problems[:3]])
    for e, p in zip(ex, problems):
        assert e.ids[-1] == tok.eos_token_id
        assert tok.decode(e.ids[:e.n_prompt]) == render_prompt(user_message(p.problem), tok)
        assert tok.decode(e.ids[e.n_prompt:-1]) == p.solution


def test_encode_examples_sequence_loss_covers_the_question(tok, problems):
    """model.pretrain_loss sequence: the same tokens, with the loss on every one after the first."""
    pairs = [(user_message(p.problem), p.solution) for p in problems[:3]]
    completion, sequence = M.encode_examples(tok, pairs), M.encode_examples(tok, pairs, "sequence")
    assert [e.ids for e in sequence] == [e.ids for e in completion]
    assert all(e.n_prompt == 0 for e in sequence) and all(e.n_prompt > 0 for e in completion)
    labels = M.collate(sequence, tok.pad_token_id)["labels"]
    assert [int((row != -100).sum()) for row in labels] == [len(e.ids) for e in sequence]
    with pytest.raises(ValueError, match="completion or sequence"):
        M.encode_examples(tok, pairs, "prompt")


@pytest.mark.parametrize("key,default,other,bad", [
    ("pretrain_level_decoding", "likelihood", "greedy", "sampled"),
    ("pretrain_loss", "completion", "sequence", "prompt"),
    ("pretrain_question_order", "given", "shuffled", "reversed"),
])
def test_a_pretraining_choice_takes_its_values_and_refuses_others(key, default, other, bad):
    assert getattr(ModelConfig(**SMALL), key) == default
    assert getattr(ModelConfig(**SMALL, **{key: other}), key) == other
    with pytest.raises(ParamsError, match=key):
        ModelConfig(**SMALL, **{key: bad})


def test_pretrain_loss_changes_training(tok, problems):
    pairs = [(user_message(p.problem), p.solution) for p in problems]
    losses = {}
    for loss in ("completion", "sequence"):
        cfg = ModelConfig(**SMALL, pretrain_steps=3, pretrain_batch_size=2, curve_points=0, pretrain_loss=loss)
        losses[loss] = M.pretrain(M.build_tiny_model(tok, cfg), tok, pairs, cfg, progress=False)["first_loss"]
    assert losses["completion"] != losses["sequence"]  # the same first batch, scored over other tokens


# --------------------------------------------------------------------------------------------------
# Model, pretraining, generation
# --------------------------------------------------------------------------------------------------

def test_build_tiny_model_default_size(tok):
    model = M.build_tiny_model(tok, ModelConfig())
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert 0.2e6 < M.n_params(model) < 1.5e6  # the default is params.yaml's model (~0.3M parameters)
    assert model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    again = M.build_tiny_model(tok, ModelConfig())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_pretrain_smoke_loss_decreases(tok, problems):
    cfg = ModelConfig(**SMALL, pretrain_steps=40, pretrain_batch_size=8, pretrain_lr=3e-3, pretrain_max_seconds=0,
                      curve_points=2)
    model = M.build_tiny_model(tok, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    pairs = [(user_message(p.problem), p.solution) for p in problems]
    calls = []
    s = M.pretrain(model, tok, pairs, cfg, progress=False,
                   curve_fn=lambda m: calls.append(1) or {"x": 1})
    assert s["steps"] == 40 and s["stopped_by"] == "steps"
    assert math.isfinite(s["final_loss"]) and s["final_loss"] < s["first_loss"] - 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [c["step"] for c in s["curve"]] == [20, 40] and len(calls) == 2 and s["curve"][0]["x"] == 1
    assert not model.training


def _scripted(accuracies: dict[int, float], calls: list):
    """A target_fn that records (step of the call, problems asked for) and answers from a step -> accuracy table."""
    def fn(m, n, phase):
        calls.append(n)
        return accuracies.get(len(calls), 0.0)
    return fn


def test_pretrain_target_schedule_cools_down_at_the_target(tok, problems):
    cfg = ModelConfig(**SMALL, pretrain_steps=200, pretrain_batch_size=2, pretrain_warmup=0.05, curve_points=0,
                      pretrain_target=0.5, pretrain_target_every=10, pretrain_target_problems=7, pretrain_level=0.0,
                      pretrain_cooldown=15)
    calls: list[int] = []
    s = M.pretrain(M.build_tiny_model(tok, cfg), tok, [(user_message(p.problem), p.solution) for p in problems],
                   cfg, progress=False, target_fn=_scripted({3: 0.6}, calls))
    t = s["target"]
    assert [p["step"] for p in t["probes"]] == [10, 20, 30] and calls == [7, 7, 7]
    assert [p["phase"] for p in t["probes"]] == ["target"] * 3 and t["reached_at_step"] == 30
    assert s["steps"] == 45 and s["stopped_by"] == "target" and "level" not in t


def test_pretrain_level_stop_probes_on_at_full_rate_until_the_level(tok, problems):
    cfg = ModelConfig(**SMALL, pretrain_steps=200, pretrain_batch_size=2, pretrain_warmup=0.05, curve_points=0,
                      pretrain_target=0.3, pretrain_target_every=10, pretrain_target_problems=7,
                      pretrain_cooldown=0, pretrain_level=0.8, pretrain_level_every=4, pretrain_level_problems=9)
    calls: list[int] = []
    # probe 2 (step 20) reaches the target; level probes every 4 steps from there; probe 5 (step 32) reaches 0.8
    s = M.pretrain(M.build_tiny_model(tok, cfg), tok, [(user_message(p.problem), p.solution) for p in problems],
                   cfg, progress=False, target_fn=_scripted({2: 0.3, 3: 0.5, 4: 0.79, 5: 0.8}, calls))
    t = s["target"]
    assert calls == [7, 7, 9, 9, 9]
    assert [(p["step"], p["phase"], p["reached"]) for p in t["probes"]] == [
        (10, "target", False), (20, "target", True), (24, "level", False), (28, "level", False), (32, "level", True)]
    assert t["reached_at_step"] == 20 and t["level_reached_at_step"] == 32 and t["level"] == 0.8
    assert s["steps"] == 32 and s["stopped_by"] == "level"


def test_pretrain_tells_each_probe_its_phase(tok, problems):
    cfg = ModelConfig(**SMALL, pretrain_steps=200, pretrain_batch_size=2, pretrain_warmup=0.05, curve_points=0,
                      pretrain_target=0.3, pretrain_target_every=10, pretrain_target_problems=7,
                      pretrain_cooldown=0, pretrain_level=0.8, pretrain_level_every=4, pretrain_level_problems=9)
    seen: list[tuple[int, str]] = []

    def probe(m, n, phase):  # a target probe answers 0.3 (the target), a level probe 0.8 (the level)
        seen.append((n, phase))
        return 0.3 if phase == "target" else 0.8

    s = M.pretrain(M.build_tiny_model(tok, cfg), tok, [(user_message(p.problem), p.solution) for p in problems],
                   cfg, progress=False, target_fn=probe)
    assert seen == [(7, "target"), (9, "level")]
    assert [(p["step"], p["phase"]) for p in s["target"]["probes"]] == [(10, "target"), (12, "level")]
    assert s["steps"] == 12 and s["stopped_by"] == "level"


def test_pretrain_level_stop_ends_at_the_level_and_keeps_the_cap(tok, problems):
    base = dict(**SMALL, pretrain_batch_size=2, pretrain_warmup=0.05, curve_points=0, pretrain_target=0.3,
                pretrain_target_every=10, pretrain_target_problems=7, pretrain_level=0.8, pretrain_level_every=5,
                pretrain_level_problems=9)
    pairs = [(user_message(p.problem), p.solution) for p in problems]
    cfg = ModelConfig(**base, pretrain_steps=200, pretrain_cooldown=6)
    s = M.pretrain(M.build_tiny_model(tok, cfg), tok, pairs, cfg, progress=False,
                   target_fn=_scripted({1: 0.4, 2: 0.9}, []))
    assert s["target"]["level_reached_at_step"] == 15 and s["steps"] == 15 and s["stopped_by"] == "level"
    cfg = ModelConfig(**base, pretrain_steps=40, pretrain_cooldown=6)  # the level never comes: the cap decides
    s = M.pretrain(M.build_tiny_model(tok, cfg), tok, pairs, cfg, progress=False,
                   target_fn=_scripted({1: 0.4}, []))
    assert s["target"]["level_reached_at_step"] is None and s["steps"] == 40 and s["stopped_by"] == "steps"


def test_target_lr_factor_decays_to_its_floor_and_holds_it():
    naive = [0.5, 1.0, 1.0, 0.7, 0.4, 0.1, 0.1, 0.1, 0.1]  # warmup 2; decay from step 3 over 3 steps to 0.1
    got = [M.target_lr_factor(s, 2, 3 if s >= 3 else None, 3, 0.1) for s in range(1, 10)]  # cool_start once met
    assert got == pytest.approx(naive)
    assert [M.target_lr_factor(s, 2, 3, 3) for s in (4, 6, 9)] == pytest.approx([2 / 3, 0.0, 0.0])


def test_level_stop_needs_the_target():
    with pytest.raises(ParamsError, match="pretrain_level.*needs model.pretrain_target > 0"):
        ModelConfig(**SMALL, pretrain_target=0.0, pretrain_level=0.7)


def test_pretrain_time_cap_stops_early(tok, problems):
    cfg = ModelConfig(**SMALL, pretrain_steps=10_000, pretrain_batch_size=4, pretrain_max_seconds=0.5)
    s = M.pretrain(M.build_tiny_model(tok, cfg), tok, [(user_message(p.problem), p.solution) for p in problems],
                   cfg, progress=False)
    assert s["stopped_by"] == "time" and s["steps"] < 10_000 and s["seconds"] < 5


def test_pretrain_rejects_sequences_longer_than_max_position(tok, problems):
    cfg = ModelConfig(**{**SMALL, "max_position": 16}, pretrain_steps=1)
    with pytest.raises(ValueError, match="max_position"):
        M.pretrain(M.build_tiny_model(tok, cfg), tok, [(user_message(problems[0].problem), problems[0].solution)],
                   cfg, progress=False)


# --------------------------------------------------------------------------------------------------
# Saving, loading, hub
# --------------------------------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path, tok):
    model = M.build_tiny_model(tok, ModelConfig(**SMALL), seed=5)
    M.save_model(model, tok, tmp_path / "m")
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in names and "config.json" in names and "generation_config.json" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
    loaded = M.load_model(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    t2 = M.load_tokenizer(tmp_path / "m")
    assert t2.padding_side == "left"
    assert t2.chat_template == tok.chat_template
    assert t2.eos_token_id == tok.eos_token_id and t2.pad_token_id == tok.pad_token_id
    assert loaded.generation_config.eos_token_id == tok.eos_token_id
    text = "Ann has 12 pens.\n\n12 + 3 = 15"
    assert t2(text)["input_ids"] == tok(text)["input_ids"]
    M.check_model_dir(tmp_path / "m")
    assert M.load_model(tmp_path / "m", dtype="bfloat16").dtype == torch.bfloat16


def test_load_model_refuses_pickles(tmp_path, tok):
    M.save_model(M.build_tiny_model(tok, ModelConfig(**SMALL)), tok, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        M.load_model(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        M.check_model_dir(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        M.check_model_dir(tmp_path / "nowhere")


def test_snapshot_hub_offline_error_says_what_to_do(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError) as e:
        M.snapshot_hub("Qwen/Qwen3-4B-Instruct-2507", "main", tmp_path / "dest", cache_dir=tmp_path / "cache")
    msg = str(e.value)
    assert "HF_HUB_OFFLINE" in msg and "model.source: path" in msg and "Qwen/Qwen3-4B-Instruct-2507" in msg
    assert not (tmp_path / "dest" / M.SOURCE_FILE).exists()
