"""Self-attention (Megatron-Core's ``SelfAttention`` + ``SelfAttentionSubmodules``).

``linear_qkv`` is one column-parallel GEMM whose output is grouped **per query group**:
for each of this rank's ``ng`` key/value groups, its ``np/ng`` query heads, then one key head,
then one value head (``[sq, b, ng * (np/ng + 2) * hn]``), not ``[Q | K | V]``. This is the
layout checkpoints and converters must use. MHA is ``ng = np``, MQA ``ng = 1``. With
``attention_output_gate`` each group also holds one gate channel per query channel, right after its query
heads (``[np/ng * hn query | np/ng * hn gate | hn key | hn value]``), and the core attention's output is
multiplied by ``sigmoid(gate)`` before ``linear_proj``; a TP rank's gates travel with its heads.
Optional q/k layernorm (per head), rotary embedding, then core attention and ``linear_proj``
(row-parallel, bias returned separately for bias-dropout-add). ``clip_qk`` is QK-clip's weight update.
``CrossAttention`` (encoder-decoder models) takes its queries from the layer input and its keys and
values from a context (``linear_q`` and ``linear_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core._activation_offload.interface import (
    FineGrainedActivationOffloadingInterface as off_interface,
)
from megatron_core._ground import divide
from megatron_core.process_groups_config import check_parallel_size, resolve_pg_collection
from megatron_core.tensor_parallel.delayed_wgrad import run_delayed_wgrads
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.fused_qkv_rope import fused_qkv_rope_supported, split_qkv_with_rope
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.rope_options import layer_skips_rope
from megatron_core.transformer.rope_utils import apply_rotary_pos_emb, rotary_cos_sin
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.submodule_protocols import (  # noqa: F401 (the slots' protocols, re-exported)
    CoreAttentionBuilder,
    CoreAttentionInterface,
    LinearInterface,
    LinearLayerBuilder,
    LinearProjBuilder,
    LinearProjInterface,
    LinearQkvBuilder,
    LinearQkvInterface,
)
from megatron_core.transformer.torch_norm import L2Norm
from megatron_core.transformer.transformer_config import TransformerConfig


@dataclass
class SelfAttentionSubmodules:
    """The parts of self-attention: fused QKV projection, core attention, output projection, q/k norms."""

    linear_qkv: ModuleSpec | type | None = None
    core_attention: ModuleSpec | type | None = None
    linear_proj: ModuleSpec | type | None = None
    q_layernorm: ModuleSpec | type | None = None
    k_layernorm: ModuleSpec | type | None = None


class Attention(MegatronModule):
    """What every attention variant shares (Megatron-Core's ``Attention`` base): its layer number and mask
    type, its tensor-parallel group checked against ``config.tensor_model_parallel_size``, and the core
    attention run under activation checkpointing when selective recompute names ``core_attn``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, pg_collection: Any = None) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # Head counts per rank come from the TP group (pg_collection, else parallel_state), as in Megatron-Core.
        self.pg_collection = resolve_pg_collection(pg_collection, required_pgs=["tp", "cp", "hcp"])
        self.tp_group = self.pg_collection.tp
        self.world_size = check_parallel_size(config, "tensor_model_parallel_size", self.tp_group, "tensor-parallel")
        self.checkpoint_core_attention = (
            config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
        )
        # Fine-grained activation offloading: the saved activations of these parts move to host memory.
        offload = set(config.offload_modules or []) if config.fine_grained_activation_offloading else set()
        self.offload_qkv_linear = "qkv_linear" in offload
        self.offload_core_attention = "core_attn" in offload
        self.offload_attn_proj = "attn_proj" in offload

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs this attention's linears deferred (``delay_wgrad_compute``; else
        nothing)."""
        run_delayed_wgrads(self)

    def _offloaded_core_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  attention_mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        """:meth:`_run_core_attention` in the ``core_attn`` offload group (training without its recompute)."""
        offload = self.offload_core_attention and self.training and not self.checkpoint_core_attention
        manager = off_interface(offload, query, "core_attn")
        with manager as query:
            context = self._run_core_attention(query, key, value, attention_mask, **kwargs)
        return manager.group_offload(context, forced_released_tensors=[query, key, value])

    def _offloaded_projection(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``linear_proj(context)`` in the ``attn_proj`` offload group."""
        manager = off_interface(self.offload_attn_proj, context, "attn_proj")
        with manager as context:
            output, bias = self.linear_proj(context)
        return manager.group_offload(output, forced_released_tensors=[context]), bias

    def _run_core_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        """``self.core_attention(query, key, value, attention_mask, **kwargs)``, recomputed in the backward
        pass when ``checkpoint_core_attention`` and training."""
        if not self.checkpoint_core_attention or not self.training:
            return self.core_attention(query, key, value, attention_mask, **kwargs)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            return self.core_attention(q, k, v, mask, **kwargs)

        return tensor_parallel.checkpoint(run, False, query, key, value, attention_mask)


class SelfAttention(Attention):
    """Multi-head / grouped-query / multi-query self-attention over ``[s, b, h]`` activations."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(config, layer_number, attn_mask_type, "self", pg_collection)
        tp = self.world_size
        self.hidden_size_per_attention_head = config.kv_channels
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp, "num_attention_heads / TP")
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp, "num_query_groups / TP")
        self.heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        self.linear_qkv_out_dim = self.query_projection_size + 2 * self.kv_projection_size
        if config.attention_output_gate:  # one gate channel per query channel, grouped with its heads
            self.linear_qkv_out_dim += self.query_projection_size

        self.linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            self.linear_qkv_out_dim,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=self.tp_group,
        )
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=self.attention_type,
            cp_comm_type=cp_comm_type,
            pg_collection=self.pg_collection,
        )
        self.linear_proj = build_output_projection(submodules.linear_proj, self.query_projection_size, config,
                                                   self.tp_group)
        self.q_layernorm = self._build_qk_norm(submodules.q_layernorm)
        self.k_layernorm = self._build_qk_norm(submodules.k_layernorm)

    def _build_qk_norm(self, spec: Any) -> torch.nn.Module | None:
        """A q/k norm from ``spec``; ``qk_l2_norm`` fills an empty slot with ``L2Norm`` (a spec's norm wins, as in
        Megatron-Core), and a spec's ``L2Norm`` needs ``qk_l2_norm`` or ``qk_layernorm`` in the config."""
        if spec is None and self.config.qk_l2_norm:
            spec = L2Norm
        elif _builds(spec, L2Norm) and not (self.config.qk_l2_norm or self.config.qk_layernorm):
            raise ValueError("the spec sets a q/k L2Norm but qk_l2_norm and qk_layernorm are False in the "
                             "TransformerConfig (set qk_l2_norm=True)")
        if spec is None:
            return None
        return build_module(
            spec, config=self.config, hidden_size=self.hidden_size_per_attention_head, eps=self.config.layernorm_epsilon
        )

    def get_query_key_value_tensors(
        self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None, output_gate: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """Split the fused QKV output into query ``[sq, b, np, hn]`` and key/value ``[sq, b, ng, hn]``; with
        ``output_gate`` (``attention_output_gate`` configs) also the output gate ``[sq, b, np, hn]``."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        return self._split_qkv(mixed_qkv, output_gate=output_gate)

    def _split_qkv(self, mixed_qkv: torch.Tensor, output_gate: bool = False) -> tuple[torch.Tensor, ...]:
        """``linear_qkv``'s output ``[sq, b, ...]`` as query, key and value (q/k layernorms applied), and the gate
        with ``output_gate``. A gated layer's group holds ``[its query heads | their gates | key | value]``."""
        sq, b = mixed_qkv.shape[:2]
        hn, ng, per_group = self.hidden_size_per_attention_head, self.num_query_groups_per_partition, self.heads_per_group
        gated = self.config.attention_output_gate
        sections = [per_group * hn] * (2 if gated else 1) + [hn, hn]
        mixed_qkv = mixed_qkv.view(sq, b, ng, sum(sections))
        parts = torch.split(mixed_qkv, sections, dim=3)
        query, key, value = parts[0], parts[-2], parts[-1]
        query = query.reshape(sq, b, ng * per_group, hn)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if not output_gate:
            return query, key, value
        if not gated:
            raise ValueError("output_gate=True needs a layer built with attention_output_gate=True")
        return query, key, value, parts[1].reshape(sq, b, ng * per_group, hn)

    def _apply_output_gate(self, context: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``context * sigmoid(gate)`` (the gate in fp32, the result in ``context``'s dtype); ``context`` is the
        core attention's output ``[sq, b, np * hn]`` (``[t, 1, np * hn]`` packed). No gate: ``context``."""
        if gate is None:
            return context
        return (context * torch.sigmoid(gate.reshape(context.shape).float())).to(context.dtype)

    def _core_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None, attention_bias: torch.Tensor | None, packed_seq_params: Any = None,
    ) -> torch.Tensor:
        extra = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
        return self._offloaded_core_attention(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                              attention_bias=attention_bias, **extra)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
        attn_mask_type: AttnMaskType | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend over ``hidden_states`` ``[s, b, h]``; returns ``(output [s, b, h], bias)``."""
        inference_context = inference_context if inference_context is not None else inference_params
        if rotary_pos_emb is not None and layer_skips_rope(self.config, self.layer_number):
            rotary_pos_emb = None  # a layer without RoPE (no_rope_freq)
        angles = self._fused_rope_angles(rotary_pos_emb, key_value_states, packed_seq_params, inference_context)
        qkv_manager = off_interface(self.offload_qkv_linear, hidden_states, "qkv_linear")
        with qkv_manager as hidden_states:
            if angles is not None:
                qkv = self._split_and_rotate(hidden_states, angles, packed_seq_params)
            elif self.config.attention_output_gate:
                qkv = self.get_query_key_value_tensors(hidden_states, key_value_states, output_gate=True)
            else:
                qkv = self.get_query_key_value_tensors(hidden_states, key_value_states)
        query, key, value, *gate = qkv_manager.group_offload(qkv, forced_released_tensors=[])
        gate = gate[0] if gate else None
        if angles is None:
            if inference_context is not None:  # KV cache: the context rotates, caches and attends (inference/contexts)
                context = inference_context.attention(self, query, key, value, rotary_pos_emb)
                return self.linear_proj(self._apply_output_gate(context, gate))
            if rotary_pos_emb is not None:
                query, key = self._rotate(query, key, rotary_pos_emb, packed_seq_params)
        context = self._core_attention(
            query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
        )
        return self._offloaded_projection(self._apply_output_gate(context, gate))

    def _rotate(
        self, query: torch.Tensor, key: torch.Tensor, rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        packed_seq_params: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Query and key rotated by their angles (RoPE positions restart at every packed document)."""
        q_emb, k_emb = _query_key_angles(rotary_pos_emb)
        cu_q, cu_kv = _cu_seqlens(packed_seq_params)
        cp_group = self._rope_cp_group(packed_seq_params)
        return (apply_rotary_pos_emb(query, q_emb, config=self.config, cu_seqlens=cu_q, cp_group=cp_group),
                apply_rotary_pos_emb(key, k_emb, config=self.config, cu_seqlens=cu_kv, cp_group=cp_group))

    def _rope_cp_group(self, packed_seq_params: Any = None) -> Any:
        """The context-parallel group that says which chunks of each packed document this rank holds (this call's
        group under hybrid CP)."""
        core_group = getattr(self.core_attention, "_cp_group", None)
        return None if core_group is None else core_group(packed_seq_params)

    def _fused_rope_angles(
        self, rotary_pos_emb: Any, key_value_states: torch.Tensor | None, packed_seq_params: Any,
        inference_context: Any,
    ) -> torch.Tensor | None:
        """The angles when the QKV split and RoPE run as one kernel each way, else ``None``.

        Asked for by ``fused_single_qkv_rope`` or ``apply_rope_fusion``; it serves self-attention in training or
        a forward without a KV cache, over a plain or packed sequence (query and key with the same
        ``cu_seqlens``), with one angle tensor for query and key and no q/k layernorm. Elsewhere the split and the
        rotation run unfused (same values).
        """
        config = self.config
        if rotary_pos_emb is None or not (config.fused_single_qkv_rope or config.apply_rope_fusion):
            return None
        q_emb, k_emb = _query_key_angles(rotary_pos_emb)
        cu_q, cu_kv = _cu_seqlens(packed_seq_params)
        plain = (key_value_states is None and inference_context is None and cu_kv is cu_q
                 and not config.attention_output_gate
                 and q_emb is k_emb and not q_emb.requires_grad and q_emb.shape[1] == 1  # not mrope's per sample
                 and q_emb.shape[-1] <= self.hidden_size_per_attention_head
                 and isinstance(self.q_layernorm, (type(None), IdentityOp))
                 and isinstance(self.k_layernorm, (type(None), IdentityOp))
                 and type(self).get_query_key_value_tensors is SelfAttention.get_query_key_value_tensors
                 and type(self)._split_qkv is SelfAttention._split_qkv)
        return q_emb if plain else None

    def clip_qk(self) -> None:
        """QK-clip (MuonClip): rescale the query/key weights of the groups whose largest recorded logit is too big.

        Per key/value group ``g`` of this rank, ``eta = min(qk_clip_threshold / max over g's query heads, 1)``;
        the rows of ``linear_qkv.weight`` of g's query heads are multiplied by ``eta ** qk_clip_alpha`` and its
        key rows by ``eta ** (1 - qk_clip_alpha)`` (value rows, output-gate rows and biases untouched), so g's
        logits shrink by ``eta``. Also applied to a full-precision ``main_param`` copy. Resets the recorded maxima.
        """
        logits = _recorded_max_logits(self, self.num_attention_heads_per_partition)
        groups, per_group = self.num_query_groups_per_partition, self.heads_per_group
        group_max = logits.view(groups, per_group).amax(dim=1)
        if torch.any(group_max > self.config.qk_clip_threshold):
            eta = torch.clamp(self.config.qk_clip_threshold / group_max, max=1.0)
            hn, alpha = self.hidden_size_per_attention_head, self.config.qk_clip_alpha
            ones = torch.ones(groups, hn, dtype=eta.dtype, device=eta.device)
            query_rows = torch.pow(eta, alpha)[:, None].expand(groups, per_group * hn)
            gate_rows = [ones.repeat(1, per_group)] if self.config.attention_output_gate else []
            rows = torch.cat((query_rows, *gate_rows, torch.pow(eta, 1 - alpha)[:, None].expand(groups, hn), ones),
                             dim=1)
            _scale_weight_rows_(self.linear_qkv.weight, rows.reshape(-1))
        self.core_attention.current_max_attn_logits = None

    def _split_and_rotate(
        self, hidden_states: torch.Tensor, angles: torch.Tensor, packed_seq_params: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``linear_qkv``, then query, key and value with RoPE applied: one Triton kernel where it runs."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        if not fused_qkv_rope_supported(mixed_qkv, angles):
            query, key, value = self._split_qkv(mixed_qkv)
            return (*self._rotate(query, key, angles, packed_seq_params), value)
        cos, sin = rotary_cos_sin(angles, mixed_qkv.shape[0], mixed_qkv.dtype,
                                  cu_seqlens=_cu_seqlens(packed_seq_params)[0],
                                  cp_group=self._rope_cp_group(packed_seq_params))
        return split_qkv_with_rope(mixed_qkv, cos, sin, self.num_query_groups_per_partition, self.heads_per_group,
                                   self.config.rotary_interleaved)


def build_output_projection(spec: Any, query_projection_size: int, config: TransformerConfig, tp_group: Any
                            ) -> torch.nn.Module:
    """The row-parallel projection of the heads' outputs (``query_projection_size``) back to the hidden size, with
    its bias left for the bias-dropout-add (every attention variant's ``linear_proj``)."""
    return build_module(spec, query_projection_size, config.hidden_size, config=config,
                        init_method=config.output_layer_init_method, bias=config.add_bias_linear,
                        input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj",
                        tp_group=tp_group)


def _recorded_max_logits(attention: torch.nn.Module, heads: int) -> torch.Tensor:
    """The per-head maxima ``clip_qk`` works from, after checking that QK-clip is on and they exist."""
    if not attention.config.qk_clip:
        raise ValueError(f"{type(attention).__name__}.clip_qk needs qk_clip=True in the TransformerConfig")
    logits = getattr(attention.core_attention, "current_max_attn_logits", None)
    if logits is None:
        raise ValueError(f"{type(attention).__name__}.clip_qk: core_attention.current_max_attn_logits is None (no "
                         "forward recorded since the last clip_qk)")
    if tuple(logits.shape) != (heads,):
        raise ValueError(f"{type(attention).__name__}.clip_qk: current_max_attn_logits has shape "
                         f"{tuple(logits.shape)}, expected ({heads},) (this rank's heads)")
    return logits


@torch.no_grad()
def _scale_weight_rows_(weight: torch.Tensor, rows: torch.Tensor) -> None:
    """Multiply row ``i`` of ``weight`` (and of its same-shaped ``main_param``, if any) by ``rows[i]`` in place."""
    targets = [weight]
    main = getattr(weight, "main_param", None)
    if main is not None:
        if main.numel() != weight.numel():
            raise ValueError(
                f"clip_qk cannot rescale a sharded main_param ({main.numel()} of {weight.numel()} elements); "
                "rescale the model weights and call the optimizer's reload_model_params()"
            )
        targets.append(main.view(weight.shape))
    for target in targets:
        target.mul_(rows.to(target.device)[:, None])


def _builds(spec: Any, cls: type) -> bool:
    """Whether ``spec`` (a class or a ``ModuleSpec``) builds ``cls``."""
    return (spec.module if isinstance(spec, ModuleSpec) else spec) is cls


def _query_key_angles(rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, Any]:
    return rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)


def _cu_seqlens(packed_seq_params: Any) -> tuple[Any, Any]:
    """``(cu_seqlens_q, cu_seqlens_kv)`` (padded where given; the key's default to the query's), or ``None``s."""
    if packed_seq_params is None:
        return None, None
    cu_q = _padded_or(packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q)
    cu_kv = _padded_or(packed_seq_params.cu_seqlens_kv_padded, packed_seq_params.cu_seqlens_kv)
    return cu_q, cu_q if cu_kv is None else cu_kv


def _padded_or(padded: Any, plain: Any) -> Any:
    return padded if padded is not None else plain


@dataclass
class CrossAttentionSubmodules:
    """The parts of cross-attention: query projection, fused key/value projection, core attention, output projection."""

    linear_q: ModuleSpec | type | None = None
    linear_kv: ModuleSpec | type | None = None
    core_attention: ModuleSpec | type | None = None
    linear_proj: ModuleSpec | type | None = None


class CrossAttention(Attention):
    """Attention of ``hidden_states`` ``[sq, b, h]`` (queries) over a context ``[sk, b, h]`` (keys and values).

    ``linear_q`` projects the queries and ``linear_kv`` the context, both column-parallel; ``linear_kv``'s output is
    grouped per head: for each of this rank's heads, its key rows then its value rows (``[sk, b, np * 2 * hn]``).
    Every query head has its own key/value head (grouped-query attention is refused, as in Megatron-Core).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: CrossAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        name: str | None = None,
    ) -> None:
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError(
                f"CrossAttention does not support grouped-query attention: num_query_groups "
                f"({config.num_query_groups}) must equal num_attention_heads ({config.num_attention_heads})"
            )
        super().__init__(config, layer_number, attn_mask_type, "cross", pg_collection)
        tp = self.world_size
        self.hidden_size_per_attention_head = config.kv_channels
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = self.query_projection_size
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp, "num_attention_heads / TP")
        self.num_query_groups_per_partition = self.num_attention_heads_per_partition
        linear_kwargs = dict(config=config, init_method=config.init_method, gather_output=False,
                             bias=config.add_bias_linear, skip_bias_add=False, is_expert=False, tp_group=self.tp_group)
        self.linear_q = build_module(submodules.linear_q, config.hidden_size, self.query_projection_size,
                                     **linear_kwargs)
        self.linear_kv = build_module(submodules.linear_kv, config.hidden_size, 2 * self.kv_projection_size,
                                      **linear_kwargs)
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
            attention_type=self.attention_type, cp_comm_type=cp_comm_type, pg_collection=self.pg_collection,
        )
        self.linear_proj = build_output_projection(submodules.linear_proj, self.query_projection_size, config,
                                                   self.tp_group)

    def get_query_key_value_tensors(
        self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query ``[sq, b, np, hn]`` from ``hidden_states``; key and value ``[sk, b, np, hn]`` from the context."""
        if key_value_states is None:
            raise ValueError("CrossAttention needs key_value_states (the context to attend over), got None")
        heads, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed_kv, _ = self.linear_kv(key_value_states)
        key, value = mixed_kv.view(*mixed_kv.shape[:-1], heads, 2 * hn).split(hn, dim=-1)
        query, _ = self.linear_q(hidden_states)
        return query.view(*query.shape[:-1], heads, hn), key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
        attn_mask_type: AttnMaskType | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``hidden_states`` ``[sq, b, h]`` over ``key_value_states`` ``[sk, b, h]``.

        ``attention_mask`` is Megatron's boolean mask (True = masked), broadcastable to ``[b, np, sq, sk]``.
        Returns ``(output [sq, b, h], bias)``. The keys and values depend on the context only, so a decoding step
        (``inference_context``) attends over the whole context as in training.
        """
        if packed_seq_params is not None:
            raise ValueError("CrossAttention does not support packed sequences (packed_seq_params must be None)")
        # Under sequence parallelism both inputs are this rank's sequence chunks; the linears gather them.
        _check_context(hidden_states, key_value_states, attention_mask,
                       self.world_size if self.config.sequence_parallel else 1)
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        if rotary_pos_emb is not None and not layer_skips_rope(self.config, self.layer_number):
            q_emb, k_emb = _query_key_angles(rotary_pos_emb)
            query = apply_rotary_pos_emb(query, q_emb, config=self.config)
            key = apply_rotary_pos_emb(key, k_emb, config=self.config)
        extra = dict(attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        context = self._run_core_attention(query, key, value, attention_mask, **extra)
        return self.linear_proj(context)


def _check_context(hidden_states: torch.Tensor, context: torch.Tensor | None, mask: torch.Tensor | None,
                   sequence_shards: int = 1) -> None:
    """ValueError unless the context is ``[sk, b, h]`` like ``hidden_states`` and the mask fits ``[b, *, sq, sk]``
    (``sequence_shards``: how many sequence-parallel chunks each input is one of; the mask spans whole sequences)."""
    if context is None:
        raise ValueError("CrossAttention needs key_value_states (the context to attend over), got None")
    if context.dim() != 3 or context.shape[1:] != hidden_states.shape[1:]:
        raise ValueError(
            f"CrossAttention: key_value_states has shape {tuple(context.shape)}; expected [sk, b, h] with b, h as in "
            f"hidden_states {tuple(hidden_states.shape)}"
        )
    if mask is None:
        return
    sq, b, sk = hidden_states.shape[0] * sequence_shards, hidden_states.shape[1], context.shape[0] * sequence_shards
    tail = tuple(mask.shape[-2:])
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or tail[0] not in (1, sq) or tail[1] != sk:
        raise ValueError(
            f"CrossAttention: attention_mask (context mask) has shape {tuple(mask.shape)}; expected "
            f"[b or 1, 1 or heads, sq or 1, sk] = [{b}, 1, {sq}, {sk}] for queries of length {sq} and a context of "
            f"length {sk}"
        )
