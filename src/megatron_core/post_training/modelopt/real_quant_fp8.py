"""Real FP8 weights for inference: an FP8-PTQ'd model's linear layers stored and run in FP8.

After ``mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)`` every column-parallel, row-parallel
and duplicated linear layer fake-quantizes its input and weight to FP8 (E4M3) with one calibrated scale
each, but still stores and multiplies high-precision tensors. :func:`convert_to_real_fp8` replaces each
such layer by an :class:`FP8ParallelLinear`, which holds

* ``weight``: the FP8 codes themselves (``torch.float8_e4m3fn``, one byte per weight; frozen),
* ``weight_scale``: the weight's dequantization scale (``amax / 448`` as Model Optimizer computes it),
* ``input_scale`` / ``input_quant_scale``: the calibrated static input scale and its inverse
  (``448 / amax``, the factor Model Optimizer multiplies the input by before rounding),

and runs the GEMM

* on CUDA with ``torch._scaled_mm`` (input rounded to FP8 with the static scale, weight as stored,
  FP32 accumulation, output in the activation dtype), where the layer's shapes fit its rules (local
  input and output features multiples of 16; the weight ``[out, in]`` row-major, i.e. the column-major
  ``[in, out]`` operand it wants) and the GPU has FP8 tensor cores (compute capability 8.9 or newer);
* elsewhere (CPU, or a layer that does not fit, reported once when converting) as an exact emulation:
  input and weight rounded and dequantized as Model Optimizer's fake quantization does, then
  multiplied in the activation dtype. On CPU the converted model therefore gives exactly the
  fake-quantized model's logits.

The path is fixed per layer when it is converted or moved (``_apply``), so the forward holds no host
synchronisation and no data-dependent Python: CUDA-graph decode steps and ``torch.compile`` of the
dynamic inference engine capture it as it is. Tensor parallelism: every shard keeps the scale its
quantizers agreed on over TP during calibration (per-tensor amax are maxima over the layer's TP group);
the conversion checks that the ranks agree. The layer does its own TP communication, as the parallel
layers do (sequence-parallel gather, output gather, all-reduce or reduce-scatter).

Why not Model Optimizer's own real-quant path (``mtq.compress`` and its GEMM registry), which
Megatron-Core uses through ``real_quant_cfg``: its ``RealQuantLinear.forward`` runs the FP8 GEMM in place
of the layer's whole forward. For NVIDIA's ``megatron.core`` layers its Megatron plugin re-enters their
``_forward_impl``; this library's layers have no such hook, so on CUDA a compressed layer would skip its
TP communication and return a tensor instead of ``(output, bias)``. Its FP8 GEMM backend also matches only
that class, computes and caches scales on the first call (an ``assert`` on a tensor, a host sync), has no
fallback for shapes ``_scaled_mm`` rejects, and it rounds and dequantizes weights with ``amax / 448`` where fake
quantization uses ``448 / amax`` and its reciprocal (one fp32 ulp apart at times: in a tiny GPT one weight moved to
the neighbouring FP8 value, 8e-4 in the logits). Megatron-Core's ``real_quant_cfg="fp8_real_quant"``
(:class:`~.layers.FP8WeightTransformerLayer`) is weight-only: FP8 storage, no input scale, compute after
dequantizing. This module is W8A8: it needs the calibrated input scale and refuses that layout.

Checkpoints: ``state_dict`` / ``load_state_dict`` hold the FP8 codes and scales (``torch.save`` works; load
into a model converted the same way). ``sharded_state_dict`` raises: save the fake-quantized model
(``dist_checkpointing`` + ``checkpointing.save_modelopt_state``) and convert after loading.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core.post_training.modelopt._backend import modelopt_modules
from megatron_core.post_training.modelopt.layers import Linear
from megatron_core.tensor_parallel import layers as tp_layers
from megatron_core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

__all__ = ["FP8ParallelLinear", "convert_to_real_fp8", "fp8_gemm_paths", "fp8_linear", "linear_weight_bytes"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest E4M3 value
_SCALES = ("weight_scale", "input_scale", "input_quant_scale")
_LINEAR_TYPES = (tp_layers.ColumnParallelLinear, tp_layers.RowParallelLinear, Linear)
_SCALED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # output dtypes of torch._scaled_mm


def fp8_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(quantization factor 448 / amax, dequantization scale 1 / that)`` in fp32, as fake quantization computes them.

    An amax of at most 2**-24 counts as 1, as in Model Optimizer's FP8 fake quantization.
    """
    amax = amax.detach().to(torch.float32).reshape(())
    safe = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
    quant = FP8_MAX / safe
    return quant, 1 / quant


def quantize_fp8(x: torch.Tensor, quant_scale: torch.Tensor) -> torch.Tensor:
    """FP8 codes of ``x * quant_scale`` (computed in fp32, clamped to +-448, rounded to nearest)."""
    return (x.to(torch.float32) * quant_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
               input_quant_scale: torch.Tensor, use_scaled_mm: bool) -> torch.Tensor:
    """``x W^T`` with FP8 ``weight [out, in]`` and a static input scale, in ``x``'s dtype (``[..., in] -> [..., out]``).

    ``use_scaled_mm``: one ``torch._scaled_mm`` on the FP8 codes (CUDA; the caller checked the shapes);
    else the exact emulation: both operands dequantized in fp32, cast to ``x``'s dtype, multiplied there.
    """
    codes = quantize_fp8(x, input_quant_scale)
    if use_scaled_mm:
        out = torch._scaled_mm(codes.reshape(-1, codes.shape[-1]).contiguous(), weight.t(), scale_a=input_scale,
                               scale_b=weight_scale, out_dtype=x.dtype, use_fast_accum=False)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    x_dq = (codes.to(torch.float32) * input_scale).to(x.dtype)
    w_dq = (weight.to(torch.float32) * weight_scale).to(x.dtype)
    return torch.matmul(x_dq, w_dq.t())


def _scaled_mm_unfit(weight: torch.Tensor) -> str | None:
    """Why ``torch._scaled_mm`` cannot run this weight ``[out, in]`` where it lies, or None."""
    out_features, in_features = weight.shape
    if weight.device.type != "cuda":
        return f"weight on {weight.device.type}"
    if torch.cuda.get_device_capability(weight.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(weight.device)
        return f"GPU compute capability {major}.{minor} has no FP8 tensor cores (needs 8.9+)"
    bad = [f"{name} {size}" for name, size in (("in", in_features), ("out", out_features)) if size % 16]
    return f"features ({', '.join(bad)}) not multiples of 16" if bad else None


class FP8ParallelLinear(torch.nn.Module):
    """A column-parallel, row-parallel or duplicated linear layer with real FP8 weights, for inference.

    Built from a calibrated FP8-quantized layer (:func:`convert_to_real_fp8`); same call signature and
    ``(output, bias)`` result as the layer it replaces, same TP communication. Parameters are frozen.
    ``model.to(dtype)`` leaves the FP8 codes and the fp32 scales as they are (exactly: FP8 values are
    representable in every float dtype) and moves them with the model.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        weight_quant, weight_scale = fp8_scales(layer.weight_quantizer.amax)
        input_quant, input_scale = fp8_scales(layer.input_quantizer.amax)
        self.parallel_mode = ("column" if isinstance(layer, tp_layers.ColumnParallelLinear)
                              else "row" if isinstance(layer, tp_layers.RowParallelLinear) else "duplicated")
        with torch.no_grad():
            self.weight = torch.nn.Parameter(quantize_fp8(layer.weight, weight_quant.to(layer.weight.device)),
                                             requires_grad=False)
        self.register_buffer("weight_scale", weight_scale.to(layer.weight.device))
        self.register_buffer("input_scale", input_scale.to(layer.weight.device))
        self.register_buffer("input_quant_scale", input_quant.to(layer.weight.device))
        bias = layer.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.config = getattr(layer, "config", None)
        self.tp_group = getattr(layer, "tp_group", None)
        self.is_expert = getattr(layer, "is_expert", False)
        self.explicit_expert_comm = getattr(layer, "explicit_expert_comm", False)
        self.sequence_parallel = getattr(layer, "sequence_parallel", False)
        self.skip_bias_add = (layer._return_bias if self.parallel_mode == "duplicated" else layer.skip_bias_add)
        self.gather_output = getattr(layer, "gather_output", False)
        self.input_is_parallel = getattr(layer, "input_is_parallel", True)
        self.output_dtype = getattr(layer, "output_dtype", None)
        self.input_size = getattr(layer, "input_size", layer.weight.shape[1])
        self.output_size = getattr(layer, "output_size", layer.weight.shape[0])
        self.scaled_mm_unfit = _scaled_mm_unfit(self.weight)

    def _apply(self, fn: Any, recurse: bool = True) -> FP8ParallelLinear:
        """Move with the model; keep the FP8 codes and fp32 scales whatever dtype the model is cast to."""
        scales = {name: getattr(self, name) for name in _SCALES}
        super()._apply(fn, recurse)
        with torch.no_grad():
            if self.weight.dtype != FP8_DTYPE:  # a cast of FP8 values to a float dtype and back is exact
                self.weight = torch.nn.Parameter(self.weight.to(FP8_DTYPE), requires_grad=False)
            for name, before in scales.items():
                if getattr(self, name).dtype != torch.float32:
                    setattr(self, name, before.to(getattr(self, name).device))
        self.scaled_mm_unfit = _scaled_mm_unfit(self.weight)
        return self

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.input_quant_scale,
                          use_scaled_mm=self.scaled_mm_unfit is None and x.dtype in _SCALED_MM_DTYPES)

    def _add_bias(self, out: torch.Tensor) -> torch.Tensor:
        return out + self.bias.to(out.dtype) if self.bias is not None and not self.skip_bias_add else out

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias)`` like the replaced layer (``bias`` only with ``skip_bias_add``)."""
        if weight is not None:
            raise ValueError(f"{type(self).__name__} multiplies by its own FP8 weight; a weight passed to forward "
                             "(a tied output layer) cannot be used")
        bias = self.bias if self.skip_bias_add else None
        if self.parallel_mode == "duplicated":
            return self._add_bias(self._matmul(input_)), bias
        communicate = not self.explicit_expert_comm
        if self.parallel_mode == "row":
            if not self.input_is_parallel:
                input_ = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
            out = self._matmul(input_)
            if communicate and self.sequence_parallel:
                out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
            elif communicate:
                out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
            return self._add_bias(out), bias
        if communicate and self.sequence_parallel:
            input_ = gather_from_sequence_parallel_region(input_, group=self.tp_group)
        out = self._add_bias(self._matmul(input_))
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.output_dtype is not None:
            out = out.to(self.output_dtype)
        return out, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Not supported: raises ``NotImplementedError`` saying how to checkpoint instead."""
        raise NotImplementedError(
            f"{prefix.rstrip('.') or type(self).__name__}: a model converted to real FP8 weights has no "
            "dist_checkpointing layout; save the fake-quantized model instead (dist_checkpointing.save + "
            "post_training.modelopt.checkpointing.save_modelopt_state), load it, and call convert_to_real_fp8 "
            "after loading (the conversion is deterministic); or use state_dict()/torch.save for one TP layout")

    def extra_repr(self) -> str:
        """Mode, sizes, TP size and the GEMM path."""
        path = "scaled_mm" if self.scaled_mm_unfit is None else f"emulated ({self.scaled_mm_unfit})"
        return (f"{self.parallel_mode}, in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={get_pg_size(self.tp_group)}, gemm={path}")


def _quantizer_problem(quantizer: Any, mo: Any) -> str | None:
    """What keeps ``quantizer`` from being a calibrated static per-tensor FP8 (E4M3) quantizer, or None."""
    if type(quantizer) is not mo.nn.TensorQuantizer:
        return f"is a {type(quantizer).__name__}, not a single TensorQuantizer"
    if not quantizer.is_enabled:
        return "is disabled"
    checks = (
        (quantizer.num_bits == (4, 3), f"quantizes to num_bits={quantizer.num_bits}, not FP8 E4M3 (4, 3)"),
        (quantizer.axis is None and not quantizer.block_sizes,
         f"has per-channel/block scales (axis={quantizer.axis}, block_sizes={quantizer.block_sizes}), not one per tensor"),
        (quantizer.fake_quant, "is already real-quantized (mtq.compress)"),
        (quantizer.pre_quant_scale is None, "has a pre-quantization scale (SmoothQuant/AWQ)"),
        (not quantizer.rotate_is_enabled and quantizer.bias is None and quantizer.backend is None,
         "rotates, shifts or uses a custom backend"),
        (not getattr(quantizer, "_dynamic", False), "computes its scale dynamically"),
    )
    for ok, problem in checks:
        if not ok:
            return problem
    amax = quantizer.amax
    if amax is None:
        return "has no amax: it was not calibrated (did forward_loop reach this layer?)"
    if amax.numel() != 1 or not torch.isfinite(amax).all():
        return f"has an amax of shape {tuple(amax.shape)} or a non-finite one"
    return None


def _layer_problem(layer: torch.nn.Module, mo: Any) -> str | None:
    """Why ``layer`` (an enabled quantized linear) cannot be converted, or None."""
    if layer.weight is None:
        return "has no weight of its own (its weight is passed to forward, e.g. tied to the embedding)"
    if layer.output_quantizer.is_enabled:
        return "quantizes its output"
    for role in ("weight", "input"):
        problem = _quantizer_problem(getattr(layer, f"{role}_quantizer"), mo)
        if problem is not None:
            hint = (" (weight-only FP8, e.g. real_quant_cfg='fp8_real_quant': W8A8 needs a calibrated input scale)"
                    if role == "input" and problem == "is disabled" else "")
            return f"{role}_quantizer {problem}{hint}"
    return None


def _has_enabled_quantizer(module: torch.nn.Module, mo: Any) -> bool:
    """Whether a direct child of ``module`` is an enabled quantizer (a sequential/grouped one if any part is)."""
    for child in module.children():
        parts = list(child) if isinstance(child, mo.nn.SequentialQuantizer | mo.nn.GroupedQuantizer) else [child]
        if any(isinstance(q, mo.nn.TensorQuantizer) and q.is_enabled for q in parts):
            return True
    return False


def _check_tp_agreement(name: str, layer: torch.nn.Module) -> None:
    """``ValueError`` on every TP rank when the ranks' amax of ``layer`` differ (collective over its TP group)."""
    if not isinstance(layer, tp_layers.ColumnParallelLinear | tp_layers.RowParallelLinear) \
            or get_pg_size(layer.tp_group) == 1 or layer.explicit_expert_comm:
        return
    local = torch.stack([layer.weight_quantizer.amax.detach().float().reshape(()),
                         layer.input_quantizer.amax.detach().float().reshape(())]).reshape(1, 2)
    gathered = gather_from_tensor_model_parallel_region(local, group=layer.tp_group).reshape(-1, 2)
    if not bool((gathered == gathered[:1]).all()):
        raise ValueError(f"convert_to_real_fp8: {name}: its TP ranks hold different amax (weight, input) "
                         f"{gathered.tolist()}; calibrate with the quantizers synced over TP (Model Optimizer's "
                         "ParallelState)")


def _strip_quantizers(model: torch.nn.Module, mo: Any) -> None:
    """Turn the remaining quantization modules back into their own classes, without quantizer children.

    Model Optimizer's record of the conversion goes too once no dynamic module of any mode is left.
    """
    quantizer_types = (mo.nn.TensorQuantizer, mo.nn.SequentialQuantizer, mo.nn.GroupedQuantizer)
    for module in reversed(list(model.modules())):
        if isinstance(module, mo.dynamic.DynamicModule) and module.original_cls in mo.nn.QuantModuleRegistry:
            module.export()
        for child_name, child in list(module.named_children()):
            if isinstance(child, quantizer_types):
                delattr(module, child_name)
    if mo.mto.ModeloptStateManager.is_converted(model) and not any(
            isinstance(m, mo.dynamic.DynamicModule) for m in model.modules()):
        mo.mto.ModeloptStateManager.remove_state(model)


def convert_to_real_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every FP8-quantized linear layer of ``model`` by an :class:`FP8ParallelLinear`, in place.

    ``model`` must have been quantized with per-tensor FP8 (E4M3) weights and inputs
    (``mtq.FP8_DEFAULT_CFG``) and calibrated. Linear layers whose quantizers are all disabled (the output
    layer of ``FP8_DEFAULT_CFG``) stay in high precision. Afterwards the model holds no Model Optimizer
    module or state: it is a plain model of this library's layers. Collective over each layer's TP group
    (the scales' agreement is checked), so every rank calls it. Returns ``model``.

    Raises ``ValueError`` naming the layer when a linear layer is quantized another way (another recipe,
    weight-only, not calibrated, grouped experts), or when no linear layer is FP8-quantized at all;
    nothing is changed then.
    """
    mo = modelopt_modules("converting a model to real FP8 weights")
    convert, first_linear = [], None
    for name, module in model.named_modules():
        is_linear = isinstance(module, _LINEAR_TYPES)
        if is_linear and first_linear is None:
            first_linear = (name, module)
        if not _has_enabled_quantizer(module, mo):
            continue
        problem = _layer_problem(module, mo) if is_linear else (
            "has enabled quantizers but is not a column/row-parallel or duplicated linear layer (grouped experts, "
            "KV-cache quantization of attention): convert_to_real_fp8 converts linear layers only")
        if problem is not None:
            raise ValueError(f"convert_to_real_fp8: {name} ({type(module).__name__}) {problem}")
        convert.append(name)
    if not convert:
        where = f"{first_linear[0]} ({type(first_linear[1]).__name__})" if first_linear else "the model"
        raise ValueError(f"convert_to_real_fp8: {where} is not FP8-quantized, nor is any other linear layer: quantize "
                         "and calibrate first, mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)")
    for name in convert:
        _check_tp_agreement(name, model.get_submodule(name))
    converted = {}
    for name in convert:  # one layer at a time: its high-precision weight is freed before the next is converted
        parent, _, child = name.rpartition(".")
        converted[name] = FP8ParallelLinear(model.get_submodule(name))
        setattr(model.get_submodule(parent), child, converted[name])
    _strip_quantizers(model, mo)
    unfit = {name: layer.scaled_mm_unfit for name, layer in converted.items()
             if layer.scaled_mm_unfit is not None and layer.weight.is_cuda}
    if unfit:
        warnings.warn(f"convert_to_real_fp8: {len(unfit)} layers run the emulated FP8 GEMM instead of "
                      f"torch._scaled_mm: {unfit}", stacklevel=2)
    return model


def fp8_gemm_paths(model: torch.nn.Module) -> dict[str, str]:
    """``{layer name: "scaled_mm" or "emulated (<why>)"}`` for every :class:`FP8ParallelLinear` of ``model``."""
    return {name: "scaled_mm" if m.scaled_mm_unfit is None else f"emulated ({m.scaled_mm_unfit})"
            for name, m in model.named_modules() if isinstance(m, FP8ParallelLinear)}


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights of ``model``'s linear layers (column/row-parallel, duplicated, FP8), scales excluded."""
    types = (*_LINEAR_TYPES, FP8ParallelLinear)
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, types) and m.weight is not None)
