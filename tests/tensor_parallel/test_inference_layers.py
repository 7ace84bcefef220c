"""Inference linears (``tensor_parallel.inference_layers``) against the training linears and one process (fp32).

On 2 CPU ranks (TP=2, sequence parallel) each inference layer loads a state dict under Megatron-Core 0.19's
(Transformer Engine's) keys; its forward-only path (eval, no grad) must equal the training layers on the same
shards and the single-process ``F.linear`` / norm on the full tensors, and its autograd path must be the parent's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_core import parallel_state
from megatron_core import tensor_parallel as tp
from megatron_core.fusions.norms import LayerNorm, RMSNorm
from megatron_core.tensor_parallel.inference_layers import (
    InferenceColumnParallelLinear,
    InferenceLayerNormColumnParallelLinear,
    InferenceLinear,
    InferenceRowParallelLinear,
    inference_all_gather_from_tensor_model_parallel_region,
    inference_reduce_scatter_to_sequence_parallel_region,
)
from megatron_core.transformer import TransformerConfig
from megatron_core.utils import init_method_normal
from tests.dist_harness import run_on_ranks

S, B, H_IN, H_OUT = 8, 2, 12, 16
TOL = dict(rtol=1e-6, atol=1e-6)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _config(tp_size: int, sp: bool = True, **overrides) -> TransformerConfig:
    cfg = dict(num_layers=1, hidden_size=H_IN, num_attention_heads=4, tensor_model_parallel_size=tp_size,
               sequence_parallel=sp, use_cpu_initialization=True, normalization="RMSNorm")
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def _column_kwargs(config: TransformerConfig, **overrides) -> dict:
    kwargs = dict(config=config, init_method=init_method_normal(0.2), gather_output=False, bias=True,
                  skip_bias_add=False, is_expert=False)
    kwargs.update(overrides)
    return kwargs


def _forward_only(layer: torch.nn.Module, x: torch.Tensor):
    layer.eval()
    with torch.no_grad():
        return layer(x)


def _check_column(rank: int) -> None:
    config = _config(2)
    weight, bias, x = _rand(H_OUT, H_IN, seed=1), _rand(H_OUT, seed=2), _rand(S, B, H_IN, seed=3)
    shard = {"weight": weight.chunk(2)[rank], "bias": bias.chunk(2)[rank], "_extra_state": None}
    layer = InferenceColumnParallelLinear(H_IN, H_OUT, **_column_kwargs(config))
    layer.load_state_dict(shard, strict=True)
    training = tp.ColumnParallelLinear(H_IN, H_OUT, **_column_kwargs(config))
    training.load_state_dict(shard, strict=True)
    x_local = x.chunk(2)[rank]
    y, out_bias = _forward_only(layer, x_local)
    assert out_bias is None
    assert_close(y, F.linear(x, weight, bias).chunk(2, dim=-1)[rank], **TOL)
    assert_close(y, training(x_local)[0].detach(), **TOL)
    layer.train()  # the autograd path is the parent's, gradients included
    x_grad = x_local.clone().requires_grad_(True)
    layer(x_grad)[0].sum().backward()
    x_ref = x_local.clone().requires_grad_(True)
    training(x_ref)[0].sum().backward()
    assert_close(x_grad.grad, x_ref.grad, **TOL)
    assert_close(layer.weight.grad, training.weight.grad, **TOL)


def _check_row(rank: int) -> None:
    config = _config(2)
    weight, bias, x = _rand(H_OUT, H_IN, seed=4), _rand(H_OUT, seed=5), _rand(S, B, H_IN, seed=6)
    shard = {"weight": weight.chunk(2, dim=1)[rank], "bias": bias, "_extra_state": None}
    kwargs = dict(config=config, init_method=init_method_normal(0.2), bias=True, input_is_parallel=True,
                  skip_bias_add=False, is_expert=False)
    layer = InferenceRowParallelLinear(H_IN, H_OUT, **kwargs)
    layer.load_state_dict(shard, strict=True)
    training = tp.RowParallelLinear(H_IN, H_OUT, **kwargs)
    training.load_state_dict(shard, strict=True)
    x_local = x.chunk(2, dim=-1)[rank]
    y, out_bias = _forward_only(layer, x_local)
    assert out_bias is None
    assert_close(y, F.linear(x, weight, bias).chunk(2)[rank], **TOL)
    assert_close(y, training(x_local)[0].detach(), **TOL)
    skip = InferenceRowParallelLinear(H_IN, H_OUT, **{**kwargs, "skip_bias_add": True})
    skip.load_state_dict(shard, strict=True)
    y_skip, b_skip = _forward_only(skip, x_local)
    assert_close(y_skip + b_skip, y, **TOL)
    layer._set_next_layer_norm_weights(torch.ones(H_OUT))  # Megatron-Core's fused-path hooks leave the plain path
    layer._set_residual(torch.zeros(S // 2, B, H_OUT))
    assert_close(_forward_only(layer, x_local)[0], y, **TOL)


def _check_layer_norm_column(rank: int, normalization: str, zero_centered: bool) -> None:
    config = _config(2, normalization=normalization, layernorm_zero_centered_gamma=zero_centered,
                     layernorm_epsilon=1e-6)
    weight, bias, x = _rand(H_OUT, H_IN, seed=7), _rand(H_OUT, seed=8), _rand(S, B, H_IN, seed=9)
    gamma, beta = _rand(H_IN, seed=10), _rand(H_IN, seed=11)
    shard = {"layer_norm_weight": gamma, "weight": weight.chunk(2)[rank], "bias": bias.chunk(2)[rank],
             "_extra_state": None}
    if normalization == "LayerNorm":
        shard["layer_norm_bias"] = beta
    layer = InferenceLayerNormColumnParallelLinear(H_IN, H_OUT, **_column_kwargs(config))
    layer.load_state_dict(shard, strict=True)
    norm = (LayerNorm if normalization == "LayerNorm" else RMSNorm)(config, H_IN, eps=1e-6)
    norm.load_state_dict({"weight": gamma, **({"bias": beta} if normalization == "LayerNorm" else {})})
    training = tp.ColumnParallelLinear(H_IN, H_OUT, **_column_kwargs(config))
    training.load_state_dict({k: v for k, v in shard.items() if not k.startswith("layer_norm")}, strict=True)
    x_local = x.chunk(2)[rank]
    y, _ = _forward_only(layer, x_local)
    scale = gamma + 1 if zero_centered else gamma
    if normalization == "LayerNorm":
        normed = F.layer_norm(x, (H_IN,), scale, beta, 1e-6)
    else:
        normed = F.rms_norm(x, (H_IN,), scale, 1e-6)
    assert_close(y, F.linear(normed, weight, bias).chunk(2, dim=-1)[rank], **TOL)
    assert_close(y, training(norm(x_local))[0].detach(), **TOL)
    layer.train()
    assert_close(layer(x_local)[0].detach(), y, **TOL)
    sharded = layer.sharded_state_dict(prefix="l.")
    assert sharded["l.weight"].global_shape == (H_OUT, H_IN) and sharded["l.layer_norm_weight"].global_shape == (H_IN,)
    assert layer.layer_norm_weight.sequence_parallel


def _check_functions(rank: int) -> None:
    group = parallel_state.get_tensor_model_parallel_group()
    config = _config(2)
    full = _rand(4, 3, 6, seed=12)
    got = inference_all_gather_from_tensor_model_parallel_region(full.chunk(2, dim=-1)[rank], group, config)
    assert_close(got, full, rtol=0, atol=0)
    partial = _rand(4, 3, 6, seed=13 + rank)
    total = _rand(4, 3, 6, seed=13) + _rand(4, 3, 6, seed=14)
    got = inference_reduce_scatter_to_sequence_parallel_region(partial, group, config)
    assert_close(got, total.chunk(2)[rank], **TOL)


def _check_tp2() -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    _check_column(rank)
    _check_row(rank)
    _check_layer_norm_column(rank, "RMSNorm", False)
    _check_layer_norm_column(rank, "LayerNorm", True)
    _check_functions(rank)
    with pytest.raises(ValueError, match="sequence_parallel"):
        InferenceColumnParallelLinear(H_IN, H_OUT, **_column_kwargs(_config(2, sp=False)))
    with pytest.raises(ValueError, match="sequence_parallel"):
        InferenceRowParallelLinear(H_IN, H_OUT, config=_config(2, sp=False), init_method=init_method_normal(0.2),
                                   bias=False, input_is_parallel=True, skip_bias_add=False, is_expert=False)


def test_inference_linears_at_tp2_equal_training_linears_and_one_process():
    run_on_ranks(2, _check_tp2)


def test_inference_linears_in_one_process():
    config = _config(1, sp=False)
    x = _rand(5, 2, H_IN, seed=20)
    column = InferenceLayerNormColumnParallelLinear(H_IN, H_OUT, **_column_kwargs(config, bias=False))
    assert set(column.state_dict()) == {"layer_norm_weight", "weight", "_extra_state"}
    y, _ = _forward_only(column, x)
    assert_close(y, F.linear(F.rms_norm(x, (H_IN,), column.layer_norm_weight, config.layernorm_epsilon),
                             column.weight), **TOL)
    linear = InferenceLinear(H_IN, H_OUT, parallel_mode="duplicated", config=config,
                             init_method=init_method_normal(0.2), bias=True, skip_bias_add=False,
                             skip_weight_param_allocation=False)
    assert set(linear.state_dict()) == {"weight", "bias"}
    assert_close(_forward_only(linear, x)[0], F.linear(x, linear.weight, linear.bias), **TOL)


def test_inference_linears_refuse_what_they_lack_by_name():
    config = _config(1, sp=False)
    common = dict(config=config, init_method=init_method_normal(0.2), bias=False, skip_bias_add=False,
                  skip_weight_param_allocation=False)
    with pytest.raises(ValueError, match="symmetric_ar_type"):
        InferenceLinear(H_IN, H_OUT, parallel_mode=None, symmetric_ar_type="multimem_all_reduce", **common)
    with pytest.raises(ValueError, match="parallel_mode"):
        InferenceLinear(H_IN, H_OUT, parallel_mode="column", **common)
    layer = InferenceLayerNormColumnParallelLinear(H_IN, H_OUT, **_column_kwargs(config))
    layer.skip_norm_and_all_gather = True
    with pytest.raises(ValueError, match="skip_norm_and_all_gather"):
        layer(torch.zeros(2, 1, H_IN))
