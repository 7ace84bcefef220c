"""Convert each model-parallel rank's own Megatron state dict to that rank's TensorRT-LLM weights.

Megatron-Core's ``DistributedTRTLLMModelWeightsConverter``: the model is already sharded the way it will run
(export at TP=2 x PP=2 by loading it at TP=2 x PP=2), so each rank converts its shard with no split of its
own. The only communication is over the tensor-parallel group: the vocabulary tables (embedding, lm head)
are gathered, cut to the tokenizer's vocabulary (Megatron pads it) and re-split evenly. The results are
copied to CPU (pinned when the weights are on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core import parallel_state
from megatron_core.export.data_type import DataType
from megatron_core.export.trtllm.trtllm_layers import NON_TRANSFORMER_LAYERS_NAMES, TRTLLMLayers
from megatron_core.export.trtllm.trtllm_layers import get_layer_name_without_prefix as suffix
from megatron_core.export.trtllm.trtllm_weights_converter.qkv_layout import split_qkv_for_trtllm
from megatron_core.export.trtllm.trtllm_weights_converter.single_device_trtllm_model_weights_converter import (
    adds_one_to_layernorm,
    num_kv_heads_of,
    str_dtype_to_torch,
    to_trtllm_layout,
)
from megatron_core.export.trtllm.trtllm_weights_converter.utils import is_gated_activation
from megatron_core.progress import track
from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron_core.tensor_parallel.utils import VocabUtility
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["DistributedTRTLLMModelWeightsConverter", "str_dtype_to_torch"]

_AS_IS = tuple(suffix(layer) for layer in (
    TRTLLMLayers.input_layernorm_weight, TRTLLMLayers.input_layernorm_bias, TRTLLMLayers.post_layernorm_weight,
    TRTLLMLayers.post_layernorm_bias, TRTLLMLayers.attention_dense_bias, TRTLLMLayers.mlp_projection_bias,
    TRTLLMLayers.mlp_router_weight, TRTLLMLayers.ffn_projection_weight, TRTLLMLayers.attention_dense_weight,
    TRTLLMLayers.mlp_projection_weight, TRTLLMLayers.ffn_linear_weight, TRTLLMLayers.attention_linear_weight))
_FC1 = tuple(suffix(layer) for layer in (
    TRTLLMLayers.mlp_fc_weight, TRTLLMLayers.mlp_fc_bias, TRTLLMLayers.ffn_fc_weight))
_QKV = (suffix(TRTLLMLayers.attention_qkv_weight), suffix(TRTLLMLayers.attention_qkv_bias))


class DistributedTRTLLMModelWeightsConverter:
    """Convert this rank's shard of a Megatron model to its TensorRT-LLM weights (collective over TP)."""

    def __init__(
        self,
        transformer_config: TransformerConfig,
        dtype: DataType,
        multi_query_mode: bool = False,
        activation: str = "gelu",
        scales: dict | None = None,
        *,
        pg_collection: Any = None,
    ) -> None:
        """The inference TP/PP sizes and ranks are the model's: those of ``pg_collection.tp`` / ``.pp`` when
        given, else ``parallel_state``'s. ``scales`` as for the single-device converter. A virtual pipeline
        (``virtual_pipeline_model_parallel_size`` > 1) raises ``ValueError``: gather its chunks first."""
        self.transformer_config = transformer_config
        self.trtllm_model_weights: dict[str, torch.Tensor] = {}
        self.storage_type = str_dtype_to_torch(dtype)
        self.activation = activation
        self.scales = scales if scales is not None else {}
        self.num_kv_heads = num_kv_heads_of(transformer_config, multi_query_mode)
        if pg_collection is not None:
            self.tp_group, pp_group = pg_collection.tp, pg_collection.pp
            self.inference_tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
            self.inference_pp_size, self.pp_rank = pp_group.size(), pp_group.rank()
        else:
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
            self.inference_tp_size = parallel_state.get_tensor_model_parallel_world_size()
            self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
            self.inference_pp_size = parallel_state.get_pipeline_model_parallel_world_size()
            self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        vp_size = transformer_config.virtual_pipeline_model_parallel_size
        if vp_size not in (None, 1):
            raise ValueError(
                f"virtual_pipeline_model_parallel_size ({vp_size}) must be None or 1 for the distributed "
                "TensorRT-LLM converter: gather the virtual-pipeline chunks and export with a plain pipeline"
            )

    def _add_to_trtllm_model_weights(self, val: torch.Tensor, layer_name: str) -> None:
        """Cast (or FP8-scale) ``val`` held as ``[in, out]``, lay it out as ``[out, in]`` and copy it to CPU."""
        if not torch.is_tensor(val):
            raise ValueError(f"{layer_name}: expected a tensor, got {type(val).__name__}")
        scale_key = layer_name.rsplit(".", 1)[0] + ".weights_scaling_factor"
        if scale_key in self.scales and layer_name.endswith("weight"):
            val = (val * self.scales[scale_key]["weight_multiplier"].to(val.device)).to(torch.float8_e4m3fn)
        else:
            val = val.to(self.storage_type)
        val = to_trtllm_layout(val.detach().contiguous())
        target = self.trtllm_model_weights.get(layer_name)
        if target is None or target.shape != val.shape or target.dtype != val.dtype:
            target = torch.empty(val.shape, dtype=val.dtype, device="cpu", pin_memory=val.is_cuda)
            self.trtllm_model_weights[layer_name] = target
        target.copy_(val, non_blocking=val.is_cuda)

    def _convert_transformer_layer(self, layer_name: str, val: torch.Tensor) -> None:
        """Convert one per-layer weight of this rank's shard."""
        if val.ndim == 2:
            val = val.T  # Megatron's [out, in] -> [in, out]
        if layer_name.endswith(_AS_IS):
            if adds_one_to_layernorm(self.transformer_config) and "layernorm.weight" in layer_name:
                val = val + 1.0
            self._add_to_trtllm_model_weights(val, layer_name)
        elif layer_name.endswith(_FC1):
            if is_gated_activation(self):
                val, gate = torch.chunk(val, 2, dim=-1)
                self._add_to_trtllm_model_weights(gate, layer_name.replace("fc", "gate"))
            self._add_to_trtllm_model_weights(val, layer_name)
        elif layer_name.endswith(_QKV):
            local_kv_heads = self.num_kv_heads // self.inference_tp_size
            local_heads = self.transformer_config.num_attention_heads // self.inference_tp_size
            (qkv,) = split_qkv_for_trtllm(val, local_heads, local_kv_heads, 1)
            self._add_to_trtllm_model_weights(qkv, layer_name)
        else:
            raise ValueError(f"{layer_name!r} is not a weight the distributed TensorRT-LLM converter can convert")

    def _convert_non_transformer_layer(self, model_state_dict: dict, layer_name: str) -> None:
        """Move ``layer_name`` (embedding, final norm, lm head), held as ``[in, out]``, into the weights."""
        if layer_name in model_state_dict:
            self._add_to_trtllm_model_weights(model_state_dict.pop(layer_name), layer_name)

    def _get_remove_vocab_padding(self, layer_name: str, model_state_dict: dict,
                                  tokenizer_vocab_size: int) -> torch.Tensor | None:
        """This rank's even share of the first ``tokenizer_vocab_size`` rows of a vocab-parallel table, as
        ``[hidden, vocab_share]`` (``None`` when the table is absent). Collective over the TP group."""
        val = model_state_dict.get(layer_name)
        if val is None:
            return None
        if self.inference_tp_size > 1:
            val = gather_from_sequence_parallel_region(val, group=self.tp_group)
        unpadded = val[:tokenizer_vocab_size]
        if self.inference_tp_size > 1:
            start, end = VocabUtility.vocab_range_from_global_vocab_size(
                tokenizer_vocab_size, self.tp_rank, self.inference_tp_size)
            unpadded = unpadded[start:end]
        return unpadded.T

    @torch.no_grad()
    def convert(self, model_state_dict: dict, trtllm_conversion_dict: dict, tokenizer_vocab_size: int) -> None:
        """Convert this rank's ``model_state_dict`` (emptied on the way) into ``self.trtllm_model_weights``.

        Collective over the tensor-parallel group (every rank of it must call it). ``tokenizer_vocab_size``
        must be divisible by the TP size when that is above 1.
        """
        if self.inference_tp_size > 1 and tokenizer_vocab_size % self.inference_tp_size:
            raise ValueError(
                f"tokenizer_vocab_size ({tokenizer_vocab_size}) must be divisible by the tensor-parallel size "
                f"({self.inference_tp_size}): the vocabulary tables are split evenly over the inference ranks"
            )
        model_state_dict = TRTLLMLayers.rename_input_layer_names_to_trtllm_layer_names(
            model_state_dict, trtllm_conversion_dict)
        for layer_name in NON_TRANSFORMER_LAYERS_NAMES:
            if layer_name not in model_state_dict:
                continue
            if layer_name in (TRTLLMLayers.vocab_embedding.value, TRTLLMLayers.lm_head.value):
                model_state_dict[layer_name] = self._get_remove_vocab_padding(
                    layer_name, model_state_dict, tokenizer_vocab_size)
            elif layer_name == TRTLLMLayers.position_embedding.value:
                table = model_state_dict[layer_name]
                model_state_dict[layer_name] = table.chunk(self.inference_tp_size)[self.tp_rank].T
            elif layer_name == TRTLLMLayers.final_layernorm_weight.value and adds_one_to_layernorm(
                    self.transformer_config):
                model_state_dict[layer_name] = model_state_dict[layer_name] + 1.0
            self._convert_non_transformer_layer(model_state_dict, layer_name)
        for layer_name, value in track(list(model_state_dict.items()), len(model_state_dict),
                                       "Converting to TRTLLM weights", lines=0):
            self._convert_transformer_layer(layer_name, value)
