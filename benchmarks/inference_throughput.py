"""Serving throughput of the dynamic inference engine against Hugging Face ``generate`` (static batches).

Reference config "tinyllama-1.1b" (BENCHMARK.md) with random bf16 weights: 22 layers, hidden 2048,
32 heads, 4 query groups, FFN 5632, vocab 32000. Workload: ``--requests`` requests (default 256),
each a ``--prompt-len`` (512) random-token prompt and ``--gen-len`` (256) greedy output tokens
(no early stop). For each concurrency (default 1, 16, 64) a closed loop keeps that many requests
in flight: when one finishes the next is submitted. Reported per concurrency: output tokens/s,
median and p90 time to first token (from submission), and the median decode-only step time next
to its bandwidth floor: (weight bytes + live KV-cache bytes) / measured device copy bandwidth,
the time one decode step needs just to read the weights and the cache once.

The engine runs eagerly and with CUDA-graph decode steps (``num_cuda_graphs``; GPU only).
Hugging Face runs in the same process on the same weights' shapes: ``generate(do_sample=False)``
on static batches of the same sizes (``--hf-batches`` batches per size; its tokens/s is
``batch * gen_len / time``, its TTFT the time of a 1-token ``generate``, its decode step
``(time - TTFT) / (gen_len - 1)``).

    PYTHONPATH=src python3 benchmarks/inference_throughput.py                 # GPU: the full comparison
    PYTHONPATH=src python3 benchmarks/inference_throughput.py --tiny          # CPU smoke test
    PYTHONPATH=src python3 benchmarks/inference_throughput.py --hybrid --no-eager   # a Nemotron-H-shaped HybridModel
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import time

import torch
import torch.nn.functional as F

from megatron_core import device as mdevice
from megatron_core import tensor_parallel
from megatron_core.activations import squared_relu
from megatron_core.inference.apis import MegatronLLM
from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.jit import have_triton
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.transformer import TransformerConfig


def add_model_and_workload_args(p: argparse.ArgumentParser) -> None:
    """The model shape (reference 1.1B config) and request shape flags, shared with ``decode_profile.py``."""
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--query-groups", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)


def apply_tiny_shapes(args: argparse.Namespace) -> None:
    """The ``--tiny`` CPU smoke shapes of the model and the engine, shared by the serving benchmarks."""
    args.layers, args.hidden, args.heads, args.query_groups, args.ffn, args.vocab = 2, 64, 4, 2, 128, 256
    args.concurrency, args.block_size, args.max_tokens = [1, 4], 8, 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_workload_args(p)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--requests-at-1", type=int, default=16,
                   help="requests for concurrency 1 (256 sequential requests take minutes; tokens/s is per request)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens per engine step (chunked prefill)")
    p.add_argument("--hf-batches", type=int, default=1, help="static batches timed per size for Hugging Face")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-eager", action="store_true", help="skip the engine without CUDA graphs")
    p.add_argument("--no-cuda-graphs", action="store_true", help="skip the engine with CUDA-graph decode steps")
    p.add_argument("--compile-decode", action="store_true",
                   help="also run the CUDA-graph engine with InferenceConfig.compile_decode_graphs")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="the first N prompt tokens are the same in every request (a system prompt)")
    p.add_argument("--prefix-caching", choices=["off", "ref_zero", "lru"], default="off",
                   help="InferenceConfig.enable_prefix_caching with this eviction policy")
    p.add_argument("--no-overlap", action="store_true",
                   help="step one at a time (InferenceConfig.async_sched_mode='legacy'; default 'async')")
    p.add_argument("--hybrid", action="store_true",
                   help="serve a Nemotron-H-shaped HybridModel of about the same size instead of the GPT "
                        "(pattern --pattern, Mamba-2 64x64 heads, 8 groups, state 128; GQA 16/8 heads of 128; "
                        "squared-ReLU FFN 8192); the floor adds each request's Mamba states, read and written once")
    p.add_argument("--pattern", default="M-M-M-M*-M-M-M-M*-M-M-M-M-", help="--hybrid: the layer pattern")
    p.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny shapes, fp32")
    args = p.parse_args()
    if args.tiny:
        apply_tiny_shapes(args)
        args.requests, args.requests_at_1, args.prompt_len, args.gen_len = 8, 2, 16, 8
        args.pattern = "M*M-"
    if args.hybrid:  # the Nemotron-H-shaped layout; --layers/--heads/--query-groups/--ffn describe it from here on
        args.layers, args.no_hf = len(args.pattern), True  # HF's NemotronH decodes on its PyTorch path: no baseline
        args.heads, args.query_groups, args.ffn = (4, 2, 128) if args.tiny else (16, 8, 8192)
    return args


def build_model(args: argparse.Namespace, dtype: torch.dtype, dev: torch.device) -> GPTModel:
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, ffn_hidden_size=args.ffn, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=dev.type == "cpu",
    )
    max_len = args.prompt_len + args.gen_len + 8
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(), args.vocab, max_len, position_embedding_type="rope",
                     rotary_base=10000).to(device=dev, dtype=dtype)
    return model.eval()


def build_hybrid_model(args: argparse.Namespace, dtype: torch.dtype, dev: torch.device) -> HybridModel:
    """The Nemotron-H-shaped HybridModel of ``--hybrid`` (no position embedding, as Nemotron-H)."""
    mamba = dict(mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, mamba_num_heads=8) if args.tiny else \
        dict(mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8, mamba_num_heads=64)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, kv_channels=16 if args.tiny else 128, ffn_hidden_size=args.ffn,
        activation_func=squared_relu, gated_linear_unit=False, normalization="RMSNorm", layernorm_epsilon=1e-5,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=dev.type == "cpu", **mamba,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = HybridModel(config, hybrid_stack_spec, args.vocab, args.prompt_len + args.gen_len + 8,
                        hybrid_layer_pattern=args.pattern, position_embedding_type="none")
    return model.to(device=dev, dtype=dtype).eval()


def mamba_state_bytes_per_request(model: torch.nn.Module) -> int:
    """Bytes of one request's convolution and SSM states over all Mamba layers (0 for a GPT)."""
    config = MambaInferenceStateConfig.from_model(model)
    if config is None:
        return 0
    per_layer = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                    for shape, dtype in ((config.conv_states_shape, config.conv_states_dtype),
                                         (config.ssm_states_shape, config.ssm_states_dtype)))
    return per_layer * sum(1 for t in config.layer_type_list if t == "M")


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    n = (1 << 28) if dev.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    mdevice.synchronize()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        mdevice.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n / statistics.median(times)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


def run_engine(args, model, concurrency: int, n_requests: int, cuda_graphs: bool, compile_decode: bool = False) -> dict:
    """Closed loop: ``concurrency`` requests in flight until ``n_requests`` finished."""
    buffer_gb = concurrency * (args.prompt_len + args.gen_len + args.block_size) * model.config.num_layers * 2 \
        * model.config.num_query_groups * model.config.kv_channels * 2 / 1024**3 + 0.01
    llm = MegatronLLM(model=model, tokenizer=None, use_coordinator=False, inference_config=InferenceConfig(
        block_size_tokens=args.block_size, buffer_size_gb=buffer_gb, max_requests=concurrency,
        max_tokens=max(args.max_tokens, concurrency), max_sequence_length=args.prompt_len + args.gen_len + 8,
        enable_chunked_prefill=True, num_cuda_graphs=8 if cuda_graphs else None,
        compile_decode_graphs=compile_decode, enable_prefix_caching=args.prefix_caching != "off",
        prefix_caching_eviction_policy="ref_zero" if args.prefix_caching == "off" else args.prefix_caching,
        async_sched_mode="legacy" if args.no_overlap else "async",
    ))
    engine = llm.engine
    params = SamplingParams(top_k=1, num_tokens_to_generate=args.gen_len, termination_id=-1)
    # Warm up at the measured shapes (allocates the KV buffers; prefill chunks and mixed steps compile their
    # kernels here, not inside the timed loop).
    engine.generate(prompts(min(concurrency, n_requests), args.prompt_len, args.vocab, 99), SamplingParams(
        top_k=1, num_tokens_to_generate=8, termination_id=-1))
    # Capture (and compile) the decode graph of every padded batch size before the clock starts.
    for size in engine.context.graph_sizes:
        engine.generate(prompts(size, 16, args.vocab, 98), SamplingParams(
            top_k=1, num_tokens_to_generate=3, termination_id=-1))
    queue = prompts(n_requests, args.prompt_len, args.vocab, 1)
    if args.shared_prefix_len:  # one system prompt in front of every request
        shared = prompts(1, args.shared_prefix_len, args.vocab, 7)[0]
        queue = [shared + q[args.shared_prefix_len:] for q in queue]
    finished, ttfts, decode_steps, live_tokens = [], [], [], []
    next_id = 0

    def submit():
        nonlocal next_id
        engine.add_request(next_id, queue[next_id], params)
        next_id += 1

    mdevice.synchronize()
    start = time.perf_counter()
    for _ in range(min(concurrency, n_requests)):
        submit()
    while len(finished) < n_requests:
        result = engine.step_modern()  # returns once a step's tokens are on the host (no extra sync: steps overlap)
        if engine.context.step_entries and engine.context.is_decode_only() and not result["finished_request_records"]:
            decode_steps.append(result["step_time"])
            live_tokens.append(sum(e.start + 1 for e in engine.context.step_entries))
        for record in result["finished_request_records"]:
            request = record.merge()
            finished.append(request)
            ttfts.append(request.ttft)
            if next_id < n_requests:
                submit()
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(r.generated_tokens) for r in finished)
    if engine.context.enable_prefix_caching:
        print(f"prefix cache: {engine.context.prefix_cache_hits} hits, "
              f"{engine.context.prefix_cache_prefill_skipped_tokens} prompt tokens not computed", flush=True)
    llm.shutdown()
    return {
        "tokens_per_s": out_tokens / elapsed, "ttft_median": statistics.median(ttfts),
        "ttft_p90": sorted(ttfts)[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))],
        "decode_step": statistics.median(decode_steps),
        "live_tokens": statistics.median(live_tokens), "elapsed": elapsed, "requests": n_requests,
    }


def run_hf(args, batch: int, dtype: torch.dtype, dev: torch.device) -> dict | None:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: skipping the Hugging Face baseline")
        return None
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.query_groups,
        max_position_embeddings=args.prompt_len + args.gen_len + 8, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg).to(device=dev, dtype=dtype).eval()
    ids = torch.tensor(prompts(batch, args.prompt_len, args.vocab, 1), device=dev)
    mask = torch.ones_like(ids)

    def gen(new: int) -> float:
        mdevice.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
        mdevice.synchronize()
        return time.perf_counter() - start

    gen(2)  # warm-up
    ttft = statistics.median(gen(1) for _ in range(3))
    total = statistics.median(gen(args.gen_len) for _ in range(args.hf_batches))
    return {"tokens_per_s": batch * args.gen_len / total, "ttft": ttft,
            "decode_step": (total - ttft) / (args.gen_len - 1), "elapsed": total}


def main() -> None:
    args = parse_args()
    dev = mdevice.get_current_device()
    dtype = torch.float32 if args.tiny or dev.type == "cpu" else torch.bfloat16
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {datetime.date.today()}, dtype {dtype}")
    print(f"config: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.query_groups} groups, "
          f"ffn {args.ffn}, vocab {args.vocab}; prompt {args.prompt_len}, generate {args.gen_len}")
    torch.manual_seed(0)
    model = build_hybrid_model(args, dtype, dev) if args.hybrid else build_model(args, dtype, dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    attention_layers = args.pattern.count("*") if args.hybrid else args.layers
    kv_bytes_per_token = 2 * attention_layers * args.query_groups * model.config.kv_channels * torch.empty(
        (), dtype=dtype).element_size()
    state_bytes = mamba_state_bytes_per_request(model)
    if state_bytes:
        print(f"hybrid {args.pattern}: {weight_bytes / 1e9:.3f} GB of weights, Mamba states {state_bytes / 1e6:.1f} MB "
              "per request (read and written once per decode step in the floor)")
        kernels = dev.type == "cuda" and have_triton()
        print("Mamba layers: " + ("Triton prefill scan from the stored states, fused decode-step kernels" if kernels
                                  else "PyTorch (conv_step / ssm_step, chunked scan)"))
    bandwidth = copy_bandwidth(dev)
    print(f"weights {weight_bytes / 1e9:.3f} GB, KV {kv_bytes_per_token} B/token, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = []
    variants = [v for v, skip in (("eager", args.no_eager), ("graphs", args.no_cuda_graphs or dev.type != "cuda"),
                                  ("graphs+compile", not args.compile_decode or dev.type != "cuda")) if not skip]
    for variant in variants:
        for c in args.concurrency:
            n = args.requests_at_1 if c == 1 else args.requests
            try:
                ours = run_engine(args, model, c, n, cuda_graphs=variant.startswith("graphs"),
                                  compile_decode=variant == "graphs+compile")
            except Exception as error:  # report and go on: one failing variant must not lose the run
                print(f"megatron_core {variant} c={c}: FAILED {type(error).__name__}: {error}", flush=True)
                continue
            floor = (weight_bytes + ours["live_tokens"] * kv_bytes_per_token + 2 * c * state_bytes) / bandwidth
            rows.append((variant, c, ours, floor))
            print(f"megatron_core {variant:14s} c={c:3d}  {n} requests: {ours['tokens_per_s']:9.1f} out tok/s  "
                  f"TTFT median {ours['ttft_median'] * 1e3:8.1f} ms (p90 {ours['ttft_p90'] * 1e3:8.1f})  "
                  f"decode step {ours['decode_step'] * 1e3:7.2f} ms  floor {floor * 1e3:6.2f} ms  "
                  f"({ours['decode_step'] / floor:4.1f}x floor)", flush=True)
    hf_rows = {}
    if not args.no_hf:
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        for c in args.concurrency:
            hf = run_hf(args, c, dtype, dev)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if hf is None:
                break
            hf_rows[c] = hf
            print(f"hf generate    c={c:3d}  static batch: {hf['tokens_per_s']:9.1f} out tok/s  "
                  f"TTFT {hf['ttft'] * 1e3:8.1f} ms  decode step {hf['decode_step'] * 1e3:7.2f} ms", flush=True)
    for variant, c, ours, floor in rows:
        ratio = f"{ours['tokens_per_s'] / hf_rows[c]['tokens_per_s']:.1f}x HF" if c in hf_rows else "no HF"
        print(f"RESULT {variant} c={c}: {ours['tokens_per_s']:.0f} tok/s ({ratio}), "
              f"TTFT median {ours['ttft_median'] * 1e3:.1f} ms, decode step "
              f"{ours['decode_step'] * 1e3:.2f} ms vs floor {floor * 1e3:.2f} ms ({ours['decode_step'] / floor:.2f}x)")


if __name__ == "__main__":
    main()
