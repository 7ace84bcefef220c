"""DeepSeek sparse attention pieces and training behaviour, fp32 on CPU.

- ``unfused_dsa_fn`` equals a per-query loop (shared or per-head keys, causal or given masks, empty slots), in
  output and gradients; with top-k >= sequence the DSA layer equals dense MLA on the same weights; DSAttention's
  absorbed layout (one latent key head, ``up_v_weight``) equals the expanded one, indexer loss included.
- ``rotate_activation`` is the orthonormal Sylvester Hadamard transform.
- The indexer KL loss equals its formula (dense, sparse, per-token); its gradient reaches only the indexer and
  scales with ``dsa_indexer_loss_coeff`` and ``DSAIndexerLossAutoScaler.set_loss_scale``; the logger records it.
- Top-k sharing (``dsa_indexer_topk_freq``): which layers compute, and that skip layers have no indexer.
- A 2-layer DSA GPT trains with finite, decreasing loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_core.models.gpt import get_gpt_layer_local_spec
from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossAutoScaler,
    DSAIndexerLossLoggingHelper,
    compute_dsa_indexer_loss,
    is_dsa_skip_topk_layer,
    rotate_activation,
    source_dsa_compute_layer,
    unfused_dsa_fn,
)
from megatron_core.transformer.spec_utils import build_module
from tests.transformer.experimental_attention_variant.dsa_common import (
    BATCH,
    SEQ,
    TOL,
    batch,
    dsa_config,
    dsa_gpt,
    dsa_layer,
    reset_dsa_globals,
)


@pytest.fixture(autouse=True)
def _clean_globals():
    reset_dsa_globals()
    yield
    reset_dsa_globals()


class _Tp1:
    tp = None


# --- sparse attention ---------------------------------------------------------------------------------------------
def _naive_sparse(query, key, value, topk, scale, mask):
    sq, b, heads, _ = query.shape
    rows = []
    for s in range(sq):
        per_b = []
        for bi in range(b):
            per_h = []
            for h in range(heads):
                keys = [int(t) for t in topk[bi, s] if t >= 0 and math.isfinite(float(mask[bi, s, t]))]
                kh, vh = min(h, key.shape[2] - 1), min(h, value.shape[2] - 1)
                if not keys:
                    per_h.append(torch.zeros(value.shape[-1]))
                    continue
                idx = torch.tensor(keys)
                logits = key[idx, bi, kh] @ query[s, bi, h] * scale + mask[bi, s, idx]
                per_h.append(torch.softmax(logits, -1) @ value[idx, bi, vh])
            per_b.append(torch.cat(per_h))
        rows.append(torch.stack(per_b))
    return torch.stack(rows)


@pytest.mark.parametrize("key_heads,masked", [(1, False), (3, False), (3, True)],
                         ids=["shared_key_causal", "per_head_causal", "per_head_given_mask"])
def test_unfused_dsa_fn_equals_per_query_loop(key_heads: int, masked: bool):
    gen = torch.Generator().manual_seed(0)
    sq, b, heads, hn, hv, k = 9, 2, 3, 5, 4, 4
    query = torch.randn(sq, b, heads, hn, generator=gen, requires_grad=True)
    key = torch.randn(sq, b, key_heads, hn, generator=gen, requires_grad=True)
    value = torch.randn(sq, b, key_heads, hv, generator=gen, requires_grad=True)
    topk = torch.stack([torch.stack([torch.randperm(sq, generator=gen)[:k] for _ in range(sq)]) for _ in range(b)])
    topk[:, :, -1] = -1  # an empty slot in every row
    causal = torch.triu(torch.full((sq, sq), float("-inf")), diagonal=1)
    mask = (torch.zeros(b, sq, sq).masked_fill(torch.rand(b, sq, sq, generator=gen) < 0.3, float("-inf"))
            if masked else None)
    out = unfused_dsa_fn(query, key, value, topk, 0.37, mask=mask)
    expected = _naive_sparse(query, key, value, topk, 0.37, mask if masked else causal.expand(b, sq, sq))
    torch.testing.assert_close(out, expected.reshape(sq, b, -1), **TOL)
    weights = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected.reshape(sq, b, -1) * weights).sum(), (query, key, value))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_topk_covering_the_sequence_equals_dense_mla():
    cfg = dsa_config(dsa_indexer_topk=SEQ)
    sparse = dsa_layer(cfg).eval()
    dense_spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True).submodules.self_attention
    dense = build_module(dense_spec, config=cfg, layer_number=1).eval()
    missing, _ = dense.load_state_dict(sparse.state_dict(), strict=False)
    assert not [k for k in missing if "_extra_state" not in k]
    x = torch.randn(SEQ, BATCH, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(sparse(x, None)[0], dense(x, None)[0], **TOL)


def test_absorbed_layout_equals_expanded_layout():
    cfg = dsa_config()
    attention = dsa_layer(cfg).core_attention.train()
    gen = torch.Generator().manual_seed(6)
    n, d, r, c, v = 4, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    q_nope, q_pe = torch.randn(SEQ, BATCH, n, d, generator=gen), torch.randn(SEQ, BATCH, n, r, generator=gen)
    latent, k_pe = torch.randn(SEQ, BATCH, c, generator=gen), torch.randn(SEQ, BATCH, 1, r, generator=gen)
    w_uk, w_uv = torch.randn(n, d, c, generator=gen), torch.randn(n, v, c, generator=gen)
    x, qr = torch.randn(SEQ, BATCH, 32, generator=gen), torch.randn(SEQ, BATCH, 16, generator=gen)
    query = torch.cat((q_nope, q_pe), -1)
    key = torch.cat((torch.einsum("sbc,ndc->sbnd", latent, w_uk), k_pe.expand(-1, -1, n, -1)), -1)
    value = torch.einsum("sbc,nvc->sbnv", latent, w_uv)
    expanded = attention(query, key, value, None, x, qr, attn_mask_type=AttnMaskType.causal)
    loss_expanded = DSAIndexerLossLoggingHelper.tracker["values"].clone()
    reset_dsa_globals()
    absorbed_query = torch.cat((torch.einsum("sbnd,ndc->sbnc", q_nope, w_uk), q_pe), -1)
    absorbed = attention(absorbed_query, torch.cat((latent.unsqueeze(2), k_pe), -1), None, None, x, qr,
                         attn_mask_type=AttnMaskType.causal, up_v_weight=w_uv)
    torch.testing.assert_close(absorbed, expanded, **TOL)
    torch.testing.assert_close(DSAIndexerLossLoggingHelper.tracker["values"], loss_expanded, **TOL)


def test_rotate_activation_is_the_orthonormal_hadamard():
    h = torch.ones(1, 1)
    for _ in range(4):
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(rotate_activation(x), x @ h / 4.0, **TOL)
    y = torch.randn(5, 16)
    torch.testing.assert_close(rotate_activation(x) @ rotate_activation(y).T, x @ y.T, **TOL)
    with pytest.raises(ValueError, match="power-of-two"):
        rotate_activation(torch.randn(2, 12))


# --- indexer loss ---------------------------------------------------------------------------------------------------
def _loss_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sq, b, heads, hn = 7, 2, 3, 4
    causal = torch.triu(torch.full((sq, sq), float("-inf")), diagonal=1)
    scores = (torch.randn(b, sq, sq, generator=gen) + causal).requires_grad_()
    topk = scores.detach().topk(3, dim=-1)
    topk = topk.indices.masked_fill(topk.values == float("-inf"), -1)
    return scores, topk, torch.randn(sq, b, heads, hn, generator=gen), torch.randn(sq, b, heads, hn, generator=gen)


def _loss_formula(scores, topk, query, key, scale, coeff, sparse):
    sq = query.shape[0]
    keep = torch.isfinite(torch.triu(torch.full((sq, sq), float("-inf")), diagonal=1)).expand(scores.shape).clone()
    if sparse:
        chosen = torch.zeros_like(keep)
        for bi in range(topk.shape[0]):
            for s in range(sq):
                chosen[bi, s, [int(t) for t in topk[bi, s] if t >= 0]] = True
        keep &= chosen
    attn = torch.einsum("sbnd,tbnd->bnst", query, key) * scale
    attn = torch.softmax(attn.masked_fill(~keep[:, None], float("-inf")), -1).sum(1)
    target = attn / attn.sum(-1, keepdim=True)
    log_pred = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), -1)
    kl = torch.where(keep, target * (torch.log(target.clamp_min(1e-10)) - log_pred), torch.zeros(()))
    return kl.sum(-1).mean() * coeff


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_loss", "sparse_loss"])
def test_indexer_loss_equals_formula(sparse: bool):
    scores, topk, query, key = _loss_inputs()
    loss = compute_dsa_indexer_loss(scores, topk, query, key, 0.5, 0.3, sparse, _Tp1())
    expected = _loss_formula(scores, topk, query, key, 0.5, 0.3, sparse)
    torch.testing.assert_close(loss, expected, **TOL)
    torch.testing.assert_close(torch.autograd.grad(loss, scores)[0], torch.autograd.grad(expected, scores)[0], **TOL)
    per_token = compute_dsa_indexer_loss(scores, topk, query, key, 0.5, 0.3, sparse, _Tp1(),
                                         calculate_per_token_loss=True)
    torch.testing.assert_close(per_token, expected * scores.shape[0] * scores.shape[1], **TOL)


def _indexer_and_main_grads(coeff: float, scale: float | None = None):
    layer = dsa_layer(dsa_config(dsa_indexer_loss_coeff=coeff)).train()
    if scale is not None:
        DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(scale))
    x = torch.randn(SEQ, BATCH, 32, generator=torch.Generator().manual_seed(2))
    out, _ = layer(x, None)
    out.square().sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return ({n: g for n, g in grads.items() if ".indexer." in n},
            {n: g for n, g in grads.items() if ".indexer." not in n})


def test_indexer_loss_gradient_scales_with_coeff_and_loss_scale():
    base_indexer, base_main = _indexer_and_main_grads(0.1)
    assert all(g is not None and g.abs().sum() > 0 for g in base_indexer.values())
    for coeff, scale, factor in ((0.2, None, 2.0), (0.1, 3.0, 3.0)):
        reset_dsa_globals()
        indexer, main = _indexer_and_main_grads(coeff, scale)
        for name, grad in indexer.items():
            torch.testing.assert_close(grad, base_indexer[name] * factor, **TOL)
        for name, grad in main.items():  # the indexer loss never reaches the main attention
            torch.testing.assert_close(grad, base_main[name], **TOL)
    reset_dsa_globals()
    indexer, main = _indexer_and_main_grads(0.0)
    assert all(g is None for g in indexer.values())
    for name, grad in main.items():
        torch.testing.assert_close(grad, base_main[name], **TOL)


def test_indexer_loss_is_logged_per_layer():
    model = dsa_gpt(dsa_config()).train()
    ids, pos, labels = batch()
    model(ids, pos, None, labels=labels).sum().backward()
    values = DSAIndexerLossLoggingHelper.tracker["values"]
    assert values.shape == (2,) and torch.all(values > 0)
    logged: dict = {}
    DSAIndexerLossLoggingHelper.track_indexer_metrics(2.0, 1, None, total_loss_dict=logged)
    torch.testing.assert_close(logged["indexer loss"], values.sum())
    assert torch.all(DSAIndexerLossLoggingHelper.tracker["values"] == 0)


# --- top-k sharing --------------------------------------------------------------------------------------------------
def test_skip_topk_layers_follow_freq_and_offset():
    assert [is_dsa_skip_topk_layer(n, 0, 2) for n in range(1, 7)] == [False, True, False, True, False, True]
    assert [is_dsa_skip_topk_layer(n, 3, 2) for n in range(1, 7)] == [False, False, False, True, False, True]
    assert [source_dsa_compute_layer(n, 3, 2) for n in range(1, 7)] == [1, 2, 3, 3, 5, 5]
    assert [source_dsa_compute_layer(n, 0, 3) for n in range(1, 8)] == [1, 1, 1, 4, 4, 4, 7]
    with pytest.raises(ValueError, match="1-based"):
        is_dsa_skip_topk_layer(0, 0, 2)


def test_shared_topk_layers_reuse_the_source_selection():
    cfg = dsa_config(num_layers=4, dsa_indexer_topk_freq=2)
    model = dsa_gpt(cfg).train()
    attentions = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert [a.indexer is None for a in attentions] == [False, True, False, True]
    assert not any("layers.1.self_attention.core_attention.indexer" in k for k in model.state_dict())
    ids, pos, labels = batch()
    model(ids, pos, None, labels=labels).sum().backward()
    holder = getattr(cfg, attentions[0]._HOLDER_ATTR)
    assert sorted(holder) == [1, 3] and holder[1].shape == (BATCH, SEQ, 5)
    split = dict(num_layers=4, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    get_transformer_block_with_experimental_attention_variant_spec(
        dsa_config(dsa_indexer_topk_freq=2, **split), pp_rank=1)  # layers 3, 4: 4 reuses 3
    with pytest.raises(ValueError, match="layer 3 reuses the top-k of layer 1"):
        get_transformer_block_with_experimental_attention_variant_spec(
            dsa_config(dsa_indexer_topk_freq=3, **split), pp_rank=1)


# --- training -------------------------------------------------------------------------------------------------------
def test_two_layer_dsa_gpt_trains():
    model = dsa_gpt(dsa_config(dsa_indexer_use_sparse_loss=True)).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids, pos, labels = batch()
    losses = []
    for _ in range(8):
        loss = model(ids, pos, None, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3 and all(b < a for a, b in zip(losses, losses[1:]))
