"""Build and save a TensorRT-LLM engine (Megatron-Core's ``TRTLLMEngineBuilder``); needs ``tensorrt_llm``.

The model class comes from the config's ``architecture`` (``LlamaForCausalLM`` is TensorRT-LLM's
``LLaMAForCausalLM``); plugins, token limits and the optional LoRA config follow the arguments. Without
TensorRT-LLM the call raises ``ImportError`` naming the package.
"""

from __future__ import annotations

from typing import Any

from megatron_core.export.trtllm._tensorrt_llm import import_tensorrt_llm


def _trtllm_build_api() -> dict[str, Any]:
    """The TensorRT-LLM entry points the build uses (imported here, lazily)."""
    purpose = "TRTLLMEngineBuilder.build_and_save_engine"
    trtllm = import_tensorrt_llm(purpose)
    common = import_tensorrt_llm(purpose, "tensorrt_llm._common")
    builder = import_tensorrt_llm(purpose, "tensorrt_llm.builder")
    commands = import_tensorrt_llm(purpose, "tensorrt_llm.commands.build")
    logger = import_tensorrt_llm(purpose, "tensorrt_llm.logger")
    lora = import_tensorrt_llm(purpose, "tensorrt_llm.lora_manager")
    modeling = import_tensorrt_llm(purpose, "tensorrt_llm.models.modeling_utils")
    plugin = import_tensorrt_llm(purpose, "tensorrt_llm.plugin")
    return dict(models=trtllm.models, check_max_num_tokens=common.check_max_num_tokens,
                BuildConfig=builder.BuildConfig, build=commands.build, logger=logger.logger,
                LoraConfig=lora.LoraConfig, optimize_model=modeling.optimize_model,
                preprocess_weights=modeling.preprocess_weights, PluginConfig=plugin.PluginConfig)


class TRTLLMEngineBuilder:
    """Builds a TensorRT-LLM engine from converted weights and a TensorRT-LLM pretrained config."""

    @staticmethod
    def build_and_save_engine(
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
        reduce_fusion: bool = False,
    ) -> Any:
        """Build the engine of one rank's ``trtllm_model_weights`` / ``trtllm_model_config``, save it to
        ``engine_dir`` and return it. ``max_seq_len`` defaults to ``max_input_len + max_output_len``; LoRA is
        configured when ``use_lora_plugin`` is given (NeMo-format checkpoints from ``lora_ckpt_list``)."""
        api = _trtllm_build_api()
        architecture = trtllm_model_config.architecture
        class_name = "LLaMAForCausalLM" if architecture == "LlamaForCausalLM" else architecture
        model_cls = getattr(api["models"], class_name, None)
        if model_cls is None:
            raise ValueError(f"trtllm_model_config.architecture ({architecture!r}) has no TensorRT-LLM model class")

        api["logger"].set_level("info")
        plugin_config = api["PluginConfig"]()
        plugin_config.gpt_attention_plugin = gpt_attention_plugin
        plugin_config.gemm_plugin = gemm_plugin
        if paged_kv_cache:
            plugin_config.enable_paged_kv_cache(tokens_per_block=tokens_per_block)
        else:
            plugin_config.paged_kv_cache = False
        plugin_config.remove_input_padding = remove_input_padding
        plugin_config.use_paged_context_fmha = paged_context_fmha
        plugin_config.multiple_profiles = multiple_profiles
        plugin_config.reduce_fusion = reduce_fusion

        if max_seq_len is None:
            max_seq_len = max_input_len + max_output_len
        max_num_tokens, opt_num_tokens = api["check_max_num_tokens"](
            max_num_tokens=max_num_tokens, opt_num_tokens=opt_num_tokens, max_seq_len=max_seq_len,
            max_batch_size=max_batch_size, max_input_len=max_input_len, max_beam_width=max_beam_width,
            remove_input_padding=remove_input_padding, enable_context_fmha=plugin_config.context_fmha,
            tokens_per_block=tokens_per_block, multiple_profiles=multiple_profiles)
        build_dict = {
            "max_input_len": max_input_len, "max_output_len": max_output_len, "max_batch_size": max_batch_size,
            "max_beam_width": max_beam_width, "max_seq_len": max_seq_len, "max_num_tokens": max_num_tokens,
            "opt_num_tokens": opt_num_tokens, "max_prompt_embedding_table_size": max_prompt_embedding_table_size,
            "gather_context_logits": False, "gather_generation_logits": False, "strongly_typed": False,
            "builder_opt": None, "use_refit": use_refit, "multiple_profiles": multiple_profiles,
        }
        if architecture == "DeciLMForCausalLM":
            build_dict.update(strongly_typed=True, use_fused_mlp=False)
            plugin_config.use_fused_mlp = False
        build_config = api["BuildConfig"].from_dict(build_dict, plugin_config=plugin_config)
        if use_lora_plugin is not None:
            build_config.lora_config = api["LoraConfig"](
                lora_dir=lora_ckpt_list, lora_ckpt_source="nemo", max_lora_rank=max_lora_rank,
                lora_target_modules=lora_target_modules)

        model = api["optimize_model"](
            model_cls.from_config(trtllm_model_config),
            use_parallel_embedding=trtllm_model_config.use_parallel_embedding,
            share_embedding_table=trtllm_model_config.share_embedding_table)
        api["preprocess_weights"](trtllm_model_weights, trtllm_model_config)
        model.load(trtllm_model_weights)
        engine = api["build"](model, build_config)
        engine.save(engine_dir)
        return engine
