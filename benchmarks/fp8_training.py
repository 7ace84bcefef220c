"""FP8 (torchao float8 GEMMs) against bf16 on one GPU: fwd+bwd throughput and a 200-step loss comparison.

Part 1, ``fwd+bwd`` (protocol: /work/shared/BENCHMARK.md, timing and MFU helpers of
``gpt_fwd_bwd.py``): for the reference config (22 layers, hidden 2048) and a 3B-class config
(28 layers, hidden 3072, 24 heads, 8 query groups, FFN 8192), bf16 and FP8 (``convert_to_float8``,
``--recipe tensorwise`` or ``rowwise``) are timed in the same process, each TransformerLayer
``torch.compile``d (torchao's casts need compile to be fast; ``--no-compile`` for eager). MFU
counts the bf16-equivalent model FLOPs for both.

Part 2, loss: the same model (default: the reference config with a byte-level vocabulary of 256)
trained ``--loss-steps`` steps on the main job's corpus (the Python standard library's sources,
collected by ``examples/main_job.py``'s ``collect_corpus``), bf16 and FP8 from the same initial
weights on the same batches, with the library's optimizer (bf16 params, fp32 main params, Adam).
Prints both curves' means over the last 10 steps and their relative difference (target < 1%).

    PYTHONPATH=src:. python3 benchmarks/fp8_training.py                 # GPU, both parts
    PYTHONPATH=src:. python3 benchmarks/fp8_training.py --only speed    # or --only loss
    PYTHONPATH=src:. python3 benchmarks/fp8_training.py --tiny          # CPU smoke test (emulated FP8)

Needs torchao >= 0.14 (float8 training) and a GPU with compute capability >= 8.9.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt_fwd_bwd import flops_per_token, report, time_steps  # noqa: E402

from megatron_core import device as mdevice  # noqa: E402
from megatron_core import tensor_parallel  # noqa: E402
from megatron_core.fp8 import convert_to_float8  # noqa: E402
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec  # noqa: E402
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_core.transformer import TransformerConfig  # noqa: E402

CONFIGS = {
    "reference (tinyllama-1.1b)": dict(layers=22, hidden=2048, heads=32, query_groups=4, ffn=5632),
    "3B-class": dict(layers=28, hidden=3072, heads=24, query_groups=8, ffn=8192),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("speed", "loss"), default=None)
    p.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--loss-steps", type=int, default=200)
    p.add_argument("--loss-config", default="reference (tinyllama-1.1b)", choices=list(CONFIGS))
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--corpus-mb", type=float, default=6.0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, emulated FP8, fp32")
    args = p.parse_args()
    args.compile = not args.no_compile
    if args.tiny:
        for cfg in CONFIGS.values():
            cfg.update(layers=2, hidden=64, heads=4, query_groups=2, ffn=128)
        args.vocab, args.seq, args.mbs, args.steps, args.warmup = 256, 32, 2, 2, 1
        args.loss_steps, args.corpus_mb, args.compile = min(args.loss_steps, 10), 0.2, False
    return args


def build(shape: dict, args: argparse.Namespace, vocab: int, fp8: bool) -> torch.nn.Module:
    """A Llama-like GPTModel of ``shape``; with ``fp8`` its transformer-layer GEMMs are float8."""
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = TransformerConfig(
        num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
        num_query_groups=shape["query_groups"], ffn_hidden_size=shape["ffn"], normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype, layernorm_epsilon=1e-5,
        fp8="e4m3" if fp8 else None, fp8_recipe=args.recipe,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab, args.seq, position_embedding_type="rope")
    return model.to(mdevice.get_current_device())


def prepare(model: torch.nn.Module, args: argparse.Namespace, fp8: bool) -> torch.nn.Module:
    """Convert to float8 (before compiling) and compile each layer unless ``--no-compile``."""
    if fp8:
        convert_to_float8(model, emulate=args.tiny)
    if args.compile:
        for layer in model.decoder.layers:
            layer.compile()
    return model


def speed(args: argparse.Namespace) -> dict:
    """fwd+bwd of bf16 and FP8 for every config; returns tokens/s and MFU per (config, precision)."""
    dev = mdevice.get_current_device()
    ids = torch.randint(0, args.vocab, (args.mbs, args.seq), device=dev)
    labels = torch.randint(0, args.vocab, (args.mbs, args.seq), device=dev)
    positions = torch.arange(args.seq, device=dev).unsqueeze(0).expand(args.mbs, -1)
    results = {}
    for name, shape in CONFIGS.items():
        timing_args = argparse.Namespace(**vars(args), **shape)
        for fp8 in (False, True):
            torch.manual_seed(1234)
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            model = prepare(build(shape, args, args.vocab, fp8), args, fp8)
            n_no_embedding = sum(p.numel() for p in model.parameters()) - model.embedding.word_embeddings.weight.numel()

            def step(model=model) -> None:
                model(ids, positions, None, labels=labels).float().mean().backward()
                for p in model.parameters():
                    p.grad = None

            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            label = f"{name} {'fp8 ' + args.recipe if fp8 else 'bf16'}"
            seconds = time_steps(step, timing_args)
            mfu = report(label, seconds, timing_args, n_no_embedding)
            results[label] = {"tokens_per_s": args.mbs * args.seq / seconds, "mfu": mfu,
                              "flops_per_token": flops_per_token(timing_args, n_no_embedding),
                              "peak_gb": mdevice.max_memory_allocated() / 1e9}
            del model
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        bf16 = results[f"{name} bf16"]["tokens_per_s"]
        fp8_tps = results[f"{name} fp8 {args.recipe}"]["tokens_per_s"]
        print(f"RESULT {name} fwd+bwd: fp8 {args.recipe} {fp8_tps:,.0f} tok/s vs bf16 {bf16:,.0f} tok/s "
              f"({fp8_tps / bf16:.2f}x)", flush=True)
    return results


def corpus_bytes(args: argparse.Namespace) -> torch.Tensor:
    """The main job's corpus (stdlib sources, as examples/main_job.py collects them) as a byte tensor."""
    from examples.main_job import collect_corpus

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stdlib.jsonl"
        collect_corpus(path, int(args.corpus_mb * 1e6))
        text = "\n".join(json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines())
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def train_curve(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace) -> list[float]:
    """Losses of ``args.loss_steps`` steps on fixed random windows of ``data`` (the same for every call)."""
    dev = mdevice.get_current_device()
    opt = get_megatron_optimizer(OptimizerConfig(lr=args.lr, weight_decay=0.1, clip_grad=1.0, bf16=not args.tiny,
                                                 adam_beta2=0.95), [model])
    gen = torch.Generator().manual_seed(7)
    positions = torch.arange(args.seq, device=dev).unsqueeze(0).expand(args.mbs, -1)
    losses = []
    for _ in range(args.loss_steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.mbs,), generator=gen)
        window = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()]).to(dev)
        opt.zero_grad()
        loss = model(window[:, :-1], positions, None, labels=window[:, 1:]).float().mean()
        loss.backward()
        success, _, _ = opt.step()
        assert success
        losses.append(loss.item())
    return losses


def loss_comparison(args: argparse.Namespace) -> dict:
    """200-step curves of bf16 and FP8 from the same weights on the same byte-level batches."""
    data = corpus_bytes(args)
    shape = CONFIGS[args.loss_config]
    print(f"loss: {args.loss_config}, byte-level vocab 256, {data.numel() / 1e6:.1f} MB of stdlib sources, "
          f"{args.loss_steps} steps of {args.mbs} x {args.seq} tokens", flush=True)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    base = build(shape, args, 256, fp8=False)
    initial = copy.deepcopy(base.state_dict())
    del base
    curves = {}
    for fp8 in (False, True):
        model = build(shape, args, 256, fp8=fp8)
        model.load_state_dict(initial)
        curves["fp8" if fp8 else "bf16"] = train_curve(prepare(model, args, fp8), data, args)
        del model
        gc.collect()
    last = {k: sum(v[-10:]) / len(v[-10:]) for k, v in curves.items()}
    rel = abs(last["fp8"] - last["bf16"]) / last["bf16"]
    print(f"RESULT loss after {args.loss_steps} steps (mean of last 10): bf16 {last['bf16']:.4f}, "
          f"fp8 {args.recipe} {last['fp8']:.4f}, relative difference {100 * rel:.2f}% (target < 1%)", flush=True)
    return {"curves": curves, "last10": last, "relative_difference": rel}


def main() -> None:
    args = parse_args()
    dev = mdevice.get_current_device()
    import torchao

    print(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"torchao {torchao.__version__}, recipe {args.recipe}, compile {args.compile}", flush=True)
    results = {}
    if args.only in (None, "speed"):
        results["speed"] = speed(args)
    if args.only in (None, "loss"):
        results["loss"] = loss_comparison(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
