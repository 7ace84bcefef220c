"""Rebuild a GPT or hybrid (Mamba) model and its tokenizer from a checkpoint written by ``examples/pretrain_gpt.py``
(or any ``training.checkpointing.save_checkpoint`` of a ``GPTModel`` / ``HybridModel`` with its training args).

The model is rebuilt from the checkpoint's ``model_config`` record (the whole model configuration,
JSON, :mod:`megatron_core.training.model_config`); the training flags in
``extra_state["args"]`` give the tokenizer (``--tokenizer-type`` / ``--tokenizer-model``), and the
model too for checkpoints older than the record (with a warning). The model is built for this
process's tensor/pipeline layout (``parallel_state``) and the distributed checkpoint reshards
into it. The vocabulary is padded as in training (``--make-vocab-size-divisible-by`` times the
training tensor-parallel size), so the saved embedding shapes match.
"""

from __future__ import annotations

import atexit
import copy
import os
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.inference.cli.local_process_group import init_local_process_group

__all__ = [
    "init_distributed_for_inference", "load_gpt_from_checkpoint", "load_training_args", "model_from_record",
    "read_checkpoint_common",
]


def _destroy_process_group() -> None:
    import torch.distributed as dist

    from megatron_core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def init_distributed_for_inference(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """Start ``torch.distributed`` (torchrun's env, else a one-rank group on an in-memory store) and the model-parallel groups."""
    import torch.distributed as dist

    from megatron_core import device, parallel_state

    if not dist.is_initialized():
        backend = device.get_default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # One process: an in-memory store and no rendezvous port (init_local_process_group); under torchrun: env://.
        if os.environ.get("WORLD_SIZE", "1") == "1" and init_local_process_group(timedelta(minutes=10)):
            for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
                os.environ.setdefault(name, value)
        else:
            dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))
        # A group this function started is torn down at exit: a gloo group left to interpreter shutdown can abort
        # the process ("terminate called without an active exception") after all work is done.
        atexit.register(_destroy_process_group)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
        )


def read_checkpoint_common(load_dir: str, sharded_strategy: Any = None) -> tuple[dict[str, Any], int, str]:
    """``(common state, iteration, checkpoint directory)`` of the latest checkpoint in ``load_dir``.

    The tracker and the common state are read here, once; ``sharded_strategy`` (a ``TorchDistLoadShardedStrategy``)
    keeps the checkpoint's ``.metadata`` for the load that follows.
    """
    from megatron_core.dist_checkpointing.serialization import load_common_state_dict
    from megatron_core.dist_checkpointing.tracker import get_checkpoint_name, read_tracker

    if not os.path.isdir(load_dir):
        what = "is not a directory" if os.path.exists(load_dir) else "does not exist"
        raise FileNotFoundError(f"checkpoint directory {load_dir} {what}")
    iteration = read_tracker(load_dir)
    if iteration is None:
        raise FileNotFoundError(f"{load_dir} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    checkpoint_dir = str(get_checkpoint_name(load_dir, iteration))
    return load_common_state_dict(checkpoint_dir, sharded_strategy=sharded_strategy), iteration, checkpoint_dir


def load_training_args(load_dir: str) -> tuple[dict[str, Any], int]:
    """``(training flags, iteration)`` of the latest checkpoint in ``load_dir``."""
    common, iteration, _ = read_checkpoint_common(load_dir)
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


def _model_from_flags(args: dict[str, Any], vocab_size: int, tp: int, pp: int) -> torch.nn.Module:
    """The model of a checkpoint without a ``model_config`` record, from the subset of flags it can read."""
    from megatron_core import parallel_state
    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec

    return GPTModel(
        _config(args, tp, pp), get_gpt_layer_local_spec(), vocab_size,
        args.get("max_position_embeddings") or args["seq_length"],
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.get("untie_embeddings_and_output_weights", False),
        position_embedding_type=args.get("position_embedding_type", "learned_absolute"),
        rotary_percent=args.get("rotary_percent", 1.0), rotary_base=args.get("rotary_base", 10000),
    )


def model_from_record(record: dict[str, Any], where: str, tp: int, pp: int) -> torch.nn.Module:
    """The ``GPTModel`` or ``HybridModel`` (``MambaModel``) a ``model_config`` record describes, for this process's
    tensor/pipeline layout."""
    from megatron_core import parallel_state
    from megatron_core.models.gpt import GPTModel, get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron_core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron_core.training.model_config import transformer_config_from_record

    model_class = str(record.get("model_class", ""))
    if not model_class.endswith((":GPTModel", ":HybridModel", ":MambaModel")):
        raise ValueError(f"{where} holds a {record.get('model_class')}; only GPTModel and HybridModel (MambaModel) "
                         "checkpoints can be loaded here")
    if record.get("unrecorded_fields"):
        warnings.warn(f"{where}: config fields {record['unrecorded_fields']} could not be recorded at save time; "
                      "they take their defaults", stacklevel=2)
    dtype = _recorded_dtype(record)
    config = transformer_config_from_record(
        record, where, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype if pp > 1 else None, use_cpu_initialization=True, perform_initialization=False)
    model_args = record["model"]
    if not model_class.endswith(":GPTModel"):
        return _hybrid_from_record(config, model_args, where)
    if config.num_moe_experts is not None or config.multi_latent_attention:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm)
    rotary = model_args.get("rotary") or {}
    inv_freq = rotary.get("inv_freq")
    percent = 2 * len(inv_freq) / config.kv_channels if inv_freq else 1.0
    model = GPTModel(
        config, spec, int(model_args["vocab_size"]), int(model_args["max_sequence_length"]),
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(model_args.get("share_embeddings_and_output_weights", False)),
        position_embedding_type=model_args.get("position_embedding_type", "learned_absolute"),
        rotary_percent=percent, seq_len_interpolation_factor=rotary.get("seq_len_interpolation_factor"),
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, False) if config.mtp_num_layers else None,
    )
    _set_recorded_rotary(model, inv_freq)
    return model


def _hybrid_from_record(config: Any, model_args: dict[str, Any], where: str) -> torch.nn.Module:
    """A ``HybridModel`` with the local hybrid stack spec, the recorded layer pattern and Mamba mixer settings."""
    from megatron_core import parallel_state
    from megatron_core.models.hybrid import HybridModel
    from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    pattern = model_args.get("hybrid_layer_pattern")
    if not pattern:
        raise ValueError(f"{where}: the hybrid model's record has no hybrid_layer_pattern (saved by an older "
                         "megatron_core); re-save it to record the pattern")
    rotary = model_args.get("rotary") or {}
    inv_freq = rotary.get("inv_freq")
    spec = hybrid_stack_spec
    mixer_params = model_args.get("mamba_mixer")
    if mixer_params:  # the recorded convolution width and SSD chunk size of the Mamba mixers
        spec = copy.deepcopy(hybrid_stack_spec)
        mixer = spec.submodules.mamba_layer.submodules.mixer
        mixer.params = {**mixer.params, **{k: int(mixer_params[k]) for k in ("d_conv", "chunk_size")}}
    model = HybridModel(
        config, spec, int(model_args["vocab_size"]), int(model_args["max_sequence_length"]),
        hybrid_layer_pattern=pattern, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(model_args.get("share_embeddings_and_output_weights", False)),
        position_embedding_type=model_args.get("position_embedding_type", "none"),
        rotary_percent=2 * len(inv_freq) / config.kv_channels if inv_freq else 1.0,
        seq_len_interpolation_factor=rotary.get("seq_len_interpolation_factor"),
    )
    _set_recorded_rotary(model, inv_freq)
    return model


def _set_recorded_rotary(model: torch.nn.Module, inv_freq: list[float] | None) -> None:
    """Give the model's rotary embedding the exact frequencies (any RoPE scaling) it was trained with."""
    module = getattr(model, "rotary_pos_emb", None)
    if inv_freq and module is not None:
        module.inv_freq = torch.tensor(inv_freq, dtype=torch.float32, device=module.inv_freq.device)
        getattr(module, "_cache", {}).clear()


def _recorded_dtype(record: dict[str, Any]) -> torch.dtype:
    fields = record["transformer_config"]
    return torch.bfloat16 if fields.get("bf16") else torch.float16 if fields.get("fp16") else torch.float32


def load_gpt_from_checkpoint(load_dir: str, tokenizer_model: str | None = None) -> tuple[torch.nn.Module, Any, dict]:
    """``(model in eval mode on the current device, tokenizer, training args)``; call :func:`init_distributed_for_inference` first.

    The model is rebuilt from the checkpoint's ``model_config`` record (the whole configuration it was
    trained with, JSON); a checkpoint saved before that record existed is rebuilt from its training flags,
    with a warning (features those flags do not describe, such as sliding windows or RoPE scaling, are lost).
    """
    from megatron_core import device, parallel_state
    from megatron_core.datasets.tokenizers import build_tokenizer
    from megatron_core.dist_checkpointing.strategies import TorchDistLoadShardedStrategy
    from megatron_core.tensor_parallel import pad_vocab_size
    from megatron_core.training.checkpointing import load_checkpoint
    from megatron_core.training.model_config import MODEL_CONFIG_KEY, parse_model_config

    strategy = TorchDistLoadShardedStrategy()  # one read of each checkpoint file: see load_checkpoint
    common, iteration, checkpoint_dir = read_checkpoint_common(load_dir, sharded_strategy=strategy)
    args = (common.get("extra_state") or {}).get("args") or {}
    record = common.get(MODEL_CONFIG_KEY)
    if record is None and not args:
        raise ValueError(f"{checkpoint_dir} records neither the model configuration nor training args; it cannot "
                         "be rebuilt for inference")
    tokenizer = build_tokenizer(
        args.get("tokenizer_type") or "NullTokenizer", vocab_file=args.get("vocab_file"),
        merge_file=args.get("merge_file"), tokenizer_model=tokenizer_model or args.get("tokenizer_model"),
        vocab_size=args.get("vocab_size"),
    )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if record is not None:
        model = model_from_record(parse_model_config(record, checkpoint_dir), checkpoint_dir, tp, pp)
    else:
        warnings.warn(f"{checkpoint_dir} has no model_config record (saved by an older megatron_core): rebuilding "
                      "the model from its training flags, which do not describe every feature (sliding-window "
                      "attention, RoPE scaling, q/k norms, ...); re-save it to record the configuration", stacklevel=2)
        vocab_size = pad_vocab_size(tokenizer.vocab_size, args.get("make_vocab_size_divisible_by", 128),
                                    args.get("tensor_model_parallel_size", 1))
        model = _model_from_flags(args, vocab_size, tp, pp)
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model in {checkpoint_dir} only "
                         f"{model.vocab_size}: is --tokenizer-model the one it was trained with?")
    model = model.to(device.get_current_device())
    load_checkpoint(load_dir, [model], None, None, iteration=iteration, load_optimizer=False, load_rng=False,
                    common_state_dict=common, sharded_strategy=strategy)
    return model.eval(), tokenizer, args
