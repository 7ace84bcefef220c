"""``POST /chat/completions`` and ``/v1/chat/completions`` (Megatron-Core's ``dynamic_text_gen_server.endpoints.
chat_completions``).

The messages (text-part lists joined, tool-call arguments turned into objects for the template)
and ``tools`` go through the tokenizer's chat template (without one: the contents joined by
newlines). With ``prevent_retokenization`` (default on) and an earlier assistant turn that carries
``prompt_token_ids`` and ``generation_token_ids``, the prompt's prefix up to that turn is replaced
by those tokens, so a multi-turn conversation is never tokenized differently than it was
generated. Leading BOS tokens are dropped, and one is added back with ``add_BOS``. ``n`` copies of
the prompt are generated. The configured parsers (``reasoning_content``, ``tool_calls``) run as in
our OpenAI server (:mod:`~megatron_core.inference.text_generation_server.response_parsers`). Each
message carries Megatron-Core's extra fields (``prompt_token_ids`` / ``generation_token_ids`` when
``return_tokenized_data`` or ``prevent_retokenization``, ``raw_text`` with ``return_raw_text``,
``generation_log_probs``, ``policy_epoch``, ``kv_cache_epoch``, ``num_evictions``).
"""

from __future__ import annotations

import json
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
from megatron_core.inference.text_generation_server.response_parsers import ChatOptions, parse_generation
from megatron_core.inference.text_generation_server.server import apply_chat_template, chat_template_owner

__all__ = ["chat_completions", "replace_prefix_tokens"]

logger = logging.getLogger(__name__)


def _text(content: Any) -> str:
    """A message's content as the plain string chat templates expect."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, list):
        parts = [p if isinstance(p, str) else str(p.get("text", "")) for p in content
                 if isinstance(p, str) or (isinstance(p, dict) and "text" in p)]
        return "".join(parts)
    return str(content)


def _arguments(value: Any) -> dict:
    """Tool-call arguments as a mapping (JSON text parsed; anything else that is not an object: ``{}``)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _template_messages(messages: list) -> list:
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise APIError(400, "each of 'messages' must be an object with 'role' and 'content'", "messages")
        copy = {**message, "content": _text(message.get("content"))}
        if isinstance(copy.get("tool_calls"), list):
            copy["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _arguments(call["function"].get("arguments"))}}
                if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
                for call in copy["tool_calls"]]
        out.append(copy)
    return out


def _template_tools(tools: Any) -> list | None:
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function")
        if isinstance(function, dict) and not isinstance(function.get("parameters"), dict):
            tool = {**tool, "function": {**function, "parameters": {"type": "object", "properties": {}}}}
        out.append(tool)
    return out


def replace_prefix_tokens(eos_token_id: int, previous_turn_token_ids: list[int],
                          retokenized_previous_turn_token_ids: list[int],
                          current_turn_token_ids: list[int]) -> list[int]:
    """The previous turn's generated tokens, then the current prompt's tokens after the previous turn's end.

    The previous turn's end is the last EOS within the retokenized previous turn (its last token
    when there is none); the previous turn's own trailing EOS is dropped.
    """
    if previous_turn_token_ids and previous_turn_token_ids[-1] == eos_token_id:
        previous_turn_token_ids = previous_turn_token_ids[:-1]
    end = len(retokenized_previous_turn_token_ids) - 1
    for i in reversed(range(min(len(retokenized_previous_turn_token_ids), len(current_turn_token_ids)))):
        if current_turn_token_ids[i] == eos_token_id:
            end = i
            break
    return list(previous_turn_token_ids) + list(current_turn_token_ids[end:])


def _prompt_tokens(state: ServerState, body: dict, messages: list, tools: list | None,
                   template_kwargs: dict) -> list[int]:
    tok = state.tokenizer
    if tok is None:
        raise APIError(400, "chat completions need a tokenizer on the server", "messages")
    if chat_template_owner(tok) is None:
        logger.warning("the tokenizer has no chat template; joining the message contents instead")
        return list(tok.tokenize("\n".join(m["content"] for m in messages)))
    tokens = list(tok.tokenize(apply_chat_template(tok, messages, tools, **template_kwargs)))
    if not flag(body, "prevent_retokenization", True):
        return tokens
    last = next((i for i in reversed(range(len(messages))) if messages[i].get("role") == "assistant"), None)
    if last is None:
        return tokens
    previous_prompt = messages[last].get("prompt_token_ids")
    previous_generation = messages[last].get("generation_token_ids")
    if not (isinstance(previous_prompt, list) and isinstance(previous_generation, list)):
        return tokens
    eos = getattr(tok, "eod", None) if getattr(tok, "eos_id", None) is None else tok.eos_id
    if eos is None:
        raise APIError(400, "prevent_retokenization needs a tokenizer with an EOS token", "messages")
    retokenized = list(tok.tokenize(apply_chat_template(tok, messages[: last + 1], tools, add_generation_prompt=False,
                                                        **template_kwargs)))
    return replace_prefix_tokens(eos, previous_prompt + previous_generation, retokenized, tokens)


def _with_bos(tokenizer: Any, tokens: list[int], add_bos: bool) -> list[int]:
    """Leading BOS tokens dropped, one put back when ``add_bos`` (the template's BOS is not doubled)."""
    bos = getattr(tokenizer, "bos", None)
    if bos is None:
        return tokens
    start = 0
    while start < len(tokens) and tokens[start] == bos:
        start += 1
    return ([bos] if add_bos else []) + tokens[start:]


def _sampling(body: dict, return_prompt_tokens: bool) -> tuple[SamplingParams, int]:
    temperature = number(body, "temperature", 1.0, 0.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = integer(body, "top_k", 0)
    n = integer(body, "n", 1, 1)
    logprobs = flag(body, "logprobs", False)
    max_tokens = integer(body, "max_completion_tokens", None, 1) or integer(body, "max_tokens", None, 1)
    if temperature == 0.0:
        temperature, top_k, top_p = 1.0, 1, 0.0
    try:
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=0.0 if top_p >= 1.0 else top_p, return_log_probs=logprobs,
            top_n_logprobs=integer(body, "top_logprobs", 0) if logprobs else 0, num_tokens_to_generate=max_tokens,
            skip_prompt_log_probs=flag(body, "skip_prompt_log_probs", True), add_BOS=flag(body, "add_BOS", False),
            termination_id=-1 if flag(body, "ignore_eos", False) else None,
            return_prompt_tokens=return_prompt_tokens,
        )
    except ValueError as error:
        raise APIError(400, f"Invalid sampling parameter: {error}") from error
    return params, n


def _logprobs_content(state: ServerState, result: dict) -> list[dict]:
    tops = result.get("generated_top_n_logprobs") or []
    content = []
    for i, (token, logprob) in enumerate(zip(result.get("generated_tokens") or [],
                                             result.get("generated_log_probs") or [])):
        text = state.tokenizer.detokenize([token])
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                                         for t, lp in top.items()]})
    return content


def _choice(state: ServerState, index: int, result: dict, options: ChatOptions, params: SamplingParams,
            flags: dict[str, bool]) -> dict[str, Any]:
    text = result.get("generated_text") or ""
    generated = result.get("generated_tokens") or []
    parsed = parse_generation(text, state.parsers, options)
    message = parsed.message() if state.parsers else {"role": "assistant", "content": text}
    if flags["tokenized"]:
        message["prompt_token_ids"] = result.get("prompt_tokens")
        message["generation_token_ids"] = generated
    if flags["raw_text"]:
        message["raw_text"] = state.tokenizer.detokenize(result.get("prompt_tokens") or []) + text
    message.update(generation_log_probs=result.get("generated_log_probs") or [],
                   policy_epoch=result.get("policy_epoch"), kv_cache_epoch=result.get("kv_cache_epoch"),
                   num_evictions=sum(1 for e in result.get("events") or [] if "EVICT" in str(e)))
    requested = (result.get("sampling_params") or {}).get("num_tokens_to_generate")
    if requested is not None and len(generated) >= requested:
        reason = "length"
    else:
        reason = parsed.finish_reason("stop", options) if state.parsers else "stop"
    choice = {"index": index, "message": message, "finish_reason": reason,
              "logprobs": {"content": _logprobs_content(state, result)} if params.return_log_probs else None}
    routing = routing_indices(result)
    if routing is not None:
        choice["moe_topk_indices"] = routing
        prompt_length = result.get("prompt_length") or 0
        if prompt_length:
            choice["prompt_moe_topk_indices"] = routing[:prompt_length]
    return choice


def _overflow(error: APIError, prompt_length: int) -> APIError:
    """Megatron-Core's wording for a prompt longer than the context (clients such as NeMo-RL match it)."""
    if "MaxSequenceLengthOverflowError" in error.message or "max_sequence_length" in error.message:
        return APIError(400, f"This model's maximum context length was exceeded. Your messages resulted in "
                             f"{prompt_length} tokens. Please reduce the length of the messages. {error.message}")
    return error


async def chat_completions(state: ServerState, body: Any) -> dict[str, Any]:
    """The chat completion response for ``body`` (raises :class:`APIError` for a 4xx / 5xx)."""
    if not isinstance(body, dict):
        raise APIError(400, "Invalid or missing JSON body: expected a JSON object")
    messages = body.get("messages")
    if not messages:
        raise APIError(400, "Missing 'messages' field", "messages")
    if not isinstance(messages, list):
        raise APIError(400, "'messages' must be a list", "messages")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        logger.warning("ignoring chat_template_kwargs of type %s", type(template_kwargs).__name__)
        template_kwargs = {}
    tools, parallel = body.get("tools"), body.get("parallel_tool_calls", True)
    options = ChatOptions(tools if isinstance(tools, list) else None, body.get("tool_choice"),
                          True if parallel is None else bool(parallel), template_kwargs)
    template_messages = _template_messages(messages)
    tokens = _prompt_tokens(state, body, template_messages, _template_tools(tools), template_kwargs)
    tokens = _with_bos(state.tokenizer, tokens, flag(body, "add_BOS", False))
    flags = {"tokenized": flag(body, "return_tokenized_data", False) or flag(body, "prevent_retokenization", True),
             "raw_text": flag(body, "return_raw_text", False)}
    params, n = _sampling(body, flags["tokenized"] or flags["raw_text"])
    results = [unwrap_serialized_tensors(r) for r in await gather(state, [tokens] * n, params)]
    error = failed_requests(results)
    if error is not None:
        raise _overflow(error, len(tokens))
    choices = [_choice(state, i, r, options, params, flags) for i, r in enumerate(results)]
    if state.verbose:
        logger.info("chat completion %s: %d choices", body.get("model"), len(choices))
    prompt_count = max((r.get("prompt_length") or len(r.get("prompt_tokens") or []) for r in results), default=0)
    cached = max((r.get("num_cached_tokens") or 0 for r in results), default=0)
    completion_count = sum(len(r.get("generated_tokens") or []) for r in results)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": "EMPTY",
            "object": "chat.completion", "choices": choices,
            "usage": {"prompt_tokens": prompt_count, "completion_tokens": completion_count,
                      "total_tokens": prompt_count + completion_count,
                      "prompt_tokens_details": {"cached_tokens": cached}}}
