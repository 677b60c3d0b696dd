"""Chunked teacher forcing (tandem/logprobs.py) against one unbatched forward pass per row."""

from __future__ import annotations

import pytest
import torch

from tandem.logprobs import completion_positions_BT, iter_logp_chunks, right_pad_BL, token_logprobs_B


def _tiny_lm(seed: int, vocab: int = 29):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).eval()


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 29, (n,), generator=g).tolist() for n in (3, 7, 1, 5, 2)]
    comps = [torch.randint(0, 29, (n,), generator=g).tolist() for n in (4, 2, 6, 0, 5)]
    return prompts, comps


def test_padding_and_positions_match_naive():
    ids, attn = right_pad_BL([[1, 2, 3], [4]], pad_id=9)
    assert ids.tolist() == [[1, 2, 3], [4, 9, 9]] and attn.tolist() == [[1, 1, 1], [1, 0, 0]]
    pos, mask = completion_positions_BT(torch.tensor([2, 1]), torch.tensor([3, 1]), width=5)
    assert mask.tolist() == [[True, True, True], [True, False, False]]
    assert [[p for p, m in zip(pr, mr) if m] for pr, mr in zip(pos.tolist(), mask.tolist())] == [[1, 2, 3], [0]]


@pytest.mark.parametrize("batch_size,chunk", [(1, 1), (2, 3), (8, 256)])
def test_token_logprobs_match_one_forward_per_row(batch_size, chunk):
    model = _tiny_lm(0)
    prompts, comps = _rows()
    got = token_logprobs_B(model, prompts, comps, temperature=0.7, pad_id=0, batch_size=batch_size,
                           chunk_tokens=chunk)
    for p, c, row in zip(prompts, comps, got):
        assert len(row) == len(c)
        if not c:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0].double() / 0.7
        want = [float(torch.log_softmax(logits[len(p) - 1 + t], -1)[y]) for t, y in enumerate(c)]
        assert row == pytest.approx(want, abs=1e-5)


def test_chunks_never_hold_more_than_chunk_tokens_positions():
    model = _tiny_lm(1)
    prompts, comps = _rows(1)
    seen = {}
    for ch in iter_logp_chunks([model, None], prompts, comps, batch_size=2, chunk_tokens=2):
        assert ch.logp_BTV[0].shape[:2] == ch.targets_BT.shape and ch.logp_BTV[0].shape[1] <= 2
        assert ch.logp_BTV[1] is None and len(ch.rows) <= 2
        for b, i in enumerate(ch.rows):
            seen.setdefault(i, 0)
            seen[i] += int(ch.mask_BT[b].sum())
    assert seen == {i: len(c) for i, c in enumerate(comps) if c}
    with pytest.raises(ValueError, match="completions"):
        list(iter_logp_chunks([model], prompts, comps[:-1]))
