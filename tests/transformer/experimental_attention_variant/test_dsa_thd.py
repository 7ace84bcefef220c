"""DeepSeek sparse attention over packed sequences (THD) equals running each document alone (fp32, 1e-5).

A 2-layer DSA GPT in training mode (indexer KL loss on, dense or sparse, mean or per-token) runs one packed
micro-batch of three documents and, separately, each document as its own micro-batch. Per-token losses, the
indexer loss (a mean over all packed rows: the documents' losses weighted by their lengths) and every gradient
agree, with top-k smaller than every document, between the document lengths, and larger than all of them, and
with the second layer reusing the first one's top-k (``dsa_indexer_topk_freq=2``). The masking helpers for the
packed "varlen" bounds match the additive masks they stand for.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer.experimental_attention_variant import dsa_masking
from megatron_core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossAutoScaler,
    DSAIndexerLossLoggingHelper,
    fused_qk_topk_naive,
    unfused_dsa_fn,
)
from megatron_core.transformer.experimental_attention_variant.dsa_indexer_loss import compute_dsa_indexer_loss
from megatron_core.transformer.experimental_attention_variant.dsa_layout import dsa_token_layout
from tests.transformer.experimental_attention_variant.dsa_common import (
    TOL,
    VOCAB,
    dsa_config,
    dsa_gpt,
    reset_dsa_globals,
)

DOCS = (5, 3, 8)


def packed_params(lengths: tuple[int, ...]) -> PackedSeqParams:
    """THD params of documents with these lengths, unpadded."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                           max_seqlen_kv=max(lengths))


def _tokens(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(DOCS)
    return torch.randint(0, VOCAB, (1, total), generator=gen), torch.randint(0, VOCAB, (1, total), generator=gen)


def _run(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, params: PackedSeqParams | None,
         positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(per-token loss, indexer loss of layer 1)``; backward of the summed per-token loss (+ indexer loss)."""
    DSAIndexerLossLoggingHelper.tracker.clear()
    loss = model(ids, positions, None, labels=labels, packed_seq_params=params)
    loss.sum().backward()
    return loss.detach(), float(DSAIndexerLossLoggingHelper.tracker["values"][0])


# Without the ReLU the index scores have no ties (with it, keys scoring exactly 0 tie and top-k may pick any of
# them, differently for different sequence lengths); the ReLU runs with top-k above every document.
@pytest.mark.parametrize("topk,relu", [(2, False), (6, False), (20, False), (20, True)],
                         ids=["topk_below_all_docs", "topk_between", "topk_above_all_docs", "topk_above_relu"])
@pytest.mark.parametrize("overrides", [dict(), dict(calculate_per_token_loss=True),
                                       dict(dsa_indexer_use_sparse_loss=True, dsa_indexer_topk_freq=2)],
                         ids=["mean_loss", "per_token_loss", "sparse_loss_shared_topk"])
def test_packed_equals_each_document_alone(topk: int, relu: bool, overrides: dict):
    reset_dsa_globals()
    # Weights large enough for an indexer loss of ~0.01-0.1 (at the default 0.02 it is ~1e-6).
    cfg = dsa_config(dsa_indexer_topk=topk, dsa_indexer_scoring_relu=relu, init_method_std=0.2, **overrides)
    per_token = cfg.calculate_per_token_loss
    ids, labels = _tokens()
    model = dsa_gpt(cfg).train()
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    packed_loss, packed_indexer = _run(model, ids, labels, packed_params(DOCS), positions)
    packed_grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    losses, indexer, start, total = [], 0.0, 0, sum(DOCS)
    for n in DOCS:
        # The packed indexer loss averages over all rows: each document's mean loss weighs n / total.
        weight = 1.0 if per_token else n / total
        DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(weight))
        doc_loss, doc_indexer = _run(model, ids[:, start:start + n], labels[:, start:start + n], None,
                                     torch.arange(n)[None])
        losses.append(doc_loss)
        indexer += weight * doc_indexer
        start += n
    reset_dsa_globals()
    torch.testing.assert_close(packed_loss, torch.cat(losses, dim=1), **TOL)
    assert packed_indexer > 1e-3
    assert packed_indexer == pytest.approx(indexer, rel=1e-5, abs=1e-8)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, **TOL, msg=lambda m, k=name: f"{k}: {m}")
    assert any("indexer" in name and g.abs().sum() > 0 for name, g in packed_grads.items())


def test_packed_rows_see_only_their_document():
    layout = dsa_token_layout(16, 1, 0, packed_params(DOCS))
    allowed = torch.isfinite(layout.causal_mask(16))
    doc = torch.tensor([0] * 5 + [1] * 3 + [2] * 8)
    want = (doc[:, None] == doc[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(allowed, want)
    assert layout.key_reorder is None


def test_varlen_bounds_equal_the_additive_mask():
    """``varlen_starts`` / ``varlen_ends`` give the same top-k, sparse attention and indexer loss as the mask."""
    gen = torch.Generator().manual_seed(0)
    sq, heads, d = 16, 3, 8
    cu = torch.tensor([0, 5, 8, 16])
    starts, ends = dsa_masking.generate_varlen_mask_params_for_positions(cu, torch.arange(sq))
    mask = dsa_token_layout(sq, 1, 0, packed_params(DOCS)).causal_mask(sq)
    q, k, w = torch.randn(sq, 1, 2, d, generator=gen), torch.randn(sq, 1, d, generator=gen), torch.randn(sq, 1, 2,
                                                                                                          generator=gen)
    scores_m, topk_m = fused_qk_topk_naive(q, k, w, 4, mask)
    scores_v, topk_v = fused_qk_topk_naive(q, k, w, 4, varlen_starts=starts, varlen_ends=ends)
    assert torch.equal(topk_m, topk_v) and torch.equal(scores_m, scores_v)
    query, key = torch.randn(sq, heads, d, generator=gen), torch.randn(sq, 1, d, generator=gen)
    out_m = unfused_dsa_fn(query, key, key, topk_m, 0.3, mask=mask)
    out_v = unfused_dsa_fn(query, key, key, topk_m, 0.3, varlen_starts=starts, varlen_ends=ends)
    assert out_m.shape == (sq, heads * d)
    torch.testing.assert_close(out_m, out_v, rtol=0, atol=0)
    pg = type("PG", (), {"tp": None})()
    loss_m = compute_dsa_indexer_loss(scores_m, topk_m, query, key.expand(-1, heads, -1), 0.3, 1.0, False, pg,
                                      mask=mask)
    loss_v = compute_dsa_indexer_loss(scores_v, topk_v, query, key.expand(-1, heads, -1), 0.3, 1.0, False, pg,
                                      varlen_starts=starts, varlen_ends=ends)
    torch.testing.assert_close(loss_m, loss_v, rtol=0, atol=0)
    with pytest.raises(ValueError, match="either an additive mask or varlen_starts"):
        fused_qk_topk_naive(q, k, w, 4, mask, varlen_starts=starts, varlen_ends=ends)


def test_real_token_rows_limit_the_indexer_loss():
    """``real_token_mask_q`` on the packed params drops padding rows from the indexer loss's average."""
    rows = torch.tensor([True] * 12 + [False] * 4)
    got = dsa_masking.extract_query_valid_rows_from_packed_seq_params(
        type("P", (), {"real_token_mask_q": rows})(), b=1, sq=16, device=torch.device("cpu"))
    assert torch.equal(got, rows[None])
    assert dsa_masking.extract_query_valid_rows_from_packed_seq_params(packed_params(DOCS), b=1, sq=16,
                                                                       device=torch.device("cpu")) is None
