"""``megatron-generate``: generate text from a ``pretrain_gpt.py`` checkpoint.

Prompts come from ``--prompt`` (repeatable) or ``--prompts-file`` (JSONL with a ``prompt`` or
``text`` field per line). Results are printed, or written as JSONL with ``--output``. For tensor
or pipeline parallelism run it under ``torchrun --nproc-per-node N`` with ``--tp`` / ``--pp``
(every rank generates; rank 0 prints).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from megatron_core.command_line import run_command


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``megatron-generate``."""
    p = argparse.ArgumentParser(prog="megatron-generate", description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory written by pretrain_gpt.py (--save)")
    p.add_argument("--tokenizer-model", default=None, help="override the tokenizer file recorded in the checkpoint")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="JSONL file, one {'prompt': ...} per line")
    p.add_argument("--output", default=None, help="write results as JSONL here instead of printing")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=1, help="1 = greedy (default); 0 = off")
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (under torchrun)")
    add_engine_args(p)
    return p


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags ``megatron-generate`` and ``megatron-serve`` share (KV cache, batching, graphs, caching)."""
    p.add_argument("--buffer-size-gb", type=float, default=1.0, help="KV cache size")
    p.add_argument("--block-size-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=64, help="requests decoded together")
    p.add_argument("--cuda-graphs", action="store_true", help="decode steps as CUDA graphs (GPU)")
    p.add_argument("--compile-decode", action="store_true",
                   help="with --cuda-graphs: torch.compile the captured forward (about 25 s per batch size)")
    p.add_argument("--async-sched-mode", choices=["legacy", "async"], default="async",
                   help="async: prepare each CUDA-graph decode step while the previous one runs (legacy: one at a time)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="share the KV blocks of common prompt prefixes between requests")
    p.add_argument("--prefix-caching-eviction-policy", choices=["ref_zero", "lru"], default="ref_zero",
                   help="ref_zero: free a shared block with its last request; lru: keep it for later requests")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="speculative decoding: tokens the checkpoint's MTP layers draft per request per step, verified "
                        "in the next forward (needs a model trained with MTP layers; 0 = off)")


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts named on the command line and in ``--prompts-file``."""
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise ValueError(f"{args.prompts_file}:{number}: not UTF-8 text") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{args.prompts_file}:{number}: not JSON ({error.msg} at column {error.colno})"
                                     ) from None
                text = record.get("prompt", record.get("text")) if isinstance(record, dict) else record
                if not isinstance(text, str):
                    raise ValueError(f"{args.prompts_file}:{number}: expected a 'prompt' string")
                prompts.append(text)
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT or --prompts-file FILE.jsonl")
    return prompts


def build_llm(args: argparse.Namespace, llm_class: Any = None) -> tuple[Any, Any]:
    """Load the checkpoint and wrap it in ``llm_class`` (``MegatronLLM``); returns ``(llm, training args)``."""
    from megatron_core.inference.apis import MegatronLLM
    from megatron_core.inference.cli.checkpoint import (
        init_distributed_for_inference,
        load_gpt_from_checkpoint,
    )
    from megatron_core.inference.cli.local_process_group import init_local_process_group
    from megatron_core.inference.config import InferenceConfig

    if args.tp * args.pp == 1:
        init_local_process_group()  # no TCPStore: nothing of this process listens beyond loopback
    init_distributed_for_inference(args.tp, args.pp)
    model, tokenizer, train_args = load_gpt_from_checkpoint(args.load, args.tokenizer_model)
    model.config.inference_sampling_seed = args.seed
    config = InferenceConfig(
        buffer_size_gb=args.buffer_size_gb, block_size_tokens=args.block_size_tokens, max_requests=args.max_batch,
        max_sequence_length=model.max_sequence_length, enable_chunked_prefill=True,
        num_cuda_graphs=8 if args.cuda_graphs else None, compile_decode_graphs=args.compile_decode,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_eviction_policy=args.prefix_caching_eviction_policy, async_sched_mode=args.async_sched_mode,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    llm_class = llm_class or MegatronLLM
    return llm_class(model=model, tokenizer=tokenizer, inference_config=config, use_coordinator=False), train_args


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad values before the model is loaded."""
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens ({args.max_tokens}) must be >= 1")
    if args.temperature < 0 or args.top_k < 0 or not 0.0 <= args.top_p <= 1.0:
        raise ValueError(f"--temperature ({args.temperature}) and --top-k ({args.top_k}) must be >= 0 and --top-p "
                         f"({args.top_p}) in [0, 1]")
    if args.tp < 1 or args.pp < 1:
        raise ValueError(f"--tp ({args.tp}) and --pp ({args.pp}) must be >= 1")
    if args.num_speculative_tokens < 0:
        raise ValueError(f"--num-speculative-tokens ({args.num_speculative_tokens}) must be >= 0")
    if args.buffer_size_gb <= 0 or args.block_size_tokens < 1 or args.max_batch < 1:
        raise ValueError(f"--buffer-size-gb ({args.buffer_size_gb}) must be > 0, --block-size-tokens "
                         f"({args.block_size_tokens}) and --max-batch ({args.max_batch}) >= 1")
    if args.output:
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"--output {args.output}: the directory {folder} does not exist")
        if os.path.isdir(args.output):
            raise IsADirectoryError(f"--output {args.output} is a directory")


def _write_results(path: str, prompts: list[str], results: list) -> None:
    """The JSONL results, written beside ``path`` and renamed onto it (never a half-written file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for prompt, request in zip(prompts, results):
                out.write(json.dumps({"prompt": prompt, "generated_text": request.generated_text,
                                      "generated_tokens": request.generated_tokens}) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def generate(args: argparse.Namespace) -> None:
    """Load, generate, print or write; the process group is torn down either way."""
    import torch.distributed as dist

    from megatron_core import parallel_state
    from megatron_core.inference.sampling_params import SamplingParams

    check_args(args)
    prompts = read_prompts(args)
    try:
        llm, _ = build_llm(args)
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                num_tokens_to_generate=args.max_tokens)
        results = llm.generate(prompts, params)
        if dist.get_rank() == 0:
            if args.output:
                _write_results(args.output, prompts, results)
            else:
                for prompt, request in zip(prompts, results):
                    print(f"=== prompt: {prompt!r}\n{prompt}{request.generated_text}\n", flush=True)
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point; a user error is one line and exit status 2 (:mod:`megatron_core.command_line`)."""
    args = build_parser().parse_args(argv)
    return run_command("megatron-generate", lambda: generate(args))


if __name__ == "__main__":
    sys.exit(main())
