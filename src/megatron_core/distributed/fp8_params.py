"""FP8 parameters (``fp8_param``): linear weights stored as float8 bytes plus a per-tensor scale.

Megatron-Core's ``fp8_param`` with Transformer Engine's ``Float8Tensor`` weights and its ``fp8_utils``
helpers (:func:`quantize_param_shard`, :func:`copy_tensor_to_quantized_param`,
:func:`dequantize_fp8_tensor`), for this library's tensorwise (current-scaling) recipe of the dense layers and
the row-wise recipe of the MoE experts' grouped weights. An FP8 parameter is an ``nn.Parameter`` of dtype
``float8_e4m3fn`` (1 byte per element) carrying:

* ``fp8_scaling``: ``'tensorwise'`` (one scale, ``fp8_max / amax``, torchao's formula) or ``'rowwise'`` (one
  power-of-two scale per row, i.e. per slice along the last dimension: per (expert, output feature) of an
  expert weight ``[E, out, in]``; :func:`power_of_two_scale`, the scales the experts' FP8 grouped GEMM takes);
* ``fp8_scale``: the fp32 quantization multiplier(s) (``value = fp8 / fp8_scale``): a 0-dim tensor
  (tensorwise) or one per row, shape ``[numel // shape[-1]]`` (rowwise);
* ``fp8_hp_dtype``: the high-precision dtype it replaces (the model's ``params_dtype``), which is the
  dtype of its gradient, of its checkpointed value and of the cast before quantization;
* ``fp8_high_precision_init_val``: the initial high-precision value (on the CPU) until the distributed
  optimizer builds its fp32 main weights from it (Transformer Engine's ``preserve_high_precision_init_val``).

The distributed optimizer keeps the fp32 main weights. After each step every data-parallel rank casts
its main shard to ``fp8_hp_dtype`` (as Megatron-Core does, so the numerics equal a high-precision
parameter cast to FP8 in the forward), max-reduces the per-parameter amaxes over the data-parallel
group, derives one scale per parameter (``fp8_max / amax``, torchao's tensorwise formula) and
quantizes its shard straight into the 1-byte parameter buffer, which the all-gather then moves. A row-wise
parameter's shard may cover parts of rows: each rank takes the amax of every row its shard touches, and the
per-row amax vectors of all row-wise parameters travel in the same single max-reduction as the tensorwise ones.

It lives beside the DDP buffers that store these parameters (the FP8 layers, the optimizer and DDP all
build on it), with the float8 cast primitives every FP8 recipe shares (:func:`fp8_max`, :func:`quantize`,
:func:`reduce_amax`; :mod:`megatron_core.fp8.delayed_scaling` uses them too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core._ground.fp8_values import _rows, _rowwise, dequantize_fp8_tensor, is_fp8_param
from megatron_core.jit import is_jit_fuser_enabled, jit_fuser
from megatron_core.tensor_parallel.wgrad_accumulation import mark_gradient_into_main_grad

__all__ = ["FP8_PARAM_BUFFER_DTYPE", "amax_or_zero", "fp8_max", "quantize", "reduce_amax", "FP8_PARAM_DTYPE",
           "FP8_PARAM_RECIPES", "FP8_PARAM_SCALINGS", "check_fp8_params_for_ddp", "clear_high_precision_init_val",
           "copy_tensor_to_quantized_param", "dequantize_fp8_tensor", "is_fp8_param", "main_param_shard",
           "make_fp8_param", "power_of_two_scale", "quantize_param_shard", "tensorwise_scale"]

FP8_PARAM_DTYPE = torch.float8_e4m3fn
FP8_PARAM_RECIPES = ("tensorwise",)
FP8_PARAM_SCALINGS = ("tensorwise", "rowwise")  # one scale per tensor (dense layers), per row (MoE experts)
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


def amax_or_zero(t: torch.Tensor) -> torch.Tensor:
    """``t``'s largest magnitude as a 0-d fp32 tensor, 0 for an empty ``t`` (``Tensor.amax()`` refuses one: an MoE
    expert that got no tokens has an empty input)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float()


def tensorwise_scale(amax: torch.Tensor, dtype: torch.dtype = FP8_PARAM_DTYPE) -> torch.Tensor:
    """The per-tensor scale(s) ``fp8_max / amax`` in fp32 (computed in fp64, as torchao's tensorwise recipe)."""
    return (fp8_max(dtype) / amax.double().clamp(min=AMAX_EPS)).float()


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2**floor(log2(448 / amax))`` (fp32), the factor that maps ``amax`` to at most e4m3's largest value: the
    exponent bits of the correctly rounded quotient, so the floor is exact (``log2`` may round up to an integer
    just below one)."""
    ratio = fp8_max(FP8_PARAM_DTYPE) / amax.float().clamp(min=AMAX_EPS)
    return ((ratio.view(torch.int32) >> 23) << 23).view(torch.float32)


# Tensors of at least this many elements take the fused (``jit_fuser``) amax and quantization kernels; smaller ones
# the eager ops. A compiled function's call costs several times the eager ops' launches on the host (measured on
# CPU: about 0.9 ms against 0.15 ms per tensor for both), which only a tensor large enough for the saved memory
# passes (about 25 bytes per element) repays: the experts' weights of an MoE model, not a dense layer's.
FUSED_MIN_ELEMENTS = 2**26


def _abs_amax_eager(hp: torch.Tensor, cols: int) -> torch.Tensor:
    return (hp.view(-1, cols).abs().amax(-1) if cols else hp.abs().amax()).float()


_abs_amax_fused = jit_fuser(_abs_amax_eager)


def _abs_amax(hp: torch.Tensor, cols: int) -> torch.Tensor:
    """``max |hp|`` in fp32: per row of ``cols`` elements, or of everything when ``cols`` is 0 (one read of ``hp``
    where fused: on accelerators, for tensors of at least ``FUSED_MIN_ELEMENTS``)."""
    return (_abs_amax_fused if hp.numel() >= FUSED_MIN_ELEMENTS else _abs_amax_eager)(hp, cols)


def _scale_of(hp: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """The quantization multiplier(s) of the high-precision value ``hp``: per row or per tensor."""
    if rowwise:
        return power_of_two_scale(_abs_amax(hp.detach().reshape(-1), hp.shape[-1]))
    return tensorwise_scale(_amax(hp))


def _quantize_as(hp: torch.Tensor, scale: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """``hp`` quantized with ``scale`` (broadcast over each row when ``rowwise``), in ``hp``'s shape."""
    if rowwise:
        return quantize(_rows(hp), scale[:, None], FP8_PARAM_DTYPE).view(hp.shape)
    return quantize(hp, scale, FP8_PARAM_DTYPE)


def _amax(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` in fp32 (0 for an empty tensor)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return _abs_amax(t.detach(), 0)


def make_fp8_param(weight: torch.nn.Parameter, scaling: str = "tensorwise") -> torch.nn.Parameter:
    """An FP8 parameter holding ``weight`` quantized with its own ``scaling`` scale(s) (one of
    :data:`FP8_PARAM_SCALINGS`; attributes copied)."""
    if scaling not in FP8_PARAM_SCALINGS:
        raise ValueError(f"make_fp8_param: scaling={scaling!r} must be one of {FP8_PARAM_SCALINGS}")
    rowwise = scaling == "rowwise"
    if rowwise and weight.dim() < 2:
        raise ValueError(f"make_fp8_param: scaling='rowwise' needs a weight of 2 or more dimensions; got shape "
                         f"{tuple(weight.shape)}")
    hp = weight.detach()
    scale = _scale_of(hp, rowwise)
    param = torch.nn.Parameter(_quantize_as(hp, scale, rowwise), requires_grad=weight.requires_grad)
    param.__dict__.update(weight.__dict__)
    # Its GEMM adds to main_grad and never overwrites it: not a weight whose first write may skip DDP's zeroing
    # (``overwrite_main_grad_on_first_wgrad``), as the layer's gradient_accumulation_fusion mark would say.
    param.__dict__.pop("wgrad_fused_into_main_grad", None)
    param.fp8_scaling = scaling
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


@torch.no_grad()
def copy_tensor_to_quantized_param(param: torch.Tensor, src: torch.Tensor) -> None:
    """Quantize the high-precision ``src`` into FP8 parameter ``param`` with fresh scale(s) from its amax(es)."""
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"copy_tensor_to_quantized_param: source shape {tuple(src.shape)} differs from the FP8 "
                         f"parameter's {tuple(param.shape)}")
    hp = src.to(device=param.device, dtype=param.fp8_hp_dtype)
    rowwise = _rowwise(param)
    param.fp8_scale.copy_(_scale_of(hp, rowwise))
    param.data.copy_(_quantize_as(hp, param.fp8_scale, rowwise))


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


def _row_block(shard: torch.Tensor, start: int, cols: int) -> tuple[int, int, torch.Tensor]:
    """The rows ``[lo, hi)`` that the flat slice ``shard`` (elements ``[start, start + n)`` of a ``[rows, cols]``
    tensor) touches, and those rows as ``[hi - lo, cols]``: a view when the slice covers whole rows, else a
    zero-padded copy (zeros leave every row's amax unchanged)."""
    lo, hi = start // cols, -(-(start + shard.numel()) // cols)
    offset = start - lo * cols
    if offset == 0 and shard.numel() == (hi - lo) * cols:
        return lo, hi, shard.view(hi - lo, cols)
    block = shard.new_zeros((hi - lo) * cols)
    block[offset:offset + shard.numel()] = shard
    return lo, hi, block.view(hi - lo, cols)


def _tensorwise_amaxes(shards: list[torch.Tensor | None], hp_dtypes: list[torch.dtype],
                       device: torch.device) -> torch.Tensor:
    """The fp32 vector of ``max |shard|`` of each of ``shards`` (0 for a ``None`` shard, which another rank owns, as
    a 0-dim zero of its ``hp_dtypes`` entry): one multi-tensor infinity norm, exact (a maximum of absolute values; the
    stack's promotion to a common dtype is exact too)."""
    if not shards:
        return torch.zeros(0, device=device)
    zeros = {dtype: torch.zeros((), dtype=dtype, device=device) for dtype in set(hp_dtypes)}
    norms = torch._foreach_norm([zeros[dtype] if shard is None else shard for shard, dtype in zip(shards, hp_dtypes)],
                                ord=float("inf"))
    return torch.stack(norms).float()


def _quantize_into_eager(out: torch.Tensor, hp: torch.Tensor, scale: torch.Tensor) -> None:
    out.copy_(quantize(hp, scale, FP8_PARAM_DTYPE))


_quantize_into_fused = jit_fuser(_quantize_into_eager)


def _quantize_into(out: torch.Tensor, hp: torch.Tensor, scale: torch.Tensor) -> None:
    """``out`` (FP8) = ``hp`` quantized with ``scale`` (0-dim, or ``[rows, 1]``): one read of ``hp`` and one write
    of ``out`` where fused (as :func:`_abs_amax`)."""
    (_quantize_into_fused if hp.numel() >= FUSED_MIN_ELEMENTS else _quantize_into_eager)(out, hp, scale)


# The batched tensorwise path: one compiled call takes the amaxes of every owned tensorwise shard and one
# writes all of their float8 bytes, each reading the fp32 main shard once (9 bytes per element in all, against
# ~37 for the eager cast, norm and per-parameter quantization; H200, 968M elements in 88 weights: 12.3 -> 3.1
# ms, 588 -> 41 kernels). Fused, Inductor computes the uses of ``main.to(bf16)`` from ``main`` itself,
# dropping the rounding the eager cast keeps; ``emulate_precision_casts`` (scoped to these compiles) keeps it.
# ``combo_kernels`` fuses the per-shard kernels horizontally (272 -> 41 launches for the 88 weights, no longer
# to compile: ~30 s cold).
BATCHED_COMPILE_OPTIONS: dict[str, Any] = {"emulate_precision_casts": True, "combo_kernels": True}


def _tensorwise_amaxes_batched_eager(mains: list[torch.Tensor | None], hp_dtypes: tuple[torch.dtype, ...],
                                     device: torch.device) -> torch.Tensor:
    """The fp32 vector of ``max |main.to(hp_dtype)|`` per shard, 0 for a ``None`` one."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([zero if main is None else main.to(dtype).abs().amax().float()
                        for main, dtype in zip(mains, hp_dtypes)])


def _quantize_batched_eager(outs: list[torch.Tensor], mains: list[torch.Tensor], scales: torch.Tensor,
                            positions: tuple[int, ...], hp_dtypes: tuple[torch.dtype, ...]) -> None:
    """``outs[k]`` (FP8) = ``mains[k].to(hp_dtypes[k])`` quantized with ``scales[positions[k]]`` (as
    :func:`quantize`)."""
    limit = fp8_max(FP8_PARAM_DTYPE)
    for out, main, position, dtype in zip(outs, mains, positions, hp_dtypes):
        hp = main.to(dtype)
        # ``|hp| * scale`` with the sign of ``hp`` is ``hp * scale`` exactly (rounding is symmetric), and the
        # ``abs`` parts the cast to ``dtype`` from the cast back to fp32: some Inductor versions fold such a
        # chain of casts into none, dropping the rounding (torch 2.11, H200: 1.6% of the bytes differed).
        scaled = torch.copysign(hp.abs().float() * scales[position], hp)
        out.copy_(scaled.clamp(-limit, limit).to(FP8_PARAM_DTYPE))


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled for fixed shapes (``dynamic=False``: the shards keep their shapes across steps)."""
    return torch.compile(fn, dynamic=False, options=BATCHED_COMPILE_OPTIONS)


def _use_batched(device: torch.device) -> bool:
    """The default for ``quantize_param_shard(batched=None)``: compiled on accelerators, eager on the CPU (and
    inside an enclosing compile, which inlines the eager ops), as :func:`megatron_core.jit.jit_fuser`."""
    return device.type != "cpu" and is_jit_fuser_enabled() and not torch.compiler.is_compiling()


def _owned(main: torch.Tensor | None) -> torch.Tensor | None:
    """``main`` detached, or ``None`` where this rank owns none of its parameter (no or an empty shard)."""
    return None if main is None or main.numel() == 0 else main.detach()


def _hp_shard(param: torch.Tensor, main: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The owned shard ``main`` (from :func:`_owned`) cast to ``param.fp8_hp_dtype`` on ``device`` (its own pass:
    keeps the rounding)."""
    return None if main is None else main.to(device=device, dtype=param.fp8_hp_dtype)


def _owned_bytes(param: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """The FP8 elements ``[start, start + numel)`` of the flattened ``param`` (a view of its bytes)."""
    return param.detach().view(-1)[start:start + numel]


def _tensorwise_batched(params: list[torch.Tensor], mains: list[torch.Tensor | None], starts: list[int],
                        device: torch.device) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
    """The tensorwise amax vector (one compiled call over all shards) and the function that, given the scales,
    quantizes every owned shard into its parameter's bytes (one compiled call)."""
    hp_dtypes = tuple(param.fp8_hp_dtype for param in params)
    amax = _compiled(_tensorwise_amaxes_batched_eager)(mains, hp_dtypes, device)
    positions = tuple(k for k, main in enumerate(mains) if main is not None)

    def write(scales: torch.Tensor) -> None:
        if positions:
            outs = [_owned_bytes(params[k], starts[k], mains[k].numel()) for k in positions]
            _compiled(_quantize_batched_eager)(outs, [mains[k] for k in positions], scales, positions,
                                               tuple(hp_dtypes[k] for k in positions))

    return amax, write


def _tensorwise_eager(params: list[torch.Tensor], shards: list[torch.Tensor | None], starts: list[int],
                      device: torch.device) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
    """As :func:`_tensorwise_batched` from the already cast ``shards``: one multi-tensor norm, then one
    quantization per owned shard."""
    amax = _tensorwise_amaxes(shards, [param.fp8_hp_dtype for param in params], device)

    def write(scales: torch.Tensor) -> None:
        for param, shard, start, scale in zip(params, shards, starts, scales.unbind()):
            if shard is not None:
                _quantize_into(_owned_bytes(param, start, shard.numel()), shard, scale)

    return amax, write


@torch.no_grad()
def quantize_param_shard(model_params: list[torch.Tensor], main_params: list[torch.Tensor | None],
                         start_offsets: list[int], data_parallel_group: Any,
                         fsdp_shard_model_params: list[torch.Tensor] | None = None,
                         batched: bool | None = None) -> None:
    """Quantize each rank's main-weight shard into its FP8 parameter with scales agreed over the DP group.

    ``main_params[i]`` is this rank's flat slice of ``model_params[i]`` starting at ``start_offsets[i]``
    (``None`` where another rank owns every element). Every rank of ``data_parallel_group`` calls this
    with the same ``model_params``: the amaxes (of the slices cast to ``fp8_hp_dtype``; one per tensorwise
    parameter, one per row of a row-wise one, a row possibly split between ranks) are max-reduced in one
    all-reduce, so every rank writes its bytes with the scales one process would compute on the whole tensor.
    Only the owned bytes change; the all-gather of the parameter buffer completes them.

    The tensorwise parameters take the batched path where ``batched`` (default: on accelerators, while the JIT
    fuser is enabled) and every owned shard is on the parameters' device: one compiled call for all their
    amaxes and one for all their quantizations, each keeping the rounding to ``fp8_hp_dtype``, bit for bit the
    eager result. Otherwise, and for the row-wise parameters, the cast to ``fp8_hp_dtype`` is its own (eager)
    pass, and the amax and quantization of the cast values are fused kernels (``jit_fuser``) for tensors of at
    least ``FUSED_MIN_ELEMENTS`` on accelerators.
    """
    if fsdp_shard_model_params is not None:
        raise ValueError("quantize_param_shard: fsdp_shard_model_params is not supported (FP8 parameters need "
                         "the distributed optimizer, not FSDP)")
    if not model_params:
        return
    device = model_params[0].device
    tensorwise = [i for i, param in enumerate(model_params) if not _rowwise(param)]
    rowwise = [i for i, param in enumerate(model_params) if _rowwise(param)]
    params = [model_params[i] for i in tensorwise]
    starts = [start_offsets[i] for i in tensorwise]
    mains = [_owned(main_params[i]) for i in tensorwise]
    # The compiled calls need every owned shard on the parameters' device (not an offloaded main weight) and
    # at least one of them; the eager path gives the same bytes otherwise.
    owned = [main for main in mains if main is not None]
    batchable = bool(owned) and all(main.device == device for main in owned)
    batched = batchable and (_use_batched(device) if batched is None else batched)
    # One amax vector: the tensorwise parameters' (one compiled call, or one multi-tensor norm of the cast
    # shards), then every row of the row-wise ones; one max-reduction over the DP group.
    if batched:
        tensorwise_amax, write = _tensorwise_batched(params, mains, starts, device)
    else:
        shards = [_hp_shard(param, main, device) for param, main in zip(params, mains)]
        tensorwise_amax, write = _tensorwise_eager(params, shards, starts, device)
    amaxes = [tensorwise_amax]
    rowwise_shards = {i: _hp_shard(model_params[i], _owned(main_params[i]), device) for i in rowwise}
    blocks = {}
    for i in rowwise:
        param, shard, cols = model_params[i], rowwise_shards[i], model_params[i].shape[-1]
        amax = torch.zeros(param.numel() // cols, dtype=torch.float32, device=device)
        if shard is not None:
            blocks[i] = lo, hi, rows = _row_block(shard, start_offsets[i], cols)
            amax[lo:hi] = _abs_amax(rows.reshape(-1), cols)
        amaxes.append(amax)
    reduced = reduce_amax(torch.cat(amaxes), data_parallel_group).split([a.numel() for a in amaxes])
    if tensorwise:
        scales = tensorwise_scale(reduced[0])
        torch._foreach_copy_([param.fp8_scale for param in params], scales.unbind())
        write(scales)
    for i, amax in zip(rowwise, reduced[1:]):
        param, shard, start, block = model_params[i], rowwise_shards[i], start_offsets[i], blocks.get(i)
        param.fp8_scale.copy_(power_of_two_scale(amax))
        if block is None:
            continue
        flat = param.detach().view(-1)
        lo, hi, rows = block
        scale = param.fp8_scale[lo:hi, None]
        if rows.data_ptr() == shard.data_ptr():  # the shard covers whole rows: quantize straight into the bytes
            _quantize_into(flat[start:start + shard.numel()].view(rows.shape), rows, scale)
            continue
        codes = quantize(rows, scale, FP8_PARAM_DTYPE).view(-1)
        offset = start - lo * param.shape[-1]
        flat[start:start + shard.numel()].copy_(codes[offset:offset + shard.numel()])
