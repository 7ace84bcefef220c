"""The static-batch generation loop (Megatron-Core's ``generate_all_output_tokens_static_batch``).

A batch of requests is padded into one ``[b, max_prompt + budget]`` token tensor; the first forward
covers every position up to the shortest prompt, then each step feeds one more position (a longer
prompt's own token until its prompt is used up, else the token just sampled). The controller's
``prep_inference_input`` builds the wrapper's inputs, the wrapper's ``get_batch_for_context_window``
cuts each step's window and ``run_one_forward_step`` returns its logits; a
:class:`StaticInferenceContext` (the KV cache) advances by the positions each forward produced.
The legacy path of :class:`StaticInferenceEngine` and the encoder-decoder (T5) and vision-language
controllers run this loop. As in Megatron-Core's static loop, ``generated_tokens`` stop before the
termination token. Requests with an :class:`~megatron_core.inference.async_stream.AsyncStream` in
``active_streams`` get a partial :class:`InferenceRequest` after each step that extended them (its tokens, text
and log-probs are those the final result will have so far), and their stream is finished when they are done (with
the exception, if the loop raises).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from megatron_core.inference.contexts.static_context import StaticInferenceContext
from megatron_core.inference.inference_request import InferenceRequest, Status
from megatron_core.inference.sampling_params import SamplingParams

__all__ = ["generate_all_output_tokens_static_batch"]


def _budgets(requests: list[InferenceRequest], lengths: list[int], max_sequence_length: int) -> list[int]:
    """Tokens to generate per request (``num_tokens_to_generate``, ``num_tokens_total`` or up to the context)."""
    budgets = []
    for request, length in zip(requests, lengths):
        params = request.sampling_params
        if params.num_tokens_to_generate is not None:
            budgets.append(params.num_tokens_to_generate)
        elif params.num_tokens_total is not None:
            budgets.append(max(0, params.num_tokens_total - length))
        else:
            budgets.append(max(0, max_sequence_length - length))
    return budgets


def _check_requests(requests: list[InferenceRequest]) -> list[list[int]]:
    """The prompts' token lists; ValueError naming what the static loop cannot serve."""
    prompts = []
    for request in requests:
        params = request.sampling_params
        if request.prompt_tokens is None:
            raise ValueError(f"request {request.request_id}: prompt_tokens is None; tokenize the prompt first")
        tokens = request.prompt_tokens
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
        if not tokens:
            raise ValueError(f"request {request.request_id}: the prompt has no tokens (prompt={request.prompt!r}); "
                             "pass add_BOS=True or a non-empty prompt")
        if params.top_n_logprobs > 0 or params.stop_words:
            raise ValueError(f"request {request.request_id}: top_n_logprobs ({params.top_n_logprobs}) and stop_words "
                             f"({params.stop_words}) are not supported by static-batch generation; use the dynamic "
                             "engine")
        prompts.append(tokens)
    return prompts


def generate_all_output_tokens_static_batch(
    controller: Any, active_requests: OrderedDict[Any, InferenceRequest], active_streams: Any = None,
) -> OrderedDict[Any, InferenceRequest]:
    """Generate every request of the batch to completion with ``controller``; the requests, filled in."""
    streams = dict(active_streams or {})
    try:
        return _generate(controller, active_requests, streams)
    except Exception as error:
        for stream in streams.values():
            stream.finish(exception=error)
        raise
    finally:
        for stream in streams.values():
            stream.finish()


def _publish(
    controller: Any, request: InferenceRequest, stream: Any, new_tokens: list[int], termination: int | None,
    log_probs: list[float] | None,
) -> None:
    """Put the partial result of ``request`` (its ``new_tokens`` so far) on its stream."""
    params = request.sampling_params
    text, segments = controller.detokenize_generations(
        new_tokens, termination, params.detokenize_stop_sequence, params.return_segments)
    stream.put(InferenceRequest(
        request_id=request.request_id, prompt=request.prompt, sampling_params=params,
        prompt_tokens=request.prompt_tokens, arrival_time=request.arrival_time,
        status=Status.ACTIVE_AND_GENERATING_TOKENS, encoder_prompt=request.encoder_prompt, generated_text=text,
        generated_segments=segments, generated_tokens=new_tokens, generated_log_probs=log_probs,
        generated_length=len(new_tokens),
    ))


def _generate(
    controller: Any, active_requests: OrderedDict[Any, InferenceRequest], streams: dict[Any, Any],
) -> OrderedDict[Any, InferenceRequest]:
    """The loop itself (``streams``: the active requests' streams by request id)."""
    requests = list(active_requests.values())
    if not requests:
        return active_requests
    prompts = _check_requests(requests)
    wrapper = controller.inference_wrapped_model
    context = wrapper.inference_context
    if not isinstance(context, StaticInferenceContext):
        raise ValueError(f"static-batch generation needs the wrapper's inference_context to be a "
                         f"StaticInferenceContext, got {type(context).__name__}")
    batch = len(requests)
    if batch > context.max_batch_size:
        raise ValueError(f"static batch of {batch} requests exceeds the context's max_batch_size "
                         f"({context.max_batch_size})")
    lengths = [len(p) for p in prompts]
    budgets = _budgets(requests, lengths, context.max_sequence_length)
    total = max(length + budget for length, budget in zip(lengths, budgets))
    if total > context.max_sequence_length:
        raise ValueError(f"prompt plus generated tokens ({total}) exceed the context's max_sequence_length "
                         f"({context.max_sequence_length})")
    params: list[SamplingParams] = [r.sampling_params for r in requests]
    termination = [controller.termination_id(p) for p in params]
    pad = getattr(controller.tokenizer, "eod", None) or 0
    device = wrapper.device

    tokens = torch.full((batch, total), pad, dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
    log_probs = torch.zeros(batch, max(total - 1, 0), dtype=torch.float32, device=device)
    prefill_only = all(b == 0 for b in budgets)
    generated = [0] * batch
    done = [False] * batch

    context.reset()
    wrapper.prep_model_for_inference()
    inference_input = controller.prep_inference_input(tokens, active_requests, use_attention_mask=prefill_only)
    context = wrapper.inference_context  # a wrapper may start a context of its own for the batch
    start, end = 0, max(lengths) if prefill_only else min(lengths)
    while True:
        window = wrapper.get_batch_for_context_window(inference_input, start, end)
        logits = wrapper.run_one_forward_step(window)
        if isinstance(context, StaticInferenceContext):
            context.sequence_len_offset += logits.shape[1]
        logits = logits[:batch].float()
        if controller.vocab_size is not None:
            logits = logits[..., : controller.vocab_size]
        started = [length <= end for length in lengths]
        if not prefill_only and end < total:
            sampled = controller.sample_from_logits(logits[:, -1], params)
            for i in range(batch):
                if started[i] and not done[i]:
                    tokens[i, end] = sampled[i]
        if any(p.return_log_probs for p in params):
            rows = torch.log_softmax(logits[:, -(end - start):], dim=-1)
            targets = tokens[:, start + 1 : end + 1]
            width = targets.shape[1]
            log_probs[:, start : start + width] = rows[:, :width].gather(2, targets.unsqueeze(2)).squeeze(2)
        for i in range(batch):
            if not started[i] or done[i]:
                continue
            if generated[i] >= budgets[i] or int(tokens[i, end]) == termination[i]:
                done[i] = True
                continue
            generated[i] += 1
            done[i] = generated[i] >= budgets[i]
            stream = streams.get(requests[i].request_id)
            if stream is not None:
                length, count = lengths[i], generated[i]
                step_log_probs = (log_probs[i, length - 1 : length - 1 + count].tolist()
                                  if params[i].return_log_probs else None)
                _publish(controller, requests[i], stream, tokens[i, length : length + count].tolist(),
                         termination[i], step_log_probs)
        for i, request in enumerate(requests):
            if done[i] and request.request_id in streams:
                streams[request.request_id].finish()
        if all(done) or end + 1 >= total:
            break
        if all(started):
            context.enable_decode_mode()
        start, end = end, end + 1

    for i, request in enumerate(requests):
        length, count = lengths[i], generated[i]
        new_tokens = tokens[i, length : length + count].tolist()
        request.generated_tokens = new_tokens
        request.generated_length = count
        request.generated_sequence_lengths = list(generated)
        request.prompt_length = length
        if params[i].return_log_probs:
            if not params[i].skip_prompt_log_probs:
                request.prompt_log_probs = log_probs[i, : length - 1].tolist()
            request.generated_log_probs = log_probs[i, length - 1 : length - 1 + count].tolist()
        text, segments = controller.detokenize_generations(
            new_tokens, termination[i], params[i].detokenize_stop_sequence, params[i].return_segments)
        request.generated_text = text
        request.generated_segments = segments
        request.status = Status.COMPLETED
    return active_requests
