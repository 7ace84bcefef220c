"""``megatron-serve``: an OpenAI-compatible HTTP server over a ``pretrain_gpt.py`` checkpoint (``server`` extra).

Binds 127.0.0.1 unless ``--host`` is given. One process (tensor/pipeline parallel serving is not
supported by this command), with no TCP store (:mod:`.local_process_group`). Stop it with
Ctrl-C: in-flight requests get up to ``--shutdown-timeout`` seconds, then are cancelled and answered
with a JSON 503 (streams: a last chunk with ``finish_reason: "cancelled"``). Errors are logged with
their traceback; if the engine loop stops, ``/health`` answers 503 with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from megatron_core.inference.cli.generate import add_engine_args, build_llm


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``megatron-serve``."""
    p = argparse.ArgumentParser(prog="megatron-serve", description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory written by pretrain_gpt.py (--save)")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--model-name", default="megatron")
    p.add_argument("--max-pending-requests", type=int, default=256)
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running requests get after Ctrl-C before they are cancelled")
    p.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    p.add_argument("--request-body-timeout", type=float, default=30.0,
                   help="seconds a client may take to send its request body (else 408)")
    p.add_argument("--parsers", nargs="+", default=[],
                   help="response parsers for chat completions (reasoning_content, tool_calls), in order, e.g. "
                        "deepseek-r1-reasoning qwen3-coder-tool")
    p.add_argument("--seed", type=int, default=42)
    add_engine_args(p)
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    from megatron_core.inference.apis import MegatronAsyncLLM, ServeConfig
    from megatron_core.inference.text_generation_server.deps import require_server_deps

    require_server_deps()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.tp = args.pp = 1
    try:  # checked before the model loads, so a wrong setting (e.g. a parser name) fails at once
        config = ServeConfig(host=args.host, port=args.port, model_name=args.model_name, verbose=args.verbose,
                             max_pending_requests=args.max_pending_requests, shutdown_timeout_s=args.shutdown_timeout,
                             max_request_bytes=args.max_request_bytes, request_body_timeout_s=args.request_body_timeout,
                             parsers=args.parsers)
    except ValueError as error:
        build_parser().error(str(error))
    async_llm, _ = build_llm(args, MegatronAsyncLLM)

    async def run() -> None:
        try:
            await async_llm.serve(config, blocking=False)
            print(f"serving {args.load} as '{args.model_name}' on http://{args.host}:{async_llm.server_port}/v1",
                  flush=True)
            await async_llm.wait_for_server()
        finally:
            await async_llm.shutdown()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, after the drain
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
