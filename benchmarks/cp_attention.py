"""Long-sequence attention: activation memory at CP=1, attention time against plain SDPA, CP=2 throughput.

Modes (results are printed as a markdown table and one JSON line per measurement):

``single`` (one GPU, or ``--device cpu`` with small ``--seq`` as a smoke test)
  * activation memory: peak memory of one ``GPTModel`` forward (bf16, micro-batch 1) minus the memory
    held before it, per token and in total, with and without the ``[1, 1, s, s]`` causal mask tensor
    (the tensor itself is allocated before the measurement);
  * attention kernel time (forward + backward) of ``DotProductAttention`` at CP=1 against plain
    ``F.scaled_dot_product_attention(is_causal=True)`` on the same ``[b, h, s, d]`` shapes, and with the
    causal mask tensor passed (the fast path should make it equal).

``cp`` (``torchrun --nproc-per-node 2``; every rank runs the same model)
  * CP=1 on each GPU alone (the whole sequence on one GPU), then CP=2 over both GPUs with each
    ``cp_comm_type``: tokens/s of a forward + backward of the model and peak memory per rank.
    Tokens/s counts the sequence once (CP=2 splits it over two GPUs), so the ideal ratio is 2.

Usage::

    python benchmarks/cp_attention.py single --seq 32768
    torchrun --nproc-per-node 2 benchmarks/cp_attention.py cp --seq 32768 65536
    python benchmarks/cp_attention.py single --device cpu --seq 512 --hidden 128 --heads 4 --groups 2 --layers 1
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_core import tensor_parallel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _build(args: argparse.Namespace, device: torch.device, cp: int = 1, comm: str = "p2p"):
    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.groups, ffn_hidden_size=4 * args.hidden, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=args.dtype == "bf16", params_dtype=_dtype(args),
        context_parallel_size=cp, cp_comm_type=comm, use_cpu_initialization=device.type == "cpu",
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), args.vocab, max(args.seq), position_embedding_type="rope")
    return model.to(device=device, dtype=_dtype(args))


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.dtype == "bf16" else torch.float32


def _peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak memory above what is allocated before ``fn`` (CUDA only; 0 on CPU)."""
    if device.type != "cuda":
        fn()
        return 0
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def _report(rows: list[dict]) -> None:
    for row in rows:
        print(json.dumps(row))
    if rows:
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for row in rows:
            print("| " + " | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys) + " |")


def _memory_rows(args: argparse.Namespace, device: torch.device, seq: int) -> list[dict]:
    model = _build(args, device)
    ids = torch.randint(0, args.vocab, (1, seq), device=device)
    pos = torch.arange(seq, device=device)[None]
    labels = torch.randint(0, args.vocab, (1, seq), device=device)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]
    rows = []
    for label, m in (("no mask tensor", None), ("causal mask tensor", mask)):
        def forward(m: torch.Tensor | None = m) -> None:
            model(ids, pos, m, labels=labels).float().mean().backward()

        forward()
        model.zero_grad(set_to_none=True)
        peak = _peak_bytes(forward, device)
        model.zero_grad(set_to_none=True)
        rows.append({"what": f"GPT fwd+bwd peak activations ({label})", "seq": seq, "layers": args.layers,
                     "GiB": peak / 2**30, "MiB/token": peak / 2**20 / seq, "ms": float("nan")})
    return rows


def _attention_rows(args: argparse.Namespace, device: torch.device, seq: int) -> list[dict]:
    from megatron_core.transformer import TransformerConfig
    from megatron_core.transformer.dot_product_attention import DotProductAttention
    from megatron_core.transformer.enums import AttnMaskType

    dtype = _dtype(args)
    cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                            num_query_groups=args.groups, attention_dropout=0.0, hidden_dropout=0.0)
    attn = DotProductAttention(cfg, 1, AttnMaskType.causal)
    hn = args.hidden // args.heads
    q = torch.randn(seq, 1, args.heads, hn, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(seq, 1, args.groups, hn, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(seq, 1, args.groups, hn, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(seq, 1, args.heads * hn, device=device, dtype=dtype)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]

    def ours(m: torch.Tensor | None = None) -> None:
        attn(q, k, v, m).backward(grad)

    def plain() -> None:
        out = F.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True,
            enable_gqa=args.groups != args.heads,
        )
        out.permute(2, 0, 1, 3).reshape(seq, 1, -1).backward(grad)

    rows = []
    for label, fn in (("plain SDPA is_causal", plain), ("DotProductAttention", ours),
                      ("DotProductAttention + mask tensor", lambda: ours(mask))):
        ms = _timed(fn, device, args.warmup, args.iters) * 1e3
        rows.append({"what": f"attention fwd+bwd: {label}", "seq": seq, "layers": 1, "GiB": float("nan"),
                     "MiB/token": float("nan"), "ms": ms})
    return rows


def run_single(args: argparse.Namespace) -> None:
    """Activation memory of the model at CP=1 and attention time against plain SDPA."""
    device = torch.device(args.device)
    rows = []
    for seq in args.seq:
        rows += _memory_rows(args, device, seq)
        rows += _attention_rows(args, device, seq)
    _report(rows)


def run_cp(args: argparse.Namespace) -> None:
    """CP=1 on each GPU alone, then CP=2 for each comm type: tokens/s and peak memory per rank."""
    import torch.distributed as dist

    from megatron_core import parallel_state
    from megatron_core.utils import get_batch_on_this_cp_rank

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    rows = []
    for seq in args.seq:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, args.vocab, (1, seq), generator=gen).to(device)
        labels = torch.randint(0, args.vocab, (1, seq), generator=gen).to(device)
        pos = torch.arange(seq, device=device)[None]
        settings = [(1, "none")] + [(world, comm) for comm in args.comm]
        for cp, comm in settings:
            if cp > 1:
                parallel_state.initialize_model_parallel(context_parallel_size=cp)
            tensor_parallel.model_parallel_cuda_manual_seed(0)
            try:
                model = _build(args, device, cp=cp, comm=comm if cp > 1 else "p2p")
                batch = {"tokens": ids, "labels": labels, "position_ids": pos}
                if cp > 1:
                    batch = get_batch_on_this_cp_rank(dict(batch))

                def step(model: torch.nn.Module = model, batch: dict = batch) -> None:
                    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                    loss.float().sum().backward()

                try:
                    seconds = _timed(step, device, args.warmup, args.iters)
                    peak = _peak_bytes(step, device)
                    result = {"tokens/s": seq / seconds, "peak GiB/rank": peak / 2**30, "ms": seconds * 1e3}
                except torch.OutOfMemoryError:
                    result = {"tokens/s": float("nan"), "peak GiB/rank": float("nan"), "ms": float("nan")}
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append({"seq": seq, "cp": cp, "cp_comm_type": comm, **result})
                del model
            finally:
                if cp > 1:
                    parallel_state.destroy_model_parallel()
    base = {row["seq"]: row["tokens/s"] for row in rows if row["cp"] == 1}
    for row in rows:
        row["speedup vs CP=1"] = row["tokens/s"] / base[row["seq"]]
    if dist.get_rank() == 0:
        _report(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["single", "cp"])
    parser.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths (default 32768; cp: 32768 65536)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--comm", nargs="+", default=["a2a", "p2p", "all_gather"], help="cp mode: comm types")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    if args.seq is None:
        args.seq = [32768] if args.mode == "single" else [32768, 65536]
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    (run_single if args.mode == "single" else run_cp)(args)


if __name__ == "__main__":
    main()
