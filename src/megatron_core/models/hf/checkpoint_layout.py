"""Where each GPTModel tensor of a Hugging Face model lives in a distributed checkpoint, without building the model.

:func:`model_layout` reads the sharded state dict of a tiny-width copy of the model (one layer, or one dense and
one layer of each kind where the model mixes them, plus its multi-token-prediction depths) and returns a
:class:`CheckpointLayout`: the sharded key of every conversion rule's parameter and the ``_extra_state`` objects of
every layer. Three layouts occur, as in Megatron-Core:

- homogeneous decoder layers are *stacked*: one key per parameter (``decoder.layers.self_attention...``), the
  global layer index a prepended axis;
- layers of different kinds (``moe_layer_freq`` a list: dense and MoE layers; ``linear_attention_freq``: gated
  delta net and softmax attention layers) keep per-layer keys (``decoder.layers.<global index>....``) with no layer
  axis (``non_homogeneous_layers``); the tiny copy has one layer per distinct kind. A gated delta net's
  ``in_proj.weight`` is stored as the row sections ``.query/.key/.value/.z/.beta/.alpha``, its ``conv1d.weight``
  as ``.query/.key/.value``;
- multi-token-prediction depth ``k`` is saved under ``mtp.layers.<k>.`` (its transformer layer as
  ``transformer_layer.``), with no layer axis;
- a HybridModel (its pattern of Mamba, attention and MLP layers) keeps per-layer keys; the tiny copy then has
  the whole pattern, one tiny layer per real one. A Mamba mixer's ``in_proj.weight`` and ``conv1d`` tensors are
  stored as named row sections (``<key>.z``, ``.x``, ``.B``, ``.C``, ``.dt``; ``<key>.x``, ``.B``, ``.C``), each
  TP-independent (:attr:`CheckpointLayout.splits`).

A routed expert's tensor has the global expert index as a further prepended axis in all three.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern,
    get_moe_layer_pattern,
)
from megatron_core.models.hf.rules import Index, fmt
from megatron_core.models.hf.safetensors_io import HFConversionError

if TYPE_CHECKING:
    from megatron_core.models.hf.bridge import AutoBridge

__all__ = ["CheckpointLayout", "model_layout"]

_DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_DECODER = "decoder.layers.{i}."


@dataclass(frozen=True)
class CheckpointLayout:
    """Sharded keys and prepended axes of one model's checkpoint (see the module docstring).

    ``tensors`` maps a rule's parameter template (``{i}`` global layer, ``{e}`` global expert) to its key template
    (``{i}`` global layer of a per-layer key, ``{k}`` MTP depth); ``objects`` lists each ``_extra_state`` object as
    ``(name template, key template, tiny layer)``, the tiny layer being the index of the tiny copy's decoder layer
    it was seen in (``None`` outside the decoder layers); ``layer_kinds`` gives, for each real layer, the tiny layer
    of its kind (``None``: every layer is tiny layer 0). ``splits`` maps a parameter template stored as row sections
    to the sections' key suffixes, in row order (the sizes are the rule's ``sections``). ``kind_tensors`` maps
    ``(parameter template, tiny layer)`` to the key template that layer kind uses, where kinds differ (a norm fused
    into the next linear of one kind but not of another).
    """

    tensors: dict[str, str]
    objects: tuple[tuple[str, str, int | None], ...]
    stacked: bool
    num_layers: int
    experts: int
    mtp_layers: int = 0
    layer_kinds: tuple[int, ...] | None = None
    splits: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kind_tensors: dict[tuple[str, int], str] = field(default_factory=dict)

    def key(self, template: str, index: Index) -> str:
        """The sharded key of rule parameter ``template`` at ``index`` (None, a layer, or ``(layer, expert)``)."""
        if template not in self.tensors:
            raise HFConversionError(f"parameter {template!r}: the GPTModel's sharded state dict has no such tensor "
                                    f"(known: {len(self.tensors)} tensors, e.g. {sorted(self.tensors)[:3]})")
        key = self.tensors[template]
        if self.layer_kinds is not None and index is not None and template.startswith(_DECODER):
            layer = index[0] if isinstance(index, tuple) else index
            key = self.kind_tensors.get((template, self.layer_kinds[layer]), key)
        return self._fill(key, index)

    def _fill(self, key: str, index: Index) -> str:
        if index is None:
            return key
        layer = index[0] if isinstance(index, tuple) else index
        return key.replace("{i}", str(layer)).replace("{k}", str(layer - self.num_layers))

    def axes(self, template: str, index: Index) -> tuple[tuple[int, int], ...]:
        """``(size, position)`` of each axis prepended to the parameter: the stacked layer, then the expert."""
        if index is None:
            return ()
        layer = index[0] if isinstance(index, tuple) else index
        out = ((self.num_layers, layer),) if self.stacked and template.startswith(_DECODER) else ()
        return (*out, (self.experts, index[1])) if isinstance(index, tuple) else out

    def placement(self, template: str, full: tuple[int, ...], index: Index) -> tuple[tuple, tuple, int]:
        """``(global_shape, global_offset, prepended axes)`` of the parameter's one stored chunk."""
        axes = self.axes(template, index)
        return (*(s for s, _ in axes), *full), (*(p for _, p in axes), *(0,) * len(full)), len(axes)

    def extra_state_objects(self) -> dict[str, ShardedObject]:
        """The (empty) ``_extra_state`` objects of GPTModel's sharded state dict, for every layer and expert."""
        out: dict[str, ShardedObject] = {}
        for template, key, tiny in self.objects:
            for index in self._indices(template, tiny):
                axes = self.axes(template, index)
                shape, offset = (tuple(s for s, _ in axes), tuple(p for _, p in axes)) if axes else ((1,), (0,))
                out[fmt(template, index)] = ShardedObject(self._fill(key, index), None, shape, offset, replica_id=0)
        return out

    def _indices(self, template: str, tiny: int | None) -> list[Index]:
        """The indices (None, layers, or ``(layer, expert)``) at which the object ``template`` exists."""
        if template.startswith(_DECODER):
            kinds = self.layer_kinds or (0,) * self.num_layers
            layers = [i for i in range(self.num_layers) if kinds[i] == tiny]
        elif template.startswith("mtp.layers.{i}."):
            layers = list(range(self.num_layers, self.num_layers + self.mtp_layers))
        else:
            return [None]
        if "{e}" in template:
            return [(i, e) for i in layers for e in range(self.experts)]
        return list(layers)


def _name_template(local_name: str) -> str | None:
    """``decoder.layers.1.x`` -> ``decoder.layers.{i}.x`` (``mtp.layers.0.`` likewise); expert 0 -> ``{e}``; other
    experts -> ``None``."""
    name = _MTP_LAYER.sub("mtp.layers.{i}.", _DECODER_LAYER.sub(_DECODER, local_name))
    if re.search(r"local_experts\.[1-9]\d*\.", name):
        return None
    return re.sub(r"local_experts\.0\.", "local_experts.{e}.", name)


def _key_template(key: str) -> str:
    """``decoder.layers.1.x`` -> ``decoder.layers.{i}.x`` (a per-layer key), ``mtp.layers.0.x`` ->
    ``mtp.layers.{k}.x``."""
    return _MTP_LAYER.sub("mtp.layers.{k}.", _DECODER_LAYER.sub(_DECODER, key))


def _built_keys(factory: ShardedTensorFactory) -> list[str]:
    """The keys of the tensors ``factory`` stores."""
    built = factory.build()
    parts = built.values() if isinstance(built, dict) else built if isinstance(built, list) else [built]
    return [part.key for part in parts]


def _layer_kinds(bridge: AutoBridge) -> list[tuple[int, int]] | None:
    """``(MoE, linear attention)`` flags of each real layer, or ``None`` where every layer is of one kind (both
    patterns read as GPTModel's layer specs read them)."""
    c = bridge.family.config_kwargs
    mixes_mlp = bool(c.get("num_moe_experts")) and isinstance(c.get("moe_layer_freq"), list)
    mixes_attention = c.get("experimental_attention_variant") is not None
    if not (mixes_mlp or mixes_attention):
        return None
    config = bridge.transformer_config(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    layers = bridge.family.num_layers
    moe = get_moe_layer_pattern(config) if mixes_mlp else [1 if c.get("num_moe_experts") else 0] * layers
    linear = get_linear_attention_pattern(config) if mixes_attention else [0] * layers
    return list(zip(moe, linear))


def _tiny_overrides(c: dict[str, Any], kinds: list[tuple[int, int]] | None, layers: int) -> dict[str, Any]:
    """TransformerConfig overrides of the tiny copy: tiny widths, 2 experts, ``layers`` layers (one per distinct
    entry of ``kinds``, in that order, where the layers mix kinds)."""
    mha = c.get("num_query_groups") in (None, c["num_attention_heads"])
    tiny: dict[str, Any] = dict(
        num_layers=layers, hidden_size=8, num_attention_heads=2, num_query_groups=2 if mha else 1,
        kv_channels=4, ffn_hidden_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        perform_initialization=False, use_cpu_initialization=True)
    if isinstance(c.get("window_attn_skip_freq"), list):  # one flag per layer of the real model
        tiny.update(window_attn_skip_freq=None)
    if c.get("num_moe_experts"):
        tiny.update(num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=4, moe_router_num_groups=None,
                    moe_router_group_topk=None)
        if kinds is not None and isinstance(c.get("moe_layer_freq"), list):
            tiny.update(moe_layer_freq=[moe for moe, _ in kinds])
        if c.get("moe_shared_expert_intermediate_size"):
            tiny.update(moe_shared_expert_intermediate_size=4)
    if c.get("mamba_num_heads"):
        tiny.update(mamba_num_heads=2, mamba_head_dim=4, mamba_num_groups=1, mamba_state_dim=4)
    if c.get("experimental_attention_variant") is not None:
        tiny.update(linear_attention_freq=[linear for _, linear in kinds or ()],
                    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4)
    if c.get("multi_latent_attention"):
        tiny.update(q_lora_rank=4 if c.get("q_lora_rank") else None, kv_lora_rank=4, qk_head_dim=2,
                    qk_pos_emb_head_dim=2, v_head_dim=2)
    return tiny


def model_layout(bridge: AutoBridge) -> CheckpointLayout:
    """The :class:`CheckpointLayout` of ``bridge``'s model.

    Read from the sharded state dict of a tiny-width copy of the model (built on CPU in an instant), so the
    converter follows whatever keys GPTModel's (HybridModel's) ``sharded_state_dict`` uses.
    """
    c = bridge.family.config_kwargs
    hybrid = bridge.family.hybrid_pattern is not None
    per_layer = None if hybrid else _layer_kinds(bridge)
    # each kind once, in the order of its last layer: the tiny copy's last layer is of the real last layer's kind,
    # whose spec the multi-token-prediction layers take
    distinct = list(dict.fromkeys(reversed(per_layer)))[::-1] if per_layer is not None else None
    tiny_layers = bridge.family.num_layers if hybrid else len(distinct) if distinct else 1
    config = bridge.transformer_config(**_tiny_overrides(c, distinct, tiny_layers))
    (model,) = bridge.to_megatron_model(load_weights=False, config=config, max_sequence_length=4)
    tensors: dict[str, str] = {}
    splits: dict[str, tuple[str, ...]] = {}
    objects: dict[tuple[str, int | None], str] = {}
    kind_tensors: dict[tuple[str, int], str] = {}
    stacked = True
    for local_name, leaf in model.sharded_state_dict().items():
        if not isinstance(leaf, (ShardedObject, ShardedTensor, ShardedTensorFactory)):
            continue
        stacked = stacked and not _DECODER_LAYER.match(leaf.key)
        template = _name_template(local_name)
        if template is None:
            continue
        layer = _DECODER_LAYER.match(local_name)
        if isinstance(leaf, ShardedObject):
            objects[(template, int(layer.group(1)) if layer else None)] = _key_template(leaf.key)
        else:
            tensors[template] = _key_template(leaf.key)
            if layer:
                kind_tensors[(template, int(layer.group(1)))] = _key_template(leaf.key)
            if isinstance(leaf, ShardedTensorFactory):
                parts = _built_keys(leaf)
                if all(key.startswith(leaf.key + ".") for key in parts):  # named sections: <key>.<name>
                    splits[template] = tuple(key[len(leaf.key) + 1:] for key in parts)
    kinds = tuple(range(tiny_layers)) if hybrid else None
    if per_layer is not None and distinct is not None:
        kinds = tuple(distinct.index(kind) for kind in per_layer)
    return CheckpointLayout(tensors, tuple((t, k, tiny) for (t, tiny), k in sorted(objects.items(), key=str)),
                            stacked, bridge.family.num_layers, c.get("num_moe_experts") or 0,
                            bridge.family.mtp_num_layers, kinds, splits, kind_tensors)
