"""The per-head largest attention logit that ``DotProductAttention`` records for QK-clip, fp32 on CPU.

- Recorded maxima equal an explicit ``Q K^T * scale`` with the mask applied (causal, padding mask, sliding window,
  GQA, cross lengths, packed documents with padding), and accumulate over forwards as an element-wise max.
- Recording changes neither the attention output nor any gradient (bit for bit), for the core attention and for
  a whole GPTModel.
- Context parallelism (CP=2, every comm type): the ranks' maxima, combined by MAX, equal one process's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.attention_max_logit import max_logits
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.utils import get_batch_on_this_cp_rank
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like

HEADS, GROUPS, HN = 4, 2, 8


def _config(**overrides) -> TransformerConfig:
    cfg = dict(num_layers=1, hidden_size=HEADS * HN, num_attention_heads=HEADS, num_query_groups=GROUPS,
               attention_dropout=0.0, log_max_attention_logit=True)
    return TransformerConfig(**{**cfg, **overrides})


def _qkv(sq: int, sk: int, b: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, HEADS, HN, generator=gen) * 3
    k = torch.randn(sk, b, GROUPS, HN, generator=gen) * 3
    v = torch.randn(sk, b, GROUPS, HN, generator=gen)
    return q, k, v


def _reference(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Explicit per-head max of ``Q K^T * scale`` over ``keep`` (``[b or 1, 1, sq, sk]``, True = visible)."""
    qb = q.permute(1, 2, 0, 3).double()
    kb = k.permute(1, 2, 0, 3).double().repeat_interleave(HEADS // GROUPS, dim=1)
    scores = qb @ kb.transpose(-1, -2) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.amax(dim=(0, 2, 3)).float()


def _causal(sq: int, sk: int) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)[None, None]


def test_causal_matches_explicit_scores() -> None:
    attn = DotProductAttention(_config(), 1, AttnMaskType.causal)
    q, k, v = _qkv(6, 6)
    attn(q, k, v, None)
    torch.testing.assert_close(attn.current_max_attn_logits, _reference(q, k, _causal(6, 6), attn.softmax_scale),
                               rtol=1e-6, atol=1e-6)
    # The plain causal mask tensor takes the same (fast) path and gives the same maxima.
    attn.current_max_attn_logits = None
    attn(q, k, v, ~_causal(6, 6))
    torch.testing.assert_close(attn.current_max_attn_logits, _reference(q, k, _causal(6, 6), attn.softmax_scale),
                               rtol=1e-6, atol=1e-6)


def test_causal_mask_excludes_the_largest_future_logit() -> None:
    attn = DotProductAttention(_config(), 1, AttnMaskType.causal)
    q, k, v = _qkv(5, 5)
    k[4] = q[0, :, ::2] * 10  # the last key aligns with the first query: a huge logit that the mask hides
    attn(q, k, v, None)
    masked_out = _reference(q, k, None, attn.softmax_scale)
    assert torch.all(attn.current_max_attn_logits[::2] < masked_out[::2])  # heads 0 and 2 meet their own query
    torch.testing.assert_close(attn.current_max_attn_logits, _reference(q, k, _causal(5, 5), attn.softmax_scale))


@pytest.mark.parametrize("case", ["padding", "window", "bottom_right", "no_mask"])
def test_masks_windows_and_lengths(case: str) -> None:
    sq, sk = (3, 7) if case == "bottom_right" else (6, 6)
    q, k, v = _qkv(sq, sk, seed=1)
    overrides, mask_type, mask, keep = {}, AttnMaskType.causal, None, _causal(sq, sk)
    if case == "padding":
        mask_type = AttnMaskType.padding
        mask = torch.rand(2, 1, sq, sk, generator=torch.Generator().manual_seed(5)) < 0.4  # True = masked
        mask[..., 0] = False
        keep = ~mask
    elif case == "window":
        overrides = dict(window_size=(2, 0))
        pos = torch.arange(sq)
        keep = keep & ((pos[:, None] - pos[None, :]) <= 2)[None, None]
    elif case == "bottom_right":
        mask_type = AttnMaskType.causal_bottom_right
    else:
        mask_type, keep = AttnMaskType.no_mask, None
    attn = DotProductAttention(_config(**overrides), 1, mask_type)
    attn(q, k, v, mask)
    torch.testing.assert_close(attn.current_max_attn_logits, _reference(q, k, keep, attn.softmax_scale),
                               rtol=1e-6, atol=1e-6)


def test_packed_documents_use_real_tokens_of_each_document() -> None:
    attn = DotProductAttention(_config(), 1, AttnMaskType.causal)
    q, k, v = _qkv(10, 10, b=1, seed=2)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_padded = torch.tensor([0, 4, 10], dtype=torch.int32)  # documents of 3 and 4 tokens, padded to 4 and 6
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=cu_padded, max_seqlen_q=6, max_seqlen_kv=6)
    q[3], q[9] = q[0] * 50, q[4] * 50  # padding tokens with huge queries must not count
    attn(q, k, v, None, packed_seq_params=params)
    docs = [_reference(q[a:a + n], k[a:a + n], _causal(n, n), attn.softmax_scale) for a, n in ((0, 3), (4, 4))]
    torch.testing.assert_close(attn.current_max_attn_logits, torch.maximum(*docs), rtol=1e-6, atol=1e-6)


def test_records_accumulate_as_running_max_and_not_when_off() -> None:
    attn = DotProductAttention(_config(), 1, AttnMaskType.causal)
    first, second = _qkv(6, 6, seed=3), _qkv(6, 6, seed=4)
    attn(*first, None)
    attn(*second, None)
    expected = torch.maximum(*(_reference(q, k, _causal(6, 6), attn.softmax_scale) for q, k, _ in (first, second)))
    torch.testing.assert_close(attn.current_max_attn_logits, expected, rtol=1e-6, atol=1e-6)
    assert not attn.current_max_attn_logits.requires_grad
    off = DotProductAttention(_config(log_max_attention_logit=False), 1, AttnMaskType.causal)
    off(*first, None)
    assert off.current_max_attn_logits is None


def test_tiles_match_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_core.transformer import attention_max_logit

    q, k, _ = _qkv(9, 9, seed=6)
    qb, kb = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)
    whole = max_logits(qb, kb, 0.3, causal=True)
    monkeypatch.setattr(attention_max_logit, "_TILE_ELEMENTS", 2 * HEADS * 9)  # two query rows per tile
    torch.testing.assert_close(max_logits(qb, kb, 0.3, causal=True), whole, rtol=0, atol=0)


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
def test_output_and_gradients_unchanged_by_recording(mask_type: AttnMaskType) -> None:
    results = []
    mask = None if mask_type == AttnMaskType.causal else torch.rand(2, 1, 6, 6) < 0.3
    for on in (False, True):
        attn = DotProductAttention(_config(log_max_attention_logit=on), 1, mask_type)
        q, k, v = (t.requires_grad_() for t in _qkv(6, 6, seed=7))
        out = attn(q, k, v, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for off, on in zip(*results):
        assert torch.equal(off, on)


def test_gpt_model_loss_and_gradients_unchanged_and_maxima_match_hooks() -> None:
    runs = []
    for flag in (False, True):
        torch.manual_seed(11)
        model = build(llama_like(), qk_clip=flag)
        seen: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        hooks = [layer.self_attention.core_attention.register_forward_pre_hook(
            lambda mod, args, s=seen: s.append((args[0].detach(), args[1].detach(), mod.softmax_scale)))
            for layer in model.decoder.layers]
        ids, pos, labels = batch()
        loss = model(ids, pos, None, labels=labels)
        loss.sum().backward()
        for hook in hooks:
            hook.remove()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model, seen))
    (loss_off, grads_off, _, _), (loss_on, grads_on, model, seen) = runs
    assert torch.equal(loss_off, loss_on)
    assert all(torch.equal(grads_off[n], grads_on[n]) for n in grads_off)
    heads, groups = model.config.num_attention_heads, model.config.num_query_groups
    for layer, (q, k, scale) in zip(model.decoder.layers, seen):
        kb = k.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1).double()
        scores = q.permute(1, 2, 0, 3).double() @ kb.transpose(-1, -2) * scale
        scores = scores.masked_fill(~_causal(q.shape[0], q.shape[0]), float("-inf"))
        torch.testing.assert_close(layer.self_attention.core_attention.current_max_attn_logits,
                                   scores.amax(dim=(0, 2, 3)).float(), rtol=1e-6, atol=1e-6)
    assert math.isfinite(float(model.decoder.layers[0].self_attention.core_attention.current_max_attn_logits.max()))


CP = 2


def _cp_check(comm_type: str) -> None:
    q, k, v = _qkv(8, 8, seed=9)
    parallel_state.initialize_model_parallel(context_parallel_size=CP)
    try:
        attn = DotProductAttention(_config(cp_comm_type=comm_type, context_parallel_size=CP), 1, AttnMaskType.causal)
        local = get_batch_on_this_cp_rank({"q": q.transpose(0, 1), "k": k.transpose(0, 1), "v": v.transpose(0, 1)})
        attn(*(local[n].transpose(0, 1).contiguous() for n in ("q", "k", "v")), None)
        found = attn.current_max_attn_logits.clone()
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=parallel_state.get_context_parallel_group())
        torch.testing.assert_close(found, _reference(q, k, _causal(8, 8), attn.softmax_scale), rtol=1e-6, atol=1e-6)
    finally:
        parallel_state.destroy_model_parallel()


def _cp_all() -> None:
    for comm_type in ("p2p", "all_gather", "a2a"):
        _cp_check(comm_type)


def test_context_parallel_maxima_match_one_process() -> None:
    run_on_ranks(CP, _cp_all)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_on_cuda_matches_explicit_scores_and_keeps_the_output() -> None:
    """On CUDA in bf16 (the fused SDPA kernels), at a length that needs several row tiles: the recorded maxima
    equal the explicit scores of the same bf16 inputs, and recording leaves the output bit-identical."""
    cfg = _config(bf16=True, params_dtype=torch.bfloat16)
    sq = 4096
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv(sq, sq, b=2, seed=5))
    recording = DotProductAttention(cfg, 1, AttnMaskType.causal).cuda()
    plain = DotProductAttention(_config(bf16=True, params_dtype=torch.bfloat16, log_max_attention_logit=False), 1,
                                AttnMaskType.causal).cuda()
    out = recording(q, k, v, None)
    assert torch.equal(out, plain(q, k, v, None))
    want = _reference(q.float().cpu(), k.float().cpu(), _causal(sq, sq), recording.softmax_scale)
    torch.testing.assert_close(recording.current_max_attn_logits.float().cpu(), want, rtol=1e-5, atol=1e-4)
