"""``megatron-convert``: Hugging Face directories <-> distributed checkpoints, from one process.

::

    megatron-convert hf-to-mcore --hf /models/llama --out /ckpt/llama --tp 2 --pp 2
    torchrun --nproc-per-node 4 examples/pretrain_gpt.py --load /ckpt/llama --no-load-optim --no-load-rng ...
    megatron-convert mcore-to-hf --mcore /ckpt/run --out /models/llama-tuned [--hf-template /models/llama]

Hybrid Mamba models (NemotronH, Mamba2) convert the same way; their checkpoint also records the model
configuration, so ``megatron-generate --load`` serves it at any TP size.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megatron_core.command_line import run_command

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    """The ``megatron-convert`` command line."""
    parser = argparse.ArgumentParser(prog="megatron-convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF directory -> distributed checkpoint (iteration 0)")
    to_mcore.add_argument("--hf", required=True, help="HF model directory (config.json, *.safetensors, tokenizer)")
    to_mcore.add_argument("--out", required=True, help="checkpoint root to create (use it as --load)")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size the run will use (vocab padding)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size the run will use (checked)")
    to_mcore.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                          help="pad the vocabulary to a multiple of this x TP, as pretrain_gpt.py does (1: no padding)")
    to_hf = sub.add_parser("mcore-to-hf", help="distributed checkpoint -> HF directory")
    to_hf.add_argument("--mcore", "--load", dest="mcore", required=True, help="checkpoint root or iteration dir")
    to_hf.add_argument("--out", required=True, help="HF directory to create (written atomically)")
    to_hf.add_argument("--hf-template", default=None,
                       help="original HF directory (config.json, tokenizer); default: found in the checkpoint")
    to_hf.add_argument("--iteration", type=int, default=None, help="default: the tracker's latest iteration")
    to_hf.add_argument("--max-shard-size", default="5GB")
    to_hf.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: the checkpoint's dtype")
    to_hf.add_argument("--overwrite", action="store_true",
                       help="replace an earlier export in --out (a directory holding other files is refused)")
    for p in (to_mcore, to_hf):
        p.add_argument("--no-progress", action="store_true", help="no progress bar / lines")
    return parser


def training_flags(bridge, tp: int, pp: int, make_vocab_size_divisible_by: int) -> str:
    """``pretrain_gpt.py`` flags describing the converted model (Llama- and GPT-2-shaped models)."""
    c, m = bridge.family.config_kwargs, bridge.family.model_kwargs
    flags = [f"--num-layers {c['num_layers']}", f"--hidden-size {c['hidden_size']}",
             f"--ffn-hidden-size {c['ffn_hidden_size']}", f"--num-attention-heads {c['num_attention_heads']}",
             f"--normalization {c['normalization']}", f"--norm-epsilon {c['layernorm_epsilon']}",
             f"--position-embedding-type {m['position_embedding_type']}",
             f"--max-position-embeddings {m['max_sequence_length']}",
             f"--tensor-model-parallel-size {tp}", f"--pipeline-model-parallel-size {pp}",
             f"--make-vocab-size-divisible-by {make_vocab_size_divisible_by}"]
    if c.get("num_query_groups"):
        flags.append(f"--num-query-groups {c['num_query_groups']}")
    if c.get("kv_channels"):
        flags.append(f"--kv-channels {c['kv_channels']}")
    if c.get("gated_linear_unit"):
        flags.append("--swiglu")
    if not c.get("add_bias_linear", True):
        flags.append("--disable-bias-linear")
    if not m["share_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    if m["position_embedding_type"] == "rope":
        flags.append(f"--rotary-base {int(m['rotary_base'])}")
    return " ".join(flags)


def flags_cannot_express(bridge) -> list[str]:
    """Features of the model that ``pretrain_gpt.py``'s model flags do not describe (use ``--hf-model``)."""
    import torch.nn.functional as F

    c = bridge.family.config_kwargs
    missing = []
    if bridge.family.rope_llama3:
        missing.append("llama3 RoPE scaling")
    if c.get("qk_layernorm") and not c.get("multi_latent_attention"):
        missing.append("q/k layernorm")
    if c.get("add_qkv_bias") and not c.get("add_bias_linear"):
        missing.append("QKV-only biases")
    if c["activation_func"] not in (F.silu, F.gelu):
        missing.append(f"activation {c['activation_func'].__name__}")
    if c.get("softmax_type", "vanilla") != "vanilla":
        missing.append("attention sinks")
    if c.get("glu_linear_offset") or c.get("activation_func_clamp_value") is not None:
        missing.append("the offset / clamped GLU")
    if c.get("window_size") is not None:
        missing.append("sliding-window attention")
    if bridge.family.model_kwargs["position_embedding_type"] == "yarn":
        missing.append("YaRN RoPE")
    if c.get("multi_latent_attention"):
        missing.append("multi-latent attention")
    if c.get("experimental_attention_variant") is not None:
        missing.append(f"{c['experimental_attention_variant']} layers")
    if c.get("attention_output_gate"):
        missing.append("gated attention")
    if c.get("moe_router_score_function", "softmax") != "softmax" or c.get("moe_router_num_groups"):
        missing.append("sigmoid / group-limited MoE routing")
    return missing


def convert(args: argparse.Namespace) -> None:
    """Run the conversion ``args`` describe."""
    from megatron_core.models.hf.bridge import AutoBridge
    from megatron_core.models.hf.convert import export_mcore_to_hf, import_hf_to_mcore

    if args.command == "hf-to-mcore":
        if args.tp < 1 or args.pp < 1 or args.make_vocab_size_divisible_by < 1:
            raise ValueError(f"--tp ({args.tp}), --pp ({args.pp}) and --make-vocab-size-divisible-by "
                             f"({args.make_vocab_size_divisible_by}) must be >= 1")
        divisible = args.make_vocab_size_divisible_by if args.make_vocab_size_divisible_by > 1 else None
        path = import_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp,
                                  make_vocab_size_divisible_by=divisible, progress=not args.no_progress)
        bridge = AutoBridge.from_hf_pretrained(args.hf, load_weights=False)
        print(f"wrote {path}")
        if bridge.family.hybrid_pattern is not None:
            print(f"a {bridge.architecture} (HybridModel): generate with megatron-generate --load {args.out} "
                  f"(any --tp dividing the model); fine-tune with examples/pretrain_hybrid.py --hf-model {args.hf}")
            return
        print("train from it with: --load", args.out, "--no-load-optim --no-load-rng",
              training_flags(bridge, args.tp, args.pp, args.make_vocab_size_divisible_by))
        missing = flags_cannot_express(bridge)
        if missing:
            print(f"note: those flags cannot express {', '.join(missing)}; train with --hf-model {args.hf} "
                  "(which builds the model from config.json) instead")
    else:
        from megatron_core.models.hf.export import parse_size

        if parse_size(args.max_shard_size) < 1:
            raise ValueError(f"--max-shard-size {args.max_shard_size!r} must be at least one byte")
        export_mcore_to_hf(args.mcore, args.out, hf_template=args.hf_template, iteration=args.iteration,
                           max_shard_size=args.max_shard_size, dtype=_DTYPES.get(args.dtype) if args.dtype else None,
                           overwrite=args.overwrite, progress=not args.no_progress)
        print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-convert``: a user error is one line and exit status 2 (:mod:`megatron_core.command_line`)."""
    args = build_parser().parse_args(argv)
    return run_command("megatron-convert", lambda: convert(args))


if __name__ == "__main__":
    sys.exit(main())
