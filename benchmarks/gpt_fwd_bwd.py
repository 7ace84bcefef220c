"""Time GPTModel forward + backward against torch.compile'd Hugging Face Llama (protocol: BENCHMARK.md).

Reference config "tinyllama-1.1b": 22 layers, hidden 2048, 32 heads, 4 query groups, FFN 5632
(SwiGLU), RMSNorm, RoPE, no biases, untied, vocab 32000, sequence 2048, micro-batch 2, bf16.
Each contender runs ``fwd+bwd`` (forward with labels, mean loss, backward, no optimizer):
median step time of ``--steps`` steps after ``--warmup`` steps, with device synchronisation.
MFU uses FLOPs/token = 6 * N + 12 * L * H * Q * T (N excludes the input embedding) and a peak
of 989 TFLOP/s (H100 SXM dense bf16).

    PYTHONPATH=src python3 benchmarks/gpt_fwd_bwd.py --compile   # GPU: reference config + HF baseline
    PYTHONPATH=src python3 benchmarks/gpt_fwd_bwd.py --tiny      # CPU smoke test (fp32, tiny shapes)

``--compile`` compiles each TransformerLayer and the loss; ``--compile-model`` the whole model.
The last line printed is a ``RESULT`` line comparing the two MFUs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_core import device as mdevice
from megatron_core import tensor_parallel
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.training_metrics import PEAK_FLOPS as TABLE_PEAK_FLOPS
from megatron_core.training_metrics import model_flops_utilization, training_flops_per_token
from megatron_core.transformer import TransformerConfig

PEAK_FLOPS = TABLE_PEAK_FLOPS["H100"]


def add_timing_argument(parser: argparse.ArgumentParser) -> None:
    """``--timing``: how :func:`time_steps` times a step."""
    parser.add_argument("--timing", choices=("sync", "events"), default="sync",
                        help="sync: synchronise after each step (the anchors' harness); events: CUDA events per "
                             "step, one synchronisation at the end (the host runs ahead, as in training)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--query-groups", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each of our TransformerLayers and the loss (fused fp32 cross entropy)")
    p.add_argument("--compile-model", action="store_true", help="torch.compile our whole GPTModel instead")
    add_timing_argument(p)
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="our loss through fusions.fused_vocab_parallel_cross_entropy (used outside torch.compile)")
    p.add_argument("--no-rope-fusion", action="store_true",
                   help="split QKV and apply RoPE unfused (default: one Triton kernel each way on CUDA)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--hf-eager", action="store_true", help="run the Hugging Face baseline without torch.compile")
    p.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny shapes, fp32, 2 steps")
    p.add_argument("--causal-mask-tensor", action="store_true",
                   help="pass the [1, 1, s, s] boolean causal mask as Megatron's loops do (default: no mask)")
    args = p.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.heads, args.query_groups, args.ffn = 2, 64, 4, 2, 128
        args.vocab, args.seq, args.mbs, args.steps, args.warmup = 256, 32, 2, 2, 1
    return args


def flops_per_token(args: argparse.Namespace, n_params_no_embedding: int) -> float:
    """PaLM / nanoGPT convention (:func:`megatron_core.training_metrics.training_flops_per_token`)."""
    return training_flops_per_token(n_params_no_embedding, args.layers, args.hidden, args.seq)


def build_ours(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    """The reference config as a GPTModel with the local spec."""
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, ffn_hidden_size=args.ffn, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion, add_bias_linear=False,
        apply_rope_fusion=not args.no_rope_fusion,
        hidden_dropout=0.0,
        attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype, layernorm_epsilon=1e-5,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), args.vocab, args.seq, position_embedding_type="rope")
    model = model.to(mdevice.get_current_device())
    if args.compile or args.compile_model:
        options = {"mode": args.compile_mode} if args.compile_mode else {}
        if args.compile_model:
            return torch.compile(model, **options)
        for layer in model.decoder.layers:
            layer.compile(**options)
        model.compute_language_model_loss = torch.compile(model.compute_language_model_loss, **options)
    return model


def build_hf(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    """The same shapes as Hugging Face LlamaForCausalLM (sdpa), compiled unless ``--hf-eager``."""
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.query_groups, max_position_embeddings=args.seq,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(hf_config).to(dtype=dtype, device=mdevice.get_current_device())
    return model if args.hf_eager else torch.compile(model)


def time_steps(step: Callable[[], None], args: argparse.Namespace) -> float:
    """Median seconds per step over ``args.steps`` after ``args.warmup``.

    ``args.timing`` "sync" (default) synchronises the device after every step and reads the wall clock;
    "events" (CUDA) brackets each step with CUDA events and synchronises once at the end, so the host
    queues the next step while the GPU works, as in a training loop (both are BENCHMARK.md's protocol).
    """
    for _ in range(args.warmup):
        step()
    mdevice.synchronize()
    if getattr(args, "timing", "sync") == "events" and mdevice.get_current_device().type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.steps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        mdevice.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(name: str, seconds: float, args: argparse.Namespace, n_params_no_embedding: int) -> float:
    """Print one contender's figures; returns its MFU in percent."""
    return report_flops(name, seconds, args, flops_per_token(args, n_params_no_embedding))


def report_flops(name: str, seconds: float, args: argparse.Namespace, fpt: float, width: int = 34) -> float:
    """Print one contender's time, tokens/s, TFLOP/s, MFU (``fpt`` FLOPs per token) and peak memory; returns MFU %."""
    tok_s = args.mbs * args.seq / seconds
    mfu = 100 * model_flops_utilization(tok_s, fpt, PEAK_FLOPS)
    print(f"{name:<{width}} {seconds * 1e3:9.1f} ms  {tok_s:11,.0f} tok/s  {tok_s * fpt / 1e12:7.1f} TFLOP/s  "
          f"MFU {mfu:5.1f}%  peak {mdevice.max_memory_allocated() / 1e9:6.2f} GB")
    return mfu


def time_contender(name: str, model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor],
                   args: argparse.Namespace, fpt: float, width: int = 34) -> float:
    """Time one model's fwd+bwd (gradients dropped after each step); prints and returns its MFU in percent."""
    def step() -> None:
        loss_fn().backward()
        for p in model.parameters():
            p.grad = None

    if mdevice.get_current_device().type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return report_flops(name, time_steps(step, args), args, fpt, width)


def run_contender(name: str, model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor],
                  args: argparse.Namespace, n_params_no_embedding: int) -> float:
    """Time one model's fwd+bwd at the dense-transformer FLOP count; prints and returns its MFU in percent."""
    return time_contender(name, model, loss_fn, args, flops_per_token(args, n_params_no_embedding))


def print_kernel_profile(step: Callable[[], None], steps: int = 3, rows: int = 25, shapes: bool = False,
                         trace: str | None = None) -> None:
    """Profile ``steps`` steps and print the kernels (CPU ops off CUDA) with the most time; with ``shapes`` the ops
    are listed per input shape (eager ops only: a compiled graph launches its kernels without them); with ``trace``
    the Chrome trace is written there and the GPU's idle gaps printed (``trace_kernels.py --gaps``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = mdevice.get_current_device().type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 record_shapes=shapes) as prof:
        for _ in range(steps):
            step()
        mdevice.synchronize()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages(group_by_input_shape=shapes).table(sort_by=sort, row_limit=rows,
                                                               max_name_column_width=70))
    if trace is not None:
        from trace_kernels import print_idle_gaps

        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))

        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)
        print_idle_gaps(Path(trace), min_us=5.0, rows=25)


def measure_ours(args: argparse.Namespace, dtype: torch.dtype, ids: torch.Tensor, position_ids: torch.Tensor,
                 labels: torch.Tensor) -> tuple[int, float]:
    """Build and time our GPTModel; returns (parameter count without the input embedding, MFU %)."""
    ours = build_ours(args, dtype)
    n_params = sum(p.numel() for p in ours.parameters())
    n_no_embedding = n_params - ours.embedding.word_embeddings.weight.numel()
    print(f"parameters {n_params / 1e9:.3f} B, FLOPs/token {flops_per_token(args, n_no_embedding) / 1e9:.2f} G")
    label = "megatron_core" + (" (compiled model)" if args.compile_model else
                               " (compiled layers)" if args.compile else " eager")
    mask = None
    if args.causal_mask_tensor:
        mask = torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool, device=ids.device).triu_(1)
        label += ", causal mask tensor passed"
    mfu = run_contender(label, ours, lambda: ours(ids, position_ids, mask, labels=labels).mean(), args,
                        n_no_embedding)
    return n_no_embedding, mfu


def main() -> None:
    args = parse_args()
    dev = mdevice.get_current_device()
    dtype = torch.float32 if args.tiny or dev.type != "cuda" else torch.bfloat16
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    ids = torch.randint(0, args.vocab, (args.mbs, args.seq), device=dev)
    labels = torch.randint(0, args.vocab, (args.mbs, args.seq), device=dev)
    position_ids = torch.arange(args.seq, device=dev).unsqueeze(0).expand(args.mbs, -1)
    print(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{dtype}, layers {args.layers}, hidden {args.hidden}, heads {args.heads}/{args.query_groups}, "
          f"ffn {args.ffn}, vocab {args.vocab}, seq {args.seq}, mbs {args.mbs}")

    n_no_embedding, ours_mfu = measure_ours(args, dtype, ids, position_ids, labels)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    if not args.no_hf:
        try:
            hf = build_hf(args, dtype)
        except ImportError:
            print("transformers is not installed; skipping the Hugging Face baseline")
            return
        label = "HF Llama sdpa" + (" eager" if args.hf_eager else " torch.compile")
        hf_mfu = run_contender(label, hf, lambda: hf(input_ids=ids, labels=labels).loss, args, n_no_embedding)
        print(f"RESULT fwd+bwd MFU: megatron_core {ours_mfu:.1f}% vs {label} {hf_mfu:.1f}% "
              f"({ours_mfu / hf_mfu if hf_mfu else float('nan'):.2f}x)")


if __name__ == "__main__":
    main()
