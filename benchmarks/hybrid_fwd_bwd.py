"""Time a Nemotron-H-shaped HybridModel forward + backward against torch.compile'd Hugging Face NemotronH.

Reference config (issue 43): hidden 2048, pattern ``M-M-M-M*-M-M-M-M*-M-M-M-M-`` (12 Mamba-2, 2 attention, 12
squared-ReLU MLP layers), Mamba 64 heads of 64 in 8 groups, state 128, conv 4, chunk 128; attention 16 heads of
128 in 8 KV groups, no RoPE; MLP 8192; vocab 131072, untied; sequence 4096, micro-batch 2, bf16; 1.32 B
parameters. Each contender runs ``fwd+bwd`` (forward with labels, mean loss, backward, no optimizer): median of
``--steps`` steps after ``--warmup`` (BENCHMARK.md's protocol). Hugging Face runs its PyTorch Mamba path: the
device has neither ``mamba_ssm`` nor ``causal_conv1d`` (the script prints which).

FLOPs per token (forward + backward), with N all parameters but the input embedding (the output layer counts):

    6 N  +  12 * L_attn * (heads * head_dim) * T  +  3 * L_mamba * [2 g Q n + 2 h Q p + 4 h p n]

The last term is the chunked scan's own FLOPs (forward times three) at the model's chunk length Q = 128: the
per-group ``C B^T`` of each chunk (``2 Q n`` per group and token), the decay-weighted scores times ``x``
(``2 Q p`` per head), the chunk states and their contribution to the output (``2 p n`` each per head); causal
halves are not taken off, as for attention. The convolution's FLOPs are in 6 N (its weight is a parameter).
MFU divides by 989 TFLOP/s (H100/H200 dense bf16).

``--scan-bench`` also times the SSD scan kernels alone at the model's shapes against their bound, and the reference
kernel ``mamba_ssm``'s ``mamba_chunk_scan_combined`` at chunk 64 and 128 where it can be imported;
``--scan-variants`` adds a table of block shapes per kernel; ``--scan-only`` skips the models (see
``benchmarks/ssd_scan_bench.py``).

    PYTHONPATH=src python3 benchmarks/hybrid_fwd_bwd.py --compile --scan-bench   # GPU
    PYTHONPATH=src:benchmarks python3 benchmarks/hybrid_fwd_bwd.py --scan-bench --scan-variants --scan-only  # GPU
    PYTHONPATH=src python3 benchmarks/hybrid_fwd_bwd.py --tiny --hf-eager          # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import importlib.util

import torch
from gpt_fwd_bwd import (  # the same step timer and report for every fwd+bwd benchmark
    add_timing_argument,
    print_kernel_profile,
    time_contender,
)
from ssd_scan_bench import run_scan_bench, scan_flops

from megatron_core import device as mdevice
from megatron_core import tensor_parallel
from megatron_core.activations import squared_relu
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.transformer import TransformerConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pattern", default="M-M-M-M*-M-M-M-M*-M-M-M-M-")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--mamba-heads", type=int, default=64)
    p.add_argument("--mamba-head-dim", type=int, default=64)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--query-groups", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile each of our layers and the loss")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode for our layers")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--hf-eager", action="store_true", help="run the Hugging Face baseline without torch.compile")
    p.add_argument("--scan-bench", action="store_true", help="time the SSD scan kernels against their bound")
    p.add_argument("--scan-variants", action="store_true", help="with --scan-bench: also time other block sizes")
    p.add_argument("--scan-only", action="store_true", help="with --scan-bench: time the scan kernels only")
    p.add_argument("--profile", action="store_true", help="print our step's 20 most expensive GPU kernels")
    p.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny shapes, fp32, 2 steps")
    add_timing_argument(p)
    args = p.parse_args()
    if args.tiny:
        args.pattern, args.hidden, args.mamba_heads, args.mamba_head_dim, args.groups = "M*M-", 32, 4, 8, 2
        args.state, args.chunk, args.heads, args.query_groups, args.head_dim = 8, 8, 4, 2, 8
        args.ffn, args.vocab, args.seq, args.mbs, args.steps, args.warmup = 64, 128, 32, 2, 2, 1
    return args


def scan_flops_per_token(args: argparse.Namespace, chunk: int) -> float:
    """Forward FLOPs of the chunked scan per token and Mamba layer: ``2 g Q n + 2 h Q p + 4 h p n``."""
    return scan_flops(args.groups, args.state, args.mamba_heads, args.mamba_head_dim, chunk)


def flops_per_token(args: argparse.Namespace, n_params_no_embedding: int) -> float:
    """``6 N + 12 L_attn W T + 3 L_mamba scan`` (see the module docstring)."""
    attention = 12 * args.pattern.count("*") * args.heads * args.head_dim * args.seq
    scan = 3 * args.pattern.count("M") * scan_flops_per_token(args, args.chunk)
    return 6 * n_params_no_embedding + attention + scan


def build_ours(args: argparse.Namespace, dtype: torch.dtype) -> HybridModel:
    config = TransformerConfig(
        num_layers=len(args.pattern), hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, kv_channels=args.head_dim, ffn_hidden_size=args.ffn,
        activation_func=squared_relu, gated_linear_unit=False, normalization="RMSNorm", layernorm_epsilon=1e-5,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=dtype == torch.bfloat16,
        params_dtype=dtype, mamba_state_dim=args.state, mamba_head_dim=args.mamba_head_dim,
        mamba_num_groups=args.groups, mamba_num_heads=args.mamba_heads,
    )
    model = HybridModel(config, hybrid_stack_spec, args.vocab, args.seq, hybrid_layer_pattern=args.pattern,
                        position_embedding_type="none").to(mdevice.get_current_device())
    for layer in model.decoder.layers:
        if hasattr(layer, "mixer"):
            layer.mixer.chunk_size = args.chunk
    if args.compile:
        options = {"mode": args.compile_mode} if args.compile_mode else {}
        for layer in model.decoder.layers:
            layer.compile(**options)
        model.compute_language_model_loss = torch.compile(model.compute_language_model_loss, **options)
    return model


def build_hf(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    cfg = transformers.NemotronHConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=len(args.pattern),
        hybrid_override_pattern=args.pattern, num_attention_heads=args.heads, num_key_value_heads=args.query_groups,
        head_dim=args.head_dim, intermediate_size=args.ffn, mamba_num_heads=args.mamba_heads,
        mamba_head_dim=args.mamba_head_dim, n_groups=args.groups, ssm_state_size=args.state, conv_kernel=4,
        chunk_size=args.chunk, layer_norm_epsilon=1e-5, tie_word_embeddings=False, use_mamba_kernels=False,
        max_position_embeddings=args.seq,
    )
    model = transformers.NemotronHForCausalLM(cfg).to(dtype=dtype, device=mdevice.get_current_device())
    return model if args.hf_eager else torch.compile(model)


def measure_ours(args: argparse.Namespace, dtype: torch.dtype, ids: torch.Tensor, position_ids: torch.Tensor,
                 labels: torch.Tensor) -> tuple[float, float]:
    """Build and time our HybridModel; returns (MFU %, FLOPs per token); the model is freed on return."""
    ours = build_ours(args, dtype)
    n_params = sum(p.numel() for p in ours.parameters())
    n_no_embedding = n_params - ours.embedding.word_embeddings.weight.numel()
    fpt = flops_per_token(args, n_no_embedding)
    print(f"parameters {n_params / 1e9:.3f} B ({n_no_embedding / 1e9:.3f} B without the input embedding), "
          f"FLOPs/token {fpt / 1e9:.2f} G (6N {6 * n_no_embedding / 1e9:.2f} G, scan "
          f"{3 * args.pattern.count('M') * scan_flops_per_token(args, args.chunk) / 1e9:.3f} G)")

    def our_loss() -> torch.Tensor:
        return ours(ids, position_ids, None, labels=labels).mean()

    label = "megatron_core HybridModel" + (" (compiled layers)" if args.compile else " eager")
    mfu = time_contender(label, ours, our_loss, args, fpt, width=40)
    if args.profile and mdevice.get_current_device().type == "cuda":
        print_kernel_profile(lambda: our_loss().backward(), steps=2, rows=20)
    return mfu, fpt


def main() -> None:
    args = parse_args()
    dev = mdevice.get_current_device()
    dtype = torch.float32 if args.tiny or dev.type != "cuda" else torch.bfloat16
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    ids = torch.randint(0, args.vocab, (args.mbs, args.seq), device=dev)
    labels = torch.randint(0, args.vocab, (args.mbs, args.seq), device=dev)
    position_ids = torch.arange(args.seq, device=dev).unsqueeze(0).expand(args.mbs, -1)
    kernels = {name: importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d")}
    print(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{dtype}, pattern {args.pattern}, hidden {args.hidden}, mamba {args.mamba_heads}x{args.mamba_head_dim} "
          f"groups {args.groups} state {args.state} chunk {args.chunk}, attention {args.heads}/{args.query_groups}"
          f"x{args.head_dim}, ffn {args.ffn}, vocab {args.vocab}, seq {args.seq}, mbs {args.mbs}; installed: "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in kernels.items()))

    if args.scan_bench and args.scan_only and dev.type == "cuda":
        run_scan_bench(args.mbs, args.seq, args.mamba_heads, args.mamba_head_dim, args.groups, args.state,
                       variants=args.scan_variants)
        return
    ours_mfu, fpt = measure_ours(args, dtype, ids, position_ids, labels)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        if args.scan_bench:
            run_scan_bench(args.mbs, args.seq, args.mamba_heads, args.mamba_head_dim, args.groups, args.state,
                           variants=args.scan_variants)
            gc.collect()
            torch.cuda.empty_cache()

    if not args.no_hf:
        try:
            hf = build_hf(args, dtype)
        except ImportError:
            print("transformers is not installed; skipping the Hugging Face baseline")
            return
        hf_label = "HF NemotronH (torch path)" + (" eager" if args.hf_eager else " torch.compile")
        hf_mfu = time_contender(hf_label, hf, lambda: hf(input_ids=ids, labels=labels).loss, args, fpt, width=40)
        print(f"RESULT fwd+bwd MFU: megatron_core {ours_mfu:.1f}% vs {hf_label} {hf_mfu:.1f}% "
              f"({ours_mfu / hf_mfu if hf_mfu else float('nan'):.2f}x)")


if __name__ == "__main__":
    main()
