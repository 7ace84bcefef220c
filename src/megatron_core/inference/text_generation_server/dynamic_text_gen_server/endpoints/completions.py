"""``POST /completions`` and ``/v1/completions`` (Megatron-Core's ``dynamic_text_gen_server.endpoints.completions``).

The body's ``prompt`` (a string, a list of strings, one token list or a list of token lists) is
tokenized here and each prompt sent through the client. Sampling fields: ``temperature`` (0 =
greedy), ``top_p``, ``top_k``, ``max_tokens`` (default 16), ``logprobs`` (an int: top log-probs per
token), ``echo`` (prepend the prompt; with ``logprobs`` also the prompt's log-probs), ``stop``,
``ignore_eos``. Each choice carries Megatron-Core's extra fields: ``prompt_token_ids``,
``generation_token_ids``, ``generation_log_probs``, ``policy_epoch``, ``kv_cache_epoch``,
``num_evictions`` and, for MoE models, ``moe_topk_indices``. A field of the wrong type or range
answers 400; a failed request 400 (refused by the engine) or 500.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from megatron_core.inference.inference_request import unwrap_serialized_tensors
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_server.dynamic_text_gen_server.endpoints.common import (
    ServerState,
    failed_requests,
    flag,
    gather,
    integer,
    number,
    routing_indices,
)
from megatron_core.inference.text_generation_server.protocol import APIError

__all__ = ["completions", "sampling_params_of"]

logger = logging.getLogger(__name__)

_PROMPT_FORMS = "Invalid 'prompt' format. Must be str, list[str], list[int], or list[list[int]]"


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(state: ServerState, prompt: Any) -> tuple[list[list[int]], list[str]]:
    """``(token lists, texts)`` of the request's prompt(s)."""
    if not prompt:
        raise APIError(400, "Missing 'prompt' field", "prompt")
    if not isinstance(prompt, (str, list)):
        raise APIError(400, "Invalid 'prompt' type. Must be str or list", "prompt")
    tok = state.tokenizer
    texts = [prompt] if isinstance(prompt, str) else prompt
    if all(isinstance(p, str) for p in texts):
        if tok is None:
            raise APIError(400, "this server has no tokenizer; send 'prompt' as token ids", "prompt")
        return [list(tok.tokenize(p)) for p in texts], list(texts)
    ids = [prompt] if _is_ids(prompt) else prompt
    if not all(_is_ids(p) and p for p in ids):
        raise APIError(400, _PROMPT_FORMS, "prompt")
    return [list(p) for p in ids], [tok.detokenize(p) if tok is not None else "" for p in ids]


def sampling_params_of(body: dict, default_max_tokens: int = 16) -> tuple[SamplingParams, bool]:
    """The request's :class:`SamplingParams` and its ``echo`` flag (400 on a bad field)."""
    temperature = number(body, "temperature", 1.0, 0.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = integer(body, "top_k", 0)
    echo = flag(body, "echo", False)
    logprobs = integer(body, "logprobs", None)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise APIError(400, "'stop' must be a string or a list of strings", "stop")
    if temperature == 0.0:  # OpenAI's greedy; SamplingParams spells it top_k = 1
        temperature, top_k, top_p = 1.0, 1, 0.0
    try:
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=0.0 if top_p >= 1.0 else top_p,
            return_log_probs=logprobs is not None, top_n_logprobs=logprobs or 0,
            skip_prompt_log_probs=not (echo and logprobs is not None),
            num_tokens_to_generate=integer(body, "max_tokens", default_max_tokens), stop_words=stop or None,
            termination_id=-1 if flag(body, "ignore_eos", False) else None, return_prompt_tokens=True,
        )
    except ValueError as error:
        raise APIError(400, f"Invalid sampling parameter: {error}") from error
    return params, echo


def _offsets(tokens: list[str]) -> list[int]:
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return offsets


def _logprobs(state: ServerState, result: dict, echo: bool) -> dict[str, Any]:
    """OpenAI's completion ``logprobs`` block, with a leading ``None`` as Megatron-Core writes it."""
    detok = state.tokenizer.detokenize
    prompt_tokens, generated = result.get("prompt_tokens") or [], result.get("generated_tokens") or []
    generated_lp, generated_top = result.get("generated_log_probs") or [], result.get("generated_top_n_logprobs") or []
    if echo:
        ids = list(prompt_tokens) + list(generated)
        token_logprobs = [None] + list(result.get("prompt_log_probs") or []) + list(generated_lp)
        tops = list(result.get("prompt_top_n_logprobs") or []) + list(generated_top)
    else:
        ids, token_logprobs, tops = list(generated), [None] + list(generated_lp), list(generated_top)
    tokens = [detok([t]) for t in ids]
    return {"token_logprobs": token_logprobs, "tokens": tokens, "text_offset": _offsets(tokens),
            "top_logprobs": [None] + tops if tops else None}


def _choice(state: ServerState, index: int, result: dict, prompt_text: str, echo: bool,
            params: SamplingParams) -> dict[str, Any]:
    generated = result.get("generated_tokens") or []
    text = result.get("generated_text") or ""
    requested = (result.get("sampling_params") or {}).get("num_tokens_to_generate")
    choice = {
        "index": index,
        "text": prompt_text + text if echo else text,
        "logprobs": _logprobs(state, result, echo) if params.return_log_probs else None,
        "finish_reason": "length" if requested is not None and len(generated) >= requested else "stop",
        "prompt_token_ids": result.get("prompt_tokens"),
        "generation_token_ids": generated,
        "generation_log_probs": result.get("generated_log_probs") or [],
        "policy_epoch": result.get("policy_epoch"),
        "kv_cache_epoch": result.get("kv_cache_epoch"),
        "num_evictions": sum(1 for e in result.get("events") or [] if "EVICT" in str(e)),
    }
    routing = routing_indices(result)
    if routing is not None:
        choice["moe_topk_indices"] = routing
        prompt_length = len(result.get("prompt_tokens") or [])
        if prompt_length:
            choice["prompt_moe_topk_indices"] = routing[:prompt_length]
    return choice


async def completions(state: ServerState, body: Any) -> dict[str, Any]:
    """The completion response for ``body`` (raises :class:`APIError` for a 4xx / 5xx)."""
    if not isinstance(body, dict):
        raise APIError(400, "Invalid or missing JSON body: expected a JSON object")
    prompt_ids, prompt_texts = _prompts(state, body.get("prompt"))
    params, echo = sampling_params_of(body)
    if params.return_log_probs and state.tokenizer is None:
        raise APIError(400, "'logprobs' needs a tokenizer on the server", "logprobs")
    started = time.perf_counter()
    results = [unwrap_serialized_tensors(r) for r in await gather(state, prompt_ids, params)]
    if state.verbose:
        logger.info("batch of %d requests in %.2f s", len(results), time.perf_counter() - started)
    error = failed_requests(results)
    if error is not None:
        raise error
    choices = [_choice(state, i, r, prompt_texts[i], echo, params) for i, r in enumerate(results)]
    prompt_count = max((len(r.get("prompt_tokens") or []) for r in results), default=0)
    completion_count = sum(len(r.get("generated_tokens") or []) for r in results)
    return {"id": str(uuid.uuid4()), "object": "text_completion", "created": int(time.time()), "model": "EMPTY",
            "choices": choices, "usage": {"prompt_tokens": prompt_count, "completion_tokens": completion_count,
                                          "total_tokens": prompt_count + completion_count}}
