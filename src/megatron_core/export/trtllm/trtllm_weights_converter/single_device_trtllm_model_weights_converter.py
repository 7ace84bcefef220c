"""Convert a whole Megatron GPT state dict to TensorRT-LLM weights on one device, split per inference rank.

Megatron-Core's ``SingleDeviceTRTLLMModelWeightsConverter``. The input is the full (TP=1) state dict; the
result, ``trtllm_model_weights``, holds the replicated weights under their TensorRT-LLM names and each
tensor-parallel piece as ``<name>.<tp_rank>.bin``; :meth:`get_local_model_weights_per_gpu` picks one
inference rank's weights out of it. Linear weights come out as TensorRT-LLM's ``[out, in]``: column-parallel
ones (QKV, fc1) split along ``out``, row-parallel ones (dense, proj) along ``in``; a gated fc1 is cut into its
first half (``mlp.fc``, the activated one) and second half (``mlp.gate``) before the split.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron_core.export.data_type import DataType
from megatron_core.export.export_config import ExportConfig
from megatron_core.export.trtllm.trtllm_layers import NON_TRANSFORMER_LAYERS_NAMES, TRTLLMLayers
from megatron_core.export.trtllm.trtllm_layers import get_layer_name_without_prefix as suffix
from megatron_core.export.trtllm.trtllm_weights_converter.qkv_layout import split_qkv_for_trtllm
from megatron_core.export.trtllm.trtllm_weights_converter.utils import is_gated_activation
from megatron_core.progress import track
from megatron_core.transformer.transformer_config import TransformerConfig

_DTYPES = {DataType.bfloat16: torch.bfloat16, DataType.float16: torch.float16, DataType.float32: torch.float32}

_REPLICATED = tuple(suffix(layer) for layer in (
    TRTLLMLayers.input_layernorm_weight, TRTLLMLayers.input_layernorm_bias, TRTLLMLayers.post_layernorm_weight,
    TRTLLMLayers.post_layernorm_bias, TRTLLMLayers.attention_dense_bias, TRTLLMLayers.mlp_projection_bias,
    TRTLLMLayers.mlp_router_weight))
_ROW_PARALLEL = tuple(suffix(layer) for layer in (
    TRTLLMLayers.attention_dense_weight, TRTLLMLayers.mlp_projection_weight, TRTLLMLayers.ffn_projection_weight))
_FC1 = tuple(suffix(layer) for layer in (
    TRTLLMLayers.mlp_fc_weight, TRTLLMLayers.mlp_fc_bias, TRTLLMLayers.ffn_fc_weight))
_LINEAR_REPLACEMENTS = tuple(suffix(layer) for layer in (
    TRTLLMLayers.ffn_linear_weight, TRTLLMLayers.attention_linear_weight))


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``tp_size`` (TensorRT-LLM's ``pad_vocab_size``)."""
    return -(-vocab_size // tp_size) * tp_size


def str_dtype_to_torch(dtype: DataType | str) -> torch.dtype:
    """The torch dtype of ``dtype`` (a ``DataType`` or its name: ``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    key = DataType[dtype] if isinstance(dtype, str) and dtype in DataType.__members__ else dtype
    if key not in _DTYPES:
        raise ValueError(f"dtype ({dtype!r}) must be a DataType or one of {list(DataType.__members__)}")
    return _DTYPES[key]


def to_trtllm_layout(val: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM's layout of a weight held as ``[in, out]``: ``[out, in]`` (trailing dims flattened); 1-D as is."""
    if val.ndim >= 2:
        return val.reshape(val.shape[0], -1).transpose(0, 1)
    return val


def num_kv_heads_of(transformer_config: TransformerConfig, multi_query_mode: bool) -> int:
    """Key/value heads of the model: ``num_query_groups``; when that is 0 or unset, 1 with
    ``multi_query_mode``, else ``num_attention_heads``."""
    if transformer_config.num_query_groups:
        return transformer_config.num_query_groups
    return 1 if multi_query_mode else transformer_config.num_attention_heads


def adds_one_to_layernorm(transformer_config: TransformerConfig) -> bool:
    """Whether norm weights are stored minus one (zero-centred gamma of a LayerNorm; NeMo's layernorm1p)."""
    return bool(transformer_config.layernorm_zero_centered_gamma) and transformer_config.normalization == "LayerNorm"


class SingleDeviceTRTLLMModelWeightsConverter:
    """Convert a full Megatron state dict to TensorRT-LLM weights split for ``export_config``'s ranks."""

    def __init__(
        self,
        export_config: ExportConfig,
        transformer_config: TransformerConfig,
        dtype: DataType,
        multi_query_mode: bool = False,
        activation: str = "gelu",
        scales: dict | None = None,
    ) -> None:
        """``dtype``: the stored weights' type; ``scales``: FP8 scaling factors by TensorRT-LLM name
        (``<...>.weights_scaling_factor`` -> ``{"weight_multiplier": tensor, ...}``): a weight with one is
        multiplied by it and stored as ``float8_e4m3fn``."""
        self.export_config = export_config
        self.transformer_config = transformer_config
        self.trtllm_model_weights: dict[str, torch.Tensor] = {}
        self.storage_type = str_dtype_to_torch(dtype)
        self.activation = activation
        self.scales = scales if scales is not None else {}
        self.num_kv_heads = num_kv_heads_of(transformer_config, multi_query_mode)

    @property
    def _tp_size(self) -> int:
        return self.export_config.inference_tp_size

    def _convert_non_transformer_layer(self, model_state_dict: dict, layer_name: str) -> None:
        """Move ``layer_name`` (embedding, final norm, lm head) from ``model_state_dict``, cast, as it is laid out."""
        if layer_name in model_state_dict:
            val = model_state_dict.pop(layer_name)
            self.trtllm_model_weights[layer_name] = val.to(self.storage_type).detach().contiguous()

    def _cast_value(self, val: torch.Tensor, layer_name: str) -> torch.Tensor:
        """Cast ``val`` to the storage type, or scale it to FP8 when ``scales`` has its weight scaling factor."""
        scale_key = layer_name.rsplit(".", 1)[0] + ".weights_scaling_factor"
        if scale_key in self.scales and layer_name.endswith("weight"):
            return (val * self.scales[scale_key]["weight_multiplier"].to(val.device)).to(torch.float8_e4m3fn)
        return val.to(self.storage_type)

    def _store(self, layer_name: str, val: torch.Tensor) -> None:
        self.trtllm_model_weights[layer_name] = self._cast_value(to_trtllm_layout(val), layer_name).detach().contiguous()

    def _store_tp_pieces(self, layer_name: str, pieces: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        for rank, piece in enumerate(pieces):
            self.trtllm_model_weights[f"{layer_name}.{rank}.bin"] = (
                self._cast_value(to_trtllm_layout(piece), layer_name).detach().contiguous())

    def _store_expert_pieces(self, layer_name: str, pieces: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        for rank, piece in enumerate(pieces):
            self.trtllm_model_weights[f"{layer_name}.{rank}.bin"] = (
                self._cast_value(piece, layer_name).detach().contiguous())

    def _convert_transformer_layer(self, layer_name: str, val: torch.Tensor) -> None:
        """Convert one per-layer weight (name with its layer number) and store it or its per-rank pieces."""
        if val.ndim == 2:
            val = val.T  # Megatron's [out, in] -> [in, out]; splits below are along these axes
        tp = self._tp_size
        if layer_name.endswith(_REPLICATED):
            if adds_one_to_layernorm(self.transformer_config) and "layernorm.weight" in layer_name:
                val = val + 1.0
            self._store(layer_name, val)
        elif layer_name.endswith(_ROW_PARALLEL):
            self._store_tp_pieces(layer_name, torch.chunk(val, tp, dim=0))
        elif layer_name.endswith(_FC1):
            if is_gated_activation(self):
                val, gate = torch.chunk(val, 2, dim=-1)
                self._store_tp_pieces(layer_name.replace("fc", "gate"), torch.chunk(gate, tp, dim=-1))
            self._store_tp_pieces(layer_name, torch.chunk(val, tp, dim=-1))
        elif layer_name.endswith(_LINEAR_REPLACEMENTS):
            self._store_tp_pieces(layer_name, torch.chunk(val, tp, dim=-1))
        elif layer_name.endswith((suffix(TRTLLMLayers.attention_qkv_weight), suffix(TRTLLMLayers.attention_qkv_bias))):
            self._store_tp_pieces(layer_name, split_qkv_for_trtllm(
                val, self.transformer_config.num_attention_heads, self.num_kv_heads, tp))
        elif layer_name.endswith(suffix(TRTLLMLayers.mlp_fc_weight_mixture_of_experts)):
            w1, w3 = torch.chunk(val, 2, dim=1)
            pieces = [torch.cat((w3_r, w1_r), dim=1)
                      for w3_r, w1_r in zip(torch.chunk(w3, tp, dim=1), torch.chunk(w1, tp, dim=1))]
            self._store_expert_pieces(layer_name.replace(".expert", ""), pieces)
        elif layer_name.endswith(suffix(TRTLLMLayers.mlp_projection_weight_mixture_of_experts)):
            self._store_expert_pieces(layer_name.replace(".expert", ""), torch.chunk(val, tp, dim=-1))
        else:
            raise ValueError(f"{layer_name!r} is not a weight the TensorRT-LLM converter knows how to convert")

    @torch.no_grad()
    def convert(self, model_state_dict: dict, trtllm_conversion_dict: dict,
                state_dict_split_by_layer_numbers: bool = True) -> None:
        """Convert ``model_state_dict`` (emptied on the way) into ``self.trtllm_model_weights``.

        ``state_dict_split_by_layer_numbers=False`` takes per-layer weights stacked over layers
        (``decoder.layers.<...>`` of shape ``[num_layers, ...]``) instead of one key per layer.
        """
        model_state_dict = TRTLLMLayers.rename_input_layer_names_to_trtllm_layer_names(
            model_state_dict, trtllm_conversion_dict, state_dict_split_by_layer_numbers)
        vocab_name, ln_f_name = TRTLLMLayers.vocab_embedding.value, TRTLLMLayers.final_layernorm_weight.value
        if self.export_config.use_parallel_embedding and vocab_name in model_state_dict:
            table = model_state_dict[vocab_name]
            padding = pad_vocab_size(table.shape[0], self._tp_size) - table.shape[0]
            if padding:
                model_state_dict[vocab_name] = torch.nn.functional.pad(table, (0, 0, 0, padding), value=0)
        if adds_one_to_layernorm(self.transformer_config) and ln_f_name in model_state_dict:
            model_state_dict[ln_f_name] = model_state_dict[ln_f_name] + 1.0
        for layer_name in NON_TRANSFORMER_LAYERS_NAMES:
            self._convert_non_transformer_layer(model_state_dict, layer_name)

        if state_dict_split_by_layer_numbers:
            per_layer = model_state_dict
        else:
            per_layer = {}
            for name in list(model_state_dict):
                stacked = model_state_dict.pop(name)
                for number in range(self.transformer_config.num_layers):
                    per_layer[re.sub(r"(?<=layers\.)", f"{number}.", name, count=1)] = stacked[number]
        for layer_name, value in track(list(per_layer.items()), len(per_layer), "Converting to TRTLLM weights",
                                       lines=0):
            self._convert_transformer_layer(layer_name, value)

    def get_padded_vocab_size(self) -> int:
        """The vocabulary size of the exported model: the (possibly padded) embedding's rows, rounded up to a
        multiple of the inference TP size when there is a separate lm head."""
        vocab_size = self.trtllm_model_weights[TRTLLMLayers.vocab_embedding.value].shape[0]
        if TRTLLMLayers.lm_head.value not in self.trtllm_model_weights:
            return vocab_size
        return pad_vocab_size(vocab_size, self._tp_size)

    def get_local_model_weights_per_gpu(self, mapping: Any, trtllm_model_config: Any) -> dict:
        """The weights of the inference rank ``mapping`` describes, layers renumbered from 0 on its stage.

        ``mapping`` is a ``tensorrt_llm.Mapping`` or anything with its ``tp_rank``, ``tp_size``,
        ``pp_layers(num_layers)``, ``is_first_pp_rank()`` and ``is_last_pp_rank()``. A ``trtllm_model_config``
        with ``new_decoder_architecture`` (Falcon) gets ``post_layernorm`` renamed ``mlp_layernorm``.
        """
        layers = list(mapping.pp_layers(self.transformer_config.num_layers))
        rename_post_ln = bool(getattr(trtllm_model_config, "new_decoder_architecture", False))
        own_piece = f".{mapping.tp_rank}.bin"
        weights = {}
        for name, value in self.trtllm_model_weights.items():
            if name in NON_TRANSFORMER_LAYERS_NAMES:
                continue
            if name.endswith(".bin"):
                if not name.endswith(own_piece):
                    continue
                name = name[: -len(own_piece)]
            number = int(name.split(".")[2])
            if number not in layers:
                continue
            name = name.replace(f"layers.{number}.", f"layers.{number - layers[0]}.", 1)
            if rename_post_ln and "post_layernorm" in name:
                name = name.replace("post_layernorm", "mlp_layernorm")
            weights[name] = value

        def split(tensor: torch.Tensor) -> torch.Tensor:
            if mapping.tp_size == 1:
                return tensor
            return torch.chunk(tensor, mapping.tp_size, dim=0)[mapping.tp_rank].contiguous()

        parallel_embedding = self.export_config.use_parallel_embedding
        if mapping.is_first_pp_rank():
            for layer in (TRTLLMLayers.vocab_embedding, TRTLLMLayers.position_embedding):
                table = self.trtllm_model_weights.get(layer.value)
                if table is not None:
                    weights[layer.value] = split(table) if parallel_embedding else table
        if mapping.is_last_pp_rank():
            lm_head = self.trtllm_model_weights.get(TRTLLMLayers.lm_head.value)
            if lm_head is not None:
                weights[TRTLLMLayers.lm_head.value] = split(lm_head)
            for layer in (TRTLLMLayers.final_layernorm_weight, TRTLLMLayers.final_layernorm_bias):
                if layer.value in self.trtllm_model_weights:
                    weights[layer.value] = self.trtllm_model_weights[layer.value]
        return weights
