"""The gated delta net layer (Megatron-Core's ``ssm.gated_delta_net.GatedDeltaNet``; Qwen3-Next's linear attention).

``in_proj`` (column-parallel) gives, for this TP rank's heads, the sections ``q | k | v | z | beta | alpha``
(``q``, ``k``: key heads x ``linear_key_head_dim``; ``v``, ``z``: value heads x ``linear_value_head_dim``;
``beta``, ``alpha``: one per value head). ``q, k, v`` go through a depthwise causal convolution and the activation;
``q, k`` are L2-normalised and repeated over the value heads they serve; the gated delta rule
(:mod:`.kernels`) runs with decay ``g = -exp(A_log) * softplus(alpha + dt_bias)`` and write strength
``sigmoid(beta)``; its output is normalised per head (``out_norm``), gated by ``act(z)`` and projected back by
``out_proj`` (row-parallel). Under context parallelism the convolution and the rule run on the whole sequence for
``1/cp`` of this TP rank's heads, between the all-to-alls of :mod:`.context_parallel`; every CP rank holds this TP
rank's whole ``conv1d``, ``A_log`` and ``dt_bias`` and uses its heads' slice. Parameter names and checkpoint keys
are Megatron-Core 0.19's (``in_proj.weight`` stored as ``.query/.key/.value/.z/.beta/.alpha``, ``conv1d`` as
``.query/.key/.value``), so checkpoints reshard across TP sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from megatron_core._ground import get_pg_rank
from megatron_core.device import get_current_device
from megatron_core.dist_checkpointing.sharded_module import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron_core.process_groups_config import check_parallel_size, resolve_pg_collection
from megatron_core.ssm.gated_delta_net.context_parallel import (
    get_parameter_local_cp,
    head_perm_for_split_sections,
    tensor_a2a_cp2hp,
    tensor_a2a_hp2cp,
    thd_cp_gather_order,
)
from megatron_core.ssm.gated_delta_net.gated_delta_rule import torch_chunk_gated_delta_rule
from megatron_core.ssm.gated_delta_net.kernels import causal_conv1d, chunk_gated_delta_rule, l2norm
from megatron_core.ssm.mamba_mixer import _init_rng, _local_rows, _mark_tp
from megatron_core.ssm.utils import _split_tensor_factory
from megatron_core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron_core.tensor_parallel.wgrad_accumulation import gradient_into_main_grad
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.linear_attention_validation import check_linear_attention_sizes
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.packed_sequences import thd_layout
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["GatedDeltaNet", "GatedDeltaNetSubmodules"]

@dataclass
class GatedDeltaNetSubmodules:
    """Specs of the fused input projection (column-parallel), the per-head output norm and the output projection
    (row-parallel)."""

    in_proj: ModuleSpec | type = IdentityOp
    out_norm: ModuleSpec | type = IdentityOp
    out_proj: ModuleSpec | type = IdentityOp


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class GatedDeltaNet(MegatronModule):
    """Gated delta net over ``[s, b, h]`` inputs; ``forward`` returns ``(out, out_bias)`` like a row-parallel linear.

    Sizes come from the config's ``linear_*`` fields; heads are split over the tensor-parallel group and then, for
    the recurrence, over the context-parallel group (``pg_collection.tp`` / ``.cp``). ``config.deterministic_mode``
    always takes the PyTorch rule; otherwise flash-linear-attention's kernel is used when installed and on an
    accelerator. ``cp_comm_type`` is accepted and ignored (the layer has its own all-to-alls).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int | None = None,
        bias: bool = False,
        conv_bias: bool = False,
        conv_init: float | None = None,
        use_qk_l2norm: bool = True,
        A_init_range: tuple[float, float] = (1, 16),
        pg_collection: Any = None,
        *,
        name: str | None = None,
        cp_comm_type: str | None = None,
    ) -> None:
        super().__init__(config)
        self.pg_collection = pg_collection = resolve_pg_collection(pg_collection)
        self.tp_group = pg_collection.tp
        self.tp_size = check_parallel_size(config, "tensor_model_parallel_size", self.tp_group, "tensor-parallel")
        self.cp_size = check_parallel_size(config, "context_parallel_size", pg_collection.cp, "context-parallel")
        self.sp_size = self.tp_size if config.sequence_parallel else 1
        check_linear_attention_sizes(config, self.tp_size, self.cp_size)
        _require(0 <= A_init_range[0] <= A_init_range[1],
                 f"A_init_range ({A_init_range}) must satisfy 0 <= low <= high")
        self.layer_number, self.bias, self.conv_bias, self.conv_init = layer_number, bias, conv_bias, conv_init
        self.use_qk_l2norm, self.A_init_range = use_qk_l2norm, tuple(A_init_range)
        self.hidden_size = config.hidden_size
        self.act_fn = config.activation_func
        self.activation = getattr(self.act_fn, "__name__", str(self.act_fn))
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.qk_dim_local_tp, self.v_dim_local_tp = self.qk_dim // self.tp_size, self.v_dim // self.tp_size
        self.num_k_heads_local_tp = self.num_key_heads // self.tp_size
        self.num_v_heads_local_tp = self.num_value_heads // self.tp_size
        self.in_proj_split_names = ["query", "key", "value", "z", "beta", "alpha"]
        self.in_proj_split_sections = (self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp,
                                       self.v_dim_local_tp, self.num_v_heads_local_tp, self.num_v_heads_local_tp)
        cp = self.cp_size
        self.feat_dim_split = ((2 * self.qk_dim_local_tp + self.v_dim_local_tp) // cp, self.v_dim_local_tp // cp,
                               self.num_v_heads_local_tp // cp, self.num_v_heads_local_tp // cp)
        self.in_proj_extra_dim = 2 * self.num_value_heads
        self.in_proj_qkvg_dim = 2 * self.qk_dim + 2 * self.v_dim
        self.in_proj_dim = self.in_proj_qkvg_dim + self.in_proj_extra_dim
        _require(not config.fp8 or self.in_proj_dim % 16 == 0,
                 f"with fp8 ({config.fp8!r}) the gated delta net's in_proj width ({self.in_proj_dim}) must be a "
                 "multiple of 16")
        self.gated_delta_rule = torch_chunk_gated_delta_rule if config.deterministic_mode else chunk_gated_delta_rule

        self.in_proj = build_module(
            submodules.in_proj, self.hidden_size, self.in_proj_dim, config=config, init_method=config.init_method,
            gather_output=False, bias=bias, skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
            tp_group=self.tp_group, name=f"{name}.in_proj" if name is not None else None,
        )
        self.in_proj.weight.partition_sizes = list(self.in_proj_split_sections)
        self.conv_dim = 2 * self.qk_dim + self.v_dim
        self.conv_dim_local_tp = self.conv_dim // self.tp_size
        self._build_own_parameters(config)
        self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=self.value_head_dim,
                                     eps=config.layernorm_epsilon)
        # Each TP rank normalises its own heads with the one shared norm: the forward sums the norm's gradient over
        # TP itself (see _apply_gated_norm), so the sequence-parallel reduction must not add it again.
        for param in self.out_norm.parameters():
            param.sequence_parallel = False
        self.out_proj = build_module(
            submodules.out_proj, self.v_dim, self.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="fc2", tp_group=self.tp_group,
            name=f"{name}.out_proj" if name is not None else None,
        )

    def _conv_sections(self) -> list[int]:
        """Local sizes of ``q, k, v`` along the convolution's channels."""
        return [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]

    def _build_own_parameters(self, config: TransformerConfig) -> None:
        """``conv1d`` (depthwise over ``q|k|v``), ``dt_bias`` (ones) and ``A_log`` (``log U(A_init_range)``).

        Under ``use_cpu_initialization`` the full-size values are drawn and each rank keeps its rows (the result
        does not depend on the TP size), else each rank draws its own shard (Megatron-Core's behaviour).
        """
        device = torch.device("cpu") if config.use_cpu_initialization else get_current_device()
        sections = self._conv_sections()
        full = config.use_cpu_initialization and config.perform_initialization
        draw_tp, tp_rank = (self.tp_size, get_pg_rank(self.tp_group)) if full else (1, 0)
        kernel = self.conv_kernel_dim
        with _init_rng(config), torch.no_grad():
            weight = torch.empty(self.conv_dim_local_tp * draw_tp, 1, kernel, device=device, dtype=config.params_dtype)
            bias = torch.empty(self.conv_dim_local_tp * draw_tp, device=device, dtype=config.params_dtype)
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Conv1d's default
            nn.init.uniform_(bias, -1 / math.sqrt(kernel), 1 / math.sqrt(kernel))
            if config.perform_initialization and self.conv_init is not None:
                nn.init.uniform_(weight, -self.conv_init, self.conv_init)
            A = torch.empty(self.num_v_heads_local_tp * draw_tp, device=device, dtype=config.params_dtype)
            if config.perform_initialization:
                A.uniform_(*self.A_init_range)
            else:
                A.fill_(1.0)
        global_sections = [size * draw_tp for size in sections]
        self.conv1d = nn.Conv1d(self.conv_dim_local_tp, self.conv_dim_local_tp, kernel_size=kernel,
                                groups=self.conv_dim_local_tp, padding=kernel - 1, bias=self.conv_bias,
                                device="meta")
        self.conv1d.weight = nn.Parameter(_local_rows(weight, global_sections, draw_tp, tp_rank))
        conv_params = [self.conv1d.weight]
        if self.conv_bias:
            self.conv1d.bias = nn.Parameter(_local_rows(bias, global_sections, draw_tp, tp_rank))
            conv_params.append(self.conv1d.bias)
        for param in conv_params:
            _mark_tp(param)
            param.partition_sizes = sections
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads_local_tp, device=device, dtype=config.params_dtype))
        self.A_log = nn.Parameter(torch.log(A.chunk(draw_tp)[tp_rank].clone()))
        for param in (self.dt_bias, self.A_log):
            _mark_tp(param)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states`` ``[s/cp, b, h]`` (``[s/(cp*tp), b, h]`` under sequence parallelism) -> ``(out, bias)``;
        ``attention_mask`` and the attention-only keyword arguments are unused (the layer is causal)."""
        inference_context = inference_context if inference_context is not None else inference_params
        if inference_context is not None:
            raise NotImplementedError("GatedDeltaNet does not support inference (as in Megatron-Core 0.19)")
        local_len, batch, _ = hidden_states.shape
        seq_len = local_len * self.sp_size * self.cp_size
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        cu_seqlens = (self._packed_cu_seqlens(packed_seq_params, batch, seq_len, hidden_states.device) if packed
                      else None)

        qkvzba, _ = self.in_proj(hidden_states)  # [s/cp, b, in_proj local]
        if self.cp_size > 1:
            perm = head_perm_for_split_sections(self.in_proj_split_sections, self.cp_size, qkvzba.device)
            qkvzba = qkvzba.index_select(-1, perm)
        cp_group = self.pg_collection.cp
        to_ranks = None
        if packed and self.cp_size > 1:
            to_documents, to_ranks = thd_cp_gather_order(packed_seq_params, seq_len, self.cp_size, qkvzba.device)
            qkvzba = tensor_a2a_cp2hp(qkvzba, 0, -1, cp_group, undo_attention_load_balancing=False)
            qkvzba = qkvzba.index_select(0, to_documents)
        else:
            qkvzba = tensor_a2a_cp2hp(qkvzba, 0, -1, cp_group)
        qkv, gate, beta, alpha = torch.split(qkvzba.transpose(0, 1), self.feat_dim_split, dim=-1)  # [b, s, .]

        qkv = self._conv(qkv, cu_seqlens)
        query, key, value = self._heads(qkv, batch, seq_len)
        A_log = get_parameter_local_cp(self.A_log, 0, cp_group)
        dt_bias = get_parameter_local_cp(self.dt_bias, 0, cp_group)
        g = -A_log.float().exp() * F.softplus(alpha.float() + dt_bias.float())
        core, _ = self.gated_delta_rule(query, key, value, g=g, beta=beta.sigmoid(), initial_state=None,
                                        output_final_state=False, use_qk_l2norm_in_kernel=False,
                                        cu_seqlens=cu_seqlens)
        gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)
        normed = self._apply_gated_norm(core, gate).reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
        if to_ranks is not None:
            normed = tensor_a2a_hp2cp(normed.index_select(0, to_ranks), 0, -1, cp_group,
                                      redo_attention_load_balancing=False)
        else:
            normed = tensor_a2a_hp2cp(normed, 0, -1, cp_group)
        return self.out_proj(normed)

    def _packed_cu_seqlens(self, packed_seq_params: Any, batch: int, seq_len: int, device: Any) -> torch.Tensor:
        """The document boundaries (padded ones when given) over the whole packed sequence."""
        _require(batch == 1, f"GatedDeltaNet: packed sequences (qkv_format='thd') need micro-batch size 1, "
                             f"got {batch}")
        layout = thd_layout(packed_seq_params, seq_len)
        if self.cp_size > 1:
            bad = [p for p in layout.padded if p % (2 * self.cp_size)]
            _require(not bad, f"GatedDeltaNet: every packed document's (padded) length must be divisible by "
                              f"2 * context_parallel_size ({2 * self.cp_size}), got lengths {list(layout.padded)}")
        return torch.tensor([*layout.starts, layout.total], dtype=torch.long, device=device)

    def _conv(self, qkv: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """Causal depthwise convolution and activation of ``qkv`` ``[b, s, (2qk + v) local]`` with this CP rank's
        channels of the weight."""
        sections = self._conv_sections()
        cp_group = self.pg_collection.cp
        weight = get_parameter_local_cp(self.conv1d.weight, 0, cp_group, split_sections=sections)
        bias = (get_parameter_local_cp(self.conv1d.bias, 0, cp_group, split_sections=sections)
                if self.conv_bias else None)
        fused = self.activation in ("silu", "swish")
        out, _ = causal_conv1d(qkv, weight.squeeze(1), bias, activation=self.activation if fused else None,
                               cu_seqlens=cu_seqlens)
        return out if fused else self.act_fn(out)

    def _heads(self, qkv: torch.Tensor, batch: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        """``q, k`` ``[b, s, v_heads, d_k]`` (L2-normalised, repeated over their value heads) and ``v``
        ``[b, s, v_heads, d_v]`` of this CP rank's heads."""
        qk_local = self.qk_dim_local_tp // self.cp_size
        query, key, value = torch.split(qkv, [qk_local, qk_local, self.v_dim_local_tp // self.cp_size], dim=-1)
        query = query.reshape(batch, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            query, key = l2norm(query), l2norm(key)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        return query.contiguous(), key.contiguous(), value.contiguous()

    def _apply_gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``out_norm(x) * act(gate)`` per head (``x``, ``gate`` ``[b, s, heads, d_v]``), in ``x``'s dtype.

        ``out_norm``'s parameters are replicated over TP while each rank holds only its heads, so they enter through
        ``copy_to_tensor_model_parallel_region``: their gradient is summed over TP in the backward (Megatron-Core
        leaves it partial unless sequence parallelism's norm reduction happens to sum it). The norm then sees the
        copies, not its parameters, so a parameter whose gradient goes straight to ``main_grad``
        (``gradient_accumulation_fusion``) is routed there here, before the copy, as the norm would have done.
        """
        flat = x.reshape(-1, x.shape[-1])
        if self.tp_size > 1:
            params = {name: copy_to_tensor_model_parallel_region(gradient_into_main_grad(param), group=self.tp_group)
                      for name, param in self.out_norm.named_parameters()}
            normed = functional_call(self.out_norm, params, (flat,))
        else:
            normed = self.out_norm(flat)
        return (normed * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """Megatron-Core's checkpoint layout: ``A_log``, ``dt_bias`` and ``conv1d`` TP-sharded along dim 0,
        ``in_proj.weight`` stored as ``.query/.key/.value/.z/.beta/.alpha`` and ``conv1d.weight`` (``.bias``) as
        ``.query/.key/.value``, each TP-sharded on its own (TP-size independent)."""
        own: dict[str, Any] = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        groups = {"tp_group": self.tp_group, "dp_cp_group": metadata["dp_cp_group"]}
        sharded = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets,
                                                      **groups)
        for child_name, module in self.named_children():
            child_prefix = f"{prefix}{child_name}."
            if module is self.conv1d:
                sharded.update(make_sharded_tensors_for_checkpoint(
                    module.state_dict(prefix="", keep_vars=True), child_prefix, {"weight": 0, "bias": 0},
                    sharded_offsets, **groups))
            elif hasattr(module, "sharded_state_dict"):
                sharded.update(module.sharded_state_dict(child_prefix, sharded_offsets, metadata))
            else:
                sharded.update(sharded_state_dict_default(module, child_prefix, sharded_offsets, metadata,
                                                          tp_group=self.tp_group))
        weight_key = f"{prefix}in_proj.weight"
        sharded[weight_key] = _split_tensor_factory(sharded[weight_key], list(self.in_proj_split_sections),
                                                    self.in_proj_split_names, 0)
        for key in (f"{prefix}conv1d.weight", f"{prefix}conv1d.bias"):
            if key in sharded:
                sharded[key] = _split_tensor_factory(sharded[key], self._conv_sections(), ["query", "key", "value"], 0)
        return sharded
