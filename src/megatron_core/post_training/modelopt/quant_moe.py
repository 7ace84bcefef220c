"""MoE experts registered with Model Optimizer's quantization (what its Megatron plugin does for NVIDIA's experts).

Two expert layouts (:mod:`megatron_core.transformer.moe.experts`):

* ``SequentialMLP``: every local expert is an ``MLP`` of column/row-parallel linears, quantized by
  :mod:`.quant_modules` like any other. :class:`QuantSequentialMLP` adds what Model Optimizer's plugin
  adds: before the distributed amax sync, ``max_calibrate`` calls ``layer_sync_moe_local_experts_amax``,
  which gives all local experts one input amax (the maximum over them; Model Optimizer's
  ``sync_moe_expert_amax``) and calibrates the weight amax of an expert that saw no token from its weight.
  The input amax is then the maximum over the expert-parallel group too, so every expert of every rank
  holds the one-process value; weight amax stay per expert.
* ``TEGroupedMLP`` / ``GroupedMLP``: ``ColumnParallelGroupedLinear`` / ``RowParallelGroupedLinear`` hold
  ``weight [E, out, in]``. :class:`QuantColumnParallelGroupedLinear` / :class:`QuantRowParallelGroupedLinear`
  give each local expert its own weight quantizer (a ``GroupedQuantizer``, children ``weight_quantizer.<e>``:
  per-tensor or per-output-channel amax per expert, as Model Optimizer does for Transformer Engine's grouped
  linear) and one input quantizer for the layer's input, and fake-quantize both in ``gemm`` before the
  grouped GEMM. Calibration reads each expert's weight directly, so an expert without tokens is calibrated
  too; the input amax is synced over the expert-parallel group (the routed-expert rule of Model Optimizer's
  ``max_calibrate``). SmoothQuant and AWQ act only on layers with a 2-D weight (Model Optimizer's
  ``is_quantized_linear``), so grouped experts get the recipe's formats with max calibration, unsmoothed.
  Expert tensor parallelism of grouped experts is refused (their amax would need a sync over it that
  Model Optimizer applies only to 2-D linears).

Checkpoints: :class:`QuantTEGroupedMLP` adds each expert's weight-quantizer buffers under its global expert
index (the weights' layout, ``<prefix>experts.linear_fc1.weight_quantizer._amax``) and the layer's input
quantizer buffers replicated; :func:`expert_quantizer_state_for` maps Model Optimizer's saved per-quantizer
settings to another expert-parallel size. The router's linear stays unquantized (it is no linear layer).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.dist_checkpointing.mapping import ShardedTensor
from megatron_core.dist_checkpointing.sharded_module import make_sharded_tensors_for_checkpoint
from megatron_core.post_training.modelopt._backend import modelopt_modules
from megatron_core.post_training.modelopt.quantizer_buffers import view_quantizer_buffers
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP
from megatron_core.transformer.moe.grouped_linear import (
    ColumnParallelGroupedLinear,
    RowParallelGroupedLinear,
    grouped_gemm,
)

_mo = modelopt_modules()

__all__ = ["QuantColumnParallelGroupedLinear", "QuantGroupedMLP", "QuantRowParallelGroupedLinear",
           "QuantSequentialMLP", "QuantTEGroupedMLP", "expert_quantizer_state_for", "modelopt_state_for"]

# Per-expert quantizer names: a SequentialMLP's local expert, a grouped linear's per-expert weight quantizer.
_SEQUENTIAL_EXPERT = re.compile(r"^(?P<head>.*\.local_experts\.)(?P<idx>\d+)(?P<tail>\..*)$")
_GROUPED_EXPERT = re.compile(r"^(?P<head>.*\.weight_quantizer\.)(?P<idx>\d+)(?P<tail>(\..*)?)$")


def _experts_parallel_state(module: torch.nn.Module) -> Any:
    """Model Optimizer's ``ParallelState`` of experts: expert data-parallel, expert-TP and expert-parallel groups."""
    return _mo.distributed.ParallelState(
        _group(resolve_process_group("expt_dp")), tensor_parallel_group=_group(module.tp_group),
        expert_model_parallel_group=_group(resolve_process_group("ep")))


def _group(group: Any) -> Any:
    return -1 if group is None else group


class _QuantGroupedLinear(_mo.nn.QuantModule):
    """Shared part of the quantized grouped expert linears (module docstring)."""

    def _setup(self) -> None:
        if self.parallel_state is None:  # always experts: the expert data-parallel and expert-parallel groups
            self.parallel_state = _experts_parallel_state(self)
        if get_pg_size(self.tp_group) > 1:
            raise NotImplementedError(
                f"quantizing {type(self).__name__} under expert tensor parallelism (size "
                f"{get_pg_size(self.tp_group)}) is not supported: use expert_tensor_parallel_size=1 or "
                "SequentialMLP experts (moe_grouped_gemm=False)")
        self._register_temp_attribute("input_quantizer", _mo.nn.TensorQuantizer())
        self._register_temp_attribute("output_quantizer", _mo.nn.TensorQuantizer())
        self.output_quantizer.disable()
        weights = _mo.nn.modules.tensor_quantizer.GroupedQuantizer(
            *(_mo.nn.TensorQuantizer() for _ in range(self.num_gemms)))
        self._register_temp_attribute("weight_quantizer", weights)

    def gemm(self, x: torch.Tensor, tokens_per_expert: Any) -> torch.Tensor:
        """The grouped GEMM on the quantized input and each expert's quantized weight."""
        x = self.input_quantizer(x)
        weight = torch.stack([self.weight_quantizer[e](self.weight[e]) for e in range(self.num_gemms)])
        return self.output_quantizer(grouped_gemm(x, weight, tokens_per_expert))

    def iter_weights_for_calibration(self):
        """``(weight of expert e, its quantizer)`` for Model Optimizer's weight calibration."""
        for e in range(self.num_gemms):
            yield self.weight[e], self.weight_quantizer[e]

    def quantizer_buffers(self) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """``(layer-wide quantizer buffers, {local expert: its weight-quantizer buffers})`` by state-dict name."""
        shared: dict[str, torch.Tensor] = {}
        experts: dict[int, dict[str, torch.Tensor]] = {}
        for name, value in self.state_dict(prefix="", keep_vars=True).items():
            if "_quantizer." not in name:
                continue
            match = re.match(r"^weight_quantizer\.(\d+)\.(.+)$", name)
            if match:
                experts.setdefault(int(match.group(1)), {})[match.group(2)] = value
            else:
                shared[name] = value
        return shared, experts

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """Quantizer buffers come back flattened (``[n]``): view them in this layer's shapes."""
        view_quantizer_buffers(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@_mo.nn.QuantModuleRegistry.register({ColumnParallelGroupedLinear: "megatron_core_ColumnParallelGroupedLinear"})
class QuantColumnParallelGroupedLinear(_QuantGroupedLinear):
    """Quantized experts' fc1 (:class:`~megatron_core.transformer.moe.grouped_linear.ColumnParallelGroupedLinear`)."""

    _is_column_parallel = True


@_mo.nn.QuantModuleRegistry.register({RowParallelGroupedLinear: "megatron_core_RowParallelGroupedLinear"})
class QuantRowParallelGroupedLinear(_QuantGroupedLinear):
    """Quantized experts' fc2 (:class:`~megatron_core.transformer.moe.grouped_linear.RowParallelGroupedLinear`)."""

    _is_row_parallel = True


@_mo.nn.QuantModuleRegistry.register({SequentialMLP: "megatron_core_SequentialMLP"})
class QuantSequentialMLP(_mo.dynamic.DynamicModule):
    """:class:`~megatron_core.transformer.moe.experts.SequentialMLP` whose local experts share one input amax."""

    def _setup(self) -> None:
        if self.parallel_state is None:
            self.parallel_state = _experts_parallel_state(self)

    def layer_sync_moe_local_experts_amax(self, sync_weight_amax: bool = False) -> None:
        """Model Optimizer's hook in ``max_calibrate``: one input amax over the local experts (module docstring)."""
        _mo.mtq.utils.sync_moe_expert_amax(self.local_experts, sync_weight_amax=sync_weight_amax)


class _QuantGroupedMLP(_mo.dynamic.DynamicModule):
    """Grouped experts whose sharded state dict holds the quantizer buffers (module docstring)."""

    def _setup(self) -> None:
        if self.parallel_state is None:
            self.parallel_state = _experts_parallel_state(self)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The experts' sharded state plus each expert's weight-quantizer buffers under its global index."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        ep_size, ep_rank = get_pg_size(self.ep_group), get_pg_rank(self.ep_group)
        dp_rank = get_pg_rank(self.dp_group)
        num_global = ep_size * self.num_local_experts
        for layer_name in ("linear_fc1", "linear_fc2"):
            layer = getattr(self, layer_name)
            if not isinstance(layer, _QuantGroupedLinear):
                continue
            shared, experts = layer.quantizer_buffers()
            flat = {name: value.reshape(-1) for name, value in shared.items()}
            sharded.update(make_sharded_tensors_for_checkpoint(flat, f"{prefix}{layer_name}.", None, sharded_offsets))
            for i, buffers in experts.items():
                offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank * self.num_local_experts + i, num_global))
                for sub, value in buffers.items():
                    sharded[f"{prefix}{layer_name}.weight_quantizer.{i}.{sub}"] = ShardedTensor.from_rank_offsets(
                        f"{prefix}experts.{layer_name}.weight_quantizer.{sub}", value.reshape(-1), *offsets,
                        replica_id=(0, 0, dp_rank), prepend_axis_num=len(offsets))
        return sharded


@_mo.nn.QuantModuleRegistry.register({TEGroupedMLP: "megatron_core_TEGroupedMLP"})
class QuantTEGroupedMLP(_QuantGroupedMLP):
    """Quantized :class:`~megatron_core.transformer.moe.experts.TEGroupedMLP` (checkpoint layout only)."""


@_mo.nn.QuantModuleRegistry.register({GroupedMLP: "megatron_core_GroupedMLP"})
class QuantGroupedMLP(_QuantGroupedMLP):
    """Quantized :class:`~megatron_core.transformer.moe.experts.GroupedMLP` (checkpoint layout only)."""


def _local_experts(model: torch.nn.Module, name: str) -> int | None:
    """How many local experts the per-expert quantizer ``name`` of ``model`` has siblings for, else ``None``."""
    for pattern, attr in ((_SEQUENTIAL_EXPERT, "num_local_experts"), (_GROUPED_EXPERT, "num_gemms")):
        match = pattern.match(name)
        if match:
            owner = match.group("head").rstrip(".").rsplit(".", 1)[0]
            try:
                count = getattr(model.get_submodule(owner), attr, None)
            except AttributeError:
                count = None
            if count is not None:
                return count
    return None


def expert_quantizer_state_for(model: torch.nn.Module, quantizer_state: dict[str, Any]) -> dict[str, Any]:
    """Model Optimizer's per-quantizer settings ``quantizer_state`` re-keyed for ``model``'s local experts.

    The settings are saved per module name, and the names of per-expert quantizers hold the local expert
    index, which depends on the expert-parallel size. All experts of a layer share one config, so each local
    expert of ``model`` takes the settings saved for local expert 0 of the same layer (as Model Optimizer's
    Megatron plugin does); entries of other modules pass through unchanged.
    """
    out: dict[str, Any] = {}
    for name, state in quantizer_state.items():
        match = _SEQUENTIAL_EXPERT.match(name) or _GROUPED_EXPERT.match(name)
        count = _local_experts(model, name) if match else None
        if count is None:  # not a per-expert quantizer (e.g. a dense layer's SequentialQuantizer stage)
            out[name] = state
        elif match.group("idx") == "0":
            out.update({f"{match.group('head')}{i}{match.group('tail')}": state for i in range(count)})
    return out


def modelopt_state_for(model: torch.nn.Module, modelopt_state: dict[str, Any]) -> dict[str, Any]:
    """A saved ``mto.modelopt_state`` whose per-expert quantizer settings fit ``model``'s expert-parallel size.

    Applies :func:`expert_quantizer_state_for` to every mode's recorded ``quantizer_state``; the rest is kept.
    """
    modes = []
    for mode, entry in modelopt_state.get("modelopt_state_dict", []):
        metadata = entry.get("metadata", {}) if isinstance(entry, dict) else {}
        if "quantizer_state" in metadata:
            metadata = {**metadata, "quantizer_state": expert_quantizer_state_for(model, metadata["quantizer_state"])}
            entry = {**entry, "metadata": metadata}
        modes.append((mode, entry))
    return {**modelopt_state, "modelopt_state_dict": modes}
