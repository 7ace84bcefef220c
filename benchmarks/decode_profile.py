"""Where a decode step of the dynamic engine spends its time (GPU only).

For each concurrency, fills the engine with that many requests (``--prompt-len`` tokens each), steps
until the batch is decode-only, then reports over ``--steps`` decode steps: the engine step's wall
time (overlapped with the host work, and one step at a time), the replay time of the captured decode graph alone (the model's forward on the GPU), what is
left for the host (scheduling, sampling, bookkeeping), and the profiler's top GPU kernels of one step.

    PYTHONPATH=src python benchmarks/decode_profile.py --concurrency 1 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference_throughput import add_model_and_workload_args, build_model, prompts  # noqa: E402

from megatron_core.inference.apis import MegatronLLM  # noqa: E402
from megatron_core.inference.config import InferenceConfig  # noqa: E402
from megatron_core.inference.sampling_params import SamplingParams  # noqa: E402
from megatron_core.transformer import fused_decode  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_workload_args(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile-decode", action="store_true", help="torch.compile the forward the decode graphs capture")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of the decode forward (e.g. max-autotune-no-cudagraphs)")
    p.add_argument("--compile-options", type=json.loads, default=None,
                   help='Inductor options for the decode forward as JSON, instead of --compile-mode, e.g. '
                        '\'{"max_autotune": true, "coordinate_descent_tuning": true, "triton.cudagraphs": false}\'')
    p.add_argument("--no-fused-decode", action="store_true",
                   help="turn off the fused single-token decode layer (transformer/fused_decode.py) for comparison")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--phases", action="store_true",
                   help="also time the phases of a decode step (synchronising the GPU between phases)")
    args = p.parse_args()
    fused_decode.enabled = not args.no_fused_decode
    dev = torch.device("cuda")
    model = build_model(args, torch.bfloat16, dev)
    for concurrency in args.concurrency:
        profile(args, model, concurrency)


def steady_seconds(fn, repeats: int) -> float:
    """Mean wall time of ``repeats`` back-to-back calls of ``fn()`` (one synchronisation at the end)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` followed by a device synchronisation."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(args, model, concurrency: int) -> None:
    cfg = model.config
    buffer_gb = concurrency * (args.prompt_len + args.gen_len + args.block_size) * cfg.num_layers * 2 \
        * cfg.num_query_groups * cfg.kv_channels * 2 / 1024**3 + 0.01
    llm = MegatronLLM(model=model, tokenizer=None, use_coordinator=False, inference_config=InferenceConfig(
        block_size_tokens=args.block_size, buffer_size_gb=buffer_gb, max_requests=concurrency,
        max_tokens=max(8192, concurrency), max_sequence_length=args.prompt_len + args.gen_len + 8,
        enable_chunked_prefill=True, num_cuda_graphs=8, compile_decode_graphs=args.compile_decode,
        async_sched_mode="async"))
    engine = llm.engine
    if args.compile_mode and args.compile_options:
        raise SystemExit("give --compile-mode or --compile-options, not both (torch.compile takes one)")
    if args.compile_mode:
        engine.controller.inference_wrapped_model.decode_compile_options = {"mode": args.compile_mode}
    elif args.compile_options:
        engine.controller.inference_wrapped_model.decode_compile_options = {"options": args.compile_options}
    params = SamplingParams(top_k=1, num_tokens_to_generate=args.gen_len, termination_id=-1)
    for i, prompt in enumerate(prompts(concurrency, args.prompt_len, args.vocab, 1)):
        engine.add_request(i, prompt, params)
    while not (engine.context.step_entries and engine.context.is_decode_only()):
        engine.step_modern()
    for _ in range(5):
        engine.step_modern()
    torch.cuda.synchronize()
    overlapped = steady_seconds(engine.step_modern, args.steps)
    engine.overlap_decode_steps = False
    engine.step_modern()  # finishes the step in flight
    wall = median_seconds(engine.step_modern, args.steps)
    engine.overlap_decode_steps = True
    graphs = engine.controller.inference_wrapped_model.decode_graphs.graphs
    graph, _ = graphs[max(graphs)] if graphs else (None, None)
    replay = median_seconds(graph.replay, args.steps) if graph is not None else float("nan")
    print(f"\n== concurrency {concurrency}: engine decode step {overlapped * 1e3:.3f} ms overlapped, "
          f"{wall * 1e3:.3f} ms one step at a time; graph replay alone {replay * 1e3:.3f} ms (graph sizes "
          f"{sorted(graphs)}), host and the rest {(wall - replay) * 1e3:.3f} ms", flush=True)
    if args.phases:
        phase_times(engine, args.steps)
    if args.no_profile:
        llm.shutdown()
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step_modern()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    llm.shutdown()


def phase_times(engine, steps: int) -> None:
    """Median wall time of each phase of ``engine.step_modern`` (the GPU is synchronised around each phase).

    Steps run one at a time here (``overlap_decode_steps`` off): synchronising would defeat the overlap.
    """
    engine.overlap_decode_steps = False
    engine.step_modern()  # finishes the step in flight
    controller = engine.controller
    wrapper = controller.inference_wrapped_model
    targets = [
        ("schedule", engine, "schedule_requests"),
        ("attention state", engine.context, "initialize_attention_state"),
        ("input ids", engine.context, "current_input_and_position_ids"),
        ("forward (graph replay)", wrapper, "run_one_forward_step"),
        ("sampling", controller.sampler, "sample"),
        ("bookkeeping", engine, "_bookkeep"),
    ]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in targets}
    originals = []

    def timed(name, fn):
        def wrapper_fn(*a, **k):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn(*a, **k)
            torch.cuda.synchronize()
            samples[name].append(time.perf_counter() - start)
            return result
        return wrapper_fn

    for name, obj, attr in targets:
        originals.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    walls = []
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step_modern()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    finally:
        engine.overlap_decode_steps = True
        for obj, attr, fn in originals:
            if attr in vars(obj):
                delattr(obj, attr)
            else:
                setattr(obj, attr, fn)
    parts = {name: statistics.median(v) for name, v in samples.items() if v}
    print(f"phases (median of {steps} steps, synchronised): step {statistics.median(walls) * 1e3:.3f} ms = "
          + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in parts.items())
          + f", other {(statistics.median(walls) - sum(parts.values())) * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
