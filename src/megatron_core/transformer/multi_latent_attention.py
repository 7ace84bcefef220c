"""Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's ``MLASelfAttention`` + ``MLASelfAttentionSubmodules``).

Per token ``x`` (``[s, b, h]``), with ``n`` heads, ``d = qk_head_dim``, ``r = qk_pos_emb_head_dim``:

- query: ``linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))`` (``q_lora_rank`` latent), or
  ``linear_q_proj(x)`` when ``q_lora_rank`` is None; per head ``d`` channels without position, ``r`` with;
- key/value: ``linear_kv_down_proj(x)`` gives a ``kv_lora_rank`` latent and ``r`` key position channels shared
  by every head; ``linear_kv_up_proj(kv_layernorm(latent))`` gives per head ``d`` key channels and
  ``v_head_dim`` value channels;
- RoPE (:mod:`.mla_rope`, MLA's own table) on the position channels; query ``[nope, rope]`` and key
  ``[nope, shared rope]``; softmax scale :func:`.mla_rope.mla_softmax_scale`; ``linear_proj`` back to ``h``.

Tensor parallelism splits the heads: ``linear_q_up_proj`` / ``linear_q_proj`` / ``linear_kv_up_proj`` are
column-parallel over heads, ``linear_proj`` row-parallel. The down projections are column-parallel too (the
local spec, as in Megatron-Core): their outputs are all-gathered over TP and, under sequence parallelism, the
latents scattered back to this rank's tokens before their norms. The shared key position channels are used by
every rank's heads, so their gradient is summed over the TP ranks. Every rank holds all ``n / TP`` key heads
(no grouped-query sharing after the up projection).

Core attention gets query/key of width ``d + r`` and values of ``v_head_dim``; the value (or, if wider, the
query and key) is zero-padded to a common width for ``DotProductAttention`` and its output trimmed back. A
DeepSeek sparse attention core (``requires_dsa_inputs``) gets them unpadded, plus ``x`` (the input) and ``qr``
(the normed query latent) for its indexer; it has no KV-cache path.
Context parallelism, packed sequences (``qkv_format='thd'``) and the KV-cache contexts (static and dynamic)
run through the same core attention / context code as ``SelfAttention``. Selective recompute of
``'mla_up_proj'`` recomputes the up projections and RoPE in the backward instead of keeping their outputs.
``MLASelfAttention.clip_qk`` is QK-clip's weight update (the shared key position channels are left alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core._activation_offload.interface import (
    FineGrainedActivationOffloadingInterface as off_interface,
)
from megatron_core._ground import divide, get_pg_rank, get_pg_size
from megatron_core._misc_utils import accepts_parameter
from megatron_core.fusions.fused_mla_yarn_rope_apply import (
    fused_apply_mla_rope_for_kv,
    fused_apply_mla_rope_for_q,
)
from megatron_core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_core.tensor_parallel.random import CheckpointWithoutOutput
from megatron_core.transformer.attention import (
    Attention,
    _cu_seqlens,
    _recorded_max_logits,
    _scale_weight_rows_,
    build_output_projection,
)
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.mla_rope import (
    build_mla_rotary_embedding,
    deinterleave_rope_channels,
    mla_softmax_scale,
    rotary_angles,
    rotate_mla,
)
from megatron_core.transformer.rope_utils import rotary_cos_sin
from megatron_core.transformer.selective_recompute import recompute_module_enabled
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import MLATransformerConfig

__all__ = ["FusedMLASelfAttention", "MLASelfAttention", "MLASelfAttentionSubmodules", "MultiLatentAttention"]


@dataclass
class MLASelfAttentionSubmodules:
    """The parts of MLA self-attention (Megatron-Core's field names; unset norms are identities)."""

    linear_proj: ModuleSpec | type | None = None
    q_layernorm: ModuleSpec | type | None = None
    kv_layernorm: ModuleSpec | type | None = None
    linear_q_proj: ModuleSpec | type | None = None
    linear_q_down_proj: ModuleSpec | type | None = None
    linear_q_up_proj: ModuleSpec | type | None = None
    linear_kv_down_proj: ModuleSpec | type | None = None
    linear_kv_up_proj: ModuleSpec | type | None = None
    linear_qkv_down_proj: ModuleSpec | type | None = None
    core_attention: ModuleSpec | type | None = None


def _accepts(spec: Any, name: str) -> bool:
    """Whether the class a spec builds takes the keyword ``name`` (or any keyword)."""
    return accepts_parameter(spec.module if isinstance(spec, ModuleSpec) else spec, name)


def _is_identity(spec: Any) -> bool:
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return module is None or (isinstance(module, type) and issubclass(module, IdentityOp))


class MultiLatentAttention(Attention):
    """The parts of MLA every variant shares: rotary table, core attention, output projection and forward."""

    def __init__(
        self,
        config: MLATransformerConfig,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(config, MLATransformerConfig):
            raise ValueError(f"multi-latent attention needs an MLATransformerConfig, got {type(config).__name__}")
        super().__init__(config, layer_number, attn_mask_type, attention_type, pg_collection)
        tp = self.world_size
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp, "num_attention_heads / TP")
        self.query_projection_size = config.v_head_dim * config.num_attention_heads
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.key_hidden_size = self.q_head_dim
        self.val_hidden_size = config.v_head_dim
        self.softmax_scale = mla_softmax_scale(config)
        self.rotary_pos_emb = build_mla_rotary_embedding(config, self.pg_collection.cp)
        attention_kwargs: dict[str, Any] = dict(
            config=config, layer_number=layer_number, attn_mask_type=attn_mask_type, attention_type=attention_type,
            softmax_scale=self.softmax_scale, cp_comm_type=cp_comm_type, pg_collection=self.pg_collection,
        )
        for key, value in (("k_channels", self.q_head_dim), ("v_channels", config.v_head_dim)):
            if _accepts(submodules.core_attention, key):  # a Megatron-style core attention sized by them
                attention_kwargs[key] = value
        self.core_attention = build_module(submodules.core_attention, **attention_kwargs)
        self.linear_proj = build_output_projection(submodules.linear_proj, self.query_projection_size, config,
                                                   self.tp_group)
        self.recompute_up_proj = recompute_module_enabled(config, "mla_up_proj")

    # ---- to be provided by a variant ------------------------------------------------------------------------
    def compress(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query latent, normed kv latent, key position channels [s, b, r])`` of ``hidden_states``."""
        raise NotImplementedError

    def up_project(self, q_compressed: torch.Tensor, kv_compressed: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_nope, q_pos, k_nope, value)`` per head of this rank, before RoPE."""
        raise NotImplementedError

    # ---- shared computation ---------------------------------------------------------------------------------
    def _angles(self, hidden_states: torch.Tensor, packed_seq_params: Any, inference_context: Any
                ) -> tuple[torch.Tensor, float]:
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(inference_context, self, hidden_states, self.config,
                                                         packed_seq_params)
        packed = packed_seq_params is not None and packed_seq_params.qkv_format in (None, "thd")
        return rotary_angles(self.rotary_pos_emb, seq_len, packed, hidden_states.device)

    def _expand_and_rotate(self, q_compressed: torch.Tensor, kv_compressed: torch.Tensor, k_pos: torch.Tensor,
                           angles: torch.Tensor, mscale: float, packed_seq_params: Any
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query ``[s, b, n, d + r]``, key ``[s, b, n, d + r]`` and value ``[s, b, n, v_head_dim]``, rotated."""
        cu_q, cu_kv = _cu_seqlens(packed_seq_params)
        if self.config.apply_rope_fusion and self.config.rope_type == "yarn" and (cu_q is None or k_pos.shape[1] == 1):
            return self._expand_and_rotate_fused(q_compressed, kv_compressed, k_pos, angles, mscale, cu_q, cu_kv)
        q_nope, q_pos, k_nope, value = self.up_project(q_compressed, kv_compressed)
        cp_group = self.pg_collection.cp
        q_pos = rotate_mla(q_pos, angles, mscale, self.config, cu_q, cp_group)
        k_pos = rotate_mla(k_pos.unsqueeze(-2), angles, mscale, self.config, cu_kv, cp_group)
        query = torch.cat((q_nope, q_pos), dim=-1)
        key = torch.cat((k_nope, k_pos.expand(*k_nope.shape[:-1], k_pos.shape[-1])), dim=-1)
        return query, key, value.contiguous()

    def _project_heads(self, q_compressed: torch.Tensor, kv_compressed: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [.., n, d + r], kv [.., n, d + v_head_dim])``: the up projections per head, not split."""
        q_nope, q_pos, k_nope, value = self.up_project(q_compressed, kv_compressed)
        return torch.cat((q_nope, q_pos), dim=-1), torch.cat((k_nope, value), dim=-1)

    def _expand_and_rotate_fused(self, q_compressed: torch.Tensor, kv_compressed: torch.Tensor, k_pos: torch.Tensor,
                                 angles: torch.Tensor, mscale: float, cu_q: torch.Tensor | None,
                                 cu_kv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_expand_and_rotate` through the fused MLA RoPE (``apply_rope_fusion`` with YaRN, as Megatron-Core):
        the query rotated in place, key and value split from ``kv`` in one pass."""
        config, cp_group = self.config, self.pg_collection.cp
        q, kv = self._project_heads(q_compressed, kv_compressed)
        cos, sin = rotary_cos_sin(angles, angles.shape[0], q.dtype, mscale)
        k_pos = k_pos.unsqueeze(-2)
        if cu_q is not None:  # packed rows [t, 1, ...] are [t, ...] to the fused functions
            q, kv, k_pos = q.squeeze(1), kv.squeeze(1), k_pos.squeeze(1)
        cp = dict(cp_rank=get_pg_rank(cp_group), cp_size=get_pg_size(cp_group))
        query = fused_apply_mla_rope_for_q(q, cos, sin, config.qk_head_dim, config.qk_pos_emb_head_dim, cu_q, **cp)
        key, value = fused_apply_mla_rope_for_kv(kv, k_pos, cos, sin, config.qk_pos_emb_head_dim, config.qk_head_dim,
                                                 config.v_head_dim, cu_kv, **cp)
        if cu_q is not None:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        return query, key, value

    def _pad(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zero-pad value (or query and key) to one head width; the dot products and outputs are unchanged.
        DeepSeek sparse attention takes different widths as they are."""
        qk, v = query.shape[-1], value.shape[-1]
        if getattr(self.core_attention, "requires_dsa_inputs", False):
            return query, key, value
        if v < qk:
            value = F.pad(value, (0, qk - v))
        elif qk < v:
            query, key = F.pad(query, (0, v - qk)), F.pad(key, (0, v - qk))
        return query, key, value

    def _trim(self, context: torch.Tensor) -> torch.Tensor:
        """Core attention's ``[s, b, n * width]`` back to ``[s, b, n * v_head_dim]``."""
        heads, v = self.num_attention_heads_per_partition, self.config.v_head_dim
        width = context.shape[-1] // heads
        if width == v:
            return context
        return context.view(*context.shape[:-1], heads, width)[..., :v].reshape(*context.shape[:-1], heads * v)

    def get_query_key_value_tensors(
        self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None, packed_seq_params: Any = None, inference_context: Any = None,
        *, inference_params: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query, key, value, q_compressed, kv_compressed)`` as Megatron-Core returns them (rotated, unpadded).

        Positions start at 0 (or restart per packed document); a KV-cache step goes through ``forward``, where the
        inference context rotates each token at its own position.
        """
        inference_context = inference_context if inference_context is not None else inference_params
        q_compressed, kv_compressed, k_pos = self.compress(hidden_states)
        angles, mscale = self._angles(hidden_states, packed_seq_params, inference_context)
        query, key, value = self._expand_and_rotate(q_compressed, kv_compressed, k_pos, angles, mscale,
                                                    packed_seq_params)
        return query, key, value, q_compressed, kv_compressed

    def _core_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None,
                        packed_seq_params: Any, **dsa_inputs: torch.Tensor) -> torch.Tensor:
        extra = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
        if dsa_inputs:  # DeepSeek sparse attention: its indexer also reads x and qr; None means the layer's type
            extra.update(dsa_inputs)
            attn_mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return self._offloaded_core_attention(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                              **extra)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        rotary_pos_cos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        position_ids: torch.Tensor | None = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
        attn_mask_type: AttnMaskType | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend over ``hidden_states`` ``[s, b, h]``; returns ``(output [s, b, h], bias)``."""
        _refuse_inputs(rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, attention_bias,
                       key_value_states)
        inference_context = inference_context if inference_context is not None else inference_params
        dsa = getattr(self.core_attention, "requires_dsa_inputs", False)
        if dsa and inference_context is not None:
            raise NotImplementedError("DeepSeek sparse attention (experimental_attention_variant='dsa') does not "
                                      "support inference with a KV cache (inference_context)")
        if inference_context is not None:
            q_compressed, kv_compressed, k_pos = self.compress(hidden_states)
            context = self._attend_with_cache(inference_context, hidden_states, q_compressed, kv_compressed, k_pos)
            return self.linear_proj(self._trim(context))
        angles, mscale = self._angles(hidden_states, packed_seq_params, None)

        def expand(q_c: torch.Tensor, kv_c: torch.Tensor, k_p: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self._pad(*self._expand_and_rotate(q_c, kv_c, k_p, angles, mscale, packed_seq_params))

        checkpoint = CheckpointWithoutOutput() if self.recompute_up_proj and self.training else None
        qkv_manager = off_interface(self.offload_qkv_linear, hidden_states, "qkv_linear")  # down and up projections
        with qkv_manager as hidden_states:
            q_compressed, kv_compressed, k_pos = self.compress(hidden_states)
            if checkpoint is not None:
                query, key, value = checkpoint.checkpoint(expand, q_compressed, kv_compressed, k_pos)
            else:
                query, key, value = expand(q_compressed, kv_compressed, k_pos)
        query, key, value = qkv_manager.group_offload((query, key, value), forced_released_tensors=[])
        dsa_inputs = {"x": hidden_states, "qr": q_compressed} if dsa else {}
        context = self._core_attention(query, key, value, attention_mask, attn_mask_type, packed_seq_params,
                                       **dsa_inputs)
        if checkpoint is not None:  # the up projections' outputs are rebuilt when the backward reaches them
            checkpoint.discard_output_and_register_recompute(context)
        return self._offloaded_projection(self._trim(context))

    def _attend_with_cache(self, inference_context: Any, hidden_states: torch.Tensor, q_compressed: torch.Tensor,
                           kv_compressed: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Attention through a KV-cache context, which rotates at each token's position, caches and attends.

        The contexts rotate the first channels of query and key by a plain half-split RoPE table; MLA hands them
        query ``[rope, nope]`` and key ``[shared rope, nope]`` (the same dot products as ``[nope, rope]``), with
        the position channels already de-interleaved and multiplied by YaRN's cosine/sine scale (RoPE is
        linear, so this equals scaling the cosines and sines).
        """
        angles, mscale = self._angles(hidden_states, None, inference_context)
        q_nope, q_pos, k_nope, value = self.up_project(q_compressed, kv_compressed)
        rot_dim = angles.shape[-1]
        q_pos = deinterleave_rope_channels(q_pos, rot_dim) * mscale
        k_pos = deinterleave_rope_channels(k_pos.unsqueeze(-2), rot_dim) * mscale
        query = torch.cat((q_pos, q_nope), dim=-1)
        key = torch.cat((k_pos.expand(*k_nope.shape[:-1], k_pos.shape[-1]), k_nope), dim=-1)
        query, key, value = self._pad(query, key, value.contiguous())
        return inference_context.attention(self, query, key, value, angles)


def _refuse_inputs(rotary_pos_emb: Any, rotary_pos_cos: Any, rotary_pos_sin: Any, rotary_pos_cos_sin: Any,
                   attention_bias: Any, key_value_states: Any) -> None:
    """MLA computes its own rotary angles and attends over its own tokens only."""
    if rotary_pos_emb is not None:
        raise ValueError(
            "multi-latent attention builds its own rotary embedding (MLATransformerConfig.rope_type): rotary_pos_emb "
            "must be None (build GPTModel with position_embedding_type='rope' or 'none', which then builds none)"
        )
    if rotary_pos_cos is not None or rotary_pos_sin is not None or rotary_pos_cos_sin is not None:
        raise ValueError("multi-latent attention does not take precomputed rotary_pos_cos / rotary_pos_sin "
                         "(flash decoding)")
    if attention_bias is not None:
        raise ValueError("attention_bias is not supported with multi-latent attention")
    if key_value_states is not None:
        raise ValueError("key_value_states (cross-attention) is not supported by MLASelfAttention")


class MLASelfAttention(MultiLatentAttention):
    """MLA self-attention over ``[s, b, h]``: the q / kv low-rank projections and their norms."""

    def __init__(
        self,
        config: MLATransformerConfig,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(config, submodules, layer_number, attn_mask_type, "self", cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection, pp_layer_offset=pp_layer_offset, name=name)
        _build_latent_projections(self, config, submodules)

    def compress(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q latent normed (or hidden_states), kv latent normed, key position channels)``
        (:func:`_compress_inputs`)."""
        return _compress_inputs(self, hidden_states)

    def clip_qk(self) -> None:
        """QK-clip (MuonClip): rescale the query/key up projections of the heads whose largest logit is too big.

        Per head ``h`` of this rank, ``eta = min(qk_clip_threshold / max logit of h, 1)``: the head's query rows
        without position are multiplied by ``eta ** qk_clip_alpha``, its query position rows by ``eta`` and its
        key rows (``linear_kv_up_proj``) by ``eta ** (1 - qk_clip_alpha)``; value rows and the shared key position
        channels stay. Every logit of ``h`` shrinks by ``eta``. Resets the recorded maxima.
        """
        heads, config = self.num_attention_heads_per_partition, self.config
        logits = _recorded_max_logits(self, heads)
        if torch.any(logits > config.qk_clip_threshold):
            eta = torch.clamp(config.qk_clip_threshold / logits, max=1.0)
            d, r, v, alpha = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim, config.qk_clip_alpha
            q_rows = torch.cat((torch.pow(eta, alpha)[:, None].expand(heads, d), eta[:, None].expand(heads, r)), dim=1)
            kv_rows = torch.cat((torch.pow(eta, 1 - alpha)[:, None].expand(heads, d),
                                 torch.ones(heads, v, dtype=eta.dtype, device=eta.device)), dim=1)
            q_proj = self.linear_q_proj if config.q_lora_rank is None else self.linear_q_up_proj
            _scale_weight_rows_(q_proj.weight, q_rows.reshape(-1))
            _scale_weight_rows_(self.linear_kv_up_proj.weight, kv_rows.reshape(-1))
        self.core_attention.current_max_attn_logits = None

    def up_project(self, q_compressed: torch.Tensor, kv_compressed: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_nope [.., n, d], q_pos [.., n, r], k_nope [.., n, d], value [.., n, v_head_dim])`` of this rank."""
        config = self.config
        q, kv = self._project_heads(q_compressed, kv_compressed)
        q_nope, q_pos = torch.split(q, [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1)
        k_nope, value = torch.split(kv, [config.qk_head_dim, config.v_head_dim], dim=-1)
        return q_nope, q_pos, k_nope, value

    def _project_heads(self, q_compressed: torch.Tensor, kv_compressed: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [.., n, d + r], kv [.., n, d + v_head_dim])`` of this rank: the up projections' outputs per head."""
        config, heads = self.config, self.num_attention_heads_per_partition
        q_proj = self.linear_q_proj if config.q_lora_rank is None else self.linear_q_up_proj
        q, _ = q_proj(q_compressed)
        kv, _ = self.linear_kv_up_proj(kv_compressed)
        return (q.view(*q.shape[:-1], heads, self.q_head_dim),
                kv.view(*kv.shape[:-1], heads, config.qk_head_dim + config.v_head_dim))


def _check_norm_specs(config: MLATransformerConfig, submodules: MLASelfAttentionSubmodules) -> None:
    """The spec's q/kv latent norms are set exactly when ``qk_layernorm`` is (Megatron-Core's rule; the q norm is
    unused without ``q_lora_rank``); a fused q/kv down projection is refused."""
    if getattr(submodules, "linear_qkv_down_proj", None) is not None:
        raise ValueError("linear_qkv_down_proj (the fused q/kv down projection of Megatron-Core's "
                         "FusedMLASelfAttention) is not supported; leave it None")
    if config.qk_layernorm:
        needed = ("kv_layernorm",) if config.q_lora_rank is None else ("q_layernorm", "kv_layernorm")
        missing = [name for name in needed if _is_identity(getattr(submodules, name))]
        if missing:
            raise ValueError(f"qk_layernorm=True but the MLA spec leaves {missing} unset / IdentityOp; give them a "
                             "norm (get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True) does)")
        return
    for name in ("q_layernorm", "kv_layernorm"):
        spec = getattr(submodules, name)
        if not _is_identity(spec):
            raise ValueError(f"the MLA spec sets {name}={spec!r} but qk_layernorm is False; set qk_layernorm=True "
                             "or leave the norm unset / IdentityOp")


def _build_latent_projections(module: Attention, config: MLATransformerConfig, submodules: Any) -> None:
    """MLA's q / kv down and up projections and latent norms, built onto ``module`` under Megatron-Core's names
    (shared with the absorbed variant, whose parameters and checkpoint keys are the same)."""
    _check_norm_specs(config, submodules)
    heads = config.num_attention_heads
    linear = dict(config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
                  is_expert=False, tp_group=module.tp_group)
    if config.q_lora_rank is None:
        module.linear_q_proj = build_module(submodules.linear_q_proj, config.hidden_size, heads * module.q_head_dim,
                                            gather_output=False, tp_comm_buffer_name="q_proj", **linear)
    else:
        module.linear_q_down_proj = build_module(submodules.linear_q_down_proj, config.hidden_size,
                                                 config.q_lora_rank, gather_output=False,
                                                 tp_comm_buffer_name="q_down_proj", **linear)
        module.linear_q_up_proj = build_module(submodules.linear_q_up_proj, config.q_lora_rank,
                                               heads * module.q_head_dim, gather_output=False,
                                               tp_comm_buffer_name="q_up_proj", **linear)
    module.linear_kv_down_proj = build_module(submodules.linear_kv_down_proj, config.hidden_size,
                                              config.kv_lora_rank + config.qk_pos_emb_head_dim,
                                              gather_output=False, tp_comm_buffer_name="kv_down_proj", **linear)
    module.linear_kv_up_proj = build_module(submodules.linear_kv_up_proj, config.kv_lora_rank,
                                            heads * (config.qk_head_dim + config.v_head_dim), gather_output=False,
                                            tp_comm_buffer_name="kv_up_proj", **linear)
    if config.q_lora_rank is not None:
        module.q_layernorm = build_module(submodules.q_layernorm or IdentityOp, hidden_size=config.q_lora_rank,
                                          config=config, eps=config.layernorm_epsilon)
    module.kv_layernorm = build_module(submodules.kv_layernorm or IdentityOp, hidden_size=config.kv_lora_rank,
                                       config=config, eps=config.layernorm_epsilon)


def _compress_inputs(module: Attention, hidden_states: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q latent normed (or hidden_states), kv latent normed, key position channels)`` of ``module``'s input.

    Column-parallel down projections give this rank's slice of the latent: it is all-gathered, and under
    sequence parallelism the latents go back to this rank's tokens (the key position channels stay whole,
    the up projections gather the tokens again).
    """
    config, group = module.config, module.tp_group
    sequence_parallel = config.sequence_parallel and get_pg_size(group) > 1
    if config.q_lora_rank is not None:
        q_compressed, _ = module.linear_q_down_proj(hidden_states)
        if q_compressed.shape[-1] != config.q_lora_rank:
            q_compressed = gather_from_tensor_model_parallel_region(q_compressed, group=group)
            if sequence_parallel:
                q_compressed = scatter_to_sequence_parallel_region(q_compressed, group=group)
        q_compressed = module.q_layernorm(q_compressed)
    else:
        q_compressed = hidden_states
    kv_combined, _ = module.linear_kv_down_proj(hidden_states)
    widths = [config.kv_lora_rank, config.qk_pos_emb_head_dim]
    if kv_combined.shape[-1] != sum(widths):
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=group)
        kv_compressed, k_pos = torch.split(kv_combined, widths, dim=-1)
        if sequence_parallel:
            kv_compressed = scatter_to_sequence_parallel_region(kv_compressed, group=group)
        # Every rank's heads use the shared key channels: their gradients are summed over TP.
        k_pos = copy_to_tensor_model_parallel_region(k_pos, group=group)
    else:
        kv_compressed, k_pos = torch.split(kv_combined, widths, dim=-1)
        if sequence_parallel:
            k_pos = gather_from_sequence_parallel_region(k_pos, group=group)
        elif get_pg_size(group) > 1:
            k_pos = copy_to_tensor_model_parallel_region(k_pos, group=group)
    return q_compressed, module.kv_layernorm(kv_compressed), k_pos


class FusedMLASelfAttention(MLASelfAttention):
    """Megatron-Core's MLA with the fused q/kv down projection (``linear_qkv_down_proj``): not provided here.

    The name exists so that code importing it runs; building one raises ``NotImplementedError`` (use
    :class:`MLASelfAttention`, whose separate down projections compute the same function; docs/compat.md).
    """

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("FusedMLASelfAttention (the fused q/kv down projection) is not provided by this "
                                  "library; use MLASelfAttention")
