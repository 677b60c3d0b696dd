"""Small stand-ins for tests and for the benchmark when no base model exists yet.

A byte-level BPE trained in memory on a few arithmetic sentences (newlines isolated, so a blank line is two
`Ċ` tokens, as in the project's tiny tokenizer), and randomly initialised tiny `Qwen3ForCausalLM`s sized
like the project's default tiny base. Nothing is downloaded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

EOS = "<|im_end|>"
PAD = "<|endoftext|>"


def corpus(n: int = 200, seed: int = 0) -> list[str]:
    """Arithmetic word-problem text with `\\n\\n`-separated steps (deterministic in `seed`)."""
    rng = random.Random(seed)
    names, objs = ["Ann", "Ben", "Cleo", "Dan", "Eva"], ["apples", "coins", "pens", "cards"]
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 30), rng.randint(1, 9)
        nm, ob = rng.choice(names), rng.choice(objs)
        out.append(f"{nm} has {a} {ob}. {nm} gets {b} more {ob}. How many {ob} does {nm} have now?\n\n"
                   f"{nm} gets {b} more, so {a} + {b} = {a + b}.\n\nThe answer is \\boxed{{{a + b}}}.")
    return out


def byte_bpe_tokenizer(texts: Sequence[str] | None = None, vocab_size: int = 400, isolate_newlines: bool = True):
    """A `PreTrainedTokenizerFast` byte-level BPE trained on `texts` (default: `corpus()`), EOS `<|im_end|>`.

    `isolate_newlines=False` lets BPE merge `\\n\\n` into one `ĊĊ` token (the Qwen-style case).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    pre = [pre_tokenizers.Digits(individual_digits=True),
           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    # one newline per pre-token (blank line = two tokens), or runs of newlines kept whole (so BPE learns `ĊĊ`)
    pre.insert(0, pre_tokenizers.Split(Regex(r"\n" if isolate_newlines else r"\n+"), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts) if texts is not None else corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    fast.padding_side = "left"
    return fast


@dataclass(frozen=True)
class TinyShape:
    """The architecture of a `tiny_qwen3` (head_dim = hidden // heads)."""

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    max_position: int = 512


def tiny_qwen3(vocab_size: int, seed: int = 0, shape: TinyShape = TinyShape(), eos_token_id: int | None = None,
               dtype: torch.dtype = torch.float32) -> Any:
    """A randomly initialised `Qwen3ForCausalLM` of `shape` (eval mode), deterministic in `seed`; the global
    RNG is untouched."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads,
                      max_position_embeddings=shape.max_position, tie_word_embeddings=True,
                      eos_token_id=eos_token_id, pad_token_id=None, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
        # HF's default init (std 0.02) gives near-uniform next-token distributions; a wider init makes the
        # two random models disagree sharply, which is what the tandem tests need to be meaningful.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.3 if "embed" in name else 0.12)
    if eos_token_id is not None:
        model.generation_config.eos_token_id = eos_token_id
    return model.to(dtype).eval()


def prompts(tokenizer: Any, n: int, seed: int = 0) -> list[list[int]]:
    """`n` tokenised problem statements of varied length (the first sentence of `corpus` rows)."""
    rows = corpus(n, seed=seed + 1)
    return [tokenizer(r.split("\n\n")[0] + "\n\n", add_special_tokens=False)["input_ids"] for r in rows]


def tiny_pair(tokenizer: Any, dtype: torch.dtype = torch.float64, layers: int = 2, seeds: tuple[int, int] = (1, 2)):
    """(senior, junior): one small architecture, different random weights (they disagree), the tokenizer's EOS."""
    shape = TinyShape(hidden=64, layers=layers, heads=4, kv_heads=2, intermediate=128)
    return tuple(tiny_qwen3(len(tokenizer), s, shape, eos_token_id=tokenizer.eos_token_id, dtype=dtype)
                 for s in seeds)


def add_logit_bias(model: Any, bias: dict[int, float]) -> Any:
    """Give `model` an lm_head bias (weight shared, so ties are kept): steers a random model toward some tokens,
    e.g. newlines so that the step schedule actually hands off, or EOS."""
    old = model.lm_head
    new = torch.nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
    new.weight = old.weight
    with torch.no_grad():
        new.bias.zero_()
        for i, b in bias.items():
            new.bias[i] = b
    model.lm_head = new
    return model


def rollout(engine: Any, prompts: Any, schedule: str, sampling: Any, seed: int, row_ids: Any = None,
            batch_size: int | None = None, **settings: Any):
    """`engine.generate` of one request built from loose settings (tests and benchmarks): `schedule` the kind,
    `settings` the other `ScheduleSpec` fields."""
    from tandem.rollout.request import RolloutSettings
    from tandem.rollout.schedule import ScheduleSpec

    s = RolloutSettings(ScheduleSpec(schedule, **settings), sampling, batch_size=batch_size or 0)
    return engine.generate(s.request(prompts, seed, row_ids))
