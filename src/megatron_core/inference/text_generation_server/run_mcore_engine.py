"""One generation of the legacy server on every rank (Megatron-Core's ``text_generation_server.run_mcore_engine``).

Rank 0 (the HTTP rank) calls :func:`run_mcore_engine` with the prompts and settings; the other
ranks call it with none (after :func:`~.endpoints.common.send_do_generate` woke them). The settings
travel as one float broadcast, the prompt tokens through :func:`~.tokenization.tokenize_prompts`,
so every rank builds the same requests and runs the same engine steps. The engine may be a
:class:`StaticInferenceEngine` (requests as :class:`InferenceRequest`) or a
:class:`DynamicInferenceEngine` (prompt token lists). The response dict (``text``, ``tokens``,
``logprobs``, ``segments``, ``top_n_logprobs``) is built on the first pipeline stage of the rank
that has the prompts; the others return ``None``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron_core.inference.communication_utils import broadcast_float_list, is_pipeline_first_stage
from megatron_core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_core.inference.inference_request import InferenceRequest
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_server.tokenization import tokenize_prompts

__all__ = ["run_mcore_engine"]


def _shared_settings(values: list[float] | None) -> list[float]:
    """``values`` from global rank 0 on every rank (as they are without ``torch.distributed``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    return broadcast_float_list(7, float_list=values, data_parallel=False).tolist()


def _detokenize(tokenizer: Any, tokens: list[int]) -> str:
    try:
        return tokenizer.detokenize(tokens, skip_special_tokens=True)
    except TypeError:  # a detokenize without skip_special_tokens
        return tokenizer.detokenize(tokens)


def _as_list(tokens: Any) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


def run_mcore_engine(engine: Any, prompts: list[str] | None = None, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 0.0, logprobs: bool = True, tokens_to_generate: int = 0,
                     top_n_logprobs: int = 0, random_seed: int = -1) -> dict[str, list] | None:
    """Generate for ``prompts`` on every rank; the response dict on the serving rank, else ``None``."""
    values = None
    if prompts is not None:
        values = [tokens_to_generate, logprobs, top_k, top_p, temperature, top_n_logprobs, random_seed]
    shared = _shared_settings(values)
    tokens_to_generate, logprobs, top_k = int(shared[0]), bool(shared[1]), int(shared[2])
    top_p, temperature, top_n_logprobs, random_seed = float(shared[3]), float(shared[4]), int(shared[5]), int(shared[6])
    if random_seed > 0:
        engine.controller.sampling_rng.manual_seed(random_seed)
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, return_segments=True, return_log_probs=logprobs,
        num_tokens_to_generate=tokens_to_generate, top_n_logprobs=top_n_logprobs, skip_prompt_log_probs=False,
    )
    tokenizer = engine.controller.tokenizer
    tokens, lengths = tokenize_prompts(tokenizer=tokenizer, prompts=prompts, tokens_to_generate=tokens_to_generate,
                                       add_BOS=False, data_parallel=False)
    prompt_tokens = [row[:length].tolist() for row, length in zip(tokens.cpu(), lengths.cpu().tolist())]
    if isinstance(engine, DynamicInferenceEngine):
        results = [record.merge() for record in engine.generate(prompt_tokens, params)]
    else:
        requests = [InferenceRequest(request_id=engine.get_new_request_id(), prompt=_detokenize(tokenizer, p),
                                     prompt_tokens=p, sampling_params=params) for p in prompt_tokens]
        results = engine.generate(inference_requests=requests)
    if prompts is None or not is_pipeline_first_stage(None):
        return None
    response: dict[str, list] = {
        "text": [p + (r.generated_text or "") for p, r in zip(prompts, results)],  # the prompts as sent, untokenized
        "tokens": [_as_list(r.prompt_tokens) + _as_list(r.generated_tokens) for r in results],
    }
    if logprobs:
        response["logprobs"] = [(r.prompt_log_probs or []) + (r.generated_log_probs or []) for r in results]
    response["segments"] = [r.segments if r.segments is not None else r.generated_segments for r in results]
    if top_n_logprobs > 0:
        response["top_n_logprobs"] = [(r.prompt_top_n_logprobs or []) + (r.generated_top_n_logprobs or [])
                                      for r in results]
    return response
