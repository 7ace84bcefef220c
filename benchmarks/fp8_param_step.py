"""The full training step (``pretrain_gpt.py``-style) with bf16, FP8 and FP8 parameters (``fp8_param``).

Part 3 of ``fp8_training.py`` (``--only step``). Each variant is built, converted (the FP8 ones, before
DDP), wrapped in ``DistributedDataParallel`` with the distributed optimizer (``fp8_param_gather`` for
``fp8_param``) and given the library's optimizer (AdamW, fp32 main params, clipping at 1.0). One timed
step is what ``pretrain_gpt.py`` runs: zero the gradient buffer, forward and backward of
``--step-microbatches`` micro-batches, ``finalize_model_grads``, the optimizer step, which for
``fp8_param`` quantizes the main shards into the FP8 weights and all-gathers their bytes. Printed per
variant: step time, tokens/s, MFU (bf16-equivalent FLOPs), peak memory, the model's parameter bytes
(FP8 weights count 1 byte per element), the mean loss of the timed steps (random tokens; a sanity
check, not a convergence test) and, after the timed steps, where a step's time goes: forward and backward
of the micro-batches, ``finalize_model_grads`` and the optimizer step, each timed between device
synchronizations over ``PHASE_STEPS`` further steps. Under ``torchrun`` the ranks form the data-parallel
group; alone, one rank.

    PYTHONPATH=src:. python3 benchmarks/fp8_training.py --only step              # one GPU
    PYTHONPATH=src:. torchrun --nproc-per-node 8 benchmarks/fp8_training.py --only step
    PYTHONPATH=src:. python3 benchmarks/fp8_training.py --only step --tiny       # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from collections.abc import Callable

import torch

from megatron_core import device as mdevice
from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.distributed.static_main_grads import local_cuda_graphs_enabled
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.utils import get_attr_wrapped_model


def init_distributed() -> None:
    """A process group (torchrun's environment, else one rank through a file store) and ``parallel_state``."""
    if not torch.distributed.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if cuda else "gloo"
        if "WORLD_SIZE" in os.environ:
            torch.distributed.init_process_group(backend)
        else:
            store = tempfile.NamedTemporaryFile(delete=False).name
            torch.distributed.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def step_variants(args: argparse.Namespace) -> list[tuple[str, tuple[str, str] | None, bool, bool]]:
    """``(label, (recipe, format) or None, fp8_param, gradient_accumulation_fusion)`` of bf16 (the baseline first),
    FP8 and FP8 with FP8 parameters. bf16 and ``fp8_param`` fuse the weight-gradient accumulation on CUDA, as
    ``pretrain_gpt.py`` does by default there (``--gradient-accumulation-fusion``; the GEMM adds into ``main_grad``;
    with FP8 parameters the FP8 layers add their own gradients and the bf16 embedding, output layer and norms take
    the fused path); torchao's FP8 GEMMs cannot (``pretrain_gpt.py`` turns it off for them)."""
    fp8 = ("tensorwise", args.fp8_format)
    fused = torch.cuda.is_available() and not args.tiny
    variants = {"bf16": ("bf16", None, False, fused),
                "bf16-unfused": ("bf16 unfused grad accumulation", None, False, False),
                "fp8": (f"fp8 tensorwise {args.fp8_format}", fp8, False, False),
                "fp8_param": (f"fp8_param tensorwise {args.fp8_format}", fp8, True, fused)}
    if args.step_variants is None:
        names = ["bf16", "bf16-unfused", "fp8", "fp8_param"] if args.step_bf16_unfused else ["bf16", "fp8", "fp8_param"]
    else:
        names = args.step_variants.split(",")
        unknown = [n for n in names if n not in variants]
        if unknown:
            raise ValueError(f"--step-variants: unknown {unknown}; known: {', '.join(variants)}")
    if not fused:  # without fusion bf16 is already unfused
        names = [n for n in names if n != "bf16-unfused"]
    return [variants[n] for n in names]


PHASE_STEPS = 3  # steps timed phase by phase after the timed steps


def phase_times(phases: dict[str, Callable[[], None]], steps: int = PHASE_STEPS) -> dict[str, float]:
    """Mean milliseconds of each of ``phases`` (run in order as one step, ``steps`` times), each timed between
    device synchronizations."""
    totals = dict.fromkeys(phases, 0.0)
    for _ in range(steps):
        for name, run in phases.items():
            mdevice.synchronize()
            start = time.perf_counter()
            run()
            mdevice.synchronize()
            totals[name] += time.perf_counter() - start
    return {name: 1e3 * total / steps for name, total in totals.items()}


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (an FP8 weight: 1 per element)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def full_step(args: argparse.Namespace, shape: dict, build: Callable[..., torch.nn.Module],
              prepare: Callable[..., torch.nn.Module], time_steps: Callable, report: Callable,
              profile: Callable[[Callable[[], None], str], None] | None = None) -> dict:
    """Time the full step of every variant of :func:`step_variants` on ``shape``; returns their figures.
    ``profile(run, label)``, when given, is called with the forward and backward phase of each FP8 variant (of every
    variant with ``args.trace_dir``)."""
    init_distributed()
    dev = mdevice.get_current_device()
    dp = parallel_state.get_data_parallel_world_size()
    mbs, micro = args.mbs[0], args.step_microbatches
    gen = torch.Generator().manual_seed(1234 + parallel_state.get_data_parallel_rank())
    ids = torch.randint(0, args.vocab, (micro, mbs, args.seq), generator=gen).to(dev)
    labels = torch.randint(0, args.vocab, (micro, mbs, args.seq), generator=gen).to(dev)
    positions = torch.arange(args.seq, device=dev).unsqueeze(0).expand(mbs, -1)
    timing_args = argparse.Namespace(**{**vars(args), "mbs": mbs * micro}, **shape)
    results, baseline = {}, None
    for label, fp8, fp8_param, fused in step_variants(args):
        torch._dynamo.reset()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = prepare(build(shape, args, args.vocab, fp8, fp8_param=fp8_param, gradient_accumulation_fusion=fused),
                        args, fp8 is not None)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, fp8_param_gather=fp8_param, overlap_grad_reduce=args.overlap,
            # pretrain_gpt.py's default: the first weight-gradient GEMM of a step overwrites, except under graphs
            overwrite_main_grad_on_first_wgrad=fused and not local_cuda_graphs_enabled(model.config),
            overlap_param_gather=args.overlap, bucket_size=40_000_000 if args.overlap else None), model)
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0, bf16=not args.tiny,
                                                     use_distributed_optimizer=True), [ddp])
        n_no_embedding = sum(p.numel() for p in model.parameters()) - model.embedding.word_embeddings.weight.numel()
        param_bytes_count = param_bytes(model)
        losses: list[torch.Tensor] = []

        def forward_backward(ddp=ddp, opt=opt, losses=losses) -> None:
            ddp.zero_grad_buffer()
            opt.zero_grad()
            total = torch.zeros((), device=dev)
            for i in range(micro):
                if i == 0 and not args.fp8_uncached_weights:  # as forward_step: FP8 weights cached per step
                    get_attr_wrapped_model(ddp, "set_is_first_microbatch")()
                loss = ddp(ids[i], positions, None, labels=labels[i]).float().mean() / micro
                loss.backward()
                total += loss.detach()
            losses.append(total)

        phases = {"fwd+bwd": forward_backward, "finalize": lambda ddp=ddp: finalize_model_grads([ddp]),
                  "optimizer": opt.step}

        def step(phases=phases) -> None:
            for run in phases.values():
                run()

        seconds = time_steps(step, timing_args)
        mfu = report(f"full step {label}", seconds, timing_args, n_no_embedding)
        tokens_per_s = dp * micro * mbs * args.seq / seconds
        loss = torch.stack(losses[-args.steps:]).mean().item()
        results[label] = {"tokens_per_s": tokens_per_s, "mfu": mfu, "step_ms": 1e3 * seconds, "loss": loss,
                          "param_gb": param_bytes_count / 1e9, "peak_gb": mdevice.max_memory_allocated() / 1e9}
        print(f"RESULT full step {label}: {tokens_per_s:,.0f} tok/s over {dp} rank(s), params "
              f"{param_bytes_count / 1e6:,.1f} MB, peak {results[label]['peak_gb']:.2f} GB, loss {loss:.4f}"
              + ("" if baseline is None else f" ({tokens_per_s / baseline:.3f}x bf16)"), flush=True)
        if baseline is None:
            baseline = tokens_per_s
        results[label]["phase_ms"] = phase_times(phases)
        print(f"RESULT full step {label} phases: " + ", ".join(
            f"{name} {ms:.1f} ms" for name, ms in results[label]["phase_ms"].items()), flush=True)
        if profile is not None and (fp8 is not None or args.trace_dir):
            profile(forward_backward, f"full step {label}, forward and backward")
        del model, ddp, opt, step, phases, forward_backward
    return results
