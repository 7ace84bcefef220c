"""Multi-latent attention (``MLASelfAttention``, ``MLATransformerConfig``), fp32 on CPU.

- One MLA layer equals a direct computation from its own weights (written out here: low-rank q/kv
  projections, RMSNorms, DeepSeek's interleaved RoPE pairs with YaRN's cosine/sine factor, the mscale^2
  softmax scale), with and without ``q_lora_rank``, with plain RoPE, and with values wider than q/k heads.
- A GPTModel with MLA equals Megatron-Core's (the installed release, local spec) on the same weights:
  identical state-dict keys, logits and every gradient.
- TP=2 (with and without sequence parallelism) and CP=2 equal one process: loss and every gradient.
- Packed documents equal separate runs; the static and dynamic KV-cache contexts equal full forwards;
  selective recompute of ``mla_up_proj`` gives the same gradients.
- Config fields and refusals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.common.embeddings.yarn_rotary_pos_embedding import yarn_inv_freq
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer import MLATransformerConfig, TransformerConfig
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.multi_latent_attention import MLASelfAttention
from megatron_core.transformer.spec_utils import build_module
from megatron_core.utils import get_batch_on_this_cp_rank
from tests.dist_harness import run_on_ranks
from tests.megatron_oracle import megatron_on_cpu

VOCAB, SEQ, BATCH, MAX_SEQ = 64, 12, 2, 32
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
             qk_pos_emb_head_dim=4, v_head_dim=6, ffn_hidden_size=64, qk_layernorm=True, add_bias_linear=False,
             gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
             use_cpu_initialization=True, layernorm_epsilon=1e-6)
YARN = dict(rope_type="yarn", rotary_base=1000.0, rotary_scaling_factor=4.0, original_max_position_embeddings=8,
            mscale=1.0, mscale_all_dim=0.7)
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(**overrides) -> MLATransformerConfig:
    return MLATransformerConfig(**{**SHAPE, **YARN, **overrides})


def _model(cfg: MLATransformerConfig, seed: int = 3) -> GPTModel:
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=cfg.qk_layernorm)
    model = GPTModel(cfg, spec, VOCAB, MAX_SEQ, position_embedding_type="rope")
    _perturb_norms(model)
    return model


def _perturb_norms(module: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "layernorm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))


def _batch(seq: int = SEQ, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    return ids, torch.arange(seq).expand(BATCH, seq), labels


# --- a direct computation -----------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _get_mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _reference(attn: MLASelfAttention, cfg: MLATransformerConfig, x: torch.Tensor) -> torch.Tensor:
    """The layer's output ``[s, b, h]`` from its weights, causal, written out step by step."""
    s, b, _ = x.shape
    n, d, r, v = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    eps = cfg.layernorm_epsilon
    if cfg.q_lora_rank is None:
        q = x @ attn.linear_q_proj.weight.T
    else:
        q = _rms(x @ attn.linear_q_down_proj.weight.T, attn.q_layernorm.weight, eps) @ attn.linear_q_up_proj.weight.T
    q = q.view(s, b, n, d + r)
    combined = x @ attn.linear_kv_down_proj.weight.T
    latent, k_rot = combined[..., :cfg.kv_lora_rank], combined[..., cfg.kv_lora_rank:]
    kv = (_rms(latent, attn.kv_layernorm.weight, eps) @ attn.linear_kv_up_proj.weight.T).view(s, b, n, d + v)
    f = cfg.rotary_scaling_factor
    if cfg.rope_type == "yarn":
        inv_freq = yarn_inv_freq(r, cfg.rotary_base, f, cfg.original_max_position_embeddings, cfg.beta_fast,
                                 cfg.beta_slow)
        factor = _get_mscale(f, cfg.mscale) / _get_mscale(f, cfg.mscale_all_dim)
    else:
        inv_freq = 1.0 / cfg.rotary_base ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
        factor = 1.0
    theta = torch.arange(s, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = (torch.cos(theta) * factor)[:, None, None], (torch.sin(theta) * factor)[:, None, None]

    def rotate(t: torch.Tensor) -> torch.Tensor:  # pairs (t[2j], t[2j + 1]) turn by theta_j; evens first
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

    query = torch.cat((q[..., :d], rotate(q[..., d:])), dim=-1)
    key = torch.cat((kv[..., :d], rotate(k_rot[:, :, None, :]).expand(s, b, n, r)), dim=-1)
    value = kv[..., d:]
    scale = _get_mscale(f, cfg.mscale_all_dim) ** 2 / math.sqrt(d + r)
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bnst,tbnv->sbnv", scores.softmax(-1), value).reshape(s, b, n * v)
    return out @ attn.linear_proj.weight.T


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(q_lora_rank=None),
    dict(rope_type="rope", mscale_all_dim=0.0),
    dict(v_head_dim=16),
], ids=["q_lora_yarn", "no_q_lora", "plain_rope", "wide_values"])
def test_layer_matches_direct_computation(overrides: dict):
    cfg = _config(**overrides)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True).submodules.self_attention
    torch.manual_seed(0)
    attn = build_module(spec, config=cfg, layer_number=1)
    _perturb_norms(attn)
    assert isinstance(attn, MLASelfAttention) and hasattr(attn, "linear_q_proj") == (cfg.q_lora_rank is None)
    x = torch.randn(SEQ, BATCH, cfg.hidden_size)
    out, bias = attn(x, None)
    assert bias is None
    torch.testing.assert_close(out, _reference(attn, cfg, x), **TOL)


def test_softmax_scale_and_query_key_value_shapes():
    cfg = _config()
    attn = build_module(get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True).submodules
                        .self_attention, config=cfg, layer_number=1)
    m = 0.1 * 0.7 * math.log(4.0) + 1.0
    assert attn.softmax_scale == pytest.approx(m * m / math.sqrt(12))
    assert attn.core_attention.softmax_scale == attn.softmax_scale
    query, key, value, q_c, kv_c = attn.get_query_key_value_tensors(torch.randn(SEQ, BATCH, 32))
    assert query.shape == key.shape == (SEQ, BATCH, 4, 12) and value.shape == (SEQ, BATCH, 4, 6)
    assert q_c.shape == (SEQ, BATCH, 16) and kv_c.shape == (SEQ, BATCH, 12)
    # The rotated key channels are shared by every head.
    assert torch.equal(key[..., 8:], key[..., :1, 8:].expand_as(key[..., 8:]))


# --- Megatron-Core as an oracle ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _megatron_on_cpu():
    """The shared oracle setup, with the Transformer Engine class checks of Megatron-Core's MLA made harmless."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer import multi_latent_attention as their_mla

    class _NotTransformerEngine:  # their MLA checks isinstance(linear, TELinear) even without TE
        pass

    te_names = ("TELinear", "TEColumnParallelLinear", "Linear")
    saved_te = {name: getattr(their_mla, name, None) for name in te_names}
    for name in te_names:
        setattr(their_mla, name, _NotTransformerEngine)
    try:
        with megatron_on_cpu():
            yield
    finally:
        for name, value in saved_te.items():
            setattr(their_mla, name, value)


def _compare_with_megatron(overrides: dict) -> list[str]:
    with _megatron_on_cpu():
        from megatron.core.models.gpt import GPTModel as TheirGPT
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as their_local_spec
        from megatron.core.transformer.dot_product_attention import DotProductAttention as TheirAttention
        from megatron.core.transformer.transformer_config import MLATransformerConfig as TheirConfig

        class _TheirAttention(TheirAttention):  # their local core attention takes no k/v channel sizes
            def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
                super().__init__(*args, **kwargs)

        fields = {**SHAPE, **YARN, **overrides}
        # Their local core attention sizes its output by kv_channels: the value head width here.
        their_config = TheirConfig(**fields, kv_channels=fields["v_head_dim"])
        spec = their_local_spec(multi_latent_attention=True, qk_layernorm=True)
        spec.submodules.self_attention.submodules.core_attention = _TheirAttention
        torch.manual_seed(5)
        theirs = TheirGPT(their_config, spec, VOCAB, MAX_SEQ, position_embedding_type="rope")
        _perturb_norms(theirs)
        ours = _model(_config(**overrides))
        assert set(ours.state_dict()) == set(theirs.state_dict())
        ours.load_state_dict(theirs.state_dict())
        ids, pos, labels = _batch()
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
        want = theirs(ids, pos, causal, labels=labels)
        want.sum().backward()
        got = ours(ids, pos, None, labels=labels)
        got.sum().backward()
        torch.testing.assert_close(got, want, **TOL)
        their_grads = dict(theirs.named_parameters())
        for name, param in ours.named_parameters():
            torch.testing.assert_close(param.grad, their_grads[name].grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return sorted(ours.state_dict())


@pytest.mark.parametrize("overrides", [dict(), dict(q_lora_rank=None)], ids=["q_lora", "no_q_lora"])
def test_gpt_model_matches_megatron_core(overrides: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.transformer.multi_latent_attention")
    (keys,) = run_on_ranks(1, _compare_with_megatron, overrides)
    layer = "decoder.layers.0.self_attention."
    expected = {"linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "kv_layernorm.weight", "linear_proj.weight"}
    expected |= ({"linear_q_proj.weight"} if overrides.get("q_lora_rank", 16) is None else
                 {"linear_q_down_proj.weight", "linear_q_up_proj.weight", "q_layernorm.weight"})
    assert {k[len(layer):] for k in keys if k.startswith(layer) and not k.endswith("_extra_state")} == expected


# --- tensor and context parallelism ------------------------------------------------------------------------------
_COLUMN = ("linear_q_down_proj.weight", "linear_q_up_proj.weight", "linear_q_proj.weight",
           "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "word_embeddings.weight", "output_layer.weight")


def _shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if name.endswith("linear_fc1.weight"):  # [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat((gate.chunk(tp)[rank], up.chunk(tp)[rank]), dim=0)
    if name.endswith(_COLUMN):
        return full.chunk(tp, dim=0)[rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[rank]
    return full


def _unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(p.chunk(2, dim=0) for p in pieces))
        return torch.cat((*gates, *ups), dim=0)
    if name.endswith(_COLUMN):
        return torch.cat(pieces, dim=0)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(pieces, dim=1)
    return pieces[0]


def _reference_run(overrides: dict, seq: int) -> tuple[dict, torch.Tensor, dict]:
    single = {k: v for k, v in overrides.items() if k not in ("sequence_parallel", "cp_comm_type")}
    model = _model(_config(**single))
    ids, pos, labels = _batch(seq)
    loss = model(ids, pos, None, labels=labels)
    loss.sum().backward()
    return ({k: v.detach().clone() for k, v in model.named_parameters()}, loss.detach(),
            {k: v.grad.detach().clone() for k, v in model.named_parameters()})


def _check_parallel(tp: int, cp: int, overrides: dict) -> str:
    seq = SEQ if cp == 1 else 16
    state, ref_loss, ref_grads = _reference_run(overrides, seq)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = _model(_config(tensor_model_parallel_size=tp, context_parallel_size=cp, **overrides))
        tp_rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_shard(name, state[name], tp, tp_rank))
        ids, pos, labels = _batch(seq)
        batch = {"tokens": ids, "labels": labels, "position_ids": pos.contiguous()}
        cp_rank = parallel_state.get_context_parallel_rank()
        if cp > 1:
            batch = get_batch_on_this_cp_rank(batch)
            chunk = seq // (2 * cp)
            index = list(range(cp_rank * chunk, (cp_rank + 1) * chunk))
            index += list(range((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk))
            ref_loss = ref_loss[:, index]
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.sum().backward()
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            if cp > 1:
                dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            pieces = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            torch.testing.assert_close(_unshard(name, pieces), ref_grads[name], **TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return f"tp={tp} cp={cp} {overrides}"
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp,cp,overrides", [
    (2, 1, dict()),
    (2, 1, dict(sequence_parallel=True)),
    (2, 1, dict(q_lora_rank=None, sequence_parallel=True)),
    (1, 2, dict(cp_comm_type="p2p")),
], ids=["tp2", "tp2_sp", "tp2_sp_no_q_lora", "cp2"])
def test_parallel_matches_single_process(tp: int, cp: int, overrides: dict):
    assert len(run_on_ranks(2, _check_parallel, tp, cp, overrides)) == 2


# --- packed sequences, KV-cache contexts, recompute ----------------------------------------------------------------
def test_packed_documents_equal_separate_runs():
    model = _model(_config()).eval()
    gen = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 11)]
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11, max_seqlen_kv=11)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(ids, pos, None, packed_seq_params=params)
        separate = torch.cat([model(d[None], torch.arange(len(d))[None], None) for d in docs], dim=1)
    torch.testing.assert_close(packed, separate, **TOL)


@pytest.mark.parametrize("overrides", [dict(), dict(v_head_dim=16)], ids=["narrow_values", "wide_values"])
def test_static_kv_cache_equals_full_forward(overrides: dict):
    from megatron_core.inference.contexts import StaticInferenceContext

    model = _model(_config(**overrides)).eval()
    ids, pos, _ = _batch(16)
    with torch.no_grad():
        full = model(ids, pos, None)
        context = StaticInferenceContext(max_batch_size=BATCH, max_sequence_length=MAX_SEQ)
        steps = [model(ids[:, :10], pos[:, :10], None, inference_context=context)]
        for t in range(10, 16):
            context.sequence_len_offset = t
            steps.append(model(ids[:, t:t + 1], pos[:, t:t + 1], None, inference_context=context))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_dynamic_engine_greedy_equals_full_forwards():
    from megatron_core.inference.config import InferenceConfig
    from megatron_core.inference.contexts import DynamicInferenceContext
    from megatron_core.inference.engines import DynamicInferenceEngine
    from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
    from megatron_core.inference.sampling_params import SamplingParams
    from megatron_core.inference.text_generation_controllers import TextGenerationController

    model = _model(_config()).eval()
    prompts = [[3, 9, 14, 2, 7], [5, 1, 60, 33, 12, 8, 40, 22, 17]]
    new = 6
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(new):
                ids = torch.tensor([tokens])
                logits = model(ids, torch.arange(len(tokens))[None], None)
                tokens.append(int(logits[0, -1].argmax()))
            expected.append(tokens[len(prompt):])
    context = DynamicInferenceContext(model.config, InferenceConfig(block_size_tokens=4, buffer_size_gb=0.01,
                                                                    max_sequence_length=MAX_SEQ))
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), tokenizer=None),
                                    context)
    records = engine.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=new, termination_id=-1))
    assert [list(r.merge().generated_tokens) for r in records] == expected
    # The block budget counts what the cache holds: every head's key and value at the padded MLA width.
    keys, values = next(iter(context.kv_memory.values()))
    per_layer = (keys[0].numel() + values[0].numel()) * keys.element_size() * context.block_size_tokens
    assert per_layer * context.num_layers_local == context.bytes_per_block
    assert keys.shape[1:] == (model.config.num_attention_heads,
                              max(model.config.qk_head_dim + model.config.qk_pos_emb_head_dim,
                                  model.config.v_head_dim))


def _grads(model: GPTModel) -> tuple[torch.Tensor, dict]:
    ids, pos, labels = _batch()
    loss = model(ids, pos, None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {k: v.grad for k, v in model.named_parameters()}


def test_mla_up_proj_recompute_gives_the_same_gradients():
    ref_loss, ref_grads = _grads(_model(_config()))
    model = _model(_config(recompute_granularity="selective", recompute_modules=["mla_up_proj", "core_attn"]))
    assert model.decoder.layers[0].self_attention.recompute_up_proj
    loss, grads = _grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


# --- config fields and refusals ------------------------------------------------------------------------------------
MEGATRON_MLA_FIELDS = dict(
    multi_latent_attention=True, q_lora_rank=512, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
    v_head_dim=128, normalization="RMSNorm", rope_type="yarn", rotary_base=10000, rotary_percent=1.0,
    rotary_scaling_factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
    mscale_all_dim=0.0, cache_mla_latents=False, mla_down_proj_fusion=False,
)


def test_config_fields_and_defaults_follow_megatron_core():
    cfg = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    assert {name: getattr(cfg, name) for name in MEGATRON_MLA_FIELDS} == MEGATRON_MLA_FIELDS
    assert issubclass(MLATransformerConfig, TransformerConfig) and dataclasses.is_dataclass(cfg)
    from megatron_core.transformer.transformer_config import MLATransformerConfig as same

    assert same is MLATransformerConfig


@pytest.mark.parametrize("overrides,match", [
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(q_lora_rank=-1), "q_lora_rank"),
    (dict(qk_pos_emb_head_dim=5), r"qk_pos_emb_head_dim \(5\) must be even"),
    (dict(rope_type="longrope"), "rope_type"),
    (dict(rotary_scaling_factor=0.0), "rotary_scaling_factor"),
    (dict(rope_type="rope", rotary_percent=0.25), r"rotary_percent \(0.25\) = 1"),
    (dict(cache_mla_latents=True), "cache_mla_latents"),
    (dict(rotary_interleaved=True), "rotary_interleaved"),
    (dict(apply_rope_fusion=True, rope_type="rope"), "apply_rope_fusion"),
    (dict(softmax_type="learnable"), "softmax_type"),
    (dict(tensor_model_parallel_size=2, q_lora_rank=15), r"q_lora_rank \(15\) must be divisible"),
    (dict(tensor_model_parallel_size=4, kv_lora_rank=14), r"kv_lora_rank \+ qk_pos_emb_head_dim"),
])
def test_config_refusals_name_fields_and_values(overrides: dict, match: str):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


def test_other_refusals():
    with pytest.raises(ValueError, match="needs an MLATransformerConfig"):
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, multi_latent_attention=True)
    with pytest.raises(ValueError, match="'mla_up_proj', which needs multi_latent_attention=True"):
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, recompute_granularity="selective",
                          recompute_modules=["mla_up_proj"])
    cfg = _config()
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    with pytest.raises(ValueError, match="position_embedding_type='yarn' with multi_latent_attention"):
        GPTModel(cfg, spec, VOCAB, MAX_SEQ, position_embedding_type="yarn")
    with pytest.raises(ValueError, match="q_layernorm=.* but qk_layernorm is False"):
        build_module(spec.submodules.self_attention, config=_config(qk_layernorm=False), layer_number=1)
    plain_spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
    with pytest.raises(ValueError, match=r"qk_layernorm=True but the MLA spec leaves \['q_layernorm', 'kv_layernorm'\]"):
        build_module(plain_spec, config=cfg, layer_number=1)
    plain = build_module(plain_spec, config=_config(qk_layernorm=False), layer_number=1)
    assert isinstance(plain.kv_layernorm, IdentityOp) and isinstance(plain.q_layernorm, IdentityOp)
    attn = build_module(spec.submodules.self_attention, config=cfg, layer_number=1)
    x = torch.randn(4, 1, 32)
    with pytest.raises(ValueError, match="rotary_pos_emb must be None"):
        attn(x, None, rotary_pos_emb=torch.zeros(4, 1, 1, 4))
    with pytest.raises(ValueError, match="attention_bias"):
        attn(x, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="needs an MLATransformerConfig"):
        MLASelfAttention(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4),
                         spec.submodules.self_attention.submodules, layer_number=1)
