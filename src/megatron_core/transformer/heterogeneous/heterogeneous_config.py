"""Per-layer configs of heterogeneous transformers (Megatron-Core's ``HeterogeneousTransformerConfig``).

NAS-pruned models such as Llama-Nemotron give every layer its own attention and MLP: either may be
dropped (``no_op``), replaced by one ``hidden -> hidden`` linear (``replace_with_linear``), or keep its
kind with a different number of query groups or FFN width. The layers are described by the
``block_configs`` list of a Hugging Face DeciLM ``config.json`` (``n_heads_in_group`` and ``ffn_mult``,
or Megatron's own ``num_query_groups`` and ``ffn_hidden_size``). ``get_config_for_layer`` gives the
plain ``TransformerConfig`` that layer ``n`` is built with; ``TransformerBlock`` calls it per layer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["AttentionConfig", "HeterogeneousTransformerConfig", "MLPConfig", "TransformerBlockConfig"]

# Hugging Face DeciLM block fields this library has no layers for: accepted only while switched off.
_INERT_HF_FIELDS = {
    "attention": ("sparsify", "window_length", "num_sink_tokens", "use_prefill_window_in_sink_attention",
                  "unshifted_sink", "mamba", "llama4"),
    "ffn": ("sparsify", "moe"),
}


def _check_fields(where: str, part: str, entries: dict, known: set[str]) -> None:
    """Raise for keys of ``entries`` that are neither ``known`` nor an inert DeciLM field."""
    for key, value in entries.items():
        if key in known:
            continue
        if key in _INERT_HF_FIELDS[part]:
            if value not in (None, False, [], {}):
                raise ValueError(f"{where}.{key} ({value!r}) is not supported: only null/false is accepted")
            continue
        raise ValueError(f"{where} has an unknown field {key!r} ({value!r}); known fields: "
                         f"{sorted(known | set(_INERT_HF_FIELDS[part]))}")


def _check_switches(where: str, no_op: Any, replace_with_linear: Any) -> None:
    for name, value in (("no_op", no_op), ("replace_with_linear", replace_with_linear)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}.{name} ({value!r}) must be true or false")
    if no_op and replace_with_linear:
        raise ValueError(f"{where}: no_op and replace_with_linear cannot both be true")


@dataclass
class AttentionConfig:
    """The self-attention of one block: dropped, replaced by a linear, or kept with its own query groups."""

    no_op: bool = False
    replace_with_linear: bool = False
    num_query_groups: int | None = None

    @classmethod
    def build_config_from_dict(cls, block_config_dict: dict, num_attention_heads: int,
                               where: str = "block") -> AttentionConfig:
        """Read ``block_config_dict["attention"]`` (``n_heads_in_group`` becomes heads / group size)."""
        entries = block_config_dict.get("attention")
        if not isinstance(entries, dict):
            raise ValueError(f"{where}.attention ({entries!r}) must be an object")
        _check_fields(f"{where}.attention", "attention", entries,
                      {"no_op", "replace_with_linear", "num_query_groups", "n_heads_in_group"})
        no_op, linear = entries.get("no_op", False), entries.get("replace_with_linear", False)
        _check_switches(f"{where}.attention", no_op, linear)
        groups = entries.get("num_query_groups")
        group_size = entries.get("n_heads_in_group")
        if groups is None and group_size is not None:
            if not isinstance(group_size, int) or group_size <= 0 or num_attention_heads % group_size:
                raise ValueError(f"{where}.attention.n_heads_in_group ({group_size!r}) must be a positive divisor "
                                 f"of num_attention_heads ({num_attention_heads})")
            groups = num_attention_heads // group_size
        if groups is not None:
            if no_op or linear:
                raise ValueError(f"{where}.attention sets a query-group count ({groups}) but its attention is "
                                 f"{'no_op' if no_op else 'replace_with_linear'}")
            if not isinstance(groups, int) or groups <= 0 or num_attention_heads % groups:
                raise ValueError(f"{where}.attention.num_query_groups ({groups!r}) must be a positive divisor of "
                                 f"num_attention_heads ({num_attention_heads})")
        return cls(no_op=no_op, replace_with_linear=linear, num_query_groups=groups)


@dataclass
class MLPConfig:
    """The MLP of one block: dropped, replaced by a linear, or kept with its own FFN width."""

    no_op: bool = False
    replace_with_linear: bool = False
    ffn_hidden_size: int | None = None

    @classmethod
    def build_config_from_dict(cls, block_config_dict: dict, hidden_size: int, where: str = "block") -> MLPConfig:
        """Read ``block_config_dict["ffn"]`` (or ``["mlp"]``); ``ffn_mult`` gives the width as DeciLM does."""
        key = "ffn" if "ffn" in block_config_dict else "mlp"
        entries = block_config_dict.get(key)
        if not isinstance(entries, dict):
            raise ValueError(f"{where} needs an 'ffn' (or 'mlp') object, got {entries!r}")
        _check_fields(f"{where}.{key}", "ffn", entries, {"no_op", "replace_with_linear", "ffn_hidden_size",
                                                         "ffn_mult"})
        no_op, linear = entries.get("no_op", False), entries.get("replace_with_linear", False)
        _check_switches(f"{where}.{key}", no_op, linear)
        size = entries.get("ffn_hidden_size")
        mult = entries.get("ffn_mult")
        if size is None and mult is not None:
            if not isinstance(mult, (int, float)) or isinstance(mult, bool) or mult <= 0:
                raise ValueError(f"{where}.{key}.ffn_mult ({mult!r}) must be a positive number")
            size = cls.ffn_mult_to_intermediate_size(mult, hidden_size)
        if size is not None:
            if no_op or linear:
                raise ValueError(f"{where}.{key} sets an FFN width ({size}) but its MLP is "
                                 f"{'no_op' if no_op else 'replace_with_linear'}")
            if isinstance(size, float) and size.is_integer():
                size = int(size)
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ValueError(f"{where}.{key}.ffn_hidden_size ({size!r}) must be a positive integer")
        return cls(no_op=no_op, replace_with_linear=linear, ffn_hidden_size=size)

    @staticmethod
    def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
        """DeciLM's FFN width: ``2/3 * ffn_mult * hidden_size`` (truncated), rounded up to a multiple of 256."""
        return MLPConfig.find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)

    @staticmethod
    def find_multiple(n: int, k: int) -> int:
        """The smallest multiple of ``k`` that is at least ``n``."""
        return -(-n // k) * k


@dataclass
class TransformerBlockConfig:
    """The attention and MLP configs of one block (layer)."""

    attention: AttentionConfig
    mlp: MLPConfig


def _read_block_list(encoded: str, path: str) -> list:
    source = f"heterogeneous_layers_config_path ({path!r})" if path else "heterogeneous_layers_config_encoded_json"
    try:
        document = json.loads(encoded)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source} is not valid JSON: {err}") from None
    if not isinstance(document, dict) or "block_configs" not in document:
        keys = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{source} must be a JSON object with a 'block_configs' list, got {keys}")
    blocks = document["block_configs"]
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise ValueError(f"{source}: block_configs must be a list of objects, got {blocks!r:.200}")
    return blocks


def _parse_block(block: dict, index: int, num_attention_heads: int, hidden_size: int) -> TransformerBlockConfig:
    where = f"block_configs[{index}]"
    unknown = sorted(set(block) - {"attention", "ffn", "mlp"})
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown}; a block holds 'attention' and 'ffn' (or 'mlp')")
    return TransformerBlockConfig(
        attention=AttentionConfig.build_config_from_dict(block, num_attention_heads, where),
        mlp=MLPConfig.build_config_from_dict(block, hidden_size, where),
    )


@dataclass
class HeterogeneousTransformerConfig(TransformerConfig):
    """A ``TransformerConfig`` whose layers differ as the ``block_configs`` JSON says.

    The JSON comes from ``heterogeneous_layers_config_encoded_json`` or, when that is empty, is read from
    ``heterogeneous_layers_config_path`` (and then kept in the encoded field, so a checkpointed config holds it).
    It must have one block per layer (``num_layers``). Setting the per-layer fields sets
    ``heterogeneous_block_specs``, which makes ``TransformerBlock`` build each layer with
    :meth:`get_config_for_layer`.
    """

    heterogeneous_layers_config_path: str = ""
    heterogeneous_layers_config_encoded_json: str = ""
    per_block_parameters: list[TransformerBlockConfig] = field(init=False)

    def __post_init__(self) -> None:
        """Validate the base fields, then read and check one block config per layer."""
        super().__post_init__()
        self.heterogeneous_block_specs = True
        path = self.heterogeneous_layers_config_path or ""
        if not self.heterogeneous_layers_config_encoded_json:
            if not path:
                raise ValueError("HeterogeneousTransformerConfig needs heterogeneous_layers_config_path or "
                                 "heterogeneous_layers_config_encoded_json; both are empty")
            try:
                self.heterogeneous_layers_config_encoded_json = Path(path).read_text()
            except OSError as err:
                raise ValueError(f"heterogeneous_layers_config_path ({path!r}) cannot be read: {err}") from None
        blocks = _read_block_list(self.heterogeneous_layers_config_encoded_json, path)
        if len(blocks) != self.num_layers:
            raise ValueError(f"block_configs has {len(blocks)} blocks but num_layers is {self.num_layers}; "
                             f"give one block per layer")
        self.per_block_parameters = [
            _parse_block(block, i, self.num_attention_heads, self.hidden_size) for i, block in enumerate(blocks)
        ]
        tp = self.tensor_model_parallel_size
        for i, block in enumerate(self.per_block_parameters):
            for name, value in (("num_query_groups", block.attention.num_query_groups),
                                ("ffn_hidden_size", block.mlp.ffn_hidden_size)):
                if value is not None and value % tp:
                    raise ValueError(f"block_configs[{i}]: {name} ({value}) must be divisible by "
                                     f"tensor_model_parallel_size ({tp})")

    def get_config_for_layer(self, layer_number: int) -> TransformerConfig:
        """The plain ``TransformerConfig`` of global layer ``layer_number`` (1-based): this config with the
        block's ``num_query_groups`` / ``ffn_hidden_size`` where the block sets them."""
        count = len(self.per_block_parameters)
        if not 1 <= layer_number <= count:
            raise ValueError(f"layer_number ({layer_number}) must be in [1, {count}]")
        block = self.per_block_parameters[layer_number - 1]
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
        if block.attention.num_query_groups is not None:
            values["num_query_groups"] = block.attention.num_query_groups
        if block.mlp.ffn_hidden_size is not None:
            values["ffn_hidden_size"] = block.mlp.ffn_hidden_size
        return TransformerConfig(**values)
