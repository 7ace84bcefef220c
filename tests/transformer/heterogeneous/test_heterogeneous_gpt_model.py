"""A heterogeneous GPTModel (``get_gpt_heterogeneous_layer_spec``), fp32 on CPU.

- Each of the five different layers equals a plain computation written out here from its own weights
  (RMSNorm, grouped-query attention with RoPE, SwiGLU, the replacing linears, the dropped parts).
- The model equals Megatron-Core's (the installed release, its heterogeneous local spec) on the same weights:
  the same state-dict keys and shapes, checkpoint (sharded) keys, loss and every gradient.
- Decoding with a static KV cache equals full forwards.
- No Hugging Face model of this family (DeciLM) ships with transformers, so there is no logits check against one.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.heterogeneous.linear_replacements import ColumnParallelLinearGathered
from megatron_core.transformer.identity_op import IdentityOp
from tests.dist_harness import run_on_ranks
from tests.megatron_oracle import megatron_on_cpu
from tests.transformer.heterogeneous.hetero_test_utils import (
    CONFIG,
    MAX_SEQ,
    VOCAB,
    batch,
    build,
    config,
    encoded_blocks,
)

TOL = dict(rtol=1e-5, atol=1e-5)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG["layernorm_epsilon"]) * weight


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``[s, b, n, d]`` at positions 0..s-1, base 10000."""
    s, d = x.shape[0], x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    first, second = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat((-second, first), dim=-1) * angles.sin()


def _attention(x: torch.Tensor, w_qkv: torch.Tensor, w_proj: torch.Tensor, groups: int) -> torch.Tensor:
    """Causal grouped-query attention; the fused QKV rows are grouped per query group: [q heads, k, v]."""
    s, b, _ = x.shape
    heads, d = CONFIG["num_attention_heads"], CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    per_group = heads // groups
    qkv = (x @ w_qkv.T).view(s, b, groups, (per_group + 2) * d)
    q, k, v = qkv.split([per_group * d, d, d], dim=-1)
    q = _rope(q.reshape(s, b, heads, d))
    k = _rope(k).repeat_interleave(per_group, dim=2)
    v = v.repeat_interleave(per_group, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, heads * d)
    return context @ w_proj.T


def _swiglu_mlp(x: torch.Tensor, w_fc1: torch.Tensor, w_fc2: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ w_fc1.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_fc2.T


def _reference_layer(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One heterogeneous layer written out: each part is dropped, a linear, or the usual computation."""
    p = {name: param.detach() for name, param in layer.named_parameters()}
    if "self_attention.weight" in p:
        x = x + _rms_norm(x, p["input_layernorm.weight"]) @ p["self_attention.weight"].T
    elif "self_attention.linear_qkv.weight" in p:
        x = x + _attention(_rms_norm(x, p["input_layernorm.weight"]), p["self_attention.linear_qkv.weight"],
                           p["self_attention.linear_proj.weight"], layer.config.num_query_groups)
    if "mlp.weight" in p:
        x = x + _rms_norm(x, p["pre_mlp_layernorm.weight"]) @ p["mlp.weight"].T
    elif "mlp.linear_fc1.weight" in p:
        x = x + _swiglu_mlp(_rms_norm(x, p["pre_mlp_layernorm.weight"]), p["mlp.linear_fc1.weight"],
                            p["mlp.linear_fc2.weight"])
    return x


def test_layers_are_built_as_their_blocks_say():
    model = build(config())
    layers = model.decoder.layers
    assert isinstance(layers[0].self_attention, IdentityOp) and isinstance(layers[0].input_layernorm, IdentityOp)
    assert isinstance(layers[1].self_attention, ColumnParallelLinearGathered)
    assert isinstance(layers[3].mlp, IdentityOp) and isinstance(layers[3].pre_mlp_layernorm, IdentityOp)
    assert isinstance(layers[4].mlp, ColumnParallelLinearGathered)
    # Each layer holds its own plain config: query groups and FFN widths per block, base values elsewhere.
    assert all(type(layer.config) is TransformerConfig for layer in layers)
    assert [layer.config.num_query_groups for layer in layers] == [8, 8, 2, 4, 4]
    assert [layer.config.ffn_hidden_size for layer in layers] == [256, 48, 64, 64, 64]
    state = model.state_dict()
    assert state["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 256, 32)  # ffn_mult 1.5 -> 256
    assert state["decoder.layers.1.mlp.linear_fc2.weight"].shape == (32, 48)
    assert state["decoder.layers.2.self_attention.linear_qkv.weight"].shape == (32 + 2 * 2 * 4, 32)
    assert state["decoder.layers.3.self_attention.linear_qkv.weight"].shape == (32 + 2 * 4 * 4, 32)
    assert state["decoder.layers.4.mlp.weight"].shape == (32, 32)


def test_each_layer_equals_a_plain_computation_and_backward_runs():
    model = build(config())
    captured = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: captured.append((mod, args[0], out[0])))
             for layer in model.decoder.layers]
    ids, pos, labels = batch()
    loss = model(ids, pos, None, labels=labels)
    for hook in hooks:
        hook.remove()
    assert len(captured) == CONFIG["num_layers"]
    for layer, x, out in captured:
        torch.testing.assert_close(out, _reference_layer(layer, x.detach()), **TOL,
                                   msg=lambda m, n=layer.layer_number: f"layer {n}: {m}")
    loss.sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name


def _compare_with_megatron() -> dict:
    with megatron_on_cpu():
        from megatron.core.models.gpt import GPTModel as TheirGPT
        from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
            get_gpt_heterogeneous_layer_spec as their_spec,
        )
        from megatron.core.transformer.heterogeneous.heterogeneous_config import (
            HeterogeneousTransformerConfig as TheirConfig,
        )

        their_config = TheirConfig(**CONFIG, heterogeneous_layers_config_encoded_json=encoded_blocks())
        torch.manual_seed(5)
        theirs = TheirGPT(their_config, their_spec(their_config, use_te=False), VOCAB, MAX_SEQ,
                          position_embedding_type="rope")
        ours = build(config())
        their_state, our_state = theirs.state_dict(), ours.state_dict()
        shapes = {k: tuple(v.shape) for k, v in our_state.items() if isinstance(v, torch.Tensor)}
        assert set(our_state) == set(their_state)
        assert shapes == {k: tuple(v.shape) for k, v in their_state.items() if isinstance(v, torch.Tensor)}
        their_keys = {k: v.key for k, v in theirs.sharded_state_dict().items() if hasattr(v, "key")}
        our_keys = {k: v.key for k, v in ours.sharded_state_dict().items() if hasattr(v, "key")}
        assert our_keys == their_keys
        with torch.no_grad():  # their norms start at 1: perturb them so that they matter
            for name, param in theirs.named_parameters():
                if "layernorm" in name:
                    param.add_(0.2 * torch.randn(param.shape))
        ours.load_state_dict(theirs.state_dict())
        ids, pos, labels = batch()
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1).view(1, 1, *[ids.shape[1]] * 2)
        want = theirs(ids, pos, causal, labels=labels)
        want.sum().backward()
        got = ours(ids, pos, None, labels=labels)
        got.sum().backward()
        torch.testing.assert_close(got, want, **TOL)
        their_params = dict(theirs.named_parameters())
        for name, param in ours.named_parameters():
            torch.testing.assert_close(param.grad, their_params[name].grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return our_keys


def test_gpt_model_matches_megatron_core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs")
    (keys,) = run_on_ranks(1, _compare_with_megatron)
    # Separate norms are saved under Transformer Engine's fused names, and every layer under its own index.
    assert keys["decoder.layers.1.input_layernorm.weight"] == "decoder.layers.1.self_attention.layer_norm_weight"
    assert keys["decoder.layers.2.input_layernorm.weight"] == (
        "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight")
    assert keys["decoder.layers.4.pre_mlp_layernorm.weight"] == "decoder.layers.4.mlp.layer_norm_weight"


def test_spec_needs_a_heterogeneous_config_and_the_local_layers():
    with pytest.raises(TypeError, match="needs a HeterogeneousTransformerConfig, got TransformerConfig"):
        get_gpt_heterogeneous_layer_spec(TransformerConfig(**CONFIG))
    with pytest.raises((ImportError, NotImplementedError), match="Transformer Engine"):
        get_gpt_heterogeneous_layer_spec(config(), use_te=True)


def test_static_kv_cache_equals_full_forward():
    from megatron_core.inference.contexts import StaticInferenceContext

    model = build(config()).eval()
    ids, pos, _ = batch()
    with torch.no_grad():
        full = model(ids, pos, None)
        context = StaticInferenceContext(max_batch_size=ids.shape[0], max_sequence_length=MAX_SEQ)
        steps = [model(ids[:, :5], pos[:, :5], None, inference_context=context)]
        for t in range(5, ids.shape[1]):
            context.sequence_len_offset = t
            steps.append(model(ids[:, t:t + 1], pos[:, t:t + 1], None, inference_context=context))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)
