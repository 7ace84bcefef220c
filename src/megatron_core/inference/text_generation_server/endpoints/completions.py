"""The legacy server's ``POST /completions`` (Megatron-Core's ``text_generation_server.endpoints.completions``).

An OpenAI-style completions body (``prompt``, ``max_tokens``, ``temperature``, ``top_k``, ``top_p``,
``logprobs``, ``echo``, ``stop``, ``seed``) runs through
:func:`~megatron_core.inference.text_generation_server.run_mcore_engine.run_mcore_engine`; each
choice is the generation (with the prompt when ``echo``) cut at the first stop string, with the
log-prob of each of its tokens (``None`` for a sequence's first token, which has none). Token
offsets come from the tokenizer's ``offsets`` when it has one, else from detokenizing each token.
``temperature: 0`` means greedy (``top_k = 1``). Refusals answer 400 with Megatron-Core's messages.
"""

from __future__ import annotations

import bisect
from typing import Any

from megatron_core.inference.text_generation_server.endpoints.common import LOCK, send_do_generate
from megatron_core.inference.text_generation_server.run_mcore_engine import run_mcore_engine

__all__ = ["MegatronCompletions", "detokenize"]

MAX_TOP_LOGPROBS = 10


def detokenize(prompt: Any, tok: Any) -> list[str]:
    """The prompt(s) as text: a string, a list of strings, one token list, or a list of token lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise ValueError(f"Unknown prompt type: {type(prompt)}")
    if not prompt:
        raise ValueError(f"prompt contains no items: {prompt}")
    if all(isinstance(item, str) for item in prompt):
        return prompt
    if all(isinstance(item, int) for item in prompt):
        return [tok.detokenize(prompt)]
    if all(isinstance(item, list) and all(isinstance(t, int) for t in item) for item in prompt):
        return [tok.detokenize(item) for item in prompt]
    raise ValueError(f"Unknown prompt type: {type(prompt)}")


def _offsets(tokenizer: Any, tokens: list[int], text: str) -> list[int]:
    """Where each token starts in ``text``."""
    offsets = getattr(tokenizer, "offsets", None)
    if offsets is not None:
        return list(offsets(tokens, text))
    starts, position = [], 0
    for token in tokens:
        starts.append(position)
        position += len(tokenizer.detokenize([token]))
    return starts


class MegatronCompletions:
    """``POST /completions`` over an inference engine."""

    def __init__(self, engine: Any, args: Any = None) -> None:
        self.engine = engine
        self.args = args

    def _settings(self, req: dict, tokenizer: Any) -> tuple[dict[str, Any], str | None]:
        """The generation settings, or the refusal message."""
        if "max_tokens" not in req:
            return {}, "max_tokens is required"
        try:
            settings = {
                "tokens_to_generate": int(req["max_tokens"]), "temperature": float(req.get("temperature", 1.0)),
                "top_k": int(req.get("top_k", 0)), "top_p": float(req.get("top_p", 1.0)),
                "top_n_logprobs": int(req.get("logprobs", 0) or 0), "echo": bool(req.get("echo", False)),
                "random_seed": int(req.get("seed", -1) if req.get("seed") is not None else -1),
                "best_of": int(req.get("best_of", 1)), "n": int(req.get("n", 1)),
            }
        except (TypeError, ValueError) as error:
            return {}, f"invalid completions field: {error}"
        stop = req.get("stop", [tokenizer.detokenize([tokenizer.eod])])
        settings["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
        if settings["temperature"] == 0:  # OpenAI's greedy; a zero temperature would divide by zero
            settings.update(top_k=1, top_p=0.0, temperature=1.0)
        if settings["top_p"] >= 1.0:
            settings["top_p"] = 0.0  # top_p = 1 filters nothing (our SamplingParams spells that 0)
        if not settings["echo"] and settings["tokens_to_generate"] == 0:
            return settings, "echo=False not supported when tokens_to_generate == 0"
        if settings["best_of"] > 1:
            return settings, "best_of > 1 not supported"
        if settings["n"] > 1:
            return settings, "num_completions > 1 not supported"
        if settings["tokens_to_generate"] > 0 and settings["top_n_logprobs"] > 0:
            return settings, "cannot return top-k unless tokens_to_generate=0 at this time"
        if settings["top_n_logprobs"] > MAX_TOP_LOGPROBS:
            return settings, f"return_topk_logprobs > {MAX_TOP_LOGPROBS} not supported"
        return settings, None

    def post(self, req: Any) -> tuple[Any, int]:
        """Answer one request: ``(JSON payload, HTTP status)``."""
        if not isinstance(req, dict) or "prompt" not in req:
            return "prompt argument required", 400
        tokenizer = self.engine.controller.tokenizer
        try:
            prompts = detokenize(req["prompt"], tokenizer)
        except ValueError as error:
            return str(error), 400
        s, refusal = self._settings(req, tokenizer)
        if refusal is not None:
            return refusal, 400
        with LOCK:
            send_do_generate()
            try:
                response = run_mcore_engine(self.engine, prompts, s["temperature"], s["top_k"], s["top_p"], True,
                                            s["tokens_to_generate"], top_n_logprobs=s["top_n_logprobs"],
                                            random_seed=s["random_seed"])
            except ValueError as error:
                return str(error), 400
        choices = [self._choice(i, prompt, response, s, tokenizer) for i, prompt in enumerate(prompts)]
        return {"choices": choices}, 200

    @staticmethod
    def _choice(index: int, prompt: str, response: dict, s: dict, tokenizer: Any) -> dict[str, Any]:
        text, tokens = response["text"][index], response["tokens"][index]
        log_probs = response.get("logprobs", [[]])[index]
        top = response.get("top_n_logprobs")
        offsets = _offsets(tokenizer, tokens, text)
        start = 0 if s["echo"] else len(prompt)
        cuts = [text.find(stop, start) for stop in s["stop"] if stop]
        end = min((c for c in cuts if c != -1), default=len(text))
        first = 0 if s["echo"] else bisect.bisect_left(offsets, len(prompt))
        last = bisect.bisect_left(offsets, end)
        kept = range(first, last)
        return {
            "index": index,
            "text": text[start:end],
            "logprobs": {
                "token_logprobs": [log_probs[j - 1] if 0 < j <= len(log_probs) else None for j in kept],
                "tokens": [tokenizer.detokenize([tokens[j]]) for j in kept],
                "text_offset": [offsets[j] for j in kept],
                "top_logprobs": None if top is None else [top[index][j - 1] if j > 0 else None for j in kept],
            },
        }
