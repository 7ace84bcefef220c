"""Megatron-Core's Transformer Engine wrappers (``megatron.core.extensions.transformer_engine``).

The names, constructor signatures and conventions are Megatron's: linear layers take
``(input_size, output_size, *, config, init_method, bias, skip_bias_add, ...)`` and their forward
returns ``(output, bias)`` (``bias`` is ``None`` unless ``skip_bias_add``); tensor-parallel groups
come from ``tp_group`` / ``pg_collection`` when given, else from ``parallel_state``.

Importing this module never needs Transformer Engine (TE); instantiating a layer without it raises
``ImportError`` naming the ``te`` extra (``pip install 'megatron-core-lite[te]'``). TE is imported in
one place (:mod:`._te_loader`). With TE installed each class binds to TE's module on first use
(see :class:`~._te_loader.LazyTEModule`). That path maps Megatron's arguments onto TE's documented
constructor arguments and nothing more; it has not been run in this project's CI (no TE there),
see docs/compat.md. The library's own layer specs use the local (PyTorch) layers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core.extensions._te_loader import HAVE_TE, LazyTEModule, import_te
from megatron_core.process_groups_config import resolve_tp_group
from megatron_core.quantization.layer_precision import LayerRecipe as TEQuantizationRecipe
from megatron_core.quantization.layer_precision import TEQuantizationParams as TEQuantizationParams
from megatron_core.quantization.layer_precision import (
    TransformerEngineConfigType as TransformerEngineConfigType,
)


def _rng_tracker() -> Callable[[], Any]:
    from megatron_core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker


def _common_linear_kwargs(config: Any, tp_group: Any, init_method: Callable | None, bias: bool,
                          skip_bias_add: bool, parallel_mode: str | None, is_expert: bool) -> dict[str, Any]:
    """TE ``Linear``-family keyword arguments for Megatron's conventions."""
    explicit_expert_comm = is_expert and get_pg_size(tp_group) > 1
    return {
        "sequence_parallel": bool(getattr(config, "sequence_parallel", False)) and not explicit_expert_comm,
        "fuse_wgrad_accumulation": bool(getattr(config, "gradient_accumulation_fusion", False)),
        "tp_group": None if explicit_expert_comm else tp_group,
        "tp_size": 1 if explicit_expert_comm else get_pg_size(tp_group),
        "get_rng_state_tracker": _rng_tracker(),
        "init_method": init_method if getattr(config, "perform_initialization", True) else (lambda w: None),
        "bias": bias,
        "return_bias": skip_bias_add,
        "parallel_mode": None if explicit_expert_comm else parallel_mode,
        "params_dtype": getattr(config, "params_dtype", torch.float32),
    }


def _with_bias(out: Any, skip_bias_add: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Megatron's ``(output, bias)`` return from TE's output (a tuple when ``return_bias``)."""
    if skip_bias_add:
        return out
    return out, None


class TENorm:
    """TE's ``LayerNorm`` or ``RMSNorm`` for ``config.normalization`` (returns the TE module itself)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, has_residual: bool = False) -> Any:
        te = import_te("TENorm")
        kinds = {"LayerNorm": te.pytorch.LayerNorm, "RMSNorm": te.pytorch.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"config.normalization={config.normalization!r}: TENorm supports {sorted(kinds)}")
        return kinds[config.normalization](
            hidden_size=hidden_size, eps=eps, sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
            zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)),
            params_dtype=getattr(config, "params_dtype", torch.float32),
        )


class TELinear(LazyTEModule):
    """TE ``Linear`` with Megatron's signature; ``parallel_mode`` is ``"column"``, ``"row"`` or ``"duplicated"``."""

    te_base = "pytorch.Linear"

    def __init__(self, input_size: int, output_size: int, *, parallel_mode: str | None, config: Any,
                 init_method: Callable, bias: bool, skip_bias_add: bool, skip_weight_param_allocation: bool,
                 tp_comm_buffer_name: str | None = None, is_expert: bool = False, symmetric_ar_type: str | None = None,
                 tp_group: Any = None, name: str | None = None, gtp_remat_group: Any = None) -> None:
        if skip_weight_param_allocation:
            raise ValueError("Transformer Engine linear layers do not support skip_weight_param_allocation=True")
        group = resolve_tp_group(tp_group, is_expert=is_expert)
        mode = None if parallel_mode == "duplicated" else parallel_mode
        super().__init__(in_features=input_size, out_features=output_size,
                         **_common_linear_kwargs(config, group, init_method, bias, skip_bias_add, mode, is_expert))
        self.config, self.te_return_bias, self.is_first_microbatch = config, skip_bias_add, True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias)`` as Megatron's linear layers return."""
        out = super().forward(x, is_first_microbatch=self.is_first_microbatch)
        self.is_first_microbatch = False
        return _with_bias(out, self.te_return_bias)


class TEColumnParallelLinear(TELinear):
    """TE ``Linear`` split along the output dimension (Megatron's ``ColumnParallelLinear``)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 gather_output: bool, bias: bool, skip_bias_add: bool, is_expert: bool,
                 skip_weight_param_allocation: bool = False, tp_comm_buffer_name: str | None = None,
                 tp_group: Any = None, stride: int = 1, name: str | None = None) -> None:
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output=True")
        super().__init__(input_size, output_size, parallel_mode="column", config=config, init_method=init_method,
                         bias=bias, skip_bias_add=skip_bias_add, skip_weight_param_allocation=skip_weight_param_allocation,
                         tp_comm_buffer_name=tp_comm_buffer_name, is_expert=is_expert, tp_group=tp_group, name=name)


class TERowParallelLinear(TELinear):
    """TE ``Linear`` split along the input dimension (Megatron's ``RowParallelLinear``)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: str | None = None, tp_group: Any = None, name: str | None = None) -> None:
        if not input_is_parallel:
            raise ValueError("Transformer Engine linear layers need input_is_parallel=True")
        super().__init__(input_size, output_size, parallel_mode="row", config=config, init_method=init_method,
                         bias=bias, skip_bias_add=skip_bias_add, skip_weight_param_allocation=False,
                         tp_comm_buffer_name=tp_comm_buffer_name, is_expert=is_expert, tp_group=tp_group, name=name)


class TELayerNormColumnParallelLinear(LazyTEModule):
    """TE ``LayerNormLinear``: the norm (``config.normalization``) fused into a column-parallel linear."""

    te_base = "pytorch.LayerNormLinear"

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 gather_output: bool, bias: bool, skip_bias_add: bool, is_expert: bool,
                 skip_weight_param_allocation: bool = False, tp_comm_buffer_name: str | None = None,
                 tp_group: Any = None, stride: int = 1, name: str | None = None) -> None:
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output=True")
        if is_expert or skip_weight_param_allocation:
            raise ValueError("TELayerNormColumnParallelLinear supports neither is_expert nor skip_weight_param_allocation")
        group = resolve_tp_group(tp_group)
        super().__init__(in_features=input_size, out_features=output_size, eps=config.layernorm_epsilon,
                         normalization=config.normalization,
                         zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)),
                         **_common_linear_kwargs(config, group, init_method, bias, skip_bias_add, "column", False))
        self.config, self.te_return_bias, self.is_first_microbatch = config, skip_bias_add, True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias)`` as Megatron's linear layers return."""
        out = super().forward(x, is_first_microbatch=self.is_first_microbatch)
        self.is_first_microbatch = False
        return _with_bias(out, self.te_return_bias)


class TEDotProductAttention(LazyTEModule):
    """TE ``DotProductAttention`` on Megatron's ``[s, b, h, d]`` tensors (Megatron's ``core_attention``)."""

    te_base = "pytorch.DotProductAttention"

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, num_splits: int | None = None,
                 cp_comm_type: str | None = "p2p", pg_collection: Any = None) -> None:
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} (attention sinks) is not passed to Transformer "
                             "Engine here; use the local spec's DotProductAttention")
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            raise ValueError("qk_clip / log_max_attention_logit (per-head max attention logits) are recorded by the "
                             "local spec's DotProductAttention only; TEDotProductAttention here does not return them")
        tp_group = resolve_tp_group(None, pg_collection)
        kv_channels = (k_channels, v_channels) if k_channels is not None else config.kv_channels
        super().__init__(
            num_attention_heads=config.num_attention_heads, kv_channels=kv_channels,
            num_gqa_groups=config.num_query_groups or config.num_attention_heads,
            attention_dropout=config.attention_dropout if attention_dropout is None else attention_dropout,
            qkv_format="sbhd", attn_mask_type=attn_mask_type.name, sequence_parallel=bool(config.sequence_parallel),
            tp_size=get_pg_size(tp_group), tp_group=tp_group, get_rng_state_tracker=_rng_tracker(),
            layer_number=layer_number, attention_type=attention_type, softmax_scale=softmax_scale,
        )
        self.config = config

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        """Attention output ``[s, b, h * d]``."""
        if packed_seq_params is not None:
            raise NotImplementedError("TEDotProductAttention here does not pass packed sequences to TE")
        kwargs = {} if attn_mask_type is None else {"attn_mask_type": attn_mask_type.name}
        return super().forward(query, key, value, attention_mask, **kwargs)


class TEGroupedLinear(LazyTEModule):
    """TE ``GroupedLinear``: ``num_gemms`` expert linears in one module (MoE grouped GEMM)."""

    te_base = "pytorch.GroupedLinear"

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, parallel_mode: str | None,
                 config: Any, init_method: Callable, bias: bool, skip_bias_add: bool, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, pg_collection: Any = None, name: str | None = None) -> None:
        group = resolve_tp_group(None, pg_collection, is_expert)
        super().__init__(num_gemms=num_gemms, in_features=input_size, out_features=output_size,
                         **_common_linear_kwargs(config, group, init_method, bias, skip_bias_add, parallel_mode,
                                                 is_expert))
        self.config, self.te_return_bias = config, skip_bias_add

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias)`` for ``x`` holding ``m_splits[i]`` tokens of expert ``i`` in order."""
        return _with_bias(super().forward(x, m_splits), self.te_return_bias)


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    """:class:`TEGroupedLinear` split along the output dimension."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None = None,
                 pg_collection: Any = None, name: str | None = None) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, pg_collection=pg_collection, name=name)


class TERowParallelGroupedLinear(TEGroupedLinear):
    """:class:`TEGroupedLinear` split along the input dimension."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None = None,
                 pg_collection: Any = None, name: str | None = None) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, pg_collection=pg_collection, name=name)


class TEDelayedScaling(LazyTEModule):
    """TE's FP8 ``DelayedScaling`` recipe from a config's ``fp8_margin``, ``fp8_amax_*`` fields."""

    te_base = "common.recipe.DelayedScaling"

    def __init__(self, config: Any, fp8_format: int, override_linear_precision: tuple = (False, False, False)) -> None:
        super().__init__(margin=config.fp8_margin, fp8_format=fp8_format,
                         amax_compute_algo=config.fp8_amax_compute_algo,
                         amax_history_len=config.fp8_amax_history_len,
                         override_linear_precision=override_linear_precision)


def te_checkpoint(forward_func: Callable, distribute_saved_activations: bool, get_rng_state_tracker: Callable,
                  tp_group: Any, *args: Any, **kwargs: Any) -> Any:
    """Activation recomputation through TE's ``checkpoint`` (Megatron's argument order)."""
    te = import_te("te_checkpoint")
    return te.pytorch.distributed.checkpoint(
        forward_func, *args, distribute_saved_activations=distribute_saved_activations,
        get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group, **kwargs,
    )


def get_cpu_offload_context(enabled: bool, num_layers: int, model_layers: int, activation_offloading: bool,
                            weight_offloading: bool, double_buffering: bool,
                            retain_pinned_cpu_buffers: bool = False) -> tuple[Any, Callable[[Any], Any]]:
    """``(context, sync_function)`` of TE's CPU offloading; a no-op pair when ``enabled`` is False."""
    if not enabled:
        return nullcontext(), (lambda tensor: tensor)
    te = import_te("CPU offloading (cpu_offloading=True)")
    return te.pytorch.get_cpu_offload_context(
        enabled, num_layers, model_layers, activation_offloading, weight_offloading, double_buffering,
    )


__all__ = [
    "HAVE_TE",
    "TEQuantizationParams",
    "TEQuantizationRecipe",
    "TransformerEngineConfigType",
    "TEColumnParallelGroupedLinear",
    "TEColumnParallelLinear",
    "TEDelayedScaling",
    "TEDotProductAttention",
    "TEGroupedLinear",
    "TELayerNormColumnParallelLinear",
    "TELinear",
    "TENorm",
    "TERowParallelGroupedLinear",
    "TERowParallelLinear",
    "get_cpu_offload_context",
    "te_checkpoint",
]
