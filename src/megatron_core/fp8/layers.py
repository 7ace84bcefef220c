"""FP8 versions of the tensor-parallel linear layers, and the conversion of a model to them.

:class:`Float8ColumnParallelLinear` and :class:`Float8RowParallelLinear` keep their parents'
parameters, state-dict keys and tensor-parallel layout (sequence parallelism included); only the
GEMM changes: its input, weight and output gradient are cast to float8, by torchao's autograd op
(``fp8_recipe='tensorwise'``/``'rowwise'``) or by :mod:`megatron_core.fp8.delayed_linear`
(``'delayed'``, whose scaling state is the layer's ``_extra_state``), and the tensor-parallel
communication is done by the usual mapping functions around it.

:func:`convert_to_float8` switches the linear layers inside every ``TransformerLayer`` of a model
(QKV, attention projection, MLP fc1/fc2, and the MoE experts' grouped fc1/fc2, see
:mod:`megatron_core.fp8.grouped_layers`); embeddings, the router and the output layer stay in high
precision, as do the first/last layers with ``first_last_layers_bf16`` (``fp8_utils.is_first_last_bf16_layer``) and
the layers a ``quant_recipe`` keeps in high precision (:mod:`megatron_core.quantization.layer_precision`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.distributed.fp8_params import (
    copy_tensor_to_quantized_param,
    dequantize_fp8_tensor,
    is_fp8_param,
    make_fp8_param,
)
from megatron_core.fp8 import fp8_param_linear
from megatron_core.fp8.delayed_linear import delayed_float8_matmul
from megatron_core.fp8.delayed_scaling import (
    DelayedScalingRecipe,
    init_state,
    pack_extra_state,
    unpack_extra_state,
)
from megatron_core.fp8.fp8_param_linear import SWIGLU, allocate_weight_transpose, fp8_param_matmul
from megatron_core.fp8.fp8_param_module import apply_keeping_fp8_params
from megatron_core.fp8.grouped_layers import GROUPED_FP8_CLASSES
from megatron_core.fp8.torchao_backend import (
    check_fp8_config,
    check_fp8_device,
    float8_linear_config,
    float8_matmul,
    linear_mm_config,
)
from megatron_core.fp8_utils import is_first_last_bf16_layer
from megatron_core.quantization.layer_precision import fp8_override_for_module
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

FP8_DIM_MULTIPLE = 16


# The delayed-scaling state of a layer (``delayed_scaling.init_state``): fp32 whatever the layer's dtype.
_DELAYED_STATE_BUFFERS = ("fp8_amax_history", "fp8_scale", "fp8_limits")


class _Float8GemmMixin:
    """The float8 GEMM and the ``_extra_state`` (delayed-scaling state, else None) of a converted layer."""

    float8_config: Any = None
    float8_mm_config: Any = None
    float8_emulate: bool = False
    float8_wgrad: bool = True  # config.fp8_wgrad for an FP8 parameter's GEMM (the delayed recipe carries its own)
    # Transformer Engine's flag: True before a step's first micro-batch (``set_is_first_microbatch``), when an FP8
    # parameter's cached transpose is refreshed; None while no schedule says where steps begin (no cache used).
    is_first_microbatch: bool | None = None

    def allocate_weight_caches(self) -> None:
        """Give each FP8 parameter its transposed-codes cache (see ``fp8_param_linear._cached_weight_transpose``)."""
        for param in self._parameters.values():
            if is_fp8_param(param):
                allocate_weight_transpose(param)

    def float8_gemm(self, x: torch.Tensor, weight: torch.Tensor, x_amax: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T`` in float8: the stored bytes of an FP8 parameter (``fp8_param``; ``x_amax``, ``x``'s amax
        if known, spares it a pass over ``x``), else delayed scales if the layer has a delayed-scaling state, else
        torchao (both ignore ``x_amax``)."""
        if is_fp8_param(weight):
            return fp8_param_matmul(x, weight, self, x_amax=x_amax)
        if x.numel() == 0:  # an expert that got no tokens: no amax to take (nor record); the weight's gradient is 0
            return torch.matmul(x, weight.t())
        if getattr(self, "float8_recipe", None) is not None:
            return delayed_float8_matmul(x, weight, self, emulate=self.float8_emulate)
        return float8_matmul(x, weight, self.float8_config, self.float8_mm_config)

    def get_extra_state(self) -> dict | None:
        """The delayed-scaling state (amax histories and scales) to checkpoint; None for torchao recipes."""
        if getattr(self, "float8_recipe", None) is None:
            return None
        return pack_extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        """Load the delayed-scaling state (``None``, from a high-precision checkpoint, resets it)."""
        if getattr(self, "float8_recipe", None) is not None:
            unpack_extra_state(self, state)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """The parent's ``_apply`` (``.to()``, ``.cuda()``, ``.bfloat16()``, ``Float16Module``) except that an FP8
        parameter keeps its bytes: it follows the device, and a cast sets its high-precision dtype. The delayed-scaling
        state (amax history, scales, limits) stays fp32 (a bf16 copy could not hold its largest scale)."""
        state = {name: self._buffers[name] for name in _DELAYED_STATE_BUFFERS if name in self._buffers}
        result = apply_keeping_fp8_params(self, super()._apply, fn, recurse)
        for name, before in state.items():
            after = self._buffers[name]
            if after is not None and after.dtype != before.dtype:
                self._buffers[name] = before.to(device=after.device)
        return result

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """The parent's entries, an FP8 parameter's being its dequantized high-precision value."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, param in self._parameters.items():
            if is_fp8_param(param) and prefix + name in destination:
                destination[prefix + name] = dequantize_fp8_tensor(param)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        """The parent's load, then each FP8 parameter re-quantized from its high-precision value."""
        super()._load_from_state_dict(state_dict, prefix, *args)
        for name, param in self._parameters.items():
            value = state_dict.get(prefix + name)
            if is_fp8_param(param) and isinstance(value, torch.Tensor) and value.shape == param.shape:
                copy_tensor_to_quantized_param(param, value)
                if self.is_first_microbatch is False:
                    self.is_first_microbatch = True  # the cached transpose holds the old bytes: refresh it

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The parent's sharded state; an FP8 parameter's entry (its dequantized value) names the parameter
        (``fp8_param``) so the optimizer's checkpoint state finds it."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name, param in self._parameters.items():
            if is_fp8_param(param) and prefix + name in sharded:
                sharded[prefix + name].fp8_param = param
        return sharded


class Float8ColumnParallelLinear(_Float8GemmMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose GEMM runs in float8 (made by :func:`convert_to_float8`)."""

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        """``(output, bias)`` as the parent's, computed with a float8 GEMM."""
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError("weight must be passed to forward() when skip_weight_param_allocation=True")
        output = self.float8_gemm(self._total_input(input_), weight)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias.to(output.dtype)
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.output_dtype is not None:
            output = output.to(self.output_dtype)
        return output, (self.bias if self.skip_bias_add else None)

    def fuses_swiglu(self) -> bool:
        """Whether :meth:`forward_swiglu` serves this layer: an FP8 parameter weight, no bias, the output neither
        gathered nor cast (and ``fp8_param_linear.FUSED_SWIGLU_GRAD``)."""
        return (fp8_param_linear.FUSED_SWIGLU_GRAD and is_fp8_param(self.weight) and self.bias is None
                and not self.gather_output and self.output_dtype is None)

    def forward_swiglu(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, amax)``: ``h = silu(gate) * up`` of this layer's output ``[gate; up]`` (an MLP's gated
        ``linear_fc1``) and ``h``'s amax (0-d fp32, for ``linear_fc2``'s ``input_amax``). The activation runs inside
        the FP8 GEMM's autograd function, whose backward quantizes SwiGLU's gradient in two passes over its inputs
        (:mod:`megatron_core.fp8.swiglu_grad_cast`); see :meth:`fuses_swiglu`."""
        if not self.fuses_swiglu():
            raise ValueError("forward_swiglu needs an FP8 parameter weight (fp8_param), no bias, gather_output=False "
                             "and no output_dtype")
        return fp8_param_matmul(self._total_input(input_), self.weight, self, activation=SWIGLU)

    def _total_input(self, input_: torch.Tensor) -> torch.Tensor:
        """The GEMM's input: gathered over the sequence-parallel ranks, or entering the tensor-parallel region."""
        if self.explicit_expert_comm or self.disable_grad_reduce:
            return input_
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, group=self.tp_group)
        return copy_to_tensor_model_parallel_region(input_, group=self.tp_group)


class Float8RowParallelLinear(_Float8GemmMixin, RowParallelLinear):
    """``RowParallelLinear`` whose GEMM runs in float8 (made by :func:`convert_to_float8`)."""

    @property
    def takes_input_amax(self) -> bool:
        """Whether :meth:`forward` uses an ``input_amax``: an FP8 parameter weight and an input already parallel."""
        return is_fp8_param(self.weight) and self.input_is_parallel

    def forward(self, input_: torch.Tensor, input_amax: torch.Tensor | None = None):
        """``(output, bias)`` as the parent's, computed with a float8 GEMM. ``input_amax``: ``input_``'s amax (this
        rank's part) where the caller made it with ``input_`` (``Float8ColumnParallelLinear.forward_swiglu``); used
        when the input is already parallel, else ignored."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
            input_amax = None  # the amax of the whole input, not of this rank's slice
        output_parallel = self.float8_gemm(input_parallel, self.weight, input_amax)
        return self._reduce_output(output_parallel)


_FP8_CLASSES = {ColumnParallelLinear: Float8ColumnParallelLinear, RowParallelLinear: Float8RowParallelLinear}


def _default_amax_group(layer: torch.nn.Module, tp_only: bool = False) -> Any:
    """Megatron-Core's amax reduction group if ``parallel_state`` is set up (TP x DP x CP, or TP x CP with
    ``tp_only_amax_red``), else the layer's TP group."""
    from megatron_core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=tp_only)
    return layer.tp_group


def _use_fp8_param(layer: torch.nn.Module, config: Any, amax_group: Any) -> None:
    """Store ``layer``'s weight as an FP8 parameter (:mod:`megatron_core.distributed.fp8_params`)."""
    layer.weight = make_fp8_param(layer.weight)
    layer.fp8_param_grad_dtype = torch.float8_e5m2 if config.fp8 == "hybrid" else torch.float8_e4m3fn
    layer.fp8_param_amax_group = amax_group


def convert_to_float8(model: torch.nn.Module, config: Any = None, emulate: bool = False,
                      amax_reduction_group: Any = None) -> list[str]:
    """Switch the linear layers of ``model``'s transformer layers to float8 GEMMs; return their names.

    ``config`` defaults to ``model.config`` and must set ``fp8``. ``fp8_recipe='tensorwise'`` or
    ``'rowwise'`` use torchao (:mod:`megatron_core.fp8.torchao_backend`); ``'delayed'`` (Megatron-Core's
    default) uses this library's delayed-scaling GEMM (:mod:`megatron_core.fp8.delayed_linear`; no torchao
    needed for the dense layers), each converted layer getting its own amax histories and scales, its
    amaxes max-reduced over ``amax_reduction_group`` (default: Megatron-Core's, the tensor x data x
    context parallel group of ``parallel_state`` (tensor x context with ``config.tp_only_amax_red``), or each
    layer's TP group without ``parallel_state``). The
    model must be on a GPU with FP8 tensor cores unless ``emulate`` (fp32 emulation of the float8
    rounding, for tests on CPU). Every converted weight needs both dimensions (per TP rank) to be
    multiples of 16. The MoE experts' grouped GEMMs use row-wise e4m3 scales whatever ``fp8_recipe`` says
    (the only FP8 grouped recipe). Call before wrapping the model in DDP/FSDP and before building the
    optimizer; parameters and state-dict keys are those of the high-precision model (with ``'delayed'``
    the layers' ``_extra_state`` entries carry the scaling state).

    With ``config.fp8_param`` (``fp8_recipe='tensorwise'``) the converted dense layers' weights become FP8
    parameters (:mod:`megatron_core.distributed.fp8_params`, GEMM :mod:`megatron_core.fp8.fp8_param_linear`; no
    torchao needed), their input / output-gradient amaxes max-reduced over ``amax_reduction_group`` when
    given (else each rank's own); the MoE experts' grouped weights become FP8 parameters with one power-of-two
    scale per (expert, output feature), the codes their FP8 grouped GEMM would cast in the forward
    (:mod:`megatron_core.fp8.fp8_param_grouped`). A later ``.to()`` /
    ``Float16Module`` moves the FP8 bytes without casting them. Wrap the model in DDP with
    ``use_distributed_optimizer`` and ``fp8_param_gather``; the state dict holds the dequantized weights.

    ``config.fp8_wgrad=False`` (Transformer Engine's high-precision weight gradient) is honoured by the delayed
    recipe, the FP8-parameter GEMMs and the experts' grouped GEMMs: their weight gradients come from the unquantized
    input and output gradient; torchao's recipes refuse it.
    """
    from megatron_core.transformer.transformer_layer import TransformerLayer

    config = config if config is not None else getattr(model, "config", None)
    if config is None or getattr(config, "fp8", None) is None:
        raise ValueError("convert_to_float8 needs a config with fp8 set ('e4m3' or 'hybrid')")
    check_fp8_config(config)
    if getattr(config, "gradient_accumulation_fusion", False) and not getattr(config, "fp8_param", False):
        raise ValueError("fp8 without Transformer Engine supports gradient_accumulation_fusion=True only with "
                         "fp8_param=True (torchao's float8 GEMMs return the weight gradient; FP8 parameters add "
                         "theirs to main_grad); got fp8_param=False")
    if not emulate:
        param = next(model.parameters(), None)
        check_fp8_device(config, param.device if param is not None else torch.device("cpu"))
    targets = []
    for layer_name, layer in model.named_modules():
        if not isinstance(layer, TransformerLayer) or is_first_last_bf16_layer(config, int(layer.layer_number) - 1):
            continue
        for name, sub in layer.named_modules():
            new_cls = _FP8_CLASSES.get(type(sub)) or GROUPED_FP8_CLASSES.get(type(sub))
            if new_cls is None:
                continue
            full_name = f"{layer_name}.{name}" if layer_name else name
            if fp8_override_for_module(config, full_name) is False:  # the quant_recipe keeps it in high precision
                continue
            shape = tuple(sub.weight.shape[-2:])
            if any(d % FP8_DIM_MULTIPLE for d in shape):
                raise ValueError(f"fp8: {full_name} has weight shape {shape} (per tensor-parallel rank); FP8 GEMMs "
                                 f"need both dimensions to be multiples of {FP8_DIM_MULTIPLE}")
            targets.append((full_name, sub, new_cls))
    fp8_param = bool(getattr(config, "fp8_param", False))
    fp8_wgrad = bool(getattr(config, "fp8_wgrad", True))
    delayed = config.fp8_recipe == "delayed"
    if delayed:
        recipe = DelayedScalingRecipe.from_config(config)
    elif not fp8_param:
        float8_config = float8_linear_config(config, emulate=emulate)
        mm_config = linear_mm_config(float8_config)
    for _, sub, new_cls in targets:
        sub.__class__ = new_cls
        sub.float8_emulate = emulate
        sub.float8_wgrad = fp8_wgrad
        if new_cls in GROUPED_FP8_CLASSES.values():
            if fp8_param:  # the experts' weights as FP8 parameters with the grouped GEMM's row-wise scales
                sub.weight = make_fp8_param(sub.weight, scaling="rowwise")
            continue
        if fp8_param:
            _use_fp8_param(sub, config, amax_reduction_group)
        elif delayed:
            group = (amax_reduction_group if amax_reduction_group is not None
                     else _default_amax_group(sub, bool(getattr(config, "tp_only_amax_red", False))))
            init_state(sub, recipe, sub.weight.device, group)
        else:
            sub.float8_config = float8_config
            sub.float8_mm_config = mm_config
    return [name for name, _, _ in targets]
