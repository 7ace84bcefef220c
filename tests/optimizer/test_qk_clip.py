"""QK-clip (``megatron_core.optimizer.qk_clip.clip_qk`` and the attentions' ``clip_qk``), fp32 on CPU.

- MHA: exactly the heads over the threshold are rescaled (queries by eta ** alpha, keys by eta ** (1 - alpha),
  Megatron-Core's formula, computed here from the recorded maxima); other rows are unchanged bit for bit; on the
  same input the clipped heads' maxima then equal the threshold (1e-5); records are reset, the max is returned.
- GQA: one eta per key/value group from its heads' largest logit; MLA: per head, position query rows by eta.
- ``log_max_only`` leaves the weights; wrapped chunks (Float16Module, DDP) and a bare model are walked.
- TP=2 (DDP-wrapped) equals one process: recorded maxima and the weights after clip_qk (1e-5).
- Validation of the config fields and of clip_qk's preconditions.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer.qk_clip import clip_qk
from megatron_core.transformer import MLATransformerConfig, TransformerConfig
from megatron_core.transformer.attention import _scale_weight_rows_
from megatron_core.transformer.module import Float16Module
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import MAX_SEQ, VOCAB, batch, build, llama_like, shard, unshard

ALPHA = 0.3


def _model(num_layers: int = 1, groups: int = 8, seed: int = 5, **overrides) -> GPTModel:
    torch.manual_seed(seed)
    model = build(llama_like(**{**dict(num_layers=num_layers, num_query_groups=groups, qk_clip=True,
                                       qk_clip_alpha=ALPHA), **overrides}))
    with torch.no_grad():  # larger query/key weights, so that the logits spread over several units
        for layer in model.decoder.layers:
            layer.self_attention.linear_qkv.weight.mul_(20)
    return model


def _forward(model: torch.nn.Module) -> None:
    ids, pos, _ = batch()
    with torch.no_grad():
        model(ids, pos, None)


def _maxima(model: GPTModel) -> list[torch.Tensor]:
    return [layer.self_attention.core_attention.current_max_attn_logits.clone() for layer in model.decoder.layers]


def _qkv_rows(weight: torch.Tensor, groups: int, per_group: int, hn: int) -> tuple[torch.Tensor, ...]:
    w = weight.view(groups, (per_group + 2) * hn, -1)
    return w[:, :per_group * hn], w[:, per_group * hn:(per_group + 1) * hn], w[:, (per_group + 1) * hn:]


def test_mha_clips_exactly_the_heads_over_threshold() -> None:
    model = _model()
    _forward(model)
    attn = model.decoder.layers[0].self_attention
    before = attn.linear_qkv.weight.detach().clone()
    maxima = _maxima(model)[0]
    threshold = float(maxima.median())
    model.config.qk_clip_threshold = threshold
    over = maxima > threshold
    assert 0 < int(over.sum()) < maxima.numel()
    assert clip_qk([model]) == pytest.approx(float(maxima.max()))
    assert attn.core_attention.current_max_attn_logits is None
    eta = torch.clamp(threshold / maxima, max=1.0)
    q0, k0, v0 = _qkv_rows(before, 8, 1, 4)
    q1, k1, v1 = _qkv_rows(attn.linear_qkv.weight.detach(), 8, 1, 4)
    assert torch.equal(q1[~over], q0[~over]) and torch.equal(k1[~over], k0[~over]) and torch.equal(v1, v0)
    assert torch.equal(q1[over], q0[over] * torch.pow(eta[over], ALPHA)[:, None, None])
    assert torch.equal(k1[over], k0[over] * torch.pow(eta[over], 1 - ALPHA)[:, None, None])
    _forward(model)
    after = _maxima(model)[0]
    torch.testing.assert_close(after[over], torch.full_like(after[over], threshold), rtol=1e-5, atol=1e-5)
    assert torch.equal(after[~over], maxima[~over])


def test_gqa_uses_one_eta_per_group() -> None:
    model = _model(groups=2)  # 8 heads, 4 per group
    _forward(model)
    attn = model.decoder.layers[0].self_attention
    before = attn.linear_qkv.weight.detach().clone()
    maxima = _maxima(model)[0]
    group_max = maxima.view(2, 4).amax(dim=1)
    threshold = float(group_max.min() + group_max.max()) / 2  # exactly one group is over
    model.config.qk_clip_threshold = threshold
    clip_qk(model)
    eta = torch.clamp(threshold / group_max, max=1.0)
    q0, k0, v0 = _qkv_rows(before, 2, 4, 4)
    q1, k1, v1 = _qkv_rows(attn.linear_qkv.weight.detach(), 2, 4, 4)
    assert torch.equal(q1, q0 * torch.pow(eta, ALPHA)[:, None, None])
    assert torch.equal(k1, k0 * torch.pow(eta, 1 - ALPHA)[:, None, None])
    assert torch.equal(v1, v0)
    _forward(model)
    after = _maxima(model)[0].view(2, 4)
    torch.testing.assert_close(after, maxima.view(2, 4) * eta[:, None], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after.amax(dim=1).max(), torch.tensor(threshold), rtol=1e-5, atol=1e-5)


def test_mla_clips_per_head() -> None:
    cfg = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, q_lora_rank=None,
                               kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                               ffn_hidden_size=64, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, qk_clip=True, qk_clip_alpha=ALPHA, rope_type="rope")
    torch.manual_seed(2)
    model = GPTModel(cfg, get_gpt_layer_local_spec(multi_latent_attention=True), VOCAB, MAX_SEQ,
                     position_embedding_type="rope")
    attn = model.decoder.layers[0].self_attention
    with torch.no_grad():
        attn.linear_q_proj.weight.mul_(30)
        attn.linear_kv_up_proj.weight.mul_(30)
        attn.linear_kv_down_proj.weight.mul_(30)
    _forward(model)
    maxima = _maxima(model)[0]
    q0, kv0, down0 = (w.detach().clone() for w in (attn.linear_q_proj.weight, attn.linear_kv_up_proj.weight,
                                                   attn.linear_kv_down_proj.weight))
    threshold = float(maxima.median())
    cfg.qk_clip_threshold = threshold
    over = maxima > threshold
    clip_qk([model])
    eta = torch.clamp(threshold / maxima, max=1.0)[:, None, None]
    q1 = attn.linear_q_proj.weight.detach().view(4, 12, -1)
    kv1 = attn.linear_kv_up_proj.weight.detach().view(4, 14, -1)
    q0, kv0 = q0.view(4, 12, -1), kv0.view(4, 14, -1)
    assert torch.equal(q1[:, :8], q0[:, :8] * torch.pow(eta, ALPHA))
    assert torch.equal(q1[:, 8:], q0[:, 8:] * eta)
    assert torch.equal(kv1[:, :8], kv0[:, :8] * torch.pow(eta, 1 - ALPHA))
    assert torch.equal(kv1[:, 8:], kv0[:, 8:])
    assert torch.equal(attn.linear_kv_down_proj.weight, down0)  # the shared key position channels stay
    assert torch.equal(q1[~over], q0[~over]) and torch.equal(kv1[~over], kv0[~over])
    _forward(model)
    after = _maxima(model)[0]
    torch.testing.assert_close(after[over], torch.full_like(after[over], threshold), rtol=1e-5, atol=1e-5)


def test_log_max_only_and_wrapped_chunks() -> None:
    model = _model(num_layers=2, bf16=True)
    wrapped = Float16Module(model.config, model)  # bf16 weights, as in mixed-precision training
    _forward(wrapped)
    maxima = _maxima(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.config.qk_clip_threshold = 1e-3
    assert clip_qk([wrapped], log_max_only=True) == pytest.approx(float(torch.stack(maxima).max()))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(layer.self_attention.core_attention.current_max_attn_logits is None for layer in model.decoder.layers)
    assert clip_qk([wrapped]) == 0.0  # nothing recorded since
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_main_param_is_rescaled_too() -> None:
    weight = torch.nn.Parameter(torch.randn(4, 3).bfloat16())
    weight.main_param = weight.detach().float().clone()
    rows = torch.tensor([1.0, 0.5, 0.25, 1.0])
    expected = weight.main_param * rows[:, None]
    _scale_weight_rows_(weight, rows)
    assert torch.equal(weight.main_param, expected)
    assert torch.equal(weight.detach(), expected.bfloat16())
    weight.main_param = torch.zeros(6)
    with pytest.raises(ValueError, match="sharded main_param"):
        _scale_weight_rows_(weight, rows)


@pytest.mark.parametrize("field, value", [("qk_clip_alpha", 0.0), ("qk_clip_alpha", 1.0), ("qk_clip_alpha", -0.5),
                                          ("qk_clip_threshold", 0), ("qk_clip_threshold", -1.0),
                                          ("qk_clip_threshold", float("inf"))])
def test_config_validation_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, qk_clip=True, **{field: value})
    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **{field: value})  # only checked with qk_clip


def test_config_defaults_match_megatron() -> None:
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert (cfg.qk_clip, cfg.qk_clip_alpha, cfg.qk_clip_threshold, cfg.log_max_attention_logit) == (
        False, 0.5, 100, False)


def test_clip_qk_preconditions() -> None:
    model = _model(qk_clip=False, log_max_attention_logit=True)
    attn = model.decoder.layers[0].self_attention
    _forward(model)
    with pytest.raises(ValueError, match="qk_clip=True"):
        attn.clip_qk()
    model.config.qk_clip = True
    attn.clip_qk()
    with pytest.raises(ValueError, match="current_max_attn_logits is None"):
        attn.clip_qk()
    with pytest.raises(ValueError, match="found no decoder"):
        clip_qk([torch.nn.Linear(2, 2)])


TP = 2


def _reference_tp() -> tuple[dict, list[torch.Tensor], dict, float]:
    model = _model(num_layers=2, groups=4)
    _forward(model)
    maxima = _maxima(model)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    threshold = float(torch.cat(maxima).median())
    model.config.qk_clip_threshold = threshold
    clip_qk([model])
    return state, maxima, {n: p.detach().clone() for n, p in model.named_parameters()}, threshold


def _tp_check() -> None:
    state, ref_maxima, ref_after, threshold = _reference_tp()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        model = build(llama_like(num_layers=2, num_query_groups=4, qk_clip=True, qk_clip_alpha=ALPHA,
                                 qk_clip_threshold=threshold), tensor_model_parallel_size=TP)
        rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], TP, rank, gated=True))
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        _forward(ddp)
        for mine, ref in zip(_maxima(model), ref_maxima):
            pieces = [torch.empty_like(mine) for _ in range(TP)]
            dist.all_gather(pieces, mine, group=group)
            torch.testing.assert_close(torch.cat(pieces), ref, rtol=1e-5, atol=1e-5)
        largest = torch.tensor(clip_qk([ddp]))  # this rank's heads: the max over TP is the model's
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        assert float(largest) == pytest.approx(float(torch.cat(ref_maxima).max()), rel=1e-5)
        for name, param in model.named_parameters():
            pieces = [torch.empty_like(param) for _ in range(TP)]
            dist.all_gather(pieces, param.detach().contiguous(), group=group)
            torch.testing.assert_close(unshard(name, pieces, gated=True), ref_after[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
    finally:
        parallel_state.destroy_model_parallel()


def test_tensor_parallel_matches_one_process() -> None:
    run_on_ranks(TP, _tp_check)
