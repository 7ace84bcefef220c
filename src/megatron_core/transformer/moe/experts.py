"""The routed experts of an MoE layer: ``SequentialMLP`` and ``TEGroupedMLP`` (Megatron-Core's ``experts``).

Both take the dispatched tokens ``[N, h]`` grouped by local expert, ``tokens_per_expert`` and the
tokens' routing probabilities ``[N]``, and return ``(output [N, h], None)`` where each row is
``p * expert(x)`` (the probability is applied after the activation; the fc2 bias is scaled too).
``SequentialMLP`` runs one ``MLP`` per local expert (keys ``local_experts.<i>.linear_fc1.weight``);
``TEGroupedMLP`` runs every local expert in one grouped GEMM per projection (keys
``linear_fc1.weight<i>``). Their sharded state dicts are identical: local expert ``i`` of EP rank
``r`` is global expert ``r * num_local_experts + i`` along an extra leading axis of
``<prefix>experts.linear_fc1.weight`` etc., so checkpoints reshard across EP, expert-TP and layouts.

``InferenceGroupedMLP`` (the experts of the inference-optimized MoE spec) is a ``TEGroupedMLP`` with the same
parameters and checkpoint keys that, under an inference engine, also takes every token with dense
``[tokens, topk]`` routing and sums each token's experts itself (no dispatcher). The grouped linears' typing
protocols are in :mod:`.submodule_protocols`.
"""

from __future__ import annotations

import dataclasses
from copy import deepcopy
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core._activation_offload.interface import (
    FineGrainedActivationOffloadingInterface as off_interface,
)
from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core._ground.inference_mode import InferenceMode
from megatron_core.activations import gated_linear_unit
from megatron_core.dist_checkpointing.factories import apply_swiglu_sharded_factory
from megatron_core.dist_checkpointing.mapping import ShardedTensor
from megatron_core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron_core.distributed.fp8_params import dequantize_fp8_tensor, is_fp8_param
from megatron_core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron_core.fusions.fused_weighted_squared_relu import (
    uses_fused_weighted_squared_relu,
    weighted_squared_relu_impl,
)
from megatron_core.tensor_parallel.delayed_wgrad import run_delayed_wgrads
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.moe.grouped_linear import (
    GROUPED_MM_ROW_ALIGN,
    align_expert_rows,
    equal_groups,
    group_counts_tensor,
    pad_expert_rows,
    unpad_expert_rows,
    use_grouped_mm,
)
from megatron_core.transformer.moe.host_counts import counts_to_host
from megatron_core.transformer.moe.moe_utils import get_default_pg_collection
from megatron_core.transformer.moe.submodule_protocols import (
    GroupedLinearFc1Builder,
    GroupedLinearFc1Interface,
    GroupedLinearFc2Builder,
    GroupedLinearFc2Interface,
)
from megatron_core.transformer.moe.token_permutation import AlignedRows
from megatron_core.transformer.selective_recompute import ActivationRecompute, recompute_module_enabled
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["GroupedLinearFc1Builder", "GroupedLinearFc1Interface", "GroupedLinearFc2Builder",
           "GroupedLinearFc2Interface", "GroupedMLP", "GroupedMLPSubmodules", "InferenceGroupedMLP", "SequentialMLP",
           "TEGroupedMLP"]

# inference_grouped_gemm_backend values: Megatron-Core's Triton ("vllm") and torch kernels both compute the grouped
# GEMMs, which this library does with torch's grouped_mm; FlashInfer's fused kernel is not provided.
_INFERENCE_GEMM_BACKENDS = ("torch", "vllm")


def _with_expert_dp(sharded: dict, expt_dp_rank: int) -> None:
    """Expert tensors are replicated over expert DP (not dense DP): fix the last replica-id entry."""
    for key, value in sharded.items():
        replica_id = getattr(value, "replica_id", None)
        if isinstance(replica_id, tuple) and len(replica_id) == 3:
            sharded[key] = dataclasses.replace(value, replica_id=(*replica_id[:2], expt_dp_rank))


def _host_counts(tokens_per_expert: torch.Tensor | list[int], config: TransformerConfig, num_local_experts: int,
                num_rows: int) -> list[int]:
    """``tokens_per_expert`` as host ints.

    With ``moe_pad_expert_input_to_capacity`` every local expert holds the same number of rows, so the counts
    follow from the row count alone: nothing is read from a tensor (which would be a device-to-host copy, and a
    graph break under ``torch.compile``).
    """
    if config.moe_pad_expert_input_to_capacity and num_rows % num_local_experts == 0:  # (validated: a capacity)
        return [num_rows // num_local_experts] * num_local_experts
    if isinstance(tokens_per_expert, torch.Tensor):
        return counts_to_host(tokens_per_expert, "the experts' row split (local_counts)")
    return list(tokens_per_expert)


class SequentialMLP(MegatronModule):
    """One ``MLP`` per local expert, run one after the other."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules: MLPSubmodules,
                 pg_collection: Any = None, name: str | None = None) -> None:
        if config.moe_ffn_hidden_size != config.ffn_hidden_size:
            config = deepcopy(config)
            config.ffn_hidden_size = config.moe_ffn_hidden_size
        super().__init__(config)
        pgs = get_default_pg_collection(pg_collection)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pgs.ep, pgs.expt_tp, pgs.expt_dp
        self.local_experts = torch.nn.ModuleList([
            MLP(self.config, submodules, is_expert=True, ffn_hidden_size=self.config.moe_ffn_hidden_size,
                tp_group=pgs.expt_tp)
            for _ in range(num_local_experts)
        ])

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor | list[int],
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``(p * expert(x) for each local expert's rows, None)``."""
        if self.config.moe_apply_probs_on_input:
            dtype = permuted_local_hidden_states.dtype
            permuted_local_hidden_states = (permuted_probs.unsqueeze(-1) * permuted_local_hidden_states).to(dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        counts = _host_counts(tokens_per_expert, self.config, self.num_local_experts,
                             permuted_local_hidden_states.shape[0])
        tokens = torch.split(permuted_local_hidden_states, counts)
        probs = torch.split(permuted_probs, counts)
        outputs = [expert(x, p)[0] for expert, x, p in zip(self.local_experts, tokens, probs)]
        return torch.cat(outputs, dim=0), None

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs the local experts deferred, last expert first."""
        run_delayed_wgrads(self)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Each local expert under its global index along a new axis of ``<prefix>experts.*``."""
        num_global = get_pg_size(self.ep_group) * self.num_local_experts
        offset = get_pg_rank(self.ep_group) * self.num_local_experts
        out: dict = {}
        for i, expert in enumerate(self.local_experts):
            local_prefix = f"{prefix}local_experts.{i}."
            offsets = (*sharded_offsets, (len(sharded_offsets), offset + i, num_global))
            expert_sd = expert.sharded_state_dict(local_prefix, offsets, metadata)
            replace_prefix_for_sharding(expert_sd, local_prefix, f"{prefix}experts.")
            _with_expert_dp(expert_sd, get_pg_rank(self.dp_group))
            out.update(expert_sd)
        return out


@dataclasses.dataclass
class GroupedMLPSubmodules:
    """The grouped fc1 and fc2 layers of ``TEGroupedMLP`` and an optional activation."""

    linear_fc1: ModuleSpec | type | None = None
    linear_fc2: ModuleSpec | type | None = None
    activation_func: Any = None


class TEGroupedMLP(MegatronModule):
    """All local experts in one grouped GEMM per projection (see :mod:`.grouped_linear`)."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules: GroupedMLPSubmodules,
                 pg_collection: Any = None, name: str | None = None) -> None:
        super().__init__(config)
        pgs = get_default_pg_collection(pg_collection)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pgs.ep, pgs.expt_tp, pgs.expt_dp
        ffn = config.moe_ffn_hidden_size
        token_size = config.moe_latent_size or config.hidden_size  # the latent width in a latent MoE layer
        self.linear_fc1 = build_module(
            submodules.linear_fc1, num_local_experts, token_size, 2 * ffn if config.gated_linear_unit else ffn,
            config=config, init_method=config.init_method, bias=config.add_bias_linear, skip_bias_add=False,
            is_expert=True, tp_comm_buffer_name="fc1", tp_group=pgs.expt_tp,
        )
        self.activation_func = submodules.activation_func or config.activation_func
        self.recompute_activation = recompute_module_enabled(config, "moe_act")  # rebuilt in the backward
        # Fine-grained activation offloading of fc1's input and of the activation's input.
        offload = set(config.offload_modules or []) if config.fine_grained_activation_offloading else set()
        self.offload_expert_fc1 = "expert_fc1" in offload
        self.offload_moe_act = "moe_act" in offload
        self.linear_fc2 = build_module(
            submodules.linear_fc2, num_local_experts, ffn, token_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, skip_bias_add=True,
            is_expert=True, tp_comm_buffer_name="fc2", tp_group=pgs.expt_tp,
        )

    def input_row_alignment(self, tokens: torch.Tensor) -> int | None:
        """The alignment of group starts the grouped GEMM wants for ``tokens``' rows (None: any layout).

        A dispatcher that permutes tokens for these experts may lay them out so (see
        ``token_permutation.permute_top_k_aligned``) and pass the ``AlignedRows`` as ``tokens_per_expert``.
        """
        return GROUPED_MM_ROW_ALIGN if use_grouped_mm(tokens, self.linear_fc1.weight) else None

    def _fused_weighted_swiglu(self, intermediate: torch.Tensor) -> bool:
        return (self.config.gated_linear_unit and self.activation_func is F.silu and intermediate.dim() == 2
                and intermediate.device.type != "cpu" and self.config.glu_linear_offset == 0.0
                and self.config.activation_func_clamp_value is None)

    def _weighted_activation(self, intermediate: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if uses_fused_weighted_squared_relu(self.config, self.activation_func):
            return weighted_squared_relu_impl(intermediate, probs)  # saves only its inputs
        if self._fused_weighted_swiglu(intermediate):
            # One fused kernel each way on a GPU (jit_fuser): no fp32 copy of the [rows, ffn] activation.
            return weighted_bias_swiglu_impl(intermediate, None, probs)
        return (self._activate(intermediate) * probs).to(intermediate.dtype)

    def _activate(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.gated_linear_unit:
            return gated_linear_unit(x, self.activation_func, self.config.glu_linear_offset,
                                     self.config.activation_func_clamp_value)
        return self.activation_func(x)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor | list[int],
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``(p * expert(x) for every row, None)``."""
        x, index = permuted_local_hidden_states, None
        on_device = isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.device == x.device
        if isinstance(tokens_per_expert, AlignedRows):
            # The dispatcher laid the rows out already (input_row_alignment): padding rows are zero, probs 0.
            counts = tokens_per_expert
        elif use_grouped_mm(x, self.linear_fc1.weight) and on_device:
            # Counts still on the GPU: lay the rows out at aligned group starts without a host sync.
            counts = align_expert_rows(tokens_per_expert, x.shape[0])
            index = counts.index
            x = x.new_zeros((counts.total_rows, x.shape[1])).index_copy(0, index, x)
            permuted_probs = permuted_probs.new_zeros(counts.total_rows).index_copy(0, index, permuted_probs)
        else:
            counts = _host_counts(tokens_per_expert, self.config, self.num_local_experts, x.shape[0])
            if use_grouped_mm(x, self.linear_fc1.weight) and not equal_groups(counts):
                # Pad each expert's rows once for both GEMMs (the kernel needs aligned groups); pads have prob 0.
                # Groups of one size (padded to capacity) run as one bmm instead, which needs no alignment.
                x, counts, index = pad_expert_rows(x, counts)
                if index is not None:
                    permuted_probs = permuted_probs.new_zeros(x.shape[0]).index_copy(0, index, permuted_probs)
        counts = self._rows_for_gemms(counts)
        probs = permuted_probs.unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:
            x = (probs * x).to(x.dtype)
            probs = torch.ones_like(probs)
        if self._fc1_fuses_weighted_activation(x, counts):
            activated, _ = self.linear_fc1(x, counts, weighted_swiglu_probs=probs)
            output, bias = self.linear_fc2(activated, counts)
            return self._with_fc2_bias(output, bias, counts, probs, index), None
        delay = self.config.delay_offload_until_cuda_graph
        fc1_manager = off_interface(self.offload_expert_fc1, x, "expert_fc1")
        with fc1_manager as x:
            intermediate, _ = self.linear_fc1(x, counts)
        intermediate = fc1_manager.group_offload(intermediate, forced_released_tensors=[x], delay_offload=delay)
        recompute = ActivationRecompute(self.recompute_activation and self.training)
        act_manager = off_interface(self.offload_moe_act, intermediate, "moe_act")
        with act_manager as intermediate:
            activated = recompute.run(self._weighted_activation, intermediate, probs)
        output, bias = self.linear_fc2(activated, counts)
        recompute.discard(output)
        # Committed after fc2: the activation's input is reloaded before its recompute needs it.
        output = act_manager.group_offload(output, forced_released_tensors=[intermediate], delay_offload=delay)
        return self._with_fc2_bias(output, bias, counts, probs, index), None

    def _with_fc2_bias(self, output: torch.Tensor, bias: torch.Tensor | None, counts: Any, probs: torch.Tensor,
                       index: torch.Tensor | None) -> torch.Tensor:
        if bias is not None:
            count_tensor = group_counts_tensor(counts, output.device)
            per_row = bias.repeat_interleave(count_tensor, dim=0, output_size=output.shape[0])
            output = output + (per_row * probs).to(output.dtype)
        return output if index is None else unpad_expert_rows(output, index)

    def _rows_for_gemms(self, counts: Any) -> Any:
        """``counts`` as fc1 prepares them for both GEMMs (``rows_for_gemms``: FP8 experts with per-expert GEMMs read
        the group ends to the host once for fc1 and fc2), else as given."""
        prepare = getattr(self.linear_fc1, "rows_for_gemms", None)
        return counts if prepare is None else prepare(counts)

    def _fc1_fuses_weighted_activation(self, x: torch.Tensor, counts: Any) -> bool:
        """Whether fc1 applies ``p * swiglu(.)`` to its output itself (``linear_fc1(x, counts,
        weighted_swiglu_probs=p)``, FP8 experts on Hopper: ``Float8ColumnParallelGroupedLinear.fuses_weighted_swiglu``);
        not for another fc1 or activation, nor with the activation recomputed or fc1's input or the activation
        offloaded. Called through the module, so its hooks run."""
        fuses = getattr(self.linear_fc1, "fuses_weighted_swiglu", None)
        return (fuses is not None and not self.recompute_activation and not self.offload_expert_fc1
                and not self.offload_moe_act and self._fused_weighted_swiglu(x) and fuses(x, counts))

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs ``linear_fc2`` then ``linear_fc1`` deferred (``delay_wgrad_compute`` or
        ``overlap_dispatch_backward_with_experts_wgrad``; else nothing)."""
        run_delayed_wgrads(self)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The same sharded tensors as ``SequentialMLP``'s: one per local expert, under its global index."""
        ep_size, ep_rank = get_pg_size(self.ep_group), get_pg_rank(self.ep_group)
        tp_size, tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        dp_rank = get_pg_rank(self.dp_group)
        num_global = ep_size * self.num_local_experts
        out: dict = {}
        for layer_name in ("linear_fc1", "linear_fc2"):
            layer = getattr(self, layer_name)
            for param_name in ("weight", "bias"):
                param = getattr(layer, param_name)
                if param is None:
                    continue
                sharded_tp = getattr(param, "tensor_model_parallel", False)
                value = dequantize_fp8_tensor(param) if is_fp8_param(param) else param  # fp8_param: high precision
                for i in range(self.num_local_experts):
                    offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank * self.num_local_experts + i, num_global))
                    axis = len(offsets) + param.partition_dim - 1
                    tp_offsets = ((axis, tp_rank, tp_size),) if sharded_tp else ()
                    replica_id = (0, 0 if sharded_tp else tp_rank, dp_rank)
                    sh = ShardedTensor.from_rank_offsets(
                        f"{prefix}experts.{layer_name}.{param_name}", value[i], *offsets, *tp_offsets,
                        replica_id=replica_id, prepend_axis_num=len(offsets),
                    )
                    if layer_name == "linear_fc1" and self.config.gated_linear_unit:
                        sh = apply_swiglu_sharded_factory(sh)
                    sh.sliced_param, sh.slice_index = param, i  # the optimizer's state is saved in the same slices
                    out[f"{prefix}{layer_name}.{param_name}{i}"] = sh
        return out


class GroupedMLP(TEGroupedMLP):
    """Alias of :class:`TEGroupedMLP` for code written against Megatron-Core's legacy grouped-GEMM experts."""


class InferenceGroupedMLP(TEGroupedMLP):
    """``TEGroupedMLP`` with an inference forward that takes dense routing (Megatron-Core's ``InferenceGroupedMLP``).

    Outside an inference engine (``InferenceMode.is_active()`` False: training, or scoring) ``forward`` is
    :meth:`TEGroupedMLP.forward`. Under an engine, ``forward(hidden [tokens, h], None, probs [tokens, topk],
    routing_map=indices [tokens, topk])`` returns ``(output [tokens, h], None)`` with each token's sum over its
    experts on this rank of ``p * expert(x)``: the (token, expert) pairs are grouped by expert and run through the
    parent's grouped GEMMs (torch ``grouped_mm`` on CUDA where it applies, one GEMM per expert on the CPU), so the
    numbers are the parent's. Parameters and checkpoint keys are the parent's.
    ``ValueError`` at build time for what is not provided: ``inference_grouped_gemm_backend="flashinfer"`` (or
    any value but ``"torch"`` / ``"vllm"``) and ``fp8_recipe="mxfp8"`` with ``fp8``.
    """

    takes_dense_routing = True  # MoELayer hands it the dense routing of InferenceTopKRouter directly

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules: GroupedMLPSubmodules,
                 pg_collection: Any = None, name: str | None = None) -> None:
        backend = config.inference_grouped_gemm_backend
        if backend not in _INFERENCE_GEMM_BACKENDS:
            raise ValueError(f"InferenceGroupedMLP: inference_grouped_gemm_backend={backend!r} is not provided "
                             f"(expected one of {_INFERENCE_GEMM_BACKENDS}; both run torch grouped GEMMs)")
        if config.fp8 and config.fp8_recipe == "mxfp8":
            raise ValueError("InferenceGroupedMLP: fp8_recipe='mxfp8' (Megatron-Core's MXFP8 inference path) is not "
                             "provided; use another fp8_recipe or fp8=None")
        super().__init__(num_local_experts, config, submodules, pg_collection, name)
        self.inference_grouped_gemm_backend = backend

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor | list[int] | None,
                permuted_probs: torch.Tensor, routing_map: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, None]:
        """Inference with dense routing (``routing_map`` given): see the class docstring; otherwise the parent's."""
        if routing_map is None or not InferenceMode.is_active():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        return self._dense_forward(permuted_local_hidden_states, permuted_probs, routing_map), None

    def _dense_forward(self, hidden_states: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor
                       ) -> torch.Tensor:
        num_tokens, topk = indices.shape
        first = get_pg_rank(self.ep_group) * self.num_local_experts
        local = indices.reshape(-1) - first
        token = torch.arange(num_tokens, device=indices.device).repeat_interleave(topk)
        keep = (local >= 0) & (local < self.num_local_experts)  # pairs whose expert lives on this EP rank
        local, token, pair_probs = local[keep], token[keep], probs.reshape(-1)[keep]
        order = torch.argsort(local, stable=True)
        token = token[order]
        counts = torch.bincount(local[order], minlength=self.num_local_experts)
        if not hidden_states.is_cuda:
            counts = counts.tolist()
        rows, _ = super().forward(hidden_states.index_select(0, token), counts, pair_probs[order])
        output = hidden_states.new_zeros(num_tokens, rows.shape[-1])
        return output.index_add_(0, token, rows.to(output.dtype))
