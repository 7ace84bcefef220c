"""FP8 post-training quantization served by the dynamic inference engine: real FP8 weights against bf16.

Reference config "tinyllama-1.1b" (22 layers, hidden 2048, GQA 32/4, FFN 5632, vocab 32000) with random bf16
weights (fixed seed), or ``--load DIR`` (a checkpoint of ``examples/pretrain_gpt.py``, rebuilt with
``inference.cli.checkpoint.load_gpt_from_checkpoint``). The same weights are served twice in one process:

* bf16: the model as built;
* fp8: FP8-PTQ'd with Model Optimizer (``FP8_DEFAULT_CFG``: per-tensor E4M3 weights and static input scales,
  max calibration on ``--calib-batches`` random-token batches), then converted to real FP8 weights
  (``post_training.modelopt.real_quant_fp8.convert_to_real_fp8``: ``torch._scaled_mm`` GEMMs; the output
  layer stays bf16, as the recipe leaves it).

For each model and concurrency (default 1 and 64) the closed loop of ``inference_throughput.run_engine``
(CUDA-graph decode steps on a GPU, eager on CPU) reports output tokens/s and the median decode-only step
next to its memory floor, (weight bytes + live KV-cache bytes) / measured copy bandwidth. Then both models
greedily continue a fixed prompt set; agreement is the fraction of generated tokens equal to bf16's position
by position up to each prompt's first divergence, and the fraction of prompts equal throughout. With random
weights the logits are nearly flat, so a small perturbation flips the argmax: agreement is a weak measure of
the quantization's quality there; use ``--load`` for a meaningful one.

    PYTHONPATH=src python3 benchmarks/fp8_ptq_inference.py                  # H200: bf16 and fp8, c=1 and 64
    PYTHONPATH=src python3 benchmarks/fp8_ptq_inference.py --tiny           # CPU smoke test (emulated FP8 GEMMs)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time

import torch
from inference_throughput import (
    add_model_and_workload_args,
    apply_tiny_shapes,
    build_model,
    copy_bandwidth,
    prompts,
    run_engine,
)

from megatron_core import device as mdevice
from megatron_core.inference.apis import MegatronLLM
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.post_training.modelopt import register_quant_modules
from megatron_core.post_training.modelopt.calibration import check_calibrated
from megatron_core.post_training.modelopt.real_quant_fp8 import (
    FP8ParallelLinear,
    convert_to_real_fp8,
    fp8_gemm_paths,
    linear_weight_bytes,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_workload_args(p)
    p.add_argument("--requests", type=int, default=128, help="requests per concurrency above 1")
    p.add_argument("--requests-at-1", type=int, default=8, help="requests at concurrency 1")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens per engine step (chunked prefill)")
    p.add_argument("--compile-decode", action="store_true", help="InferenceConfig.compile_decode_graphs as well")
    p.add_argument("--calib-batches", type=int, default=4, help="random-token calibration batches")
    p.add_argument("--calib-batch-size", type=int, default=4)
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sequence")
    p.add_argument("--agree-prompts", type=int, default=32, help="prompts of the greedy agreement set")
    p.add_argument("--agree-prompt-len", type=int, default=128)
    p.add_argument("--agree-gen-len", type=int, default=64)
    p.add_argument("--load", default=None, help="a checkpoint directory of examples/pretrain_gpt.py instead of "
                                                "random weights (its own configuration overrides the shape flags)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny shapes, fp32, emulated FP8 GEMMs")
    args = p.parse_args()
    if args.tiny:
        apply_tiny_shapes(args)
        args.requests, args.requests_at_1, args.prompt_len, args.gen_len = 4, 2, 16, 6
        args.calib_batches, args.calib_batch_size, args.calib_len = 2, 2, 16
        args.agree_prompts, args.agree_prompt_len, args.agree_gen_len = 4, 8, 6
    # run_engine's workload flags that this benchmark keeps at inference_throughput's defaults
    args.shared_prefix_len, args.prefix_caching, args.no_overlap = 0, "off", False
    return args


def build_weights(args: argparse.Namespace, dtype: torch.dtype, dev: torch.device) -> torch.nn.Module:
    """The model to serve: random weights of the reference config (seed 0), or ``--load``'s checkpoint."""
    if args.load is None:
        torch.manual_seed(0)
        return build_model(args, dtype, dev)
    from megatron_core.inference.cli.checkpoint import (
        init_distributed_for_inference,
        load_gpt_from_checkpoint,
    )

    init_distributed_for_inference()
    model, _, _ = load_gpt_from_checkpoint(args.load)
    args.vocab = model.vocab_size
    return model.to(dtype).eval()


def ptq_and_convert(args: argparse.Namespace, model: torch.nn.Module, dev: torch.device) -> float:
    """FP8-PTQ ``model`` (calibrated on random tokens) and convert it to real FP8 weights; returns the seconds."""
    import modelopt.torch.quantization as mtq

    register_quant_modules()
    gen = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, args.vocab, (args.calib_batch_size, args.calib_len), generator=gen).to(dev)
               for _ in range(args.calib_batches)]
    positions = torch.arange(args.calib_len, device=dev).expand(args.calib_batch_size, -1)

    def forward_loop(m: torch.nn.Module) -> None:
        for ids in batches:
            m(ids, positions, None)

    start = time.perf_counter()
    with torch.no_grad():
        mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)
        check_calibrated(model)
        convert_to_real_fp8(model)
    mdevice.synchronize()
    return time.perf_counter() - start


def greedy_outputs(args: argparse.Namespace, model: torch.nn.Module, prompt_set: list[list[int]],
                   cuda_graphs: bool) -> list[list[int]]:
    """Greedy continuations of ``prompt_set`` by the engine (all prompts in flight together)."""
    max_len = args.agree_prompt_len + args.agree_gen_len + args.block_size
    buffer_gb = len(prompt_set) * max_len * model.config.num_layers * 2 * model.config.num_query_groups \
        * model.config.kv_channels * 2 / 1024**3 + 0.01
    llm = MegatronLLM(model=model, tokenizer=None, use_coordinator=False, inference_config=InferenceConfig(
        block_size_tokens=args.block_size, buffer_size_gb=buffer_gb, max_requests=len(prompt_set),
        max_tokens=max(args.max_tokens, len(prompt_set)), max_sequence_length=max_len,
        enable_chunked_prefill=True, num_cuda_graphs=8 if cuda_graphs else None))
    params = SamplingParams(top_k=1, num_tokens_to_generate=args.agree_gen_len, termination_id=-1)
    outputs = [list(r.generated_tokens) for r in llm.generate(prompt_set, params)]
    llm.shutdown()
    return outputs


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """``(generated tokens equal to the reference's up to each prompt's first divergence, prompts fully equal)``."""
    prefix = []
    for a, b in zip(ours, reference, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        prefix.append(same)
    total = sum(len(b) for b in reference)
    return sum(prefix) / total, sum(p == len(b) for p, b in zip(prefix, reference, strict=True)) / len(reference)


def serve(args, name: str, model: torch.nn.Module, dev: torch.device, bandwidth: float) -> dict[int, dict]:
    """``run_engine`` at every concurrency; prints one row each."""
    weight_bytes = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    kv_bytes_per_token = 2 * model.config.num_layers * model.config.num_query_groups * model.config.kv_channels \
        * next(model.parameters()).element_size()  # the cache takes the activations' dtype (the embedding's)
    cuda_graphs = dev.type == "cuda"
    rows = {}
    for c in args.concurrency:
        n = args.requests_at_1 if c == 1 else args.requests
        result = run_engine(args, model, c, n, cuda_graphs=cuda_graphs, compile_decode=args.compile_decode)
        floor = (weight_bytes + result["live_tokens"] * kv_bytes_per_token) / bandwidth
        rows[c] = {**result, "floor": floor}
        print(f"{name:5s} c={c:3d} {n:4d} requests: {result['tokens_per_s']:9.1f} out tok/s  decode step "
              f"{result['decode_step'] * 1e3:7.3f} ms  floor {floor * 1e3:6.3f} ms "
              f"({result['decode_step'] / floor:4.1f}x)  TTFT median {result['ttft_median'] * 1e3:7.1f} ms", flush=True)
    return rows


def main() -> None:
    args = parse_args()
    dev = mdevice.get_current_device()
    dtype = torch.float32 if args.tiny or dev.type == "cpu" else torch.bfloat16
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {datetime.date.today()}, dtype {dtype}")
    bf16 = build_weights(args, dtype, dev)
    fp8 = build_weights(args, dtype, dev)
    fp8.load_state_dict(bf16.state_dict())
    cfg = bf16.config
    print(f"config: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads / "
          f"{cfg.num_query_groups} groups, ffn {cfg.ffn_hidden_size}, vocab {args.vocab}; prompt {args.prompt_len}, "
          f"generate {args.gen_len}; {'--load ' + args.load if args.load else 'random weights (seed 0)'}")
    seconds = ptq_and_convert(args, fp8, dev)
    gc.collect()
    paths = fp8_gemm_paths(fp8)
    converted = [n for n, m in fp8.named_modules() if isinstance(m, FP8ParallelLinear)]
    high = sum(bf16.get_submodule(n).weight.nbytes for n in converted)
    low = sum(fp8.get_submodule(n).weight.nbytes for n in converted)
    assert low * dtype.itemsize == high, (low, high)  # one byte per weight: half of bf16
    print(f"FP8 PTQ + conversion {seconds:.1f} s: {len(converted)} linears, their weights {high / 1e9:.3f} GB -> "
          f"{low / 1e9:.3f} GB; all linear weights {linear_weight_bytes(bf16) / 1e9:.3f} GB -> "
          f"{linear_weight_bytes(fp8) / 1e9:.3f} GB (output layer stays {dtype}); GEMM paths "
          f"{sorted(set(paths.values()))}")
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        print(f"GPU memory allocated with both models: {torch.cuda.memory_allocated() / 1e9:.3f} GB")
    bandwidth = copy_bandwidth(dev)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results = {label: serve(args, label, model, dev, bandwidth) for label, model in (("bf16", bf16), ("fp8", fp8))}
    prompt_set = prompts(args.agree_prompts, args.agree_prompt_len, args.vocab, 4321)
    reference = greedy_outputs(args, bf16, prompt_set, cuda_graphs=dev.type == "cuda")
    tokens, whole = agreement(greedy_outputs(args, fp8, prompt_set, cuda_graphs=dev.type == "cuda"), reference)
    print(f"greedy agreement with bf16 on {args.agree_prompts} prompts x {args.agree_gen_len} tokens: {tokens:.3f} of "
          f"tokens up to the first divergence, {whole:.3f} of prompts identical")
    for c in args.concurrency:
        ref, ours = results["bf16"][c], results["fp8"][c]
        print(f"RESULT c={c}: fp8 {ours['tokens_per_s']:.0f} tok/s vs bf16 {ref['tokens_per_s']:.0f} "
              f"({ours['tokens_per_s'] / ref['tokens_per_s']:.2f}x); decode step {ours['decode_step'] * 1e3:.3f} ms vs "
              f"{ref['decode_step'] * 1e3:.3f} ms (floors {ours['floor'] * 1e3:.3f} / {ref['floor'] * 1e3:.3f} ms)")
    print(f"RESULT agreement: {tokens:.3f} of tokens, {whole:.3f} of prompts")


if __name__ == "__main__":
    main()
