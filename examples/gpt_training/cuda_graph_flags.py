"""``--cuda-graph-impl``: the flags a recorded layer (``local``) or a captured iteration (``full_iteration``) cannot
serve, refused by their command-line names.

The library's ``TransformerConfig`` refuses the same settings by field name (``recompute_granularity``,
``sequence_parallel``, ...) while the model is built; checking the flags first lets ``pretrain_gpt.py`` say which
flags the user has to change.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["validate_cuda_graph_args"]

_GENERATOR_SWAP = "which a CUDA graph capture forbids"


def validate_cuda_graph_args(args: argparse.Namespace, require: Callable[[bool, str], None]) -> None:
    """The ``--cuda-graph-impl`` rules; ``require(condition, message)`` raises the parser's error."""
    if args.cuda_graph_impl == "local":
        require(args.recompute_granularity != "full",
                "--recompute-granularity full cannot be combined with --cuda-graph-impl local: a recomputed layer "
                "cannot be replayed from its recorded graph (--recompute-granularity selective can)")
    if args.cuda_graph_impl != "full_iteration":
        return
    require(args.cuda_graph_warmup_steps >= 0,
            f"--cuda-graph-warmup-steps ({args.cuda_graph_warmup_steps}) must be >= 0")
    for flag, given, why in (
            ("--step-time-breakdown", args.step_time_breakdown, "its timers read the clock inside the step"),
            ("--use-torch-fsdp2", args.use_torch_fsdp2, "FSDP2's hooks manage parameters on the host"),
            ("--overlap-param-gather", args.overlap_param_gather, "the all-gather's dispatch state lives on the host"),
            ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size > 1, "untested with pipelining"),
            ("--sequence-parallel", args.sequence_parallel,
             f"its RNG-tracker fork swaps generator states, {_GENERATOR_SWAP}"),
            (f"--recompute-granularity {args.recompute_granularity}", args.recompute_granularity is not None,
             f"recomputation saves and restores generator states, {_GENERATOR_SWAP}"),
            (f"--attention-dropout {args.attention_dropout}", args.attention_dropout > 0,
             f"the RNG-tracker fork around attention dropout swaps generator states, {_GENERATOR_SWAP}")):
        require(not given, f"{flag} cannot be combined with --cuda-graph-impl full_iteration: {why}")
    if args.num_experts is not None:
        _validate_moe(args, require)


def _validate_moe(args: argparse.Namespace, require: Callable[[bool, str], None]) -> None:
    """MoE in a captured iteration: only where the tokens-per-expert counts never leave the device (the library's
    ``transformer_validation._check_full_iteration_moe``, in flags)."""
    expert_tp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    padded = args.moe_pad_expert_input_to_capacity
    prefix = f"--num-experts {args.num_experts} with --cuda-graph-impl full_iteration"
    require(args.expert_model_parallel_size * expert_tp == 1,
            f"{prefix} needs every expert on each rank: --expert-model-parallel-size "
            f"{args.expert_model_parallel_size} x expert tensor-parallel size {expert_tp} (--expert-tensor-parallel-"
            "size, default --tensor-model-parallel-size) must be 1 (the token dispatch's collectives are sized on "
            "the host)")
    require(args.moe_grouped_gemm, f"{prefix} needs --moe-grouped-gemm (SequentialMLP splits rows by counts read "
                                   "on the host)")
    require(padded or args.moe_expert_capacity_factor is None,
            f"{prefix}: --moe-expert-capacity-factor {args.moe_expert_capacity_factor} drops tokens (the row count "
            "depends on the routing) unless --moe-pad-expert-input-to-capacity")
    require(padded or args.bf16 or args.fp16,
            f"{prefix}: fp32 experts run one GEMM per expert, sized by counts read on the host; add --bf16 / --fp16 "
            "or --moe-pad-expert-input-to-capacity")
