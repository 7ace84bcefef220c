"""Qwen3-Next (``Qwen3NextForCausalLM``) as a GPTModel: gated delta net and gated softmax attention layers.

Layers follow ``layer_types``: ``linear_attention`` is a gated delta net (``experimental_attention_variant=
"gated_delta_net"``, ``linear_attention_freq`` the 0/1 pattern), ``full_attention`` a softmax attention with an
output gate (``attention_output_gate``), per-head q/k norms and partial RoPE (``rotary_percent``). Every norm but
the delta net's output norm is zero-centred in both libraries (``layernorm_zero_centered_gamma``); that one stores
``w`` in Hugging Face and ``w - 1`` here, so its conversion adds or subtracts 1 (exact for weights in [0.5, 2],
where norms live). The MLPs are MoE with a sigmoid-gated shared expert, dense where ``mlp_only_layers`` /
``decoder_sparse_step`` say so. Hugging Face's delta net projections are grouped per key head
(``in_proj_qkvz``: ``[q_g, k_g, v_g, z_g]``, ``in_proj_ba``: ``[b_g, a_g]``); Megatron's ``in_proj`` stacks the
sections ``q | k | v | z | beta | alpha`` of each TP rank's heads.

The multi-token-prediction layer of Qwen's checkpoints (``mtp.*``; ``config.json`` ``mtp_num_hidden_layers``;
transformers drops it on load) is GPTModel's MTP depth 0: ``mtp.fc`` is ``eh_proj`` (input ``[embedding;
hidden]``), ``mtp.pre_fc_norm_embedding`` / ``_hidden`` are ``enorm`` / ``hnorm``, ``mtp.norm`` is
``final_layernorm`` and ``mtp.layers.0.*`` is the transformer layer, which Megatron builds from the last decoder
layer's spec (softmax attention in Qwen's models). One depth only: Qwen's layout has one ``fc`` and norm set for
all its layers where Megatron has one per depth; other layouts are refused by name with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from megatron_core.models.hf.rules import Copy, FusedQKV, Index, Reader, SectionedRows, WeightRule, fmt
from megatron_core.models.hf.safetensors_io import HFConversionError

__all__ = ["GatedDeltaNetInProj", "OffsetCopy", "qwen3_next_layer_parts", "qwen3_next_mtp"]

_MTP_REMEDY = "; remove them from the checkpoint to convert the main model (transformers ignores them on load too)"


@dataclass(frozen=True)
class OffsetCopy(Copy):
    """A :class:`Copy` whose Megatron value is the HF one plus ``offset`` (a norm that is zero-centred on one side
    only); export subtracts it again."""

    offset: float = 0.0

    def from_hf(self, read: Reader, layer: Index, tp_rank: int, tp_size: int,
                shapes: Callable[[str], tuple[int, ...]], padded_rows: int | None = None) -> torch.Tensor:
        return super().from_hf(read, layer, tp_rank, tp_size, shapes, padded_rows) + self.offset

    def to_hf(self, shards: list[torch.Tensor], layer: Index, hf_rows: int | None = None
              ) -> dict[str, torch.Tensor]:
        return {name: t - self.offset for name, t in super().to_hf(shards, layer, hf_rows).items()}


@dataclass(frozen=True)
class GatedDeltaNetInProj(WeightRule):
    """``in_proj.weight`` of a gated delta net from HF's ``in_proj_qkvz`` and ``in_proj_ba``.

    TP rank ``r`` holds key heads ``[r * K / tp, (r + 1) * K / tp)`` and the value heads they serve, which are HF's
    consecutive groups; within the rank the rows are ``q | k | v | z | beta | alpha``.
    """

    qkvz: str = ""
    ba: str = ""
    key_heads: int = 1
    value_heads: int = 1
    key_dim: int = 1
    value_dim: int = 1

    def hf_names(self, layer: Index) -> list[str]:
        return [fmt(self.qkvz, layer), fmt(self.ba, layer)]

    @property
    def sections(self) -> tuple[int, ...]:
        """Rows of the full (TP=1) ``in_proj`` per section ``q | k | v | z | beta | alpha``: the row sections the
        distributed checkpoint stores it as (``.query/.key/.value/.z/.beta/.alpha``)."""
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return (qk, qk, v, v, self.value_heads, self.value_heads)

    def _group_rows(self) -> tuple[list[int], list[int]]:
        """Rows of one key head's group in ``in_proj_qkvz`` (q, k, v, z) and ``in_proj_ba`` (b, a)."""
        per = self.value_heads // self.key_heads
        return [self.key_dim, self.key_dim, per * self.value_dim, per * self.value_dim], [per, per]

    def from_hf(self, read: Reader, layer: Index, tp_rank: int, tp_size: int,
                shapes: Callable[[str], tuple[int, ...]]) -> torch.Tensor:
        groups = self.key_heads // tp_size
        sections = []
        for name, rows in zip(self.hf_names(layer), self._group_rows()):
            size = sum(rows)
            block = read(name, [slice(tp_rank * groups * size, (tp_rank + 1) * groups * size)])
            split = block.reshape(groups, size, -1).split(rows, dim=1)
            sections += [part.reshape(-1, block.shape[-1]) for part in split]
        return torch.cat(sections, dim=0).contiguous()

    def to_hf(self, shards: list[torch.Tensor], layer: Index) -> dict[str, torch.Tensor]:
        qkvz_rows, ba_rows = self._group_rows()
        groups = self.key_heads // len(shards)
        qkvz, ba = [], []
        for shard in shards:
            parts = shard.split([groups * r for r in qkvz_rows + ba_rows], dim=0)
            grouped = [p.reshape(groups, -1, shard.shape[-1]) for p in parts]
            qkvz.append(torch.cat(grouped[:4], dim=1).reshape(-1, shard.shape[-1]))
            ba.append(torch.cat(grouped[4:], dim=1).reshape(-1, shard.shape[-1]))
        return {fmt(self.qkvz, layer): torch.cat(qkvz).contiguous(), fmt(self.ba, layer): torch.cat(ba).contiguous()}

    def hf_shapes(self, mcore_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """HF's two tensors, from the full (TP=1) ``in_proj.weight`` shape."""
        qkvz_rows, ba_rows = self._group_rows()
        hidden = mcore_shape[-1]
        return {self.qkvz: (self.key_heads * sum(qkvz_rows), hidden), self.ba: (self.key_heads * sum(ba_rows), hidden)}


def linear_attention_pattern(path: str, cfg: dict, layers: int) -> list[int]:
    """1 (gated delta net) or 0 (softmax attention) per layer from ``layer_types``, else from
    ``full_attention_interval`` (every N-th layer softmax attention, Qwen3-Next's default 4)."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        if interval < 1:
            raise HFConversionError(f"{path}: full_attention_interval={interval!r} is not supported (must be >= 1)")
        return [0 if (i + 1) % interval == 0 else 1 for i in range(layers)]
    kinds = {"linear_attention": 1, "full_attention": 0}
    if len(types) != layers or any(t not in kinds for t in types):
        raise HFConversionError(f"{path}: layer_types={types!r} is not supported (needs num_hidden_layers ({layers}) "
                                f"entries, each one of {sorted(kinds)})")
    return [kinds[t] for t in types]


def qwen3_next_layer_parts(cfg: dict, heads: int, groups: int, head_dim: int
                           ) -> tuple[dict[str, Any], list[WeightRule], list[WeightRule]]:
    """``(config fields, gated delta net layer rules, gated attention layer rules)`` (MLP rules not included)."""
    key_heads, value_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    key_dim, value_dim = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    config = dict(experimental_attention_variant="gated_delta_net", linear_conv_kernel_dim=int(
        cfg["linear_conv_kernel_dim"]), linear_key_head_dim=key_dim, linear_value_head_dim=value_dim,
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, attention_output_gate=True,
        layernorm_zero_centered_gamma=True)
    norm = Copy("decoder.layers.{i}.input_layernorm.weight", hf="model.layers.{i}.input_layernorm.weight")
    m, hf = "decoder.layers.{i}.self_attention.", "model.layers.{i}.linear_attn."
    qk = key_heads * key_dim
    gdn: list[WeightRule] = [
        norm,
        GatedDeltaNetInProj(m + "in_proj.weight", qkvz=hf + "in_proj_qkvz.weight", ba=hf + "in_proj_ba.weight",
                            key_heads=key_heads, value_heads=value_heads, key_dim=key_dim, value_dim=value_dim),
        SectionedRows(m + "conv1d.weight", hf=hf + "conv1d.weight", sections=(qk, qk, value_heads * value_dim)),
        Copy(m + "A_log", hf=hf + "A_log", tp_axis=0),
        Copy(m + "dt_bias", hf=hf + "dt_bias", tp_axis=0),
        OffsetCopy(m + "out_norm.weight", hf=hf + "norm.weight", offset=-1.0),
        Copy(m + "out_proj.weight", hf=hf + "out_proj.weight", tp_axis=1),
    ]
    a = "model.layers.{i}.self_attn."
    attention: list[WeightRule] = [
        norm,
        FusedQKV(m + "linear_qkv.weight", parts=(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                 num_heads=heads, num_groups=groups, head_dim=head_dim, output_gate=True),
        Copy(m + "linear_proj.weight", hf=a + "o_proj.weight", tp_axis=1),
        Copy(m + "q_layernorm.weight", hf=a + "q_norm.weight"),
        Copy(m + "k_layernorm.weight", hf=a + "k_norm.weight"),
    ]
    return config, gdn, attention


def _renamed(rule: WeightRule, mcore: tuple[str, str], hf: tuple[str, str]) -> WeightRule:
    """``rule`` with ``mcore[0]`` replaced by ``mcore[1]`` in its parameter name and ``hf[0]`` by ``hf[1]`` in every
    HF name it holds."""
    changes: dict[str, Any] = {"mcore": rule.mcore.replace(*mcore)}
    for f in fields(rule):
        value = getattr(rule, f.name)
        if f.name == "mcore":
            continue
        if isinstance(value, str):
            changes[f.name] = value.replace(*hf)
        elif isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
            changes[f.name] = tuple(v.replace(*hf) for v in value)
    return replace(rule, **changes)


def qwen3_next_mtp(cfg: dict, last_layer_rules: list[WeightRule], last_layer_linear: bool
                   ) -> tuple[int, list[WeightRule], dict[str, str]]:
    """``(MTP depths, rules of depth 0, refused HF prefixes)`` of a Qwen3-Next config (see the module docstring);
    ``last_layer_rules`` are the rules of the last decoder layer, whose spec the MTP layer takes."""
    depths = int(cfg.get("mtp_num_hidden_layers") or 0)
    why = None
    if depths == 0:
        why = "config.json has no mtp_num_hidden_layers (or 0)"
    elif depths > 1:
        why = (f"mtp_num_hidden_layers={depths}: Qwen's layout shares one mtp.fc / mtp.pre_fc_norm_* / mtp.norm among "
               "its MTP layers, while each Megatron MTP depth has its own eh_proj / enorm / hnorm / final_layernorm; "
               "only 1 is supported")
    elif cfg.get("mtp_use_dedicated_embeddings"):
        why = "mtp_use_dedicated_embeddings=True: Megatron's MTP layers share the model's embedding"
    elif last_layer_linear:
        why = ("the last decoder layer is a gated delta net, and Megatron builds the MTP layer from the last "
               "layer's spec, while Qwen's MTP layer is softmax attention")
    if why is not None:
        return 0, [], {"mtp.": f"Qwen3-Next's multi-token-prediction layers ('mtp.*') are not converted: {why}"
                                + _MTP_REMEDY}
    m = "mtp.layers.{i}."
    rules: list[WeightRule] = [
        Copy(m + "enorm.weight", hf="mtp.pre_fc_norm_embedding.weight"),
        Copy(m + "hnorm.weight", hf="mtp.pre_fc_norm_hidden.weight"),
        Copy(m + "eh_proj.weight", hf="mtp.fc.weight", tp_axis=0),
        Copy(m + "final_layernorm.weight", hf="mtp.norm.weight"),
    ]
    rules += [_renamed(r, ("decoder.layers.{i}.", m + "mtp_model_layer."), ("model.layers.{i}.", "mtp.layers.0."))
              for r in last_layer_rules]
    return 1, rules, {}
