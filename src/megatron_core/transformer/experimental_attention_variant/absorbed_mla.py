"""Multi-latent attention with matrix absorption (Megatron-Core's ``AbsorbedMLASelfAttention``).

Standard MLA (:mod:`megatron_core.transformer.multi_latent_attention`) up-projects the normed kv latent
``c_kv`` (``kv_lora_rank = c`` channels) into per-head keys and values. The absorbed form never does: per head
``n`` the key up projection ``W_uk[n]`` (``[d, c]``) is folded into the query and the value up projection
``W_uv[n]`` (``[v_head_dim, c]``) is applied to the attention output,

    q_nope . (W_uk c_kv) = (q_nope W_uk) . c_kv,      sum_j p_j W_uv c_kv_j = W_uv sum_j p_j c_kv_j,

so core attention runs in multi-query form: query ``[s, b, n, c + r]`` (absorbed query, then the rotated
position channels), one shared key head ``[s, b, 1, c + r]`` (``c_kv``, then the shared rotated key channels)
and ``value=None`` (the value is the key's first ``c`` channels), plus ``x`` / ``qr`` (for DeepSeek sparse
attention's indexer) and ``up_v_weight`` ``[n, v_head_dim, c]``. A core attention that sets
``consumes_absorbed_v_up_projection`` (``DSAttention``) applies ``up_v_weight`` itself and returns
``[s, b, n * v_head_dim]``; otherwise it returns the latent ``[s, b, n * c]`` and the layer applies it.

The parameters are standard MLA's, under the same names (``linear_kv_up_proj.weight`` stays the combined
``[n * (d + v_head_dim), c]`` matrix, split per head at run time), so checkpoints move between the two classes
unchanged; checkpoints with split ``linear_k_up_proj`` / ``linear_v_up_proj`` weights load too.

Tensor parallelism splits the heads as in standard MLA. Every rank attends with the whole latent, so under
sequence parallelism it is all-gathered after its norm (and its gradient reduce-scattered back); without
sequence parallelism its gradient is summed over the TP ranks (Megatron-Core requires sequence parallelism with
TP > 1). Under context parallelism every tensor here holds this rank's tokens (the load-balanced split, per
document for packed sequences) rotated at their own positions; the core attention (DSA's all-gather form) gathers
the keys over CP. Dynamic context parallelism (``packed_seq_params.local_cp_size``) is refused, as in
Megatron-Core. KV-cache inference, ``cache_mla_latents``, linear biases, QK-clip and the Transformer Engine delayed
weight-gradient hooks (``backward_dw``) are not provided; as in Megatron-Core, fine-grained activation offloading
does not apply to this layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core._ground import divide, get_pg_rank, get_pg_size
from megatron_core.fusions.fused_mla_yarn_rope_apply import fused_apply_mla_rope_for_q
from megatron_core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron_core.tensor_parallel.random import CheckpointWithoutOutput
from megatron_core.transformer.attention import Attention, _cu_seqlens, build_output_projection
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.mla_rope import (
    build_mla_rotary_embedding,
    mla_softmax_scale,
    rotary_angles,
    rotate_mla,
)
from megatron_core.transformer.multi_latent_attention import _build_latent_projections, _compress_inputs
from megatron_core.transformer.rope_utils import rotary_cos_sin
from megatron_core.transformer.selective_recompute import recompute_module_enabled
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import MLATransformerConfig

__all__ = ["AbsorbedMLASelfAttention", "AbsorbedMLASelfAttentionSubmodules"]


def _restore_packed_thd_batch_dim(core_attn_out: torch.Tensor, hidden_states: torch.Tensor,
                                  packed_seq_params: Any) -> torch.Tensor:
    """``[t, n * width]`` back to ``[t, 1, n * width]`` for packed sequences whose core attention dropped the
    batch dimension; anything else as it is."""
    if (packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
            and core_attn_out.dim() == hidden_states.dim() - 1):
        return core_attn_out.unsqueeze(1)
    return core_attn_out


def _apply_absorbed_v_up_projection(core_attn_out: torch.Tensor, v_up_weight: torch.Tensor,
                                    num_attention_heads_per_partition: int, kv_lora_rank: int, v_head_dim: int,
                                    core_consumed_v_up_projection: bool) -> torch.Tensor:
    """The heads' values ``[.., n * v_head_dim]`` from core attention's output: its latent ``[.., n * c]`` times
    ``v_up_weight`` ``[n, v_head_dim, c]`` per head, or the output itself when the core attention applied it."""
    heads = num_attention_heads_per_partition
    expected = heads * (v_head_dim if core_consumed_v_up_projection else kv_lora_rank)
    if core_attn_out.shape[-1] != expected:
        what = "projected (n * v_head_dim)" if core_consumed_v_up_projection else "latent (n * kv_lora_rank)"
        raise RuntimeError(f"AbsorbedMLASelfAttention: core attention returned width {core_attn_out.shape[-1]}, "
                           f"expected the {what} width {expected}")
    if core_consumed_v_up_projection:
        return core_attn_out
    latent = core_attn_out.view(*core_attn_out.shape[:-1], heads, kv_lora_rank)
    values = torch.einsum("...nc,ndc->...nd", latent, v_up_weight.to(latent.dtype))
    return values.reshape(*core_attn_out.shape[:-1], heads * v_head_dim)


@dataclass
class AbsorbedMLASelfAttentionSubmodules:
    """The parts of absorbed MLA self-attention (Megatron-Core's field names; unset norms are identities)."""

    linear_q_proj: ModuleSpec | type | None = None
    linear_q_down_proj: ModuleSpec | type | None = None
    linear_q_up_proj: ModuleSpec | type | None = None
    linear_kv_down_proj: ModuleSpec | type | None = None
    linear_kv_up_proj: ModuleSpec | type | None = None
    core_attention: ModuleSpec | type | None = None
    linear_proj: ModuleSpec | type | None = None
    q_layernorm: ModuleSpec | type | None = None
    kv_layernorm: ModuleSpec | type | None = None


def _check_config(config: Any) -> None:
    """What the absorbed layer cannot run, as ``ValueError``s naming the fields."""
    if not isinstance(config, MLATransformerConfig):
        raise ValueError(f"AbsorbedMLASelfAttention needs an MLATransformerConfig, got {type(config).__name__}")
    if config.add_bias_linear:
        raise ValueError("AbsorbedMLASelfAttention requires add_bias_linear=False (the absorbed up projections "
                         "have no bias to fold)")
    if config.cache_mla_latents:
        raise ValueError("cache_mla_latents=True is not supported by AbsorbedMLASelfAttention")
    if recompute_module_enabled(config, "mla_up_proj") and (config.fp8 or config.fp4):
        raise ValueError(f"recompute_modules containing 'mla_up_proj' with fp8 ({config.fp8!r}) / fp4 "
                         f"({config.fp4!r}) is not supported by AbsorbedMLASelfAttention")


class AbsorbedMLASelfAttention(Attention):
    """MLA self-attention over ``[s, b, h]`` with the key/value up projections absorbed (module docstring)."""

    def __init__(
        self,
        config: MLATransformerConfig,
        submodules: AbsorbedMLASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ) -> None:
        _check_config(config)
        super().__init__(config, layer_number, attn_mask_type, "self", pg_collection)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, self.world_size,
                                                        "num_attention_heads / TP")
        self.query_projection_size = config.v_head_dim * config.num_attention_heads
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.key_hidden_size = None  # no KV-cache inference
        self.val_hidden_size = None
        self.recompute_up_proj = recompute_module_enabled(config, "mla_up_proj")
        self.softmax_scale = mla_softmax_scale(config)
        self.cache_mla_latents = config.cache_mla_latents
        self.rotary_pos_emb = build_mla_rotary_embedding(config, self.pg_collection.cp)
        latent, rope = config.kv_lora_rank, config.qk_pos_emb_head_dim
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
            attention_type="self", softmax_scale=self.softmax_scale, k_channels=latent + rope, v_channels=latent,
            cp_comm_type=cp_comm_type, pg_collection=self.pg_collection)
        self.linear_proj = build_output_projection(submodules.linear_proj, self.query_projection_size, config,
                                                   self.tp_group)
        _build_latent_projections(self, config, submodules)
        # The absorbed attention multiplies by this weight directly, never through the layer's own GEMM, so its
        # gradient arrives in ``.grad``; without the fused-GEMM mark of gradient_accumulation_fusion DDP's hook adds
        # it to ``main_grad`` (with the mark the hook dropped it, as if the GEMM had already written it).
        self.linear_kv_up_proj.weight.__dict__.pop("wgrad_fused_into_main_grad", None)

    # ---- the up-projection weights per head -----------------------------------------------------------------
    def _get_kv_up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_up [n, qk_head_dim, c], v_up [n, v_head_dim, c])``: views of this rank's ``linear_kv_up_proj``."""
        config, heads = self.config, self.num_attention_heads_per_partition
        weight = self.linear_kv_up_proj.weight
        per_head = config.qk_head_dim + config.v_head_dim
        if tuple(weight.shape) != (heads * per_head, config.kv_lora_rank):
            raise RuntimeError(f"AbsorbedMLASelfAttention: linear_kv_up_proj.weight has shape {tuple(weight.shape)}, "
                               f"expected ({heads * per_head}, {config.kv_lora_rank})")
        kv_up = weight.view(heads, per_head, config.kv_lora_rank)
        return kv_up[:, :config.qk_head_dim], kv_up[:, config.qk_head_dim:]

    def _get_v_up_weight(self) -> torch.Tensor:
        """``v_up`` ``[n, v_head_dim, c]`` (see :meth:`_get_kv_up_weights`)."""
        return self._get_kv_up_weights()[1]

    def _combine_split_kv_up_weights(self, k_up_weight: torch.Tensor, v_up_weight: torch.Tensor) -> torch.Tensor:
        """Split key ``[n * qk_head_dim, c]`` and value ``[n * v_head_dim, c]`` up projections as the combined
        per-head ``linear_kv_up_proj`` weight ``[n * (qk_head_dim + v_head_dim), c]``."""
        config, heads = self.config, self.num_attention_heads_per_partition
        c = config.kv_lora_rank
        combined = torch.cat((k_up_weight.reshape(heads, config.qk_head_dim, c),
                              v_up_weight.reshape(heads, config.v_head_dim, c)), dim=1)
        return combined.reshape(heads * (config.qk_head_dim + config.v_head_dim), c)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """Also accept checkpoints that store the key and value up projections apart (``linear_k_up_proj`` /
        ``linear_v_up_proj``), combining them into ``linear_kv_up_proj``."""
        combined, k_key, v_key = (f"{prefix}linear_kv_up_proj.weight", f"{prefix}linear_k_up_proj.weight",
                                  f"{prefix}linear_v_up_proj.weight")
        if combined not in state_dict and k_key in state_dict and v_key in state_dict:
            state_dict[combined] = self._combine_split_kv_up_weights(state_dict.pop(k_key), state_dict.pop(v_key))
        extra, k_extra, v_extra = (f"{prefix}linear_kv_up_proj._extra_state", f"{prefix}linear_k_up_proj._extra_state",
                                   f"{prefix}linear_v_up_proj._extra_state")
        if k_extra in state_dict or v_extra in state_dict:
            k_state, v_state = state_dict.pop(k_extra, None), state_dict.pop(v_extra, None)
            if extra not in state_dict:
                state_dict[extra] = k_state if k_state is not None else v_state
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- query, key and the core attention -------------------------------------------------------------------
    def _latents(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Standard MLA's ``(q_compressed, kv_compressed, k_pos)``, the kv latent over the whole sequence: every
        rank's heads attend with it, so its gradient is summed over TP (a reduce-scatter under SP)."""
        q_compressed, kv_compressed, k_pos = _compress_inputs(self, hidden_states)
        if get_pg_size(self.tp_group) > 1:
            if self.config.sequence_parallel:
                kv_compressed = gather_from_sequence_parallel_region(kv_compressed, group=self.tp_group)
            else:
                kv_compressed = copy_to_tensor_model_parallel_region(kv_compressed, group=self.tp_group)
        return q_compressed, kv_compressed, k_pos

    def _angles(self, hidden_states: torch.Tensor, packed_seq_params: Any) -> tuple[torch.Tensor, float]:
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, self, hidden_states, self.config, packed_seq_params)
        packed = packed_seq_params is not None and packed_seq_params.qkv_format in (None, "thd")
        return rotary_angles(self.rotary_pos_emb, seq_len, packed, hidden_states.device)

    def _absorb_and_rotate(self, q_compressed: torch.Tensor, kv_compressed: torch.Tensor, k_pos: torch.Tensor,
                           angles: torch.Tensor, mscale: float, packed_seq_params: Any
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query [.., n, c + r], key [.., 1, c + r])``: the absorbed query and the latent key, rotated."""
        config, heads = self.config, self.num_attention_heads_per_partition
        c, r = config.kv_lora_rank, config.qk_pos_emb_head_dim
        q_proj = self.linear_q_proj if config.q_lora_rank is None else self.linear_q_up_proj
        q, _ = q_proj(q_compressed)
        q_nope, q_pos = torch.split(q.view(*q.shape[:-1], heads, self.q_head_dim), [config.qk_head_dim, r], dim=-1)
        k_up, _ = self._get_kv_up_weights()
        q_absorbed = torch.einsum("...nd,ndc->...nc", q_nope, k_up)
        kv_latent, k_pos = kv_compressed.unsqueeze(-2), k_pos.unsqueeze(-2)
        cu_q, cu_kv = _cu_seqlens(packed_seq_params)
        cp_group = self.pg_collection.cp
        if config.apply_rope_fusion:  # one kernel rotates the last r channels of each head, in place
            query, key = torch.cat((q_absorbed, q_pos), dim=-1), torch.cat((kv_latent, k_pos), dim=-1)
            cos, sin = rotary_cos_sin(angles, angles.shape[0], query.dtype, mscale)
            cp = dict(cp_rank=get_pg_rank(cp_group), cp_size=get_pg_size(cp_group))
            packed = cu_q is not None  # packed rows [t, 1, ...] are [t, ...] to the fused function
            query = fused_apply_mla_rope_for_q(query.squeeze(1) if packed else query, cos, sin, c, r, cu_q, **cp)
            key = fused_apply_mla_rope_for_q(key.squeeze(1) if packed else key, cos, sin, c, r, cu_kv, **cp)
            return (query.unsqueeze(1), key.unsqueeze(1)) if packed else (query, key)
        q_pos = rotate_mla(q_pos, angles, mscale, config, cu_q, cp_group)
        k_pos = rotate_mla(k_pos, angles, mscale, config, cu_kv, cp_group)
        return torch.cat((q_absorbed, q_pos), dim=-1), torch.cat((kv_latent, k_pos), dim=-1)

    def get_query_key_value_tensors(
        self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
        packed_seq_params: Any = None, inference_context: Any = None, *, inference_params: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_absorbed [.., n, c + r], kv_compressed [.., 1, c + r], q_compressed)`` as Megatron-Core returns
        them: the absorbed, rotated query, the shared latent key (whole sequence) and the normed query latent."""
        _refuse(key_value_states, inference_context if inference_context is not None else inference_params)
        _check_packed(packed_seq_params)
        q_compressed, kv_compressed, k_pos = self._latents(hidden_states)
        angles, mscale = self._angles(hidden_states, packed_seq_params)
        query, key = self._absorb_and_rotate(q_compressed, kv_compressed, k_pos, angles, mscale, packed_seq_params)
        return query, key, q_compressed

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: torch.Tensor | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        rotary_pos_cos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        position_ids: torch.Tensor | None = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend over ``hidden_states`` ``[s, b, h]``; returns ``(output [s, b, h], bias)``."""
        if rotary_pos_emb is not None or rotary_pos_cos is not None or rotary_pos_sin is not None \
                or rotary_pos_cos_sin is not None:
            raise ValueError("AbsorbedMLASelfAttention builds its own rotary embedding: rotary_pos_emb / "
                             "rotary_pos_cos / rotary_pos_sin / rotary_pos_cos_sin must be None")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by AbsorbedMLASelfAttention")
        _refuse(key_value_states, inference_context if inference_context is not None else inference_params)
        _check_packed(packed_seq_params)
        angles, mscale = self._angles(hidden_states, packed_seq_params)

        def up_project(q_c: torch.Tensor, kv_c: torch.Tensor, k_p: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
            return self._absorb_and_rotate(q_c, kv_c, k_p, angles, mscale, packed_seq_params)

        q_compressed, kv_compressed, k_pos = self._latents(hidden_states)
        checkpoint = CheckpointWithoutOutput() if self.recompute_up_proj and self.training else None
        if checkpoint is not None:
            query, key = checkpoint.checkpoint(up_project, q_compressed, kv_compressed, k_pos)
        else:
            query, key = up_project(q_compressed, kv_compressed, k_pos)
        v_up = self._get_v_up_weight()
        extra = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
        context = self._run_core_attention(query, key, None, attention_mask, x=hidden_states, qr=q_compressed,
                                           up_v_weight=v_up, position_ids=position_ids,
                                           attn_mask_type=self.attn_mask_type, **extra)
        context = _restore_packed_thd_batch_dim(context, hidden_states, packed_seq_params)
        context = _apply_absorbed_v_up_projection(
            context, v_up, self.num_attention_heads_per_partition, self.config.kv_lora_rank, self.config.v_head_dim,
            getattr(self.core_attention, "consumes_absorbed_v_up_projection", False))
        if checkpoint is not None:  # the up projections' outputs are rebuilt when the backward reaches them
            checkpoint.discard_output_and_register_recompute(context)
        return self.linear_proj(context)

    def clip_qk(self) -> None:
        """QK-clip is not provided for the absorbed layer (as in Megatron-Core): ``NotImplementedError``."""
        raise NotImplementedError("clip_qk is not implemented for AbsorbedMLASelfAttention; use MLASelfAttention")


def _refuse(key_value_states: Any, inference_context: Any) -> None:
    if key_value_states is not None:
        raise ValueError("key_value_states (cross-attention) is not supported by AbsorbedMLASelfAttention")
    if inference_context is not None:
        raise NotImplementedError("AbsorbedMLASelfAttention does not support inference with a KV cache "
                                  "(inference_context / inference_params)")


def _check_packed(packed_seq_params: Any) -> None:
    if packed_seq_params is not None and getattr(packed_seq_params, "local_cp_size", None) is not None:
        raise ValueError(f"packed_seq_params.local_cp_size ({packed_seq_params.local_cp_size}) must be None: "
                         "dynamic context parallelism is not supported with multi-latent attention")
