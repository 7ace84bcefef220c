"""Time an MoE GPTModel forward + backward against torch.compile'd Hugging Face Mixtral (protocol: BENCHMARK.md).

Reference config (issue 15): Mixtral-shaped, 16 layers, hidden 2048, 32 heads / 8 query groups, 8 experts,
top-2, expert FFN ``--ffn`` (SwiGLU), RMSNorm, RoPE, no biases, untied, vocab 32000, sequence 2048,
micro-batch 2, bf16, one GPU, grouped-GEMM experts. Each contender runs ``fwd+bwd`` (forward with
labels, mean loss, backward): median step time of ``--steps`` steps after ``--warmup``. MFU counts
the *active* parameters (attention, norms, router, top-k experts, output layer; not the input
embedding): FLOPs/token = 6 * N_active + 12 * L * H * T, peak 989 TFLOP/s (H100 SXM dense bf16).

A third measurement times the experts' six grouped GEMMs alone (fc1 and fc2: forward, data and weight
gradients; contiguous operands) against the same GEMMs dense, with the same total FLOPs, at two routings: the
tokens spread evenly over the experts, and the top-k of near-uniform router logits (what a freshly initialised
router produces; the ``RESULT`` line).

    PYTHONPATH=src python3 benchmarks/moe_fwd_bwd.py --compile   # GPU: reference config + HF baseline
    PYTHONPATH=src python3 benchmarks/moe_fwd_bwd.py --tiny      # CPU smoke test (fp32, tiny shapes)
    PYTHONPATH=src python3 benchmarks/moe_fwd_bwd.py --compile --fp8 tensorwise:hybrid --fp8-param --skip-ours --no-hf

``--fp8-param`` times the FP8 step twice more, each model wrapped in DDP with the distributed optimizer (one rank):
with the experts' (and dense layers') high-precision weights cast in every forward, and with them stored as FP8
parameters (``fp8_param``), which the optimizer step quantizes once per step. It prints each one's ``fwd+bwd``
(gradient-buffer zeroing, forward, backward) and, separately, its optimizer step (``finalize_model_grads`` and the
distributed optimizer's step; with ``fp8_param`` that step includes the quantization of the main weights into the
FP8 parameters), and a ``RESULT`` line with both ratios: ``fwd+bwd`` alone and ``fwd+bwd`` + optimizer step.

``--fp8-no-wgrad`` sets ``fp8_wgrad=False`` (weight gradients in bf16 from the unquantized operands) for the FP8
variants whose GEMMs honour it: the delayed recipe, the FP8 parameters of ``--fp8-param``, and the grouped GEMMs timed
alone; torchao's recipes refuse it, so their variants keep ``fp8_wgrad=True``. With the flag every FP8 label says
which one it ran.

``--compile`` compiles each layer's norms and attention and the loss (the MoE block has data-dependent
shapes and runs eagerly with one grouped GEMM per projection). The last lines are ``RESULT`` lines.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gpt_fwd_bwd import (  # the same step timer and report for every fwd+bwd benchmark
    add_timing_argument,
    print_kernel_profile,
    report_flops,
    time_contender,
    time_steps,
)

from megatron_core import device as mdevice
from megatron_core import tensor_parallel
from megatron_core.fp8 import convert_to_float8, fp8_grouped_gemm, grouped_swiglu
from megatron_core.fp8.expert_gemm_mode import EXPERT_GEMM_MODES, set_fp8_expert_gemm
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe.cutlass_grouped_gemm import set_moe_grouped_gemm_backend
from megatron_core.transformer.moe.grouped_linear import align_expert_rows, grouped_gemm


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--query-groups", type=int, default=8)
    p.add_argument("--ffn", type=int, default=5632, help="expert FFN hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sequential", action="store_true", help="SequentialMLP experts instead of grouped GEMM")
    p.add_argument("--aux-loss", type=float, default=0.0, help="moe_aux_loss_coeff (HF computes none by default)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="moe_expert_capacity_factor with every expert padded to its capacity (drops tokens: not the "
                        "dropless computation Hugging Face runs; for timing the capacity layout, e.g. with --no-hf)")
    p.add_argument("--compile", action="store_true", help="torch.compile each layer's norms and attention and the loss")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--no-rope-fusion", action="store_true",
                   help="split QKV and apply RoPE unfused (default: one Triton kernel each way on CUDA)")
    add_timing_argument(p)
    p.add_argument("--compile-moe", action="store_true",
                   help="torch.compile each whole layer, MoE block included (needs the sync-free EP=1 path)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode for --compile-moe / --compile, e.g. "
                   "max-autotune-no-cudagraphs (Inductor then autotunes Triton templates against aten's GEMMs)")
    p.add_argument("--compile-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a torch.compile option for --compile-moe / --compile (repeatable; not with --compile-mode): "
                        "an Inductor setting such as cpp_wrapper=True, combo_kernels=True or triton.cudagraphs=True "
                        "(the value a Python literal), or guard_filter_fn=NAME, a function of torch.compiler such as "
                        "skip_guard_on_all_nn_modules_unsafe")
    p.add_argument("--fp8-steps-only", action="store_true",
                   help="with --fp8 and --microbatches N > 1: time the FP8 model in steps of N micro-batches only "
                        "(not also one micro-batch a step)")
    p.add_argument("--profile", action="store_true", help="print our step's 25 most expensive GPU kernels (and, "
                   "with --fp8, those of the experts' FP8 grouped GEMMs timed alone)")
    p.add_argument("--hf-eager", action="store_true", help="run the Hugging Face baseline without torch.compile")
    p.add_argument("--fp8", default=None, metavar="RECIPE:FORMAT",
                   help="also time our model in FP8 (e.g. tensorwise:hybrid; the experts use row-wise e4m3 scales)")
    p.add_argument("--fp8-param", action="store_true",
                   help="with --fp8 (tensorwise recipe): also time, under DDP with the distributed optimizer, the FP8 "
                        "step with high-precision weights against FP8 parameters (fp8_param: experts' weights stored "
                        "as e4m3 codes + row-wise scales); fwd+bwd and the optimizer step (which then does the weight "
                        "casts) reported separately, and their sum")
    p.add_argument("--fp8-wgrad-in-gemm", action="store_true",
                   help="with --fp8-param: time the fp8_param step once more with the experts' weight gradient added "
                        "into main_grad by the Triton grouped GEMM (fp8_param_grouped.ACCUMULATE_WGRAD_IN_GEMM, the "
                        "default; the fp8_param run without this flag uses the separate addition)")
    p.add_argument("--fp8-no-wgrad", action="store_true",
                   help="with --fp8: fp8_wgrad=False (bf16 weight gradients) for the FP8 variants that honour it (the "
                        "delayed recipe, --fp8-param's FP8 parameters, the grouped GEMMs timed alone); torchao's "
                        "tensorwise/rowwise GEMMs refuse it and keep fp8_wgrad=True; the labels say which ran")
    p.add_argument("--trace-dir", default=None,
                   help="with --profile: write each profiled step's Chrome trace there and print the GPU's idle gaps")
    p.add_argument("--profile-shapes", action="store_true",
                   help="with --profile: list the eager ops per input shape (run without --compile-moe to see the "
                        "experts' casts)")
    p.add_argument("--fp8-expert-gemm", choices=EXPERT_GEMM_MODES, default=None,
                   help="the FP8 experts' GEMMs: one grouped GEMM each (grouped, the default), one "
                        "torch._scaled_mm per expert (per_expert), or grouped in the forward and per expert in the "
                        "backward (per_expert_backward; megatron_core.fp8.expert_gemm_mode)")
    p.add_argument("--fp8-unfused-swiglu", action="store_true",
                   help="FP8 experts: fc1 and the weighted SwiGLU as two autograd functions (grouped_swiglu."
                        "FUSED_WEIGHTED_SWIGLU = False), dh read again for fc1's data-gradient cast")
    p.add_argument("--sync-debug", action="store_true",
                   help="after timing, run one more FP8 step with torch.cuda.set_sync_debug_mode('warn') and list "
                        "where the host waited for the GPU")
    p.add_argument("--skip-ours", action="store_true", help="do not time our bf16 model")
    p.add_argument("--no-gemms", action="store_true", help="skip the experts' grouped GEMMs timed alone")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time our bf16 and FP8 steps (--microbatches micro-batches each) as full-iteration CUDA "
                        "graphs (the library's FullCudaGraphWrapper, fresh models), which removes the host's launch "
                        "time")
    p.add_argument("--microbatches", type=int, default=1,
                   help="also time the FP8 model in steps of N micro-batches, its experts' FP8 weight operands made "
                        "once per step (set_is_first_microbatch); the per-micro-batch mean is its result")
    p.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny shapes, fp32, 2 steps")
    p.add_argument("--grouped-gemm-backend", choices=["torch", "cutlass"], default=None,
                   help="the grouped experts' GEMM kernel (default: MEGATRON_CORE_MOE_GROUPED_GEMM, else torch); "
                        "cutlass: 128-row tiles on Hopper, built with nvcc on first use")
    args = p.parse_args()
    if args.fp8_param and (args.fp8 is None or not args.fp8.startswith("tensorwise:")):
        p.error("--fp8-param needs --fp8 tensorwise:FORMAT (fp8_param's recipe)")
    if args.fp8_wgrad_in_gemm and not args.fp8_param:
        p.error("--fp8-wgrad-in-gemm needs --fp8-param")
    if args.fp8_no_wgrad and (args.fp8 is None or not (args.fp8.startswith("delayed:") or args.fp8_param)):
        p.error("--fp8-no-wgrad needs --fp8 delayed:FORMAT or --fp8-param (torchao's recipes refuse fp8_wgrad=False)")
    if args.fp8_no_wgrad and args.fp8_wgrad_in_gemm:
        p.error("--fp8-wgrad-in-gemm times the FP8 weight-gradient kernel, which --fp8-no-wgrad replaces by bf16")
    if args.compile_option and args.compile_mode:
        p.error("--compile-option and --compile-mode exclude each other (torch.compile takes options or a mode)")
    if args.tiny:
        args.layers, args.hidden, args.heads, args.query_groups, args.ffn = 2, 64, 4, 2, 128
        args.vocab, args.seq, args.mbs, args.steps, args.warmup = 256, 32, 2, 2, 1
    return args


def active_parameters(args: argparse.Namespace) -> int:
    """Parameters a token uses, without the input embedding."""
    h, head_dim = args.hidden, args.hidden // args.heads
    attention = h * head_dim * (args.heads + 2 * args.query_groups) + args.heads * head_dim * h
    expert = 3 * h * args.ffn
    per_layer = attention + args.experts * h + args.topk * expert + 2 * h
    return args.layers * per_layer + h + args.vocab * h


def flops_per_token(args: argparse.Namespace) -> float:
    """6 N_active + 12 L H T (attention not halved for causality)."""
    return 6 * active_parameters(args) + 12 * args.layers * args.hidden * args.seq


def fp8_wgrad(args: argparse.Namespace, recipe: str, fp8_param: bool) -> bool:
    """The ``fp8_wgrad`` of an FP8 variant: False with ``--fp8-no-wgrad`` where its GEMMs honour it (the delayed
    recipe or FP8 parameters; torchao's recipes refuse it)."""
    return not (args.fp8_no_wgrad and (recipe == "delayed" or fp8_param))


def wgrad_label(args: argparse.Namespace, wgrad: bool) -> str:
    """The label suffix of an FP8 variant that ran with ``fp8_wgrad=wgrad`` (empty without ``--fp8-no-wgrad``)."""
    if not args.fp8_no_wgrad:
        return ""
    return " fp8_wgrad=False" if not wgrad else " fp8_wgrad=True (torchao)"


def build_ours(args: argparse.Namespace, dtype: torch.dtype, fp8: tuple[str, str] | None = None,
               fp8_param: bool = False, cuda_graph_impl: str = "none") -> torch.nn.Module:
    """Our MoE GPTModel; with ``fp8 = (recipe, format)`` its layer GEMMs (experts included) run in FP8, with
    ``fp8_param`` their weights stored as FP8 parameters, with ``fp8_wgrad`` as :func:`fp8_wgrad` says."""
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, ffn_hidden_size=args.ffn, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype, layernorm_epsilon=1e-5,
        num_moe_experts=args.experts, moe_router_topk=args.topk, moe_grouped_gemm=not args.sequential,
        moe_aux_loss_coeff=args.aux_loss, moe_token_dispatcher_type="alltoall", apply_rope_fusion=not args.no_rope_fusion,
        cuda_graph_impl=cuda_graph_impl,
        **({} if fp8 is None else dict(fp8=fp8[1], fp8_recipe=fp8[0], fp8_param=fp8_param,
                                       fp8_wgrad=fp8_wgrad(args, fp8[0], fp8_param))),
        **({} if args.capacity_factor is None else dict(moe_expert_capacity_factor=args.capacity_factor,
                                                         moe_pad_expert_input_to_capacity=True)),
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config, spec, args.vocab, args.seq, position_embedding_type="rope")
    model = model.to(mdevice.get_current_device())
    if fp8 is not None:
        convert_to_float8(model, emulate=model.embedding.word_embeddings.weight.device.type != "cuda")
    if args.compile_moe or args.compile:
        mode = compile_kwargs(args)
        for layer in model.decoder.layers:
            parts = [layer] if args.compile_moe else [layer.input_layernorm, layer.self_attention,
                                                      layer.pre_mlp_layernorm]
            for part in parts:
                part.compile(**mode)
        model.decoder.final_layernorm.compile(**mode)
        model.compute_language_model_loss = torch.compile(model.compute_language_model_loss, **mode)
    return model


def compile_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """``torch.compile``'s keyword arguments for our model: ``--compile-mode`` or ``--compile-option`` settings."""
    import ast

    if args.compile_mode:
        return {"mode": args.compile_mode}
    options: dict[str, object] = {}
    for option in args.compile_option:
        key, _, value = option.partition("=")
        if key == "guard_filter_fn":
            options[key] = getattr(torch.compiler, value)
        else:
            options[key] = ast.literal_eval(value)
    return {"options": options} if options else {}


def build_hf(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    hf_config = transformers.MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.query_groups, num_local_experts=args.experts,
        num_experts_per_tok=args.topk, max_position_embeddings=args.seq, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    model = transformers.MixtralForCausalLM(hf_config).to(dtype=dtype, device=mdevice.get_current_device())
    return model if args.hf_eager else torch.compile(model)


def expert_counts(args: argparse.Namespace, routing: str) -> list[int]:
    """Rows per expert: ``even`` (the tokens spread evenly) or ``router`` (the top-k of near-uniform logits)."""
    rows = args.mbs * args.seq * args.topk
    if routing == "even":
        counts = [rows // args.experts] * args.experts
        counts[-1] += rows - sum(counts)
        return counts
    logits = torch.randn(args.mbs * args.seq, args.experts, generator=torch.Generator().manual_seed(0)) * 0.1
    return torch.topk(logits, args.topk).indices.flatten().bincount(minlength=args.experts).tolist()


def grouped_vs_dense(args: argparse.Namespace, dtype: torch.dtype, counts: list[int]
                     ) -> tuple[float, float, float | None]:
    """Seconds of the experts' six GEMMs (fc1 and fc2: forward, data and weight gradients) on the grouped kernel,
    of the same six GEMMs dense, with the same total FLOPs, and (``--fp8`` on a GPU, else None) of the grouped
    GEMMs in FP8 with their casts (the weight gradients in bf16 with ``--fp8-no-wgrad``).

    Every operand is contiguous, as in the model: fc2 reads the SwiGLU's output and fc1's backward the SwiGLU's
    gradient, both fresh tensors. (Until session 21 fc2 read a column slice of fc1's output, which the grouped
    kernel copies first and cuBLAS reads in place, and the slice's backward filled a zero gradient.) The output
    gradients are fixed tensors and every ``.grad`` is dropped before each backward, so no accumulation is timed.
    The dense GEMMs run the routed rows only, so the grouped layout's alignment rows count against the grouped
    kernel.
    """
    dev = mdevice.get_current_device()
    rows = sum(counts)
    # The layout the dropless model runs (device-side counts, groups at aligned starts): the grouped kernel. A
    # host list of equal counts would take the batched-matmul path of capacity-padded experts instead.
    layout = align_expert_rows(torch.tensor(counts, device=dev), rows) if dev.type == "cuda" else counts
    padded_rows = layout.total_rows if dev.type == "cuda" else rows

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype)

    x, a = tensor(padded_rows, args.hidden).requires_grad_(), tensor(padded_rows, args.ffn).requires_grad_()
    grad_h, grad_y = tensor(padded_rows, 2 * args.ffn), tensor(padded_rows, args.hidden)
    # The dense GEMMs do the routed rows' FLOPs only; the grouped layout's alignment rows count against it.
    dense_x, dense_a = x[:rows].detach().requires_grad_(), a[:rows].detach().requires_grad_()
    w1 = tensor(args.experts, 2 * args.ffn, args.hidden).requires_grad_()
    w2 = tensor(args.experts, args.hidden, args.ffn).requires_grad_()
    d1, d2 = tensor(2 * args.ffn, args.hidden).requires_grad_(), tensor(args.hidden, args.ffn).requires_grad_()

    def run(fc1: Callable[[], torch.Tensor], fc2: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> None:
        for leaf in leaves:
            leaf.grad = None
        h, y = fc1(), fc2()
        torch.autograd.backward([h, y], [grad_h[: h.shape[0]], grad_y[: y.shape[0]]])

    def grouped() -> None:
        run(lambda: grouped_gemm(x, w1, layout), lambda: grouped_gemm(a, w2, layout), [x, a, w1, w2])

    def dense() -> None:
        run(lambda: F.linear(dense_x, d1), lambda: F.linear(dense_a, d2), [dense_x, dense_a, d1, d2])

    def grouped_fp8() -> None:
        wgrad = not args.fp8_no_wgrad
        run(lambda: fp8_grouped_gemm(x, w1, ends=layout.ends, fp8_wgrad=wgrad),
            lambda: fp8_grouped_gemm(a, w2, ends=layout.ends, fp8_wgrad=wgrad), [x, a, w1, w2])

    fp8_s = time_steps(grouped_fp8, args) if args.fp8 and dev.type == "cuda" else None
    if fp8_s is not None and args.profile:
        print_kernel_profile(grouped_fp8)
    return time_steps(grouped, args), time_steps(dense, args), fp8_s


def measure_ours(args: argparse.Namespace, dtype: torch.dtype, ids: torch.Tensor, position_ids: torch.Tensor,
                 labels: torch.Tensor, fp8: tuple[str, str] | None = None) -> float:
    """Build and time our MoE GPTModel (FP8 with ``fp8``); returns its MFU in percent (the model is freed on return).

    MFU counts the same bf16 model FLOPs for FP8, so FP8's MFU is "bf16-equivalent"."""
    torch._dynamo.reset()
    ours = build_ours(args, dtype, fp8)
    mode = " (compiled layers)" if args.compile_moe else " (compiled attn)" if args.compile else " eager"
    label = "megatron_core " + ("SequentialMLP" if args.sequential else "grouped GEMM") + mode
    label += "" if fp8 is None else f" fp8 {fp8[0]}:{fp8[1]}" + wgrad_label(args, fp8_wgrad(args, fp8[0], False))
    if fp8 is not None and args.fp8_expert_gemm:
        set_fp8_expert_gemm(args.fp8_expert_gemm)
        label += f" experts {args.fp8_expert_gemm}"
    if fp8 is not None and args.fp8_unfused_swiglu:
        grouped_swiglu.FUSED_WEIGHTED_SWIGLU = False
        label += " fc1 and SwiGLU unfused"
    label += "".join(f" {option}" for option in args.compile_option)
    steps_only = fp8 is not None and args.fp8_steps_only and args.microbatches > 1
    mfu = float("nan") if steps_only else time_contender(
        label, ours, lambda: ours(ids, position_ids, None, labels=labels).mean(), args, flops_per_token(args), width=36)
    loss_fn = lambda: ours(ids, position_ids, None, labels=labels).mean()  # noqa: E731
    if fp8 is not None and args.sync_debug:
        print_host_syncs(microbatch_step(args, ours, loss_fn))
    if fp8 is not None and args.microbatches > 1:
        mfu = time_microbatches(args, ours, label, loss_fn)
        if args.profile:  # one step of N micro-batches (the cached weight operands at work), per micro-batch
            print_kernel_profile(microbatch_step(args, ours, loss_fn), steps=1, rows=90, shapes=args.profile_shapes,
                                 trace=trace_path(args, "fp8" if fp8 else "bf16"))
    elif args.profile:
        print_kernel_profile(lambda: loss_fn().backward(), steps=4, rows=90, shapes=args.profile_shapes,
                             trace=trace_path(args, "fp8" if fp8 else "bf16"))
    return mfu


def trace_path(args: argparse.Namespace, name: str) -> str | None:
    """Where ``--trace-dir`` puts the profiled step's Chrome trace (``None`` without it)."""
    return None if args.trace_dir is None else f"{args.trace_dir}/moe_{name}.json"


def print_host_syncs(step: Callable[[], None]) -> None:
    """Run ``step`` (warmed up once first) with CUDA's sync debug mode on and print each place the host waited for
    the GPU (a synchronizing call), with how often."""
    import warnings
    from collections import Counter

    step()
    mdevice.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    places = Counter(f"{w.filename}:{w.lineno}: {str(w.message)[:90]}" for w in caught
                     if "synchroniz" in str(w.message))
    print(f"host syncs in one step: {sum(places.values())}", flush=True)
    for place, count in places.most_common(20):
        print(f"  {count:4d}x {place}", flush=True)


def microbatch_step(args: argparse.Namespace, model: torch.nn.Module,
                    loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """One step of ``--microbatches`` fwd+bwd passes, the model told where the step begins."""
    def step() -> None:
        model.set_is_first_microbatch()
        for _ in range(args.microbatches):
            loss_fn().backward()
            for p in model.parameters():
                p.grad = None
    return step


def time_graphed(args: argparse.Namespace, dtype: torch.dtype, ids: torch.Tensor, position_ids: torch.Tensor,
                 labels: torch.Tensor, fp8: tuple[str, str] | None, microbatches: int) -> float:
    """``--cuda-graph``: a fresh model (``cuda_graph_impl="full_iteration"``) trained through the library's
    ``FullCudaGraphWrapper`` around ``forward_backward_no_pipelining`` (``microbatches`` micro-batches a step, the
    FP8 weight cache refreshed in the first), every step after the warm-up one replay of the captured iteration;
    prints the time per micro-batch and returns its MFU in percent. A fresh model, because one that already ran
    eagerly on the default stream keeps autograd nodes bound to it, which the capture (on the wrapper's stream)
    cannot wait on."""
    from fp8_param_step import init_distributed

    from megatron_core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader
    from megatron_core.pipeline_parallel.schedules import forward_backward_no_pipelining

    init_distributed()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the tracker, as initialize_model_parallel left it
    torch._dynamo.reset()
    # The wrapper keeps its graphs and static buffers per process (as Megatron-Core's): each model starts afresh.
    schedule = FullCudaGraphWrapper(forward_backward_no_pipelining, cuda_graph_warmup_steps=2)
    schedule.reset_cuda_graph()
    StaticBufferLoader.static_buffers = {"training": [], "validation": []}
    torch.cuda.empty_cache()
    label = "megatron_core" + ("" if fp8 is None else f" fp8 {fp8[0]}:{fp8[1]}")
    try:
        model = build_ours(args, dtype, fp8, cuda_graph_impl="full_iteration")
    except ValueError as error:  # e.g. fp32 experts (--tiny): their counts are read on the host
        print(f"{label} full-iteration CUDA graph refused: {error}", flush=True)
        return float("nan")

    def forward_step(data_iterator, model):  # noqa: ANN001, ANN202 - the schedule's protocol
        data = next(data_iterator)
        output = model(data["tokens"], data["position_ids"], None, labels=data["labels"])
        return output, lambda out: (out.float().mean(), {})

    batch = {"tokens": ids, "position_ids": position_ids, "labels": labels}

    def step() -> None:
        schedule(forward_step_func=forward_step, data_iterator=iter([batch] * microbatches), model=model,
                 num_microbatches=microbatches, seq_length=args.seq, micro_batch_size=args.mbs, forward_only=False)

    if mdevice.get_current_device().type != "cuda":
        label += " (no CUDA: the wrapper runs every call eagerly)"
    try:
        seconds = time_steps(step, args) / microbatches
    except Exception as error:  # noqa: BLE001 - reported, the other timings stand
        print(f"{label} full-iteration CUDA graph failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
        return float("nan")
    return report_flops(f"{label}, full-iteration CUDA graph, {microbatches} micro-batch(es) a step", seconds, args,
                        flops_per_token(args), width=36)


def time_microbatches(args: argparse.Namespace, model: torch.nn.Module, label: str,
                      loss_fn: Callable[[], torch.Tensor]) -> float:
    """``--microbatches N``: steps of ``N`` micro-batch fwd+bwd passes, the model told where each step begins
    (``set_is_first_microbatch``, as the schedules do: the experts' FP8 weight operands are made in the first
    micro-batch and reused by the others); prints the mean time per micro-batch (a whole step's median over ``N``)
    and returns its MFU in percent."""
    # Compiled layers get a graph for each value of the flag: room for them besides the uncached ones timed before.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    seconds = time_steps(microbatch_step(args, model, loss_fn), args) / args.microbatches
    return report_flops(f"{label}, {args.microbatches} micro-batches per step", seconds, args, flops_per_token(args),
                        width=36)


def measure_fp8_param(args: argparse.Namespace, dtype: torch.dtype, ids: torch.Tensor, position_ids: torch.Tensor,
                      labels: torch.Tensor) -> None:
    """``--fp8-param``: the FP8 step under DDP + the distributed optimizer, weights cast in the forward against FP8
    parameters; fwd+bwd and the optimizer step (which quantizes the FP8 parameters) timed separately."""
    from fp8_param_step import init_distributed
    from gpt_fwd_bwd import report_flops

    from megatron_core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron_core.fp8 import fp8_param_grouped
    from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_distributed()
    fp8 = tuple(args.fp8.split(":"))
    times = {}
    default_wgrad_in_gemm = fp8_param_grouped.ACCUMULATE_WGRAD_IN_GEMM
    for fp8_param, wgrad_in_gemm in [(False, False), (True, False)] + ([(True, True)] if args.fp8_wgrad_in_gemm else []):
        torch._dynamo.reset()
        fp8_param_grouped.ACCUMULATE_WGRAD_IN_GEMM = wgrad_in_gemm
        model = build_ours(args, dtype, fp8, fp8_param=fp8_param)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, fp8_param_gather=fp8_param), model)
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-5, bf16=dtype == torch.bfloat16,
                                                     use_distributed_optimizer=True, clip_grad=1.0), [ddp])

        def fwd_bwd(ddp: torch.nn.Module = ddp) -> None:
            ddp.zero_grad_buffer()
            ddp(ids, position_ids, None, labels=labels).mean().backward()

        def optimizer_step(ddp: torch.nn.Module = ddp, opt: object = opt) -> None:
            finalize_model_grads([ddp])
            opt.step()

        if mdevice.get_current_device().type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        label = (f"fp8 {args.fp8} DDP+distopt" + (" fp8_param" if fp8_param else " (hp weights)")
                 + (" wgrad in GEMM" if wgrad_in_gemm else "") + wgrad_label(args, fp8_wgrad(args, fp8[0], fp8_param)))
        fb = time_steps(fwd_bwd, args)
        report_flops(label + " fwd+bwd", fb, args, flops_per_token(args), width=48)
        if args.profile:
            print_kernel_profile(fwd_bwd)
        fwd_bwd()
        step = time_steps(optimizer_step, args)
        if args.profile:
            print_kernel_profile(optimizer_step, steps=1, rows=12)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"{label + ' optimizer step':<48} {step * 1e3:9.1f} ms  (fwd+bwd + step {(fb + step) * 1e3:.1f} ms; "
              f"parameter bytes {weights / 1e9:.3f} GB)", flush=True)
        times[fp8_param, wgrad_in_gemm] = (fb, step)
        del model, ddp, opt, fwd_bwd, optimizer_step  # the closures' defaults hold the model and optimizer too
        gc.collect()
        if mdevice.get_current_device().type == "cuda":
            torch.cuda.empty_cache()
    fp8_param_grouped.ACCUMULATE_WGRAD_IN_GEMM = default_wgrad_in_gemm
    (hp_fb, hp_step), (fp_fb, fp_step) = times[False, False], times[True, False]
    print(f"RESULT fp8_param {args.fp8}: fwd+bwd {hp_fb / fp_fb:.3f}x the FP8 step with high-precision weights; "
          f"fwd+bwd + optimizer step {(hp_fb + hp_step) / (fp_fb + fp_step):.3f}x", flush=True)
    if (True, True) in times:
        in_fb, in_step = times[True, True]
        print(f"RESULT fp8_param wgrad in GEMM: fwd+bwd {fp_fb / in_fb:.3f}x fp8_param with a separate addition, "
              f"{hp_fb / in_fb:.3f}x the FP8 step with high-precision weights", flush=True)


def ratio(mfu: float, baseline_mfu: float) -> float:
    """``mfu / baseline_mfu`` (how many times faster), NaN without a baseline."""
    return mfu / baseline_mfu if baseline_mfu else float("nan")


def main() -> None:
    args = parse_args()
    if args.grouped_gemm_backend is not None:
        set_moe_grouped_gemm_backend(args.grouped_gemm_backend)
    dev = mdevice.get_current_device()
    dtype = torch.float32 if args.tiny or dev.type != "cuda" else torch.bfloat16
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    ids = torch.randint(0, args.vocab, (args.mbs, args.seq), device=dev)
    labels = torch.randint(0, args.vocab, (args.mbs, args.seq), device=dev)
    position_ids = torch.arange(args.seq, device=dev).unsqueeze(0).expand(args.mbs, -1)
    print(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{dtype}, layers {args.layers}, hidden {args.hidden}, heads {args.heads}/{args.query_groups}, "
          f"experts {args.experts} top-{args.topk}, expert ffn {args.ffn}, vocab {args.vocab}, seq {args.seq}, "
          f"mbs {args.mbs}; active parameters {active_parameters(args) / 1e9:.3f} B, "
          f"FLOPs/token {flops_per_token(args) / 1e9:.2f} G")

    ours_mfu = measure_ours(args, dtype, ids, position_ids, labels) if not args.skip_ours else float("nan")
    graphed_mfu = {}  # label -> MFU of the full-iteration CUDA graph timings (--cuda-graph)
    if args.cuda_graph and not args.skip_ours:
        graphed_mfu["bf16"] = time_graphed(args, dtype, ids, position_ids, labels, None, args.microbatches)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    fp8_mfu = None
    if args.fp8:
        fp8 = tuple(args.fp8.split(":"))
        fp8_mfu = measure_ours(args, dtype, ids, position_ids, labels, fp8=fp8)
        if args.cuda_graph:
            mfu = graphed_mfu[f"fp8 {args.fp8}"] = time_graphed(args, dtype, ids, position_ids, labels, fp8,
                                                                args.microbatches)
            print(f"RESULT full-iteration graph of fp8 {args.fp8}: {ratio(mfu, ours_mfu):.3f}x our bf16 step (eager)",
                  flush=True)
        label = args.fp8 + wgrad_label(args, fp8_wgrad(args, fp8[0], False))
        if args.microbatches > 1:
            label += f" (mean micro-batch of {args.microbatches}-micro-batch steps)"
        print(f"RESULT fp8 {label} fwd+bwd: {fp8_mfu / ours_mfu:.3f}x our bf16 step", flush=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.fp8_param:
        measure_fp8_param(args, dtype, ids, position_ids, labels)

    for routing in () if args.no_gemms else ("even", "router"):
        counts = expert_counts(args, routing)
        grouped_s, dense_s, fp8_s = grouped_vs_dense(args, dtype, counts)
        print(f"{'RESULT' if routing == 'router' else 'even routing:'} experts' grouped GEMMs "
              f"{grouped_s * 1e3:.2f} ms vs one dense GEMM of equal FLOPs {dense_s * 1e3:.2f} ms "
              f"({grouped_s / dense_s:.2f}x); rows per expert {counts}")
        if fp8_s is not None:
            print(f"  the same grouped GEMMs in FP8{wgrad_label(args, not args.fp8_no_wgrad)} (casts included): "
                  f"{fp8_s * 1e3:.2f} ms "
                  f"({grouped_s / fp8_s:.2f}x bf16's speed)")

    if not args.no_hf:
        try:
            hf = build_hf(args, dtype)
        except ImportError:
            print("transformers is not installed; skipping the Hugging Face baseline")
            return
        hf_label = "HF Mixtral sdpa" + (" eager" if args.hf_eager else " torch.compile")
        hf_mfu = time_contender(hf_label, hf, lambda: hf(input_ids=ids, labels=labels).loss, args,
                                flops_per_token(args), width=36)
        print(f"RESULT fwd+bwd MFU (active params): megatron_core {ours_mfu:.1f}% vs {hf_label} {hf_mfu:.1f}% "
              f"({ratio(ours_mfu, hf_mfu):.2f}x)")
        if fp8_mfu is not None:
            print(f"RESULT fp8 {args.fp8} fwd+bwd (bf16-equivalent MFU {fp8_mfu:.1f}%) vs {hf_label} in bf16: "
                  f"{ratio(fp8_mfu, hf_mfu):.2f}x")
        for label, mfu in graphed_mfu.items():
            print(f"RESULT full-iteration graph of {label} (bf16-equivalent MFU {mfu:.1f}%) vs {hf_label} in bf16: "
                  f"{ratio(mfu, hf_mfu):.2f}x")


if __name__ == "__main__":
    main()
