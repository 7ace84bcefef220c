"""Rebuild a GPT model and its tokenizer from a checkpoint written by ``examples/pretrain_gpt.py``.

The checkpoint's ``extra_state["args"]`` holds the training flags; they give the model shape and
the tokenizer (``--tokenizer-type`` / ``--tokenizer-model``). The model is built for this
process's tensor/pipeline layout (``parallel_state``) and the distributed checkpoint reshards
into it. The vocabulary is padded as in training (``--make-vocab-size-divisible-by`` times the
training tensor-parallel size), so the saved embedding shapes match.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["init_distributed_for_inference", "load_training_args", "load_gpt_from_checkpoint"]


def init_distributed_for_inference(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """Start ``torch.distributed`` (torchrun's env, else a one-rank gloo group on 127.0.0.1) and the model-parallel groups."""
    import torch.distributed as dist

    from megatron_core import device, parallel_state

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(port))
        backend = device.get_default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
        )


def load_training_args(load_dir: str) -> tuple[dict[str, Any], int]:
    """``(training flags, iteration)`` of the latest checkpoint in ``load_dir``."""
    from megatron_core.dist_checkpointing.serialization import load_common_state_dict
    from megatron_core.dist_checkpointing.training.checkpointing import get_checkpoint_name
    from megatron_core.dist_checkpointing.training.tracker import read_tracker

    iteration = read_tracker(load_dir)
    if iteration is None:
        raise FileNotFoundError(f"{load_dir} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    common = load_common_state_dict(get_checkpoint_name(load_dir, iteration))
    args = (common.get("extra_state") or {}).get("args")
    if not args:
        raise ValueError(f"the checkpoint in {load_dir} (iteration {iteration}) has no training args in extra_state")
    return args, iteration


def _config(args: dict[str, Any], tp: int, pp: int) -> Any:
    from megatron_core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.get("bf16") else torch.float16 if args.get("fp16") else torch.float32
    return TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], num_attention_heads=args["num_attention_heads"],
        num_query_groups=args.get("num_query_groups"), ffn_hidden_size=args.get("ffn_hidden_size"),
        kv_channels=args.get("kv_channels"), hidden_dropout=0.0, attention_dropout=0.0,
        normalization=args.get("normalization", "LayerNorm"), layernorm_epsilon=args.get("norm_epsilon", 1e-5),
        gated_linear_unit=bool(args.get("swiglu")), activation_func=F.silu if args.get("swiglu") else F.gelu,
        add_bias_linear=not args.get("disable_bias_linear", False), tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, params_dtype=dtype, bf16=bool(args.get("bf16")), fp16=bool(args.get("fp16")),
        pipeline_dtype=dtype if pp > 1 else None, use_cpu_initialization=True,
    )


def load_gpt_from_checkpoint(load_dir: str, tokenizer_model: str | None = None) -> tuple[torch.nn.Module, Any, dict]:
    """``(model in eval mode on the current device, tokenizer, training args)``; call :func:`init_distributed_for_inference` first."""
    from megatron_core import device, parallel_state
    from megatron_core.datasets.tokenizers import build_tokenizer
    from megatron_core.dist_checkpointing.training.checkpointing import load_checkpoint
    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_core.tensor_parallel import pad_vocab_size

    args, _ = load_training_args(load_dir)
    tokenizer = build_tokenizer(
        args.get("tokenizer_type") or "NullTokenizer", vocab_file=args.get("vocab_file"),
        merge_file=args.get("merge_file"), tokenizer_model=tokenizer_model or args.get("tokenizer_model"),
        vocab_size=args.get("vocab_size"),
    )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vocab_size = pad_vocab_size(tokenizer.vocab_size, args.get("make_vocab_size_divisible_by", 128),
                                args.get("tensor_model_parallel_size", 1))
    model = GPTModel(
        _config(args, tp, pp), get_gpt_layer_local_spec(), vocab_size,
        args.get("max_position_embeddings") or args["seq_length"],
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.get("untie_embeddings_and_output_weights", False),
        position_embedding_type=args.get("position_embedding_type", "learned_absolute"),
        rotary_percent=args.get("rotary_percent", 1.0), rotary_base=args.get("rotary_base", 10000),
    )
    model = model.to(device.get_current_device())
    load_checkpoint(load_dir, [model], None, None, load_optimizer=False, load_rng=False)
    return model.eval(), tokenizer, args
