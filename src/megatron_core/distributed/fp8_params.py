"""FP8 parameters (``fp8_param``): linear weights stored as float8 bytes plus a per-tensor scale.

Megatron-Core's ``fp8_param`` with Transformer Engine's ``Float8Tensor`` weights and its ``fp8_utils``
helpers (:func:`quantize_param_shard`, :func:`copy_tensor_to_quantized_param`,
:func:`dequantize_fp8_tensor`), for this library's tensorwise (current-scaling) recipe. An FP8 parameter
is an ``nn.Parameter`` of dtype ``float8_e4m3fn`` (1 byte per element) carrying:

* ``fp8_scale``: a 0-dim fp32 tensor, the quantization multiplier (``value = fp8 / fp8_scale``);
* ``fp8_hp_dtype``: the high-precision dtype it replaces (the model's ``params_dtype``), which is the
  dtype of its gradient, of its checkpointed value and of the cast before quantization;
* ``fp8_high_precision_init_val``: the initial high-precision value (on the CPU) until the distributed
  optimizer builds its fp32 main weights from it (Transformer Engine's ``preserve_high_precision_init_val``).

The distributed optimizer keeps the fp32 main weights. After each step every data-parallel rank casts
its main shard to ``fp8_hp_dtype`` (as Megatron-Core does, so the numerics equal a high-precision
parameter cast to FP8 in the forward), max-reduces the per-parameter amaxes over the data-parallel
group, derives one scale per parameter (``fp8_max / amax``, torchao's tensorwise formula) and
quantizes its shard straight into the 1-byte parameter buffer, which the all-gather then moves.

It lives beside the DDP buffers that store these parameters (the FP8 layers, the optimizer and DDP all
build on it), with the float8 cast primitives every FP8 recipe shares (:func:`fp8_max`, :func:`quantize`,
:func:`reduce_amax`; :mod:`megatron_core.fp8.delayed_scaling` uses them too).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core.tensor_parallel.wgrad_accumulation import mark_gradient_into_main_grad

__all__ = ["FP8_PARAM_BUFFER_DTYPE", "fp8_max", "quantize", "reduce_amax", "FP8_PARAM_DTYPE", "FP8_PARAM_RECIPES", "check_fp8_params_for_ddp",
           "clear_high_precision_init_val", "copy_tensor_to_quantized_param", "dequantize_fp8_tensor", "is_fp8_param",
           "main_param_shard", "make_fp8_param", "quantize_param_shard", "tensorwise_scale"]

FP8_PARAM_DTYPE = torch.float8_e4m3fn
FP8_PARAM_RECIPES = ("tensorwise",)
AMAX_EPS = 1e-12  # the smallest amax a scale is derived from (torchao's EPS)
FP8_PARAM_BUFFER_DTYPE = torch.uint8  # the DDP parameter buffer of FP8 params (their raw bytes)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of float8 ``dtype``."""
    return float(torch.finfo(dtype).max)


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` cast to float8 ``dtype``, saturated at its largest finite value."""
    limit = fp8_max(dtype)
    return (t.float() * scale).clamp(-limit, limit).to(dtype)


def reduce_amax(amax: torch.Tensor, group: Any) -> torch.Tensor:
    """``amax`` (fp32) max-reduced over ``group`` (the amax reduction group; nothing to do for one rank)."""
    if group is not None and get_pg_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def is_fp8_param(tensor: Any) -> bool:
    """Whether ``tensor`` is an FP8 parameter made by :func:`make_fp8_param`."""
    return bool(getattr(tensor, "is_fp8_param", False))


def tensorwise_scale(amax: torch.Tensor, dtype: torch.dtype = FP8_PARAM_DTYPE) -> torch.Tensor:
    """The per-tensor scale(s) ``fp8_max / amax`` in fp32 (computed in fp64, as torchao's tensorwise recipe)."""
    return (fp8_max(dtype) / amax.double().clamp(min=AMAX_EPS)).float()


def _amax(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` in fp32 (0 for an empty tensor)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float()


def make_fp8_param(weight: torch.nn.Parameter) -> torch.nn.Parameter:
    """An FP8 parameter holding ``weight`` quantized with its own tensorwise scale (attributes copied)."""
    hp = weight.detach()
    scale = tensorwise_scale(_amax(hp))
    param = torch.nn.Parameter(quantize(hp, scale, FP8_PARAM_DTYPE), requires_grad=weight.requires_grad)
    param.__dict__.update(weight.__dict__)
    param.fp8_scale = scale
    param.fp8_hp_dtype = weight.dtype
    param.fp8_high_precision_init_val = hp.to("cpu", copy=True)
    param.is_fp8_param = True
    mark_gradient_into_main_grad(param)  # its GEMM's backward adds the gradient to main_grad (DDP's hook skips it)
    return param


def check_fp8_params_for_ddp(params: list[torch.Tensor], ddp_config: Any) -> None:
    """``ValueError`` unless FP8 parameters among ``params`` are wrapped with the distributed optimizer and
    ``fp8_param_gather`` (they keep no high-precision copy for another optimizer to update)."""
    if any(is_fp8_param(p) for p in params) and not (ddp_config.use_distributed_optimizer
                                                      and ddp_config.fp8_param_gather):
        raise ValueError("a model with FP8 parameters (fp8_param=True) needs DistributedDataParallelConfig("
                         "use_distributed_optimizer=True, fp8_param_gather=True); got use_distributed_optimizer="
                         f"{ddp_config.use_distributed_optimizer}, fp8_param_gather={ddp_config.fp8_param_gather}")


def dequantize_fp8_tensor(fp8_tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision value (``fp8_hp_dtype``) of an FP8 parameter."""
    return (fp8_tensor.detach().float() / fp8_tensor.fp8_scale).to(fp8_tensor.fp8_hp_dtype)


@torch.no_grad()
def copy_tensor_to_quantized_param(param: torch.Tensor, src: torch.Tensor) -> None:
    """Quantize the high-precision ``src`` into FP8 parameter ``param`` with a fresh scale from its amax."""
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"copy_tensor_to_quantized_param: source shape {tuple(src.shape)} differs from the FP8 "
                         f"parameter's {tuple(param.shape)}")
    hp = src.to(device=param.device, dtype=param.fp8_hp_dtype)
    param.fp8_scale.copy_(tensorwise_scale(_amax(hp)))
    param.data.copy_(quantize(hp, param.fp8_scale, FP8_PARAM_DTYPE))


def main_param_shard(param: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened FP8 ``param`` as a new ``dtype`` main-weight tensor: from its
    high-precision initial value while it has one, else dequantized."""
    init = getattr(param, "fp8_high_precision_init_val", None)
    value = init if init is not None else dequantize_fp8_tensor(param)
    return value.reshape(-1)[start:end].to(device=param.device, dtype=dtype, copy=True)


def clear_high_precision_init_val(params: list[torch.Tensor]) -> None:
    """Drop the initial high-precision values once the main weights exist."""
    for param in params:
        if getattr(param, "fp8_high_precision_init_val", None) is not None:
            param.fp8_high_precision_init_val = None


@torch.no_grad()
def quantize_param_shard(model_params: list[torch.Tensor], main_params: list[torch.Tensor | None],
                         start_offsets: list[int], data_parallel_group: Any,
                         fsdp_shard_model_params: list[torch.Tensor] | None = None) -> None:
    """Quantize each rank's main-weight shard into its FP8 parameter with a scale agreed over the DP group.

    ``main_params[i]`` is this rank's flat slice of ``model_params[i]`` starting at ``start_offsets[i]``
    (``None`` where another rank owns every element). Every rank of ``data_parallel_group`` calls this
    with the same ``model_params``: the amaxes (of the slices cast to ``fp8_hp_dtype``) are max-reduced
    in one all-reduce, so every rank writes its bytes with the scale one process would compute on the
    whole tensor. Only the owned bytes change; the all-gather of the parameter buffer completes them.
    """
    if fsdp_shard_model_params is not None:
        raise ValueError("quantize_param_shard: fsdp_shard_model_params is not supported (FP8 parameters need "
                         "the distributed optimizer, not FSDP)")
    if not model_params:
        return
    device = model_params[0].device
    shards = [None if main is None else main.detach().to(device=device, dtype=param.fp8_hp_dtype)
              for param, main in zip(model_params, main_params)]
    amax = torch.stack([torch.zeros((), device=device) if s is None else _amax(s) for s in shards])
    scales = tensorwise_scale(reduce_amax(amax, data_parallel_group))
    for i, (param, shard, start) in enumerate(zip(model_params, shards, start_offsets)):
        param.fp8_scale.copy_(scales[i])
        if shard is not None and shard.numel():
            param.detach().view(-1)[start:start + shard.numel()].copy_(quantize(shard, scales[i], FP8_PARAM_DTYPE))
