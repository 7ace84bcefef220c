"""Command-line flags of ``pretrain_gpt.py``, named as Megatron-LM names them, and their validation."""

from __future__ import annotations

import argparse
import ast

from gpt_training.cuda_graph_flags import validate_cuda_graph_args
from gpt_training.fp8 import add_fp8_arguments, validate_fp8_args
from gpt_training.hf_model import apply_hf_model_args
from gpt_training.optimizer_flags import validate_optimizer_precision_args
from gpt_training.presets import PRESETS, apply_preset
from gpt_training.upcycling import validate_upcycling_args
from megatron_core.device import cuda_available


def _parallel(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false",
                   help="interleaved pipelines: exchange activations and gradients between stages without overlapping "
                        "them with the other half of each step (Megatron-LM's flag; the overlap is on by default and "
                        "only the interleaved schedule has it)")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer of the first pipeline stage when splitting layers")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as one layer of the last pipeline stage")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence over this many ranks (load-balanced chunks)")
    g.add_argument("--cp-comm-type", choices=["p2p", "all_gather", "a2a", "a2a+p2p"], default="p2p",
                   help="context-parallel attention exchange (a2a: Ulysses all-to-all; p2p: ring)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="the loss in fused passes over the logits, without an fp32 copy of them")
    g.add_argument("--cross-entropy-fusion-impl", choices=["native", "te"], default="native")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="compute SwiGLU with separate operations instead of one fused function each way")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false",
                   help="split the QKV projection and apply RoPE with separate operations instead of one fused "
                        "kernel each way (the fused kernel runs on CUDA with Triton; Megatron-LM's flag)")
    g.add_argument("--gradient-accumulation-fusion", action=argparse.BooleanOptionalAction, default=None,
                   help="weight-gradient GEMMs accumulate straight into the fp32 main_grad (with DDP; default: on "
                        "on CUDA unless --use-torch-fsdp2, as Megatron-LM's default)")
    g.add_argument("--overwrite-main-grad-on-first-wgrad", action=argparse.BooleanOptionalAction, default=None,
                   help="zero_grad_buffer() skips the main_grad of weights written by the fused weight-gradient GEMM, "
                        "whose first GEMM of the step writes instead of adding (our extension; default: on exactly "
                        "when --gradient-accumulation-fusion is)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="shard parameters, gradients and optimizer state with PyTorch FSDP2 "
                        "(TorchFullyShardedDataParallel) instead of DDP")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def _model(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--hf-model", default=None, help="fine-tune from this Hugging Face directory (shape, weights, "
                   "tokenizer); see docs/hf_conversion.md")
    g.add_argument("--model-preset", choices=sorted(PRESETS), default=None,
                   help="fills the model-shape flags you leave unset")
    g.add_argument("--num-layers", dest="num_layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default=None)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=None)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None)
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary of --mock-data / NullTokenizer")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="+", default=None,
                   help="with --recompute-granularity selective: core_attn (the default), mlp, layernorm, and for "
                        "MoE layers moe, moe_act, shared_experts")
    g.add_argument("--use-cpu-initialization", action=argparse.BooleanOptionalAction, default=True,
                   help="initialise full weights on the CPU and keep this rank's shard (the same weights under "
                        "every tensor-parallel size); --no-use-cpu-initialization initialises on the device "
                        "(fast for large models)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer and the loss (GPU speed-up; first steps compile)")
    g.add_argument("--cuda-graph-impl", choices=("none", "local", "full_iteration"), default="none",
                   help="local: record each transformer layer's forward and backward as CUDA graphs (through "
                        "torch.compile; on a GPU, in training) and replay them; full_iteration: capture the whole "
                        "forward-backward of a step (and of an evaluation batch) as one CUDA graph after "
                        "--cuda-graph-warmup-steps eager calls, then replay it (GPU only; megatron_core.full_cuda_graph)")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="eager calls before the full-iteration graph is captured, per stage (training, evaluation)")


def parse_layer_freq(text: str) -> int | list[int]:
    """``--moe-layer-freq``: an int, or a list written with literals, ``+`` and ``*`` (e.g. ``([0]*1+[1]*2)``)."""
    try:
        value = _evaluate_list_expression(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r}: {err}") from None
    if isinstance(value, list) and not all(v in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r}: a list holds 0 (dense) or 1 (MoE) per layer")
    if isinstance(value, int) and value < 1:
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r}: must be >= 1")
    return value


def _evaluate_list_expression(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate_list_expression(item) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate_list_expression(node.left), _evaluate_list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("only integers, lists, + and * are allowed")


def _mla(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-latent attention (DeepSeek-V2/V3)")
    g.add_argument("--multi-latent-attention", action="store_true", help="MLA (builds an MLATransformerConfig)")
    g.add_argument("--q-lora-rank", type=int, default=None, help="query latent width (None: one q projection)")
    g.add_argument("--kv-lora-rank", type=int, default=512)
    g.add_argument("--qk-head-dim", type=int, default=128)
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    g.add_argument("--v-head-dim", type=int, default=128)
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None, help="MLA's RoPE (default: yarn)")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0)
    g.add_argument("--mscale", type=float, default=1.0)
    g.add_argument("--mscale-all-dim", type=float, default=0.0)
    g.add_argument("--qk-layernorm", action="store_true", help="q/k norms (MLA: the latent RMSNorms)")


def _mtp(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-token prediction (DeepSeek-V3's MTP)")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="MTP depths after the decoder, each predicting one more future token (None: no MTP)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="weight of the MTP losses (averaged over the depths) in the gradients")


def _moe(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (None: dense model)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-layer-freq", type=parse_layer_freq, default=1,
                   help="N: one MoE layer every N layers (layer 0 first); or a list with 1 (MoE) / 0 (dense) per "
                        "layer, such as [0,1,1] or ([0]*1+[1]*2) (Megatron-LM's forms)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None)
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                                                  "quantile_balancing", "none"],
                   default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true")
    g.add_argument("--moe-per-layer-logging", action="store_true")
    g.add_argument("--moe-use-upcycling", action="store_true",
                   help="first MoE run only: upcycle the dense checkpoint in --load into this MoE model, save it "
                        "to --save at iteration 1 and train on")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="benchmark aid: random router logits (near-uniform expert loads), the router still trains")
    g.add_argument("--moe-routing-trace-path", default=None,
                   help="write every MoE router's top-k expert choices, one JSON line per (iteration, layer), to "
                        "DIR/router_trace_rank{rank}.jsonl (megatron_core.transformer.moe.router_trace)")
    g.add_argument("--moe-routing-trace-max-training-iters", type=int, default=None,
                   help="with --moe-routing-trace-path, trace this many iterations (default: --train-iters)")
    g.add_argument("--moe-routing-trace-capture-logits", action="store_true",
                   help="also write each router's gating logits (bf16) to DIR/logits_rank{rank}.bin")
    g.add_argument("--moe-routing-trace-capture-hidden-states", action="store_true",
                   help="also write each router's input (bf16) to DIR/hidden_states_rank{rank}.bin")
    g.add_argument("--moe-routing-trace-dump-weights", action="store_true",
                   help="also save each router's weight and expert bias to DIR/router_state_rank{rank}.pt")


def _training(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="stop (RuntimeError on every rank, before the optimizer step) on a non-finite loss or "
                        "gradient norm; --no-check-for-nan-in-loss-and-grad lets the optimizer skip such steps")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Adam keeps main params and moments in the dtypes below (needs --use-distributed-optimizer); "
                        "on CUDA one fused kernel per bucket shard updates them and writes the bf16 params")
    for flag in ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        g.add_argument(flag, choices=["fp32", "bf16", "fp16"], default="fp32")
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-interval", type=int, default=None, help="exit after this iteration (for tests)")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's threshold-triggered garbage collector off while training and collect only at "
                        "--manual-gc-interval and around evaluation (Megatron-LM's flag): no collection pauses the "
                        "host at a random point of a step")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc, collect every this many steps (0: never between steps)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc, do not collect before and after each evaluation")


def _data(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="a prefix, or weight-prefix pairs: '0.7 a_text_document 0.3 b_text_document'")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--tokenizer-type", default=None,
                   help="GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer, SentencePieceTokenizer, NullTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _logging_and_checkpoints(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging, evaluation and checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--fixed-validation-set", action="store_true",
                   help="evaluate on the same --eval-iters batches every time (by default, as in Megatron, "
                        "each evaluation draws the next batches of the validation split)")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None,
                   help="resume from this directory; it must hold a checkpoint, except when it is also --save "
                        "and still empty (the first run of a resumable job)")
    g.add_argument("--load-if-present", action="store_true",
                   help="start from scratch when --load holds no checkpoint instead of exiting with an error")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--log-json", default=None, help="also append one JSON line per log interval to this file")
    g.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress display")
    g.add_argument("--step-time-breakdown", action="store_true",
                   help="log where each step's time goes (compute, gradient sync, optimizer, pipeline bubble), "
                        "measured with CUDA events (no extra synchronisation), averaged over ranks")
    g.add_argument("--profile", action="store_true", help="record a window of steps with the PyTorch profiler")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="accepted for Megatron-LM compatibility; --profile always uses the PyTorch profiler")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--profile-dir", default="profile", help="where the Chrome traces go")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every flag ``pretrain_gpt.py`` accepts."""
    parser = argparse.ArgumentParser(description="Pretrain a GPT with megatron_core.", allow_abbrev=False)
    for add in (_parallel, _model, _mla, _moe, _mtp, _training, add_fp8_arguments, _data, _logging_and_checkpoints):
        add(parser)
    return parser


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _validate_torch_fsdp2(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for --use-torch-fsdp2: the layouts and options FSDP2 cannot serve."""
    if not args.use_torch_fsdp2:
        return
    _require(args.pipeline_model_parallel_size == 1, "--use-torch-fsdp2 is not supported with pipeline "
             f"parallelism (--pipeline-model-parallel-size {args.pipeline_model_parallel_size})")
    _require((args.expert_model_parallel_size or 1) == 1, "--use-torch-fsdp2 is not supported with expert "
             f"parallelism (--expert-model-parallel-size {args.expert_model_parallel_size})")
    _require(not args.use_distributed_optimizer, "--use-torch-fsdp2 cannot be combined with "
             "--use-distributed-optimizer (FSDP2 shards the optimizer state itself)")
    _require(not args.gradient_accumulation_fusion, "--use-torch-fsdp2 is not supported with "
             "--gradient-accumulation-fusion")
    _require(args.untie_embeddings_and_output_weights, "--use-torch-fsdp2 requires "
             "--untie-embeddings-and-output-weights (a tied embedding cannot live in two FSDP units)")
    _require(not args.fp16, "--use-torch-fsdp2 does not support --fp16 (use --bf16)")
    _require(not args.overlap_param_gather, "--use-torch-fsdp2 gathers parameters itself; drop --overlap-param-gather")
    _require(args.num_experts is None, f"--use-torch-fsdp2 is not supported with --num-experts ({args.num_experts}): "
             "FSDP2 cannot shard expert parameters (use DDP, optionally with --use-distributed-optimizer)")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Apply the preset, derive data-parallel size and gradient accumulation, and check the flags."""
    gqa_flags = args.num_query_groups is not None or args.group_query_attention  # given here, not by a preset
    apply_hf_model_args(args)
    apply_preset(args, {action.dest: action.default for action in build_parser()._actions})
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _require(getattr(args, name) is not None, f"--{name.replace('_', '-')} is required (or pick --model-preset)")
    args.position_embedding_type = args.position_embedding_type or "learned_absolute"
    args.normalization = args.normalization or "LayerNorm"
    args.rotary_base = args.rotary_base or 10000
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    _require(not (gqa_flags and args.multi_latent_attention),
             f"--num-query-groups ({args.num_query_groups}) / --group-query-attention do not apply to "
             "--multi-latent-attention (MLA projects keys and values from one latent of --kv-lora-rank)")
    _require(not (args.multi_latent_attention and args.rotary_percent != 1.0 and (args.rope_type or "yarn") == "yarn"),
             f"--rotary-percent ({args.rotary_percent}) does not apply to --multi-latent-attention with --rope-type "
             "yarn (the default): YaRN rotates all of --qk-pos-emb-head-dim; use --rope-type rope")
    if args.num_query_groups is not None:
        args.group_query_attention = True
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    _require(cp >= 1, f"--context-parallel-size ({cp}) must be >= 1")
    _require(world_size % (tp * pp * cp) == 0,
             f"world size ({world_size}) must be divisible by tensor ({tp}) x pipeline ({pp}) x context ({cp}) "
             "parallel sizes")
    _require(args.seq_length % (2 * cp) == 0 or cp == 1,
             f"--seq-length ({args.seq_length}) must be divisible by 2 x --context-parallel-size ({2 * cp})")
    args.data_parallel_size = world_size // (tp * pp * cp)
    _require(args.micro_batch_size >= 1, f"--micro-batch-size ({args.micro_batch_size}) must be >= 1")
    validate_fp8_args(args, _require)
    if args.gradient_accumulation_fusion is None:
        args.gradient_accumulation_fusion = cuda_available() and not args.use_torch_fsdp2
    if args.overwrite_main_grad_on_first_wgrad is None:
        # a recorded layer cannot honour a per-step first write (DistributedDataParallel refuses the pair)
        args.overwrite_main_grad_on_first_wgrad = (args.gradient_accumulation_fusion
                                                   and args.cuda_graph_impl not in ("local", "full_iteration"))
    _require(args.manual_gc_interval >= 0, f"--manual-gc-interval ({args.manual_gc_interval}) must be >= 0")
    _validate_torch_fsdp2(args)
    validate_cuda_graph_args(args, _require)
    validate_optimizer_precision_args(args, _require)
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    _require(args.global_batch_size % per_step == 0,
             f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size "
             f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size}) = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        accounted = int(args.account_for_embedding_in_pipeline_split) + int(args.account_for_loss_in_pipeline_split)
        per_rank = (args.num_layers + accounted) // pp
        _require(pp > 1 and per_rank % args.num_layers_per_virtual_pipeline_stage == 0,
                 f"--num-layers-per-virtual-pipeline-stage ({args.num_layers_per_virtual_pipeline_stage}) needs "
                 f"--pipeline-model-parallel-size > 1 and must divide (num_layers + accounted embedding/loss) / pp "
                 f"({per_rank})")
        args.virtual_pipeline_model_parallel_size = per_rank // args.num_layers_per_virtual_pipeline_stage
    # Megatron-LM's rule: overlapped exchanges exist only in the interleaved schedule, and then unbatched.
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are exclusive")
    _require(args.mock_data or args.data_path, "give --data-path PREFIX [...] or --mock-data")
    _require(args.mock_data or args.tokenizer_type, "--data-path needs --tokenizer-type (and its model/vocab files)")
    if args.mock_data and args.tokenizer_type is None:
        _require(args.vocab_size is not None, "--mock-data without --tokenizer-type needs --vocab-size")
        args.tokenizer_type = "NullTokenizer"
    _require(args.save_interval is None or args.save is not None, "--save-interval needs --save DIR")
    _require(not args.profile or 1 <= args.profile_step_start <= args.profile_step_end,
             f"--profile-step-start ({args.profile_step_start}) must be >= 1 and <= --profile-step-end "
             f"({args.profile_step_end})")
    _require(args.mtp_num_layers is None or args.mtp_num_layers >= 1,
             f"--mtp-num-layers ({args.mtp_num_layers}) must be >= 1")
    validate_upcycling_args(args)
    _validate_moe(args)
    _validate_counts(args)
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    _require(args.lr_warmup_iters < args.lr_decay_iters,
             f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than --lr-decay-iters "
             f"({args.lr_decay_iters}; it defaults to --train-iters)")
    return args


def _validate_moe(args: argparse.Namespace) -> None:
    """MoE flag rules that the library would otherwise report by field name while building the model, or only at
    the first training step (Megatron-LM's rules, given in its flags' names)."""
    if args.num_experts is not None:
        _require(args.cuda_graph_impl != "local", f"--cuda-graph-impl local cannot be combined with --num-experts "
                 f"({args.num_experts}): the tokens per expert change every step, so a recorded MoE layer cannot be "
                 "replayed")
        tp = args.tensor_model_parallel_size
        _require(tp == 1 or args.sequence_parallel,
                 f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel (MoE layers "
                 "split the tokens over the tensor-parallel ranks)")
        etp = args.expert_tensor_parallel_size or tp
        _require(etp == 1 or args.disable_bias_linear,
                 f"--num-experts with an expert tensor-parallel size of {etp} (--expert-tensor-parallel-size, "
                 "default --tensor-model-parallel-size) needs --disable-bias-linear (expert biases need "
                 "--expert-tensor-parallel-size 1)")
    shared = args.moe_shared_expert_intermediate_size
    _require(shared is None or args.num_experts is not None,
             f"--moe-shared-expert-intermediate-size ({shared}) needs --num-experts (shared experts belong to MoE "
             "layers)")
    _require(shared is None or args.disable_bias_linear,
             f"--moe-shared-expert-intermediate-size ({shared}) needs --disable-bias-linear (shared experts have no "
             "biases, as in Megatron-Core)")


def _validate_counts(args: argparse.Namespace) -> None:
    """Step counts and intervals: positive where they divide, ``--eval-iters 0`` meaning no evaluation and
    ``--train-iters 0`` no training (with ``--save``, the initial model is written)."""
    for name in ("train_iters", "eval_iters", "eval_interval", "lr_warmup_iters", "num_workers"):
        value = getattr(args, name)
        _require(value is None or value >= 0, f"--{name.replace('_', '-')} ({value}) must be >= 0")
    for name in ("micro_batch_size", "log_interval", "save_interval", "lr_decay_iters", "lr_wsd_decay_iters"):
        value = getattr(args, name)
        _require(value is None or value >= 1, f"--{name.replace('_', '-')} ({value}) must be >= 1")
    _require(args.lr >= 0 and args.min_lr >= 0, f"--lr ({args.lr}) and --min-lr ({args.min_lr}) must be >= 0")
    if args.eval_iters == 0:  # no evaluation at all, neither periodic nor at the end
        args.eval_interval = 0
