"""The causal-mask fast path (a plain causal mask tensor runs SDPA's ``is_causal`` kernel, any other
mask is honoured) and sliding-window attention against an explicit softmax reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.transformer import TransformerConfig
from megatron_core.transformer import causal_mask as cm
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from tests.models.gpt_test_utils import VOCAB, build, llama_like

S = 12


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             attention_dropout=0.0, hidden_dropout=0.0, **kw)


def _qkv(b: int = 2, s: int = S):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(s, b, 4, 8, generator=gen), torch.randn(s, b, 2, 8, generator=gen),
            torch.randn(s, b, 2, 8, generator=gen))


def _reference(q, k, v, keep: torch.Tensor) -> torch.Tensor:
    """Explicit softmax attention; ``keep`` ``[sq, sk]`` True = attend."""
    q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    out = probs @ v
    return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (S, 0), (-1, 0)])
def test_sliding_window_matches_reference(window):
    attn = DotProductAttention(_config(window_size=window), 1, AttnMaskType.causal)
    q, k, v = _qkv()
    i = torch.arange(S)
    diff = i[:, None] - i[None, :]
    keep = (diff >= 0) & ((diff <= window[0]) if window[0] >= 0 else True)
    torch.testing.assert_close(attn(q, k, v, None), _reference(q, k, v, keep), rtol=1e-5, atol=1e-5)


def test_window_needs_a_causal_mask_type_and_a_pair():
    with pytest.raises(ValueError, match=r"window_size \(\(4, 0\)\) needs a causal attention mask type.*padding"):
        DotProductAttention(_config(window_size=(4, 0)), 1, AttnMaskType.padding)
    with pytest.raises(ValueError, match=r"window_size \(\(4,\)\) must be a \(left, right\) pair"):
        DotProductAttention(_config(window_size=(4,)), 1, AttnMaskType.causal)


def _causal(b: int = 1, s: int = S) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s).clone()


def test_plain_causal_mask_is_recognised_once_per_tensor(monkeypatch):
    mask = _causal(2)
    calls = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: calls.append(1) or equal(a, b))
    assert cm.is_plain_causal_mask(mask, S, S)
    assert cm.is_plain_causal_mask(mask, S, S)
    assert len(calls) == 1  # cached per tensor: one comparison however many layers ask
    mask[1, 0, 5, 2] = True  # modified in place: checked again, and now it is not plain causal
    assert not cm.is_plain_causal_mask(mask, S, S)
    assert len(calls) == 2
    assert not cm.is_plain_causal_mask(_causal(1)[..., :-1, :-1].contiguous(), S, S)  # wrong shape
    assert not cm.is_plain_causal_mask(torch.zeros(1, 1, S, S, dtype=torch.bool), S, S)


def _record_sdpa(monkeypatch) -> list:
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seen.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


def test_model_with_and_without_the_causal_mask_tensor(monkeypatch):
    torch.manual_seed(0)
    model = build(llama_like())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, S), generator=gen)
    pos = torch.arange(S).unsqueeze(0).expand(2, S)
    seen = _record_sdpa(monkeypatch)
    without = model(ids, pos, None)
    with_mask = model(ids, pos, _causal(1))
    with_batch_mask = model(ids, pos, _causal(2))
    assert torch.equal(without, with_mask) and torch.equal(without, with_batch_mask)
    assert seen and all(no_mask and causal for no_mask, causal in seen)  # the fast path every time


def test_a_document_mask_is_still_honoured(monkeypatch):
    """A block-diagonal causal mask (two documents) is not the plain pattern: it is used, and it matters."""
    torch.manual_seed(0)
    model = build(llama_like())
    ids = torch.randint(0, VOCAB, (1, S))
    pos = torch.arange(S).unsqueeze(0)
    doc = _causal(1)
    doc[..., 6:, :6] = True  # tokens of the second document do not see the first
    seen = _record_sdpa(monkeypatch)
    masked = model(ids, pos, doc)
    assert seen and all(not no_mask for no_mask, _ in seen)
    plain = model(ids, pos, None)
    assert torch.allclose(masked[:, :6], plain[:, :6], atol=1e-6)
    assert not torch.allclose(masked[:, 6:], plain[:, 6:], atol=1e-3)
    second = model(ids[:, 6:], torch.arange(6).unsqueeze(0), None)
    # RoPE scores depend on relative positions only, so the second document alone gives the same logits.
    torch.testing.assert_close(masked[:, 6:], second, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("freq,expected", [(None, [True] * 4), (2, [True, False, True, False]),
                                           ([1, 1, 0, 1], [True, True, False, True])])
def test_window_attn_skip_freq_picks_the_window_layers(freq, expected):
    model = build(llama_like(num_layers=4, window_size=(3, 0), window_attn_skip_freq=freq))
    got = [layer.self_attention.core_attention.window_size is not None for layer in model.decoder.layers]
    assert got == expected
    with pytest.raises(ValueError, match=r"window_attn_skip_freq \(\[1, 0\]\) must be a positive int or a list"):
        build(llama_like(num_layers=4, window_size=(3, 0), window_attn_skip_freq=[1, 0]))
