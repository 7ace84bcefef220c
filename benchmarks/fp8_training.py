"""FP8 (torchao float8 GEMMs) against bf16 on one GPU: fwd+bwd throughput and a 200-step loss comparison.

Part 1, ``fwd+bwd`` (protocol: /work/shared/BENCHMARK.md, timing and MFU helpers of
``gpt_fwd_bwd.py``): for the reference config (22 layers, hidden 2048) and a 3B-class config
(28 layers, hidden 3072, 24 heads, 8 query groups, FFN 8192), bf16 and each FP8 variant
(``convert_to_float8``; ``--variants recipe:format,...``, recipes ``tensorwise``/``rowwise``,
formats ``e4m3``/``hybrid``) are timed in the same process at each ``--mbs``, each
TransformerLayer ``torch.compile``d (``--compile-scope model``: the whole GPTModel; torchao's
casts need compile to be fast; ``--no-compile`` for eager). MFU counts the bf16-equivalent model
FLOPs for both.

Part 2, loss: the same model (default: the reference config; ``--loss-config moe-small`` for a small
Mixtral-shaped MoE whose experts' grouped GEMMs run in FP8 too; a byte-level vocabulary of 256)
trained ``--loss-steps`` steps on the main job's corpus (the Python standard library's sources,
collected by ``examples/main_job.py``'s ``collect_corpus``), bf16 and FP8 from the same initial
weights on the same batches, with the library's optimizer (bf16 params, fp32 main params, AdamW)
and LR schedule (warm-up, cosine decay). Prints the means over the last 10 steps and their
relative difference (target < 1%); ``--noise-seed`` adds a bf16 run from other initial weights.

Part 3, ``--only step`` (:mod:`fp8_param_step`): the full training step (DDP, distributed optimizer,
``--step-microbatches`` micro-batches, optimizer step and parameter all-gather) of bf16, FP8 and FP8 with
FP8 parameters (``fp8_param``: no bf16 weight copy, the all-gather moves 1-byte weights) on
``--step-config``; step time, tokens/s, peak memory and parameter bytes of each. Runs under ``torchrun``.

    PYTHONPATH=src:. python3 benchmarks/fp8_training.py                 # GPU, both parts
    PYTHONPATH=src:. python3 benchmarks/fp8_training.py --only speed    # or --only loss
    PYTHONPATH=src:. python3 benchmarks/fp8_training.py --tiny          # CPU smoke test (emulated FP8)
    PYTHONPATH=src:. python3 benchmarks/fp8_training.py --only step     # full step, fp8_param vs bf16

Needs torchao >= 0.14 (float8 training) and a GPU with compute capability >= 8.9.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_param_step import full_step, init_distributed  # noqa: E402
from gpt_fwd_bwd import flops_per_token, report, time_steps  # noqa: E402

from megatron_core import device as mdevice  # noqa: E402
from megatron_core import tensor_parallel  # noqa: E402
from megatron_core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.distributed.fp8_params import is_fp8_param  # noqa: E402
from megatron_core.fp8 import convert_to_float8  # noqa: E402
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec  # noqa: E402
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron_core.transformer import TransformerConfig  # noqa: E402

CONFIGS = {
    "reference (tinyllama-1.1b)": dict(layers=22, hidden=2048, heads=32, query_groups=4, ffn=5632),
    "3B-class": dict(layers=28, hidden=3072, heads=24, query_groups=8, ffn=8192),
    # Mixtral-shaped, small enough for a 200-step loss run with the optimizer on one GPU (0.6B parameters).
    "moe-small": dict(layers=8, hidden=1024, heads=16, query_groups=4, ffn=2816, experts=8, topk=2),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("speed", "loss", "step"), default=None,
                   help="one part; the full-step part ('step') runs only when asked for")
    p.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise",
                   help="FP8 recipe of the loss comparison (and of the speed part unless --variants)")
    p.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default="hybrid",
                   help="config.fp8: 'hybrid' keeps e5m2 for the output gradient (Megatron's usual choice)")
    p.add_argument("--variants", default=None,
                   help="speed part: comma-separated recipe:format pairs, e.g. tensorwise:hybrid,rowwise:e4m3")
    p.add_argument("--configs", default="reference (tinyllama-1.1b),3B-class", help="speed part: comma-separated config names")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", default="2", help="speed part: micro-batch size(s), comma-separated")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of the compiled layers or model, e.g. max-autotune-no-cudagraphs (for "
                        "CUDA graphs per layer use --cuda-graph-impl local)")
    p.add_argument("--cuda-graph-impl", choices=("none", "local"), default="none",
                   help="TransformerConfig.cuda_graph_impl: 'local' records each layer as CUDA graphs (the layers "
                        "are then not compiled again here)")
    p.add_argument("--compile-scope", choices=("layer", "model"), default="layer",
                   help="torch.compile each TransformerLayer, or the whole GPTModel")
    p.add_argument("--loss-steps", type=int, default=200)
    p.add_argument("--loss-config", default="reference (tinyllama-1.1b)", choices=list(CONFIGS))
    p.add_argument("--loss-mbs", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--lr-warmup-steps", type=int, default=20,
                   help="linear warm-up, then cosine decay to --min-lr at the last step (0: constant --lr)")
    p.add_argument("--noise-seed", type=int, default=None,
                   help="also train bf16 from weights initialised with this seed: the bf16 run-to-run spread")
    p.add_argument("--loss-fp8-param", action="store_true",
                   help="loss part: also train with FP8 parameters (fp8_param, tensorwise); every run then goes "
                        "through DDP with the distributed optimizer, which FP8 parameters need")
    p.add_argument("--corpus-mb", type=float, default=6.0)
    p.add_argument("--profile", action="store_true", help="print the FP8 variants' top kernels (speed part: of the step; step part: of forward and backward)")
    p.add_argument("--step-config", default="reference (tinyllama-1.1b)", choices=list(CONFIGS),
                   help="full-step part: the model")
    p.add_argument("--step-microbatches", type=int, default=4, help="full-step part: micro-batches per step")
    p.add_argument("--step-layers", type=int, default=None,
                   help="full-step part: this many layers of --step-config instead of all (for profiles)")
    p.add_argument("--step-variants", default=None,
                   help="full-step part: comma-separated subset of bf16,bf16-unfused,fp8,fp8_param (default: all)")
    p.add_argument("--fp8-plain-casts", action="store_true",
                   help="FP8 parameters' casts as plain torch ops (fp8_param_linear.FUSED_CASTS = False), for comparison")
    p.add_argument("--fp8-wgrad-add", action="store_true",
                   help="FP8 parameters' weight gradients as torch._scaled_mm + add (fp8_param_ops.ACCUMULATE_IN_GEMM "
                        "= False) instead of cuBLASLt's accumulating GEMM, for comparison")
    p.add_argument("--fp8-unfused-swiglu", action="store_true",
                   help="the MLP applies SwiGLU after its FP8 fc1 (fp8_param_linear.FUSED_SWIGLU_GRAD = False) instead "
                        "of inside fc1's autograd function with swiglu_grad_cast's kernels, for comparison")
    p.add_argument("--fp8-uncached-weights", action="store_true",
                   help="full-step part: no set_is_first_microbatch, so FP8 layers transpose their weights in every "
                        "backward instead of once per step, for comparison")
    p.add_argument("--trace-dir", default=None,
                   help="with --profile: also write each profiled variant's Chrome trace here, bf16 included")
    p.add_argument("--step-bf16-unfused", action="store_true",
                   help="full-step part: also time bf16 without gradient-accumulation fusion (pretrain_gpt.py's "
                        "bf16 default on CUDA, the baseline, has it)")
    p.add_argument("--overlap", action="store_true",
                   help="full-step part: overlap_grad_reduce and overlap_param_gather (40M-element buckets)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--no-rope-fusion", action="store_true",
                   help="QKV split and RoPE as plain torch ops (apply_rope_fusion=False) instead of pretrain_gpt.py's "
                        "default fused kernel")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, emulated FP8, fp32")
    args = p.parse_args()
    args.compile = not args.no_compile
    if args.tiny:
        for cfg in CONFIGS.values():
            cfg.update(layers=2, hidden=64, heads=4, query_groups=2, ffn=128)
        args.vocab, args.seq, args.mbs, args.steps, args.warmup = 256, 32, "2", 2, 1
        args.loss_steps, args.corpus_mb, args.compile = min(args.loss_steps, 10), 0.2, False
        args.lr_warmup_steps = min(args.lr_warmup_steps, 2)
        args.step_microbatches = min(args.step_microbatches, 2)
    args.variants = [tuple(v.split(":")) for v in (args.variants or f"{args.recipe}:{args.fp8_format}").split(",")]
    for recipe, fmt in args.variants:
        if recipe not in ("tensorwise", "rowwise") or fmt not in ("e4m3", "hybrid"):
            p.error(f"--variants: {recipe}:{fmt} is not recipe:format with recipe tensorwise|rowwise, format e4m3|hybrid")
    args.configs = args.configs.split(",")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    args.mbs = [int(m) for m in str(args.mbs).split(",")]
    return args


def moe_fields(shape: dict) -> dict:
    """The MoE config fields of ``shape`` (grouped-GEMM experts, all-to-all dispatcher, aux loss 1e-2); {} if dense."""
    if "experts" not in shape:
        return {}
    return dict(num_moe_experts=shape["experts"], moe_router_topk=shape["topk"], moe_grouped_gemm=True,
                moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2)


def build(shape: dict, args: argparse.Namespace, vocab: int, fp8: tuple[str, str] | None,
          fp8_param: bool = False, gradient_accumulation_fusion: bool = False) -> torch.nn.Module:
    """A Llama-like GPTModel of ``shape``; with ``fp8 = (recipe, format)`` its layer GEMMs will be float8 (and with
    ``fp8_param`` their weights FP8 parameters, once converted); ``gradient_accumulation_fusion`` as the config's."""
    dtype = torch.float32 if args.tiny else torch.bfloat16
    recipe, fmt = fp8 if fp8 is not None else ("tensorwise", None)
    config = TransformerConfig(
        num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
        num_query_groups=shape["query_groups"], ffn_hidden_size=shape["ffn"], normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype, layernorm_epsilon=1e-5,
        cuda_graph_impl=args.cuda_graph_impl, gradient_accumulation_fusion=gradient_accumulation_fusion,
        apply_rope_fusion=not args.no_rope_fusion, fp8=fmt, fp8_recipe=recipe, fp8_param=fp8_param, **moe_fields(shape),
    )
    spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False) if "experts" in shape
            else get_gpt_layer_local_spec())
    model = GPTModel(config, spec, vocab, args.seq, position_embedding_type="rope")
    return model.to(mdevice.get_current_device())


def prepare(model: torch.nn.Module, args: argparse.Namespace, fp8: bool) -> torch.nn.Module:
    """Convert to float8 (before compiling), then compile each layer or the whole model unless ``--no-compile``."""
    if fp8:
        convert_to_float8(model, emulate=args.tiny)
    if args.cuda_graph_impl == "local":  # the layers go through their recorded graphs (compiled by the library)
        return model
    if args.compile and args.compile_scope == "layer":
        for layer in model.decoder.layers:
            layer.compile(mode=args.compile_mode)
    elif args.compile:
        model.compile(mode=args.compile_mode)
    return model


def variant_label(fp8: tuple[str, str] | None) -> str:
    """``bf16`` or ``fp8 <recipe> <format>``."""
    return "bf16" if fp8 is None else f"fp8 {fp8[0]} {fp8[1]}"


def speed(args: argparse.Namespace) -> dict:
    """fwd+bwd of bf16 and every FP8 variant, per config and micro-batch size; tokens/s and MFU of each."""
    dev = mdevice.get_current_device()
    results = {}
    for name in args.configs:
        shape = CONFIGS[name]
        for mbs in args.mbs:
            ids = torch.randint(0, args.vocab, (mbs, args.seq), device=dev)
            labels = torch.randint(0, args.vocab, (mbs, args.seq), device=dev)
            positions = torch.arange(args.seq, device=dev).unsqueeze(0).expand(mbs, -1)
            timing_args = argparse.Namespace(**{**vars(args), "mbs": mbs}, **shape)
            baseline = None
            for fp8 in [None, *args.variants]:
                torch._dynamo.reset()  # fresh static-shape graphs for every model and micro-batch size
                torch.manual_seed(1234)
                tensor_parallel.model_parallel_cuda_manual_seed(1234)
                model = prepare(build(shape, args, args.vocab, fp8), args, fp8 is not None)
                n_no_embedding = (sum(p.numel() for p in model.parameters())
                                  - model.embedding.word_embeddings.weight.numel())

                def step(model=model, ids=ids, positions=positions, labels=labels) -> None:
                    model(ids, positions, None, labels=labels).float().mean().backward()
                    for p in model.parameters():
                        p.grad = None

                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                label = f"{name} mbs {mbs} {variant_label(fp8)}"
                seconds = time_steps(step, timing_args)
                mfu = report(label, seconds, timing_args, n_no_embedding)
                tokens_per_s = mbs * args.seq / seconds
                results[label] = {"tokens_per_s": tokens_per_s, "mfu": mfu, "step_ms": 1e3 * seconds,
                                  "flops_per_token": flops_per_token(timing_args, n_no_embedding),
                                  "peak_gb": mdevice.max_memory_allocated() / 1e9}
                if fp8 is None:
                    baseline = tokens_per_s
                else:
                    print(f"RESULT {name} mbs {mbs} fwd+bwd: {variant_label(fp8)} {tokens_per_s:,.0f} tok/s vs "
                          f"bf16 {baseline:,.0f} tok/s ({tokens_per_s / baseline:.3f}x)", flush=True)
                if args.profile and fp8 is not None:
                    profile_kernels(step, label)
                del model, step
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return results


def profile_kernels(step: Callable[[], None], label: str, rows: int = 25, trace_dir: str | None = None) -> None:
    """Print the GPU kernels of two ``step()`` calls, by total time (torch.profiler), their sum against the wall time
    of the two calls (how much of it the device was busy; the profiler's own host overhead included), and the
    host-side operators by self CPU time; with ``trace_dir``, also write the Chrome trace there."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        mdevice.synchronize()
        start = time.perf_counter()
        for _ in range(2):
            step()
        mdevice.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - start)
    kernels = [e for e in prof.key_averages() if e.device_type != torch.autograd.DeviceType.CPU]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3  # the kernels' own, not the ops' totals
    print(f"kernels of 2 steps, {label}: {busy_ms:.1f} ms of kernels in {wall_ms:.1f} ms")
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70), flush=True)
    print(f"host side of the same 2 steps, {label}, by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70),
          flush=True)
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(trace_dir) / ("".join(c if c.isalnum() else "_" for c in label) + ".json")))


def corpus_bytes(args: argparse.Namespace) -> torch.Tensor:
    """The main job's corpus (stdlib sources, as examples/main_job.py collects them) as a byte tensor."""
    from examples.main_job import collect_corpus

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stdlib.jsonl"
        collect_corpus(path, int(args.corpus_mb * 1e6))
        text = "\n".join(json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines())
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def train_curve(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace,
                distributed: bool = False) -> list[float]:
    """Losses of ``args.loss_steps`` steps on fixed random windows of ``data`` (the same for every call).

    The library's optimizer (bf16 params, fp32 main params, AdamW, clipping at 1.0) under the library's
    ``OptimizerParamScheduler``: linear warm-up over ``--lr-warmup-steps``, then cosine decay to ``--min-lr``.
    ``distributed``: the model wrapped in ``DistributedDataParallel`` with the distributed optimizer (FP8
    parameters gathered as bytes when the model has them), as ``pretrain_gpt.py`` runs it.
    """
    dev = mdevice.get_current_device()
    if distributed:
        fp8_param = any(is_fp8_param(p) for p in model.parameters())
        model = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, fp8_param_gather=fp8_param), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=args.lr, min_lr=args.min_lr, weight_decay=0.1, clip_grad=1.0,
                                                 bf16=not args.tiny, adam_beta2=0.95,
                                                 use_distributed_optimizer=distributed), [model])
    scheduler = None
    if args.lr_warmup_steps > 0:
        scheduler = OptimizerParamScheduler(
            opt, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_steps,
            lr_decay_steps=args.loss_steps, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
            wd_incr_steps=args.loss_steps, wd_incr_style="constant")
    gen = torch.Generator().manual_seed(7)
    mbs = args.loss_mbs
    positions = torch.arange(args.seq, device=dev).unsqueeze(0).expand(mbs, -1)
    losses = []
    for _ in range(args.loss_steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (mbs,), generator=gen)
        window = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()]).to(dev)
        opt.zero_grad()
        if distributed:
            model.zero_grad_buffer()
        loss = model(window[:, :-1], positions, None, labels=window[:, 1:]).float().mean()
        loss.backward()
        if distributed:
            finalize_model_grads([model])
        success, _, _ = opt.step()
        assert success
        if scheduler is not None:
            scheduler.step(1)
        losses.append(loss.item())
    return losses


def loss_comparison(args: argparse.Namespace) -> dict:
    """Curves of bf16 and FP8 (``--recipe``, ``--fp8-format``) from the same weights on the same batches.

    With ``--noise-seed`` a second bf16 run starts from differently initialised weights: how far two
    bf16 runs land apart, the scale on which to read the FP8 difference.
    """
    data = corpus_bytes(args)
    shape = CONFIGS[args.loss_config]
    fp8_variant = (args.recipe, args.fp8_format)
    schedule = (f"warm-up {args.lr_warmup_steps} steps to {args.lr}, cosine to {args.min_lr}"
                if args.lr_warmup_steps > 0 else f"constant lr {args.lr}")
    print(f"loss: {args.loss_config}, byte-level vocab 256, {data.numel() / 1e6:.1f} MB of stdlib sources, "
          f"{args.loss_steps} steps of {args.loss_mbs} x {args.seq} tokens, {schedule}", flush=True)

    if args.loss_fp8_param:
        init_distributed()

    def initial_weights(seed: int) -> dict:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        base = build(shape, args, 256, fp8=None)
        weights = copy.deepcopy(base.state_dict())
        del base
        return weights

    runs = {"bf16": (1234, None, False), variant_label(fp8_variant): (1234, fp8_variant, False)}
    if args.loss_fp8_param:
        runs[f"fp8_param tensorwise {args.fp8_format}"] = (1234, ("tensorwise", args.fp8_format), True)
    if args.noise_seed is not None:
        runs[f"bf16 seed {args.noise_seed}"] = (args.noise_seed, None, False)
    curves = {}
    for label, (seed, fp8, fp8_param) in runs.items():
        torch._dynamo.reset()
        weights = initial_weights(seed)
        model = build(shape, args, 256, fp8=fp8, fp8_param=fp8_param)
        model.load_state_dict(weights)
        del weights
        curves[label] = train_curve(prepare(model, args, fp8 is not None), data, args,
                                    distributed=args.loss_fp8_param)
        del model
        gc.collect()
        if mdevice.get_current_device().type == "cuda":
            torch.cuda.empty_cache()
    last = {k: sum(v[-10:]) / len(v[-10:]) for k, v in curves.items()}
    rel = {k: abs(v - last["bf16"]) / last["bf16"] for k, v in last.items() if k != "bf16"}
    for k in rel:
        print(f"RESULT loss after {args.loss_steps} steps (mean of last 10): bf16 {last['bf16']:.4f}, {k} "
              f"{last[k]:.4f}, relative difference {100 * rel[k]:.2f}%", flush=True)
    checkpoints = sorted({s for s in (1, 10, 25, 50, 100, 150, args.loss_steps) if s <= args.loss_steps})
    print("step | " + " | ".join(curves), flush=True)
    for s in checkpoints:
        print(f"{s} | " + " | ".join(f"{c[s - 1]:.4f}" for c in curves.values()), flush=True)
    return {"curves": curves, "last10": last, "relative_difference": rel}


def main() -> None:
    args = parse_args()
    dev = mdevice.get_current_device()
    import torchao

    print(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"torchao {torchao.__version__}, variants {args.variants}, compile {args.compile} ({args.compile_scope}, mode {args.compile_mode}), "
          f"cuda_graph_impl {args.cuda_graph_impl}",
          flush=True)
    if args.fp8_plain_casts:
        from megatron_core.fp8 import fp8_param_linear

        fp8_param_linear.FUSED_CASTS = False
    if args.fp8_unfused_swiglu:
        from megatron_core.fp8 import fp8_param_linear

        fp8_param_linear.FUSED_SWIGLU_GRAD = False
    if args.fp8_wgrad_add:
        from megatron_core.fp8 import fp8_param_ops

        fp8_param_ops.ACCUMULATE_IN_GEMM = False
    results = {}
    if args.only in (None, "speed"):
        results["speed"] = speed(args)
    if args.only in (None, "loss"):
        results["loss"] = loss_comparison(args)
    if args.only == "step":
        shape = dict(CONFIGS[args.step_config])
        if args.step_layers is not None:
            shape["layers"] = args.step_layers
        profile = functools.partial(profile_kernels, trace_dir=args.trace_dir) if args.profile else None
        results["step"] = full_step(args, shape, build, prepare, time_steps, report, profile)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
