"""``--hf-model DIR``: fine-tune from a Hugging Face directory (config, safetensors weights, tokenizer).

The model-shape flags are filled from ``config.json`` (a contradicting flag is an error), the
TransformerConfig comes from the bridge (q/k norm, QKV biases, RoPE scaling, activation) with
the run's parallel, precision and recompute settings, each rank loads only its slices of the
weights, and the directory's tokenizer (with its chat template) is the run's tokenizer. A hybrid Mamba
directory (``NemotronHForCausalLM``, ``Mamba2ForCausalLM``) gives a ``HybridModel`` (its layer pattern, Mamba
sizes, convolution width and chunk size from config.json); ``pretrain_hybrid.py`` is the entry point for those.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

# Run settings taken from the flags; everything else about the model comes from config.json.
_RUN_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "sequence_parallel", "bf16", "fp16", "params_dtype", "pipeline_dtype", "recompute_granularity",
               "recompute_method", "recompute_num_layers", "recompute_modules", "hidden_dropout", "attention_dropout", "init_method_std",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type",
               "moe_aux_loss_coeff", "moe_grouped_gemm")


def load_bridge(path: str, load_weights: bool = True) -> Any:
    """The ``AutoBridge`` of a Hugging Face directory (imported here, so runs without ``--hf-model`` never need it)."""
    from megatron_core.models.hf import AutoBridge

    return AutoBridge.from_hf_pretrained(path, load_weights=load_weights)


def apply_hf_model_args(args: argparse.Namespace) -> Any:
    """Fill the model-shape flags from ``--hf-model``'s config.json; returns the bridge (``None`` without the flag)."""
    if not getattr(args, "hf_model", None):
        return None
    bridge = load_bridge(args.hf_model, load_weights=False)
    c, m = bridge.family.config_kwargs, bridge.family.model_kwargs
    shape = dict(num_layers=c["num_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["ffn_hidden_size"],
                 num_attention_heads=c["num_attention_heads"], num_query_groups=c.get("num_query_groups"),
                 kv_channels=c.get("kv_channels"), max_position_embeddings=m["max_sequence_length"],
                 position_embedding_type=m["position_embedding_type"], normalization=c["normalization"])
    if m["position_embedding_type"] == "rope":
        shape["rotary_base"] = int(m["rotary_base"])
    for name, value in shape.items():
        given = getattr(args, name)
        if given is not None and value is not None and given != value:
            raise ValueError(f"--{name.replace('_', '-')} {given} contradicts --hf-model {args.hf_model} "
                             f"(config.json gives {value}); leave it out")
        setattr(args, name, value)
    args.norm_epsilon = c["layernorm_epsilon"]
    args.swiglu = bool(c.get("gated_linear_unit"))
    args.disable_bias_linear = not c.get("add_bias_linear", True)
    args.untie_embeddings_and_output_weights = not m["share_embeddings_and_output_weights"]
    args.seq_length = args.seq_length or min(2048, m["max_sequence_length"])
    if os.path.isfile(os.path.join(args.hf_model, "tokenizer.json")):
        args.tokenizer_type = args.tokenizer_type or "HuggingFaceTokenizer"
        args.tokenizer_model = args.tokenizer_model or args.hf_model
    elif args.tokenizer_type is None:
        args.vocab_size = args.vocab_size or bridge.family.vocab_size
    return bridge


def hf_tokenizer(bridge: Any, args: argparse.Namespace, fallback):
    """The directory's tokenizer when it has one (``tokenizer.json``), else ``fallback(args)``."""
    if os.path.isfile(os.path.join(bridge.directory, "tokenizer.json")) and args.tokenizer_model == bridge.directory:
        return bridge.tokenizer()
    return fallback(args)


def hf_model_chunks(bridge: Any, args: argparse.Namespace, base_config) -> tuple[object, list, int]:
    """``(config, chunks, padded vocab)``: this rank's GPTModel chunks (one HybridModel for a hybrid Mamba model)
    with the HF weights loaded."""
    run = {name: getattr(base_config, name) for name in _RUN_FIELDS if hasattr(base_config, name)}
    if not bridge.family.config_kwargs.get("num_moe_experts"):
        run = {k: v for k, v in run.items() if not k.startswith("moe_")}
    config = bridge.transformer_config(**run, perform_initialization=False,
                                       use_cpu_initialization=base_config.use_cpu_initialization)
    chunks = bridge.to_megatron_model(config=config, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    vocab = chunks[0].vocab_size
    return config, chunks, vocab

