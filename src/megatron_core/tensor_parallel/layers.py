"""Tensor-parallel layers: ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``.

A column layer ``Y = X A^T + b`` shards ``A`` by output rows (``[out/TP, in]``, ``partition_dim=0``),
so each rank computes a slice of ``Y``'s last dim. A row layer shards ``A`` by input columns
(``[out, in/TP]``, ``partition_dim=1``); each rank computes a partial sum that is all-reduced
(or reduce-scattered along the sequence under sequence parallelism) before the bias is added.
The embedding shards vocabulary rows. Activations are ``[s, b, h]``; linear layers return
``(output, bias)`` where ``bias`` is not ``None`` only with ``skip_bias_add=True``.

Expert layers (``is_expert=True``) use the expert tensor-parallel group, and when experts are
parallelised (TP > 1 or EP > 1) leave all communication to the MoE token dispatcher.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.device import get_current_device
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.process_groups_config import check_parallel_size
from megatron_core.tensor_parallel.delayed_wgrad import DelayedWgradMixin, LinearWithDelayedWgrad
from megatron_core.tensor_parallel.embedding_function import embedding_with_grad_accumulation
from megatron_core.tensor_parallel.frozen_linear import LinearWithFrozenWeight, linear_with_frozen_weight
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.linear_function import (
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron_core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_core.tensor_parallel.sharded_state import make_tp_sharded_state_dict
from megatron_core.tensor_parallel.utils import VocabUtility
from megatron_core.tensor_parallel.weight_init import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "copy_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]


def _resolve_group(tp_group, pg_collection, is_expert: bool, config: ModelParallelConfig):
    """The layer's (expert) TP group from the package resolver; a contradicting config TP size raises."""
    group = resolve_tp_group(tp_group, pg_collection, is_expert)
    if not is_expert:
        check_parallel_size(config, "tensor_model_parallel_size", group, "tensor-parallel")
    return group


def _divide(size: int, world_size: int, what: str) -> int:
    if size % world_size != 0:
        raise ValueError(
            f"{what} ({size}) must be divisible by the tensor-parallel size ({world_size}); pad it, e.g. "
            f"with megatron_core.tensor_parallel.pad_vocab_size({size}, 1, {world_size}) -> "
            f"{-(-size // world_size) * world_size}"
        )
    return size // world_size


def _new_weight(shape: tuple[int, ...], config: ModelParallelConfig) -> Parameter:
    on_device = torch.device("cpu") if config.use_cpu_initialization else get_current_device()
    return Parameter(torch.empty(*shape, dtype=config.params_dtype, device=on_device))


def _mark_fused_wgrad(weight: Parameter, config: ModelParallelConfig) -> None:
    """With ``gradient_accumulation_fusion`` this layer's weight gradient always goes straight into ``main_grad``.

    DDP's backward hook then ignores the dummy ``.grad`` even where the backward could not set
    ``grad_added_to_main_grad`` (inside a ``torch.compile``d graph).
    """
    if config.gradient_accumulation_fusion:
        weight.wgrad_fused_into_main_grad = True


def _init_weight(weight, config, init_method, full_shape, per_partition, partition_dim, stride,
                 keep_master, rank, world_size, is_expert):
    """Initialise a sharded weight the way ``config`` asks; returns the master weight if kept."""
    if config.use_cpu_initialization and config.perform_initialization:
        return _initialize_affine_weight_cpu(
            weight, full_shape[0], full_shape[1], per_partition, partition_dim, init_method,
            stride=stride, return_master_weight=keep_master, params_dtype=config.params_dtype,
            rank=rank, world_size=world_size,
        )
    if config.perform_initialization:
        _initialize_affine_weight_gpu(weight, init_method, partition_dim, stride=stride, is_expert=is_expert)
    else:
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    return None


def _linear_impl(input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The parallel linear op: :func:`linear_with_frozen_weight` for a weight that does not require grad,
    else :func:`linear_with_grad_accumulation_and_async_allreduce` (Megatron-Core's ``_forward_impl``)."""
    if not weight.requires_grad:
        return linear_with_frozen_weight(input, weight, *args, **kwargs)
    return linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)


def _defers_wgrad(layer: DelayedWgradMixin, weight: torch.Tensor) -> bool:
    """Whether this call's weight gradient goes to ``layer``'s ``backward_dw()`` queue."""
    return layer.delay_wgrad_compute and weight is layer.weight and weight.requires_grad and torch.is_grad_enabled()


def _default_extra_state(state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: a missing ``_extra_state`` reads as None (Megatron drops the output layer's)."""
    state_dict.setdefault(f"{prefix}_extra_state")


class ColumnParallelLinear(DelayedWgradMixin, torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output dim: weight ``[output_size / TP, input_size]``.

    Input ``[s, b, input_size]`` (``[s / TP, b, input_size]`` with sequence parallelism); output
    ``[s, b, output_size / TP]``, or the full ``output_size`` with ``gather_output``.
    ``skip_weight_param_allocation`` lets the caller pass the weight to ``forward`` (tied
    output layer). Returns ``(output, bias)``.
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig,
                 init_method: Callable, bias: bool = True, gather_output: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False, embedding_activation_buffer=None,
                 grad_output_buffer=None, is_expert: bool = False, tp_comm_buffer_name: str | None = None,
                 disable_grad_reduce: bool = False, tp_group=None, name: str | None = None,
                 output_dtype: torch.dtype | None = None, pg_collection=None) -> None:
        super().__init__()
        self._register_load_state_dict_pre_hook(_default_extra_state)
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        self.config = config
        self.disable_grad_reduce = disable_grad_reduce
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self.name = name
        self.output_dtype = output_dtype
        self.tp_group = _resolve_group(tp_group, pg_collection, is_expert, config)
        world_size = get_pg_size(self.tp_group)
        rank = get_pg_rank(self.tp_group)
        self.explicit_expert_comm = is_expert and (world_size > 1 or self.expert_parallel)
        self.output_size_per_partition = _divide(output_size, world_size, "output_size")

        self.master_weight = None
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = _new_weight((self.output_size_per_partition, input_size), config)
            self.master_weight = _init_weight(
                self.weight, config, init_method, (output_size, input_size), self.output_size_per_partition,
                0, stride, keep_master_weight_for_test, rank, world_size, is_expert,
            )
            self.weight.allreduce = not is_expert
            _mark_fused_wgrad(self.weight, config)

        if bias:
            self.bias = _new_weight((self.output_size_per_partition,), config)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            self.bias.allreduce = not is_expert
        else:
            self.register_parameter("bias", None)

        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and world_size <= 1:
            warnings.warn("sequence_parallel is ignored by a ColumnParallelLinear whose TP group has one rank",
                          stacklevel=2)
            self.sequence_parallel = False
        self.allreduce_dgrad = world_size > 1 and not self.sequence_parallel and not disable_grad_reduce
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The linear op for ``weight``: the frozen-weight op when it does not require grad."""
        return _linear_impl(input, weight, *args, **kwargs)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        """``(output, bias)``; ``weight`` overrides the layer's own (required with skip_weight_param_allocation)."""
        if weight is None:
            if self.weight is None:
                raise ValueError("weight must be passed to forward() when skip_weight_param_allocation=True")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"supplied weight has shape {tuple(weight.shape)}, expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        if self.config.defer_embedding_wgrad_compute and self.embedding_activation_buffer is not None:
            limit = self.config.wgrad_deferral_limit
            if limit == 0 or len(self.embedding_activation_buffer) < limit:  # the op defers the same micro-batches
                self.embedding_activation_buffer.append(input_)

        bias = self.bias if not self.skip_bias_add else None
        if self.allreduce_dgrad or self.sequence_parallel or self.explicit_expert_comm or self.disable_grad_reduce:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        allreduce_dgrad = False if self.explicit_expert_comm else self.allreduce_dgrad
        sequence_parallel = False if self.explicit_expert_comm else self.sequence_parallel
        if _defers_wgrad(self, weight):
            output_parallel = LinearWithDelayedWgrad.apply(
                input_parallel, weight, bias, self.gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                self.tp_group, self)
        else:
            output_parallel = self._forward_impl(
                input=input_parallel, weight=weight, bias=bias,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                grad_output_buffer=self.grad_output_buffer if self.config.defer_embedding_wgrad_compute else None,
                wgrad_deferral_limit=(self.config.wgrad_deferral_limit if self.config.defer_embedding_wgrad_compute
                                      else None),
                tp_group=self.tp_group,
            )
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output:
            if self.sequence_parallel:
                raise ValueError("gather_output cannot be used together with sequence_parallel")
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        if self.output_dtype is not None:
            output = output.to(self.output_dtype)
        return output, (self.bias if self.skip_bias_add else None)

    def deferrable(self) -> bool:
        """Whether ``delay_wgrad_compute`` can defer this layer's weight gradient: an own weight that the plain
        op multiplies (a subclass with its own forward or op, e.g. FP8, computes it immediately)."""
        cls = type(self)
        return (self.weight is not None and cls.forward is ColumnParallelLinear.forward
                and cls._forward_impl is ColumnParallelLinear._forward_impl)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Weight and bias as sharded tensors (``ShardedTensor``) split along dim 0 over TP."""
        return make_tp_sharded_state_dict(self, prefix, {"weight": 0, "bias": 0}, sharded_offsets,
                                          metadata=metadata)

    def set_extra_state(self, state) -> None:
        """Extra state is ignored (kept for Transformer Engine checkpoint compatibility)."""

    def get_extra_state(self) -> None:
        """No extra state (kept for Transformer Engine checkpoint compatibility)."""
        return None

    def extra_repr(self) -> str:
        """Sizes, bias, TP size and whether the output is gathered."""
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={get_pg_size(self.tp_group)}, gather_output={self.gather_output}")


class RowParallelLinear(DelayedWgradMixin, torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input dim: weight ``[output_size, input_size / TP]``.

    Input ``[s, b, input_size / TP]`` (``input_is_parallel=True``) or the full input, which is
    then split. Output ``[s, b, output_size]``, or ``[s / TP, b, output_size]`` with sequence
    parallelism. The bias is replicated and added after the reduction. Returns ``(output, bias)``.
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig,
                 init_method: Callable, bias: bool, input_is_parallel: bool, skip_bias_add: bool,
                 stride: int = 1, keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None, name: str | None = None,
                 pg_collection=None) -> None:
        super().__init__()
        self._register_load_state_dict_pre_hook(_default_extra_state)
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.config = config
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.sequence_parallel = config.sequence_parallel
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self.name = name
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel=True needs input_is_parallel=True")
        self.tp_group = _resolve_group(tp_group, pg_collection, is_expert, config)
        world_size = get_pg_size(self.tp_group)
        rank = get_pg_rank(self.tp_group)
        self.explicit_expert_comm = is_expert and (world_size > 1 or self.expert_parallel)
        self.input_size_per_partition = _divide(input_size, world_size, "input_size")

        self.weight = _new_weight((output_size, self.input_size_per_partition), config)
        self.master_weight = _init_weight(
            self.weight, config, init_method, (output_size, input_size), self.input_size_per_partition,
            1, stride, keep_master_weight_for_test, rank, world_size, is_expert,
        )
        self.weight.allreduce = not is_expert
        _mark_fused_wgrad(self.weight, config)

        if bias:
            self.bias = _new_weight((output_size,), config)
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            self.bias.allreduce = not is_expert
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The linear op for ``weight``: the frozen-weight op when it does not require grad."""
        return _linear_impl(input, weight, *args, **kwargs)

    def forward(self, input_: torch.Tensor):
        """``(output, bias)``: the reduced output, and the bias only when ``skip_bias_add``."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        if _defers_wgrad(self, self.weight):
            output_parallel = LinearWithDelayedWgrad.apply(
                input_parallel, self.weight, None, self.gradient_accumulation_fusion, False, False, self.tp_group, self)
        else:
            output_parallel = self._forward_impl(
                input=input_parallel, weight=self.weight, bias=None,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                allreduce_dgrad=False, sequence_parallel=False, tp_group=self.tp_group,
            )
        return self._reduce_output(output_parallel)

    def _reduce_output(self, output_parallel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum the partial outputs over TP (reduce-scatter under SP), then add or return the bias."""
        if self.explicit_expert_comm:
            output_ = output_parallel
        elif self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        if self.skip_bias_add:
            return output_, self.bias
        output = output_ + self.bias.to(output_.dtype) if self.bias is not None else output_
        return output, None

    def deferrable(self) -> bool:
        """Whether ``delay_wgrad_compute`` can defer this layer's weight gradient (not in a subclass with its own
        forward or op)."""
        cls = type(self)
        return cls.forward is RowParallelLinear.forward and cls._forward_impl is RowParallelLinear._forward_impl

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Weight as a ``ShardedTensor`` split along dim 1 over TP; the bias is replicated."""
        return make_tp_sharded_state_dict(self, prefix, {"weight": 1}, sharded_offsets, metadata=metadata)

    def set_extra_state(self, state) -> None:
        """Extra state is ignored (kept for Transformer Engine checkpoint compatibility)."""

    def get_extra_state(self) -> None:
        """No extra state (kept for Transformer Engine checkpoint compatibility)."""
        return None

    def extra_repr(self) -> str:
        """Sizes, bias, TP size and whether the input is already split."""
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={get_pg_size(self.tp_group)}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding whose rows (the vocabulary) are split over TP: weight ``[num_embeddings / TP, embedding_dim]``.

    Input ``[b, s]`` token ids; output ``[b, s, h]``, or ``[s / TP, b, h]`` with
    ``reduce_scatter_embeddings`` (sequence parallelism). Ids outside this rank's range look up
    zeros, and the partial lookups are summed across TP.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable,
                 reduce_scatter_embeddings: bool = False, config: ModelParallelConfig, tp_group=None,
                 pg_collection=None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tp_group = _resolve_group(tp_group, pg_collection, False, config)
        self.tensor_model_parallel_size = get_pg_size(self.tp_group)
        rank = get_pg_rank(self.tp_group)
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, self.tensor_model_parallel_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.deterministic_mode = config.deterministic_mode
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.weight = _new_weight((self.num_embeddings_per_partition, embedding_dim), config)
        _init_weight(self.weight, config, init_method, (num_embeddings, embedding_dim),
                     self.num_embeddings_per_partition, 0, 1, False, rank, self.tensor_model_parallel_size,
                     False)
        _mark_fused_wgrad(self.weight, config)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Look up ``input_`` ids ``[b, s]``; returns ``[b, s, h]`` (``[s / TP, b, h]`` when reduce-scattering)."""
        if self.tensor_model_parallel_size > 1:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked_input = (input_ - self.vocab_start_index).masked_fill(input_mask, 0)
        else:
            masked_input = input_
        if (self.gradient_accumulation_fusion and hasattr(self.weight, "main_grad") and self.weight.requires_grad
                and torch.is_grad_enabled()):
            # The weight gradient goes straight into DDP's fp32 main_grad (no dense gradient in the weight's dtype).
            output_parallel = embedding_with_grad_accumulation(masked_input, self.weight, self.deterministic_mode)
        elif self.deterministic_mode:
            output_parallel = self.weight[masked_input]
        else:
            output_parallel = F.embedding(masked_input, self.weight)
        if self.tensor_model_parallel_size > 1:
            output_parallel = output_parallel.masked_fill(input_mask.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The weight as a ``ShardedTensor`` split along the vocabulary dim over TP."""
        return make_tp_sharded_state_dict(self, prefix, {"weight": 0}, sharded_offsets, allow_shape_mismatch=("weight",),
                                          metadata=metadata)
