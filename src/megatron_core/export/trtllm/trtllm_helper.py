"""Export a Megatron GPT to TensorRT-LLM (Megatron-Core's ``TRTLLMHelper``).

Two public calls, as in Megatron-Core: :meth:`TRTLLMHelper.get_trtllm_pretrained_config_and_model_weights`
converts a state dict into one weights dict and one TensorRT-LLM pretrained config per inference rank, and
:meth:`TRTLLMHelper.build_and_save_engine` builds a rank's engine. Both need the ``tensorrt_llm`` package
(its config classes and ``Mapping``) and raise ``ImportError`` naming it when it is missing; constructing the
helper does not. The weight conversion alone runs with torch only, through the converters in
``trtllm_weights_converter`` (``helper.trtllm_conversion_dict`` is the name mapping to give them).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from megatron_core.export.data_type import DataType
from megatron_core.export.export_config import ExportConfig
from megatron_core.export.model_type import ModelType
from megatron_core.export.trtllm._tensorrt_llm import import_tensorrt_llm
from megatron_core.export.trtllm.engine_builder.trtllm_engine_builder import TRTLLMEngineBuilder
from megatron_core.export.trtllm.model_to_trllm_mapping.default_conversion_dict import (
    DEFAULT_CONVERSION_DICT,
    NEMOTRON_NAS_CONVERSION_DICT,
)
from megatron_core.export.trtllm.trt_model_config import TRT_MODEL_CONFIG
from megatron_core.export.trtllm.trt_model_type import TRT_MODEL_TYPE_STRING
from megatron_core.export.trtllm.trtllm_layers import TRTLLMLayers
from megatron_core.export.trtllm.trtllm_weights_converter.distributed_trtllm_model_weights_converter import (
    DistributedTRTLLMModelWeightsConverter,
)
from megatron_core.export.trtllm.trtllm_weights_converter.single_device_trtllm_model_weights_converter import (
    SingleDeviceTRTLLMModelWeightsConverter,
)
from megatron_core.export.trtllm.trtllm_weights_converter.utils import is_gated_activation
from megatron_core.transformer.transformer_config import TransformerConfig

_ON_DEVICE_MODEL_TYPES = (ModelType.gpt, ModelType.gptnext, ModelType.llama, ModelType.nemotron_nas)


class TRTLLMHelper:
    """Convert a Megatron GPT's weights to TensorRT-LLM and build its engines."""

    def __init__(
        self,
        *,
        transformer_config: TransformerConfig,
        model_type: ModelType,
        trtllm_conversion_dict: dict | None = None,
        position_embedding_type: str = "learned_absolute",
        max_position_embeddings: int | None = None,
        rotary_percentage: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling_factor: float = 8.0,
        moe_tp_mode: int = 2,
        multi_query_mode: bool = False,
        activation: str = "gelu",
        seq_len_interpolation_factor: float | None = None,
        moe_renorm_mode: Any = None,
        share_embeddings_and_output_weights: bool = False,
    ) -> None:
        """``trtllm_conversion_dict`` (Megatron keys without layer numbers -> ``TRTLLMLayers``) is merged over
        ``DEFAULT_CONVERSION_DICT`` (and ``NEMOTRON_NAS_CONVERSION_DICT`` for nemotron-nas).
        ``position_embedding_type`` is ``"learned_absolute"`` or ``"rope"`` (``ValueError`` otherwise); the rest
        goes into the TensorRT-LLM config."""
        if position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError(
                f"position_embedding_type ({position_embedding_type!r}) must be 'learned_absolute' or 'rope'")
        self.transformer_config = transformer_config
        self.model_type = model_type
        self.trtllm_conversion_dict = dict(DEFAULT_CONVERSION_DICT)
        if model_type == ModelType.nemotron_nas:
            self.trtllm_conversion_dict.update(NEMOTRON_NAS_CONVERSION_DICT)
        self.trtllm_conversion_dict.update(trtllm_conversion_dict or {})
        self.position_embedding_type = position_embedding_type
        self.max_position_embeddings = max_position_embeddings
        self.rotary_percentage = rotary_percentage
        self.rotary_base = rotary_base
        self.rope_scaling_factor = rope_scaling_factor
        self.moe_tp_mode = moe_tp_mode
        self.multi_query_mode = multi_query_mode
        self.activation = activation
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.moe_renorm_mode = moe_renorm_mode
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.weights_converter: Any = None

    def _get_trtllm_config(self, export_config: ExportConfig, world_size: int, gpus_per_node: int,
                           vocab_size_padded: int, dtype: DataType, fp8_quantized: bool = False,
                           fp8_kvcache: bool = False) -> Any:
        """TensorRT-LLM's pretrained config (``TRT_MODEL_CONFIG[model_type]``) of this model."""
        purpose = "TRTLLMHelper's TensorRT-LLM config"
        non_gated_version = import_tensorrt_llm(purpose, "tensorrt_llm.functional").non_gated_version
        moe_config = import_tensorrt_llm(purpose, "tensorrt_llm.layers").MoeConfig
        cfg = self.transformer_config
        hidden_act = self.activation.split("-")[-1] if cfg.num_moe_experts else non_gated_version(self.activation)
        config = {
            "architecture": TRT_MODEL_TYPE_STRING[self.model_type],
            "dtype": dtype.name,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups or cfg.num_attention_heads,
            "head_size": cfg.kv_channels,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size,
            "norm_epsilon": cfg.layernorm_epsilon,
            "vocab_size": vocab_size_padded,
            "position_embedding_type": "rope_gpt_neox" if self.position_embedding_type == "rope" else "learned_absolute",
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": hidden_act,
            "use_parallel_embedding": export_config.use_parallel_embedding,
            "embedding_sharding_dim": 0,
            "share_embedding_table": self.share_embeddings_and_output_weights,
            "quantization": {"quant_algo": "FP8" if fp8_quantized else None,
                             "kv_cache_quant_algo": "FP8" if fp8_kvcache else None},
            "bias": cfg.add_bias_linear,
            "apply_query_key_layer_scaling": False,
            "rotary_pct": self.rotary_percentage,
            "rotary_base": self.rotary_base,
            "moe_num_experts": 0 if cfg.moe_router_topk == 0 else (cfg.num_moe_experts or 1),
            "moe_top_k": cfg.moe_router_topk,
            "moe_normalization_mode": self.moe_renorm_mode or moe_config.ExpertScaleNormalizationMode.RENORMALIZE,
            "moe_tp_mode": self.moe_tp_mode,
            "logits_dtype": "float32",
            "world_size": world_size,
            "tp_size": export_config.inference_tp_size,
            "pp_size": export_config.inference_pp_size,
            "gpus_per_node": gpus_per_node,
        }
        if self.model_type == ModelType.falcon:
            config["new_decoder_architecture"] = cfg.num_layers != 32
            config["parallel_attention"] = True
        if self.seq_len_interpolation_factor is not None:
            config["rotary_scaling"] = {"type": "linear", "factor": float(self.seq_len_interpolation_factor)}
        if self.model_type == ModelType.nemotron_nas:
            config["block_configs"] = json.loads(cfg.heterogeneous_layers_config_encoded_json)["block_configs"]
            config["rotary_scaling"] = {"type": "llama3", "factor": self.rope_scaling_factor}
        return TRT_MODEL_CONFIG[self.model_type](**config)

    def _load_scaling_factors(self, model_state_dict: dict) -> dict:
        """FP8 scaling factors from Transformer Engine's ``_extra_state`` entries, by TensorRT-LLM name.

        Each linear's extra state (a buffer holding ``torch.save`` of a dict with ``scale_fwd`` and
        ``scale_inv_fwd``; index 0 is the input's, 1 the weight's) gives ``<name>.activation_scaling_factor``
        and ``<name>.weights_scaling_factor``, each ``{"trt_llm_scale": scale_inv, "weight_multiplier": scale}``;
        a gated fc1's are also given to its ``gate``. Core attention's extra state is skipped.
        """
        extra_states = {}
        for key, val in model_state_dict.items():
            if "._extra_state" in key and not key.endswith("core_attention._extra_state"):
                extra_states[key.split("._extra_state")[0] + ".weight"] = val
        extra_states = TRTLLMLayers.rename_input_layer_names_to_trtllm_layer_names(
            extra_states, self.trtllm_conversion_dict, False)
        gated = is_gated_activation(self)
        scales = {}
        for key, buffer in extra_states.items():
            if buffer is None:
                continue
            buffer.seek(0)
            state = torch.load(buffer)
            activation = {"trt_llm_scale": state["scale_inv_fwd"][0].view(1),
                          "weight_multiplier": state["scale_fwd"][0].view(1)}
            weight = {"trt_llm_scale": state["scale_inv_fwd"][1].view(1),
                      "weight_multiplier": state["scale_fwd"][1].view(1)}
            activation_key = key.replace(".weight", ".activation_scaling_factor")
            weight_key = key.replace(".weight", ".weights_scaling_factor")
            scales[activation_key], scales[weight_key] = activation, weight
            if gated and ".mlp.fc" in key:
                scales[activation_key.replace("fc", "gate")] = activation
                scales[weight_key.replace("fc", "gate")] = weight
        return scales

    def get_trtllm_pretrained_config_and_model_weights(
        self,
        model_state_dict: dict,
        dtype: DataType,
        export_config: ExportConfig | None = None,
        on_device_distributed_conversion: bool = False,
        vocab_size: int | None = None,
        gpus_per_node: int | None = None,
        state_dict_split_by_layer_numbers: bool = True,
        fp8_quantized: bool = False,
        fp8_kvcache: bool = False,
    ) -> tuple[list[dict], list[Any]]:
        """``(weights, configs)``: lists with one entry per inference rank (single device) or one, this rank's
        (``on_device_distributed_conversion``, collective over the model's TP group).

        Single device: the whole model's state dict, split for ``export_config`` (default ``ExportConfig()``);
        ``vocab_size`` must be ``None`` (it is the embedding's). On device: this rank's shard; the layout is the
        model's, so ``export_config`` must be ``None``, and ``vocab_size`` (the tokenizer's) and
        ``gpus_per_node`` are required. Needs ``tensorrt_llm``.
        """
        trtllm = import_tensorrt_llm("TRTLLMHelper.get_trtllm_pretrained_config_and_model_weights")
        if model_state_dict is None:
            raise ValueError("model_state_dict (None) must be the model's state dict")
        scales = self._load_scaling_factors(model_state_dict) if fp8_quantized else {}
        model_state_dict = {k: v for k, v in model_state_dict.items() if "extra_state" not in k}
        if not on_device_distributed_conversion:
            if vocab_size is not None:
                raise ValueError(f"vocab_size ({vocab_size}) must be None for single-device conversion: it is the "
                                 "embedding's number of rows")
            return self._get_trtllm_pretrained_config_and_model_weights_list_on_single_device(
                export_config or ExportConfig(), model_state_dict, dtype, gpus_per_node,
                state_dict_split_by_layer_numbers, scales, fp8_quantized, fp8_kvcache)
        problems = []
        if vocab_size is None:
            problems.append("vocab_size (None) is required")
        if gpus_per_node is None:
            problems.append("gpus_per_node (None) is required")
        if export_config is not None:
            problems.append(f"export_config ({export_config}) must be None: the layout is the loaded model's")
        if self.model_type not in _ON_DEVICE_MODEL_TYPES:
            problems.append(f"model_type ({self.model_type}) must be one of {[t.name for t in _ON_DEVICE_MODEL_TYPES]}")
        if problems:
            raise ValueError("on_device_distributed_conversion=True: " + "; ".join(problems))
        weights, config = self._get_trtllm_pretrained_config_and_model_weights_in_distributed_setting(
            model_state_dict, dtype, vocab_size, gpus_per_node, scales, fp8_quantized, fp8_kvcache, trtllm)
        return [weights], [config]

    def _add_scales_to_converter(self, converter: Any, scales: dict, fp8_kvcache: bool) -> None:
        """Add the TensorRT-LLM scales (and, with ``fp8_kvcache``, a 1.0 KV-cache scale per layer) to the weights."""
        kv_scales = {}
        if fp8_kvcache:
            for key in converter.trtllm_model_weights:
                if ".attention.qkv.weight" in key:
                    kv_scales[key.split(".qkv")[0] + ".kv_cache_scaling_factor"] = torch.tensor([1.0])
        converter.trtllm_model_weights.update({key: s["trt_llm_scale"] for key, s in scales.items()})
        converter.trtllm_model_weights.update(kv_scales)

    def _get_trtllm_pretrained_config_and_model_weights_in_distributed_setting(
        self, model_state_dict: dict, dtype: DataType, vocab_size: int, gpus_per_node: int, scales: dict,
        fp8_quantized: bool, fp8_kvcache: bool, trtllm: Any,
    ) -> tuple[dict, Any]:
        """This rank's weights and config, converted from its own shard."""
        self.weights_converter = DistributedTRTLLMModelWeightsConverter(
            transformer_config=self.transformer_config, dtype=dtype, multi_query_mode=self.multi_query_mode,
            activation=self.activation, scales=scales)
        self.weights_converter.convert(model_state_dict, self.trtllm_conversion_dict, vocab_size)
        self._add_scales_to_converter(self.weights_converter, scales, fp8_kvcache)
        converter = self.weights_converter
        export_config = ExportConfig(inference_tp_size=converter.inference_tp_size,
                                     inference_pp_size=converter.inference_pp_size, use_parallel_embedding=True)
        world_size = converter.inference_tp_size * converter.inference_pp_size
        config = self._get_trtllm_config(export_config, world_size, gpus_per_node, vocab_size, dtype,
                                         fp8_quantized, fp8_kvcache)
        config.mapping = trtllm.Mapping(world_size=world_size,
                                        rank=converter.pp_rank * converter.inference_tp_size + converter.tp_rank,
                                        tp_size=converter.inference_tp_size, pp_size=converter.inference_pp_size)
        return converter.trtllm_model_weights, config

    def _get_trtllm_pretrained_config_and_model_weights_list_on_single_device(
        self, export_config: ExportConfig, model_state_dict: dict, dtype: DataType, gpus_per_node: int | None,
        state_dict_split_by_layer_numbers: bool, scales: dict, fp8_quantized: bool, fp8_kvcache: bool,
    ) -> tuple[list[dict], list[Any]]:
        """Every inference rank's weights and config, converted from the whole model's state dict."""
        trtllm = import_tensorrt_llm("TRTLLMHelper.get_trtllm_pretrained_config_and_model_weights")
        self.weights_converter = SingleDeviceTRTLLMModelWeightsConverter(
            export_config=export_config, transformer_config=self.transformer_config, dtype=dtype,
            activation=self.activation, multi_query_mode=self.multi_query_mode, scales=scales)
        self.weights_converter.convert(model_state_dict, self.trtllm_conversion_dict,
                                       state_dict_split_by_layer_numbers)
        self._add_scales_to_converter(self.weights_converter, scales, fp8_kvcache)
        vocab_size_padded = self.weights_converter.get_padded_vocab_size()
        world_size = export_config.inference_tp_size * export_config.inference_pp_size
        gpus_per_node = gpus_per_node or export_config.inference_tp_size
        weights_list, configs = [], []
        for rank in range(world_size):
            mapping = trtllm.Mapping(world_size=world_size, rank=rank, tp_size=export_config.inference_tp_size,
                                     pp_size=export_config.inference_pp_size)
            config = self._get_trtllm_config(export_config, world_size, gpus_per_node, vocab_size_padded, dtype,
                                             fp8_quantized, fp8_kvcache)  # a new one per rank: each has its mapping
            config.mapping = mapping
            configs.append(config)
            weights_list.append(self.weights_converter.get_local_model_weights_per_gpu(mapping, config))
        return weights_list, configs

    def build_and_save_engine(
        self,
        engine_dir: str,
        trtllm_model_weights: dict,
        trtllm_model_config: Any,
        max_input_len: int = 1024,
        max_output_len: int = 1024,
        max_batch_size: int = 4,
        lora_ckpt_list: Any = None,
        use_lora_plugin: Any = None,
        max_lora_rank: int = 64,
        lora_target_modules: Any = None,
        max_prompt_embedding_table_size: int = 0,
        paged_kv_cache: bool = True,
        remove_input_padding: bool = True,
        paged_context_fmha: bool = False,
        use_refit: bool = False,
        max_num_tokens: int | None = None,
        max_seq_len: int | None = None,
        opt_num_tokens: int | None = None,
        max_beam_width: int = 1,
        tokens_per_block: int = 128,
        multiple_profiles: bool = False,
        gpt_attention_plugin: str = "auto",
        gemm_plugin: str = "auto",
    ) -> Any:
        """Build one rank's engine with :class:`TRTLLMEngineBuilder` and save it to ``engine_dir``; returns it.
        Needs ``tensorrt_llm``."""
        return TRTLLMEngineBuilder.build_and_save_engine(
            engine_dir, trtllm_model_weights, trtllm_model_config, max_input_len, max_output_len, max_batch_size,
            lora_ckpt_list, use_lora_plugin, max_lora_rank, lora_target_modules, max_prompt_embedding_table_size,
            paged_kv_cache, remove_input_padding, paged_context_fmha, use_refit, max_num_tokens, max_seq_len,
            opt_num_tokens, max_beam_width, tokens_per_block, multiple_profiles, gpt_attention_plugin, gemm_plugin)
