"""This library's layers registered with Model Optimizer's quantization (its ``QuantModuleRegistry``).

Model Optimizer's own Megatron plugin registers NVIDIA's ``megatron.core`` classes; this module does
the same for ours, so ``modelopt.torch.quantization.quantize(model, cfg, forward_loop)`` inserts
quantizers into every :class:`~megatron_core.tensor_parallel.ColumnParallelLinear`,
:class:`~megatron_core.tensor_parallel.RowParallelLinear` and the duplicated
:class:`~megatron_core.post_training.modelopt.layers.Linear` of a model. Importing it registers them
(once per process); :func:`megatron_core.post_training.modelopt.register_quant_modules` is the entry.

How a parallel linear is quantized: during its forward, the module-level
``linear_with_grad_accumulation_and_async_allreduce`` (or, for a frozen weight, ``linear_with_frozen_weight``)
that the layer calls is swapped for one that
quantizes the GEMM's input and weight (Model Optimizer's ``_ParallelLinear`` plugin base, the one its
Megatron, Apex and FairScale plugins use). So the quantizers see exactly the local GEMM operands: a
column layer's input after the sequence-parallel gather is done inside that function, a row layer's
input shard ``[s, b, in / TP]``.

Which ranks agree on what: each layer's ``parallel_state`` names its data-parallel group (with
context parallelism; the expert data-parallel group for experts), its own tensor-parallel group and,
for experts, the expert-parallel group. Model Optimizer's calibration takes the maximum of an amax
over the data-parallel group always, and over the tensor-parallel group where the shards must share
one scale: a column layer's per-tensor input and weight amax, a row layer's per-tensor input amax and
its per-tensor or per-output-channel weight amax. Per-output-channel amax of a column layer and
per-input-block amax of a row layer stay local: they belong to the rows/columns that rank holds.
AWQ-lite's per-layer statistics of a column layer are averaged over TP, and every layer's activation
statistic and search errors are token-weighted means over its data-parallel group (:mod:`.awq_tp`), so TP=N
and DP=N pick the one-process scales; a row layer's weight blocks must lie whole in its input shard.

Checkpoints: :meth:`sharded_state_dict` adds the quantizer buffers (``*_quantizer._amax``,
``input_quantizer._pre_quant_scale``, ``*_global_amax``) beside the weights, split over TP the way
their channels are (see :func:`_quantizer_shard_axis`); scalars are stored as ``[1]``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_core.dist_checkpointing.factories import apply_swiglu_sharded_factory
from megatron_core.dist_checkpointing.mapping import ShardedTensor
from megatron_core.dist_checkpointing.sharded_module import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron_core.post_training.modelopt._backend import modelopt_modules
from megatron_core.post_training.modelopt.awq_tp import sync_awq_statistics
from megatron_core.post_training.modelopt.layers import Linear
from megatron_core.post_training.modelopt.quantizer_buffers import view_quantizer_buffers
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.tensor_parallel import layers as tp_layers
from megatron_core.transformer.mlp import MLP

_mo = modelopt_modules()

__all__ = ["QuantColumnParallelLinear", "QuantLinear", "QuantMLP", "QuantRowParallelLinear"]

# Quantizer buffers that sharded_state_dict knows how to split over TP.
_KNOWN_BUFFERS = ("_amax", "_pre_quant_scale", "_global_amax")
# fc1 entries whose first axis is the output row (so a gated fc1 stores them as [gate; up] like its weight).
_FC1_ROW_BUFFER = re.compile(r"linear_fc1\.weight_quantizer\.(\d+\.)*_amax$")


def _group_or_unused(group: Any) -> Any:
    """A process group for ``ParallelState``: ``-1`` (unused, nothing to sync) where none is registered."""
    return -1 if group is None else group


def parallel_state_for(layer: torch.nn.Module) -> Any:
    """Model Optimizer's ``ParallelState`` for one of our linear layers (see the module docstring)."""
    tp_group = getattr(layer, "tp_group", None)
    if getattr(layer, "is_expert", False):
        return _mo.distributed.ParallelState(
            _group_or_unused(resolve_process_group("expt_dp")),
            tensor_parallel_group=_group_or_unused(tp_group),
            expert_model_parallel_group=_group_or_unused(resolve_process_group("ep")),
        )
    return _mo.distributed.ParallelState(
        _group_or_unused(resolve_process_group("dp_cp")), tensor_parallel_group=_group_or_unused(tp_group)
    )


def _matrix(buffer: torch.Tensor, out_rows: int) -> torch.Tensor:
    """An amax as ``[rows, columns]``: 2-D block amax ``[o/b, 1, i/b, 1]`` squeezed, else ``[out_rows, -1]``."""
    if buffer.ndim == 4:
        return buffer.squeeze(1).squeeze(-1)
    return buffer.reshape(out_rows, -1)


def _quantizer_shard_axis(name: str, value: torch.Tensor, column: bool) -> tuple[torch.Tensor, int | None]:
    """``(tensor to store, TP axis or None for replicated)`` for the quantizer buffer ``name``.

    Scalars (per-tensor amax, NVFP4's global amax) are replicated as ``[1]``. A weight amax with more
    than one value is ``[rows, columns]`` of the local weight: a column layer owns its rows (axis 0);
    a row layer owns its input blocks (axis 1), while a per-output-channel amax (one column) was made
    equal over TP by calibration and is replicated. Input-side buffers (``_pre_quant_scale``, a
    per-channel input amax) follow the input dim: split on a row layer, replicated on a column layer.
    """
    if value.numel() == 1:
        return value.reshape(1), None
    quantizer = name.split(".", 1)[0]
    if quantizer == "weight_quantizer":
        return value, None  # reshaped by the caller, which knows the weight's rows
    if quantizer == "input_quantizer":
        return value.reshape(-1), (None if column else 0)
    return value.reshape(-1), (0 if column else None)


def _check_blocks_fit(name: str, block_sizes: dict, local_in: int, column: bool) -> None:
    """``ValueError`` when a row layer's weight blocks straddle its TP input shards (they could not reshard)."""
    block = block_sizes.get(-1) if isinstance(block_sizes, dict) else None
    if column or not isinstance(block, int) or local_in % block == 0:
        return
    raise ValueError(
        f"{name}: the weight blocks ({block} input channels) do not divide this row-parallel layer's input shard "
        f"({local_in} channels per TP rank): its block scales differ from one process's and cannot be resharded; "
        "use a tensor-parallel size whose input shard is a multiple of the block size"
    )


# The module-level GEMM functions of ``tensor_parallel.layers`` that a parallel linear's forward calls.
_GEMM_FUNCTIONS = ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight")


class _QuantParallelLinear(_mo.custom._ParallelLinear):
    """Shared part of the quantized column- and row-parallel linear layers."""

    # Both GEMM functions a layer may call: frozen weights (real-quantized ones included) take the second.
    _functionals_to_replace = [(tp_layers, name) for name in _GEMM_FUNCTIONS]
    # Model Optimizer enters ``enable_weight_access_and_writeback()`` of a parallel linear that has this
    # marker around its calibration steps (it is how TP-sharded Hugging Face linears take part); ours uses
    # it to make AWQ's statistics those of the whole layer (see ``awq_tp``).
    _hf_tp_plan = "megatron_core"

    def _setup(self) -> None:
        if self.parallel_state is None:
            self.parallel_state = parallel_state_for(self)
        if getattr(self, "gradient_accumulation_fusion", False):
            # The fused path writes the weight gradient into weight.main_grad, but the GEMM now sees the
            # quantized copy of the weight (which has no main_grad); use the plain autograd path.
            warnings.warn("gradient_accumulation_fusion is turned off in a quantized linear layer", stacklevel=2)
            self.gradient_accumulation_fusion = False
        super()._setup()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's forward with the quantizing GEMM swapped in; the module function is restored even on error.

        (Model Optimizer's swap restores it only when the forward returns: after an exception the next
        forward would wrap the leftover quantized function again.)
        """
        originals = {name: getattr(tp_layers, name) for name in _GEMM_FUNCTIONS}
        try:
            return super().forward(*args, **kwargs)
        finally:
            for name, original in originals.items():
                setattr(tp_layers, name, original)
                if hasattr(tp_layers, f"_{name}"):
                    delattr(tp_layers, f"_{name}")

    @contextmanager
    def enable_weight_access_and_writeback(self) -> Iterator[None]:
        """Model Optimizer's hook around a calibration step: AWQ statistics made to agree over TP and DP (``awq_tp``).

        An expert's layer also leaves the expert-parallel group inside it: SmoothQuant and AWQ re-calibrate
        the smoothed weight by ``max_calibrate`` of the layer alone, which does not know the layer is an
        expert and would take its weight amax as the maximum over the experts of all EP ranks (each expert's
        weight amax is its own; the input amax was synced over EP before, by the model's calibration).
        """
        sync_awq_statistics(self)
        saved = self.parallel_state
        if getattr(self, "is_expert", False):
            self.parallel_state = _mo.distributed.ParallelState(
                _group_or_unused(resolve_process_group("expt_dp")), tensor_parallel_group=_group_or_unused(self.tp_group))
        try:
            yield
        finally:
            self.parallel_state = saved
        sync_awq_statistics(self)

    def _quantizer_state(self, prefix: str = "") -> dict[str, tuple[torch.Tensor, int | None]]:
        column = bool(self._is_column_parallel)
        out = {}
        for name, value in self.state_dict(prefix="", keep_vars=True).items():
            if "_quantizer." not in name:
                continue
            if not name.endswith(_KNOWN_BUFFERS):
                raise NotImplementedError(
                    f"quantizer buffer {name!r} of {type(self).__name__} cannot be stored in a sharded "
                    f"checkpoint yet (known buffers: {', '.join(_KNOWN_BUFFERS)})"
                )
            tensor, axis = _quantizer_shard_axis(name, value, column)
            if name.startswith("weight_quantizer") and value.numel() > 1:
                tensor = _matrix(value, self.weight.shape[0])
                # a row layer's input blocks are its own (even one block per row); one amax per output row is shared
                block_sizes = self.get_submodule(name.rsplit(".", 1)[0]).block_sizes or {}
                blocked = bool(block_sizes)
                _check_blocks_fit(prefix + name, block_sizes, self.weight.shape[1], column)
                axis = 0 if column else (1 if blocked else None)
            out[name] = (tensor, axis)
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The layer's sharded state with its quantizer buffers split over TP (module docstring)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        quantizer_state = self._quantizer_state(prefix)
        for name in quantizer_state:
            sharded.pop(f"{prefix}{name}", None)
        tensors = {name: tensor for name, (tensor, _) in quantizer_state.items()}
        axes = {name: axis for name, (_, axis) in quantizer_state.items() if axis is not None}
        sharded.update(make_sharded_tensors_for_checkpoint(
            tensors, prefix, axes, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]))
        return sharded

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """Quantizer buffers come back in their stored shape (``[1]``, ``[rows, columns]``): view them as ours."""
        view_quantizer_buffers(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@_mo.nn.QuantModuleRegistry.register({tp_layers.ColumnParallelLinear: "megatron_core_ColumnParallelLinear"})
class QuantColumnParallelLinear(_QuantParallelLinear):
    """Quantized :class:`~megatron_core.tensor_parallel.ColumnParallelLinear` (weight ``[out / TP, in]``)."""

    _is_column_parallel = True


@_mo.nn.QuantModuleRegistry.register({tp_layers.RowParallelLinear: "megatron_core_RowParallelLinear"})
class QuantRowParallelLinear(_QuantParallelLinear):
    """Quantized :class:`~megatron_core.tensor_parallel.RowParallelLinear` (weight ``[out, in / TP]``)."""

    _is_row_parallel = True


@_mo.nn.QuantModuleRegistry.register({Linear: "megatron_core_post_training_Linear"})
class QuantLinear(_mo.quant_linear._QuantLinear):
    """Quantized duplicated :class:`~megatron_core.post_training.modelopt.layers.Linear` (no TP split).

    Model Optimizer's ``nn.Linear`` quantization: the input is quantized before the forward and the
    weight while it is read; the layer's ``(output, bias)`` tuple passes through.
    """


@_mo.nn.QuantModuleRegistry.register({MLP: "megatron_core_MLP"})
class QuantMLP(_mo.dynamic.DynamicModule):
    """:class:`~megatron_core.transformer.MLP` whose gated ``linear_fc1`` stores per-row weight amax as ``[gate; up]``.

    A gated fc1 holds ``[gate_r; up_r]`` on each TP rank; ``MLP.sharded_state_dict`` stores its weight
    TP-independently as ``[gate; up]`` and this does the same for the amax rows that belong to those
    weight rows, so a quantized checkpoint reshards like the weights.
    """

    def _setup(self) -> None:
        """No quantizer of its own: only the checkpoint layout changes (and no group to sync over)."""
        if self.parallel_state is None:
            self.parallel_state = parallel_state_for(self)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """``MLP``'s sharded state with the gated fc1's per-row amax split into gate and up halves."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not self.config.gated_linear_unit:
            return sharded
        for key, value in sharded.items():
            # local_shape is the rank's own tensor, without the prepended layer axes
            if _FC1_ROW_BUFFER.search(key) and isinstance(value, ShardedTensor) and len(value.local_shape) == 2:
                sharded[key] = apply_swiglu_sharded_factory(value)
        return sharded
