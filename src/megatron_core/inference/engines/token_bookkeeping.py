"""Booking a step's sampled tokens into its requests (a mixin of ``DynamicInferenceEngine``).

For each row of a step's output: the prompt chunk's log-probs, then the sampled token (with its
log-probs, the request's first-token time, a token event and the token listeners), then the stop
rules (termination token, stop word, length limits). A request that stops is released from the KV
cache, given its ``routing_indices`` under routing replay, and finished as ``COMPLETED``. An error
while booking one row fails that request alone (:mod:`.fault_isolation`).

With speculative decoding a row first emits its accepted drafts, one by one with the same checks (a stop
inside the run drops the rest); then the rejected drafts are rewound out of the KV cache and the row's new
drafts kept for the request's next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from megatron_core.inference.contexts.dynamic_context import StepEntry
from megatron_core.inference.engines.fault_isolation import describe
from megatron_core.inference.inference_request import (
    DynamicInferenceEventType,
    DynamicInferenceRequest,
    Status,
)

__all__ = ["TokenBookkeeping"]

logger = logging.getLogger(__name__)


class TokenBookkeeping:
    """Mixin over the engine's ``controller``, ``context``, ``requests``, ``running``, ``_suspects``,
    ``speculative_drafts`` and its counts,
    ``_sequence_length``, ``_notify_token``, ``_fail_request`` and ``_finish``."""

    def _bookkeep(self, entries: list[StepEntry], output: Any) -> None:
        """Book every row of a step's ``output``; a row that raises fails its request alone."""
        now = time.monotonic()
        tokenizer_top = self.controller.detokenize
        track_tokens = self.context.inference_config.track_generated_token_events
        for i, entry in enumerate(entries):
            request = self.requests[entry.request_id]
            try:
                self._bookkeep_entry(i, entry, request, output, now, tokenizer_top, track_tokens)
            except Exception as error:  # noqa: BLE001 - this request's fault alone
                logger.error("request %s failed while booking its token", entry.request_id, exc_info=error)
                self._fail_request(request, f"internal error while generating: {describe(error)}")

    def _bookkeep_entry(self, i: int, entry: StepEntry, request: DynamicInferenceRequest, output: Any, now: float,
                        tokenizer_top: Callable, track_tokens: bool) -> None:
        """Book row ``i`` of a step's ``output`` for ``request``: log-probs, its token, the stop checks."""
        params = request.sampling_params
        if output.chunk_log_probs[i] is not None:
            have = len(request.prompt_log_probs or [])
            upto = request.prompt_length - 1
            new = [lp for j, lp in enumerate(output.chunk_log_probs[i]) if have <= entry.start + j < upto]
            request.prompt_log_probs = (request.prompt_log_probs or []) + new
            if params.top_n_logprobs and output.chunk_top_n[i] is not None:
                tops = [t for j, t in enumerate(output.chunk_top_n[i]) if have <= entry.start + j < upto]
                request.prompt_top_n_logprobs = (request.prompt_top_n_logprobs or []) + [
                    {tokenizer_top([tok]): lp for tok, lp in top} for top in tops
                ]
        token = output.sampled_tokens[i]
        if token is None:
            return
        self._suspects.discard(request.request_id)  # it sampled: it did not cause the failure it is isolated for
        request.status = Status.ACTIVE_AND_GENERATING_TOKENS
        if request.ttft is None:
            request.ttft = now - request.arrival_time
        accepted = output.accepted_tokens[i] if output.accepted_tokens else None
        if accepted is not None:  # speculative decoding: the accepted drafts come first
            self.speculative_drafted_count += entry.draft_tokens
            self.speculative_accepted_count += len(accepted)
            lps, tops = output.accepted_log_probs[i], output.accepted_top_n[i]
            for j, draft in enumerate(accepted):
                if self._book_token(request, draft, None if lps is None else lps[j],
                                    None if tops is None else tops[j], tokenizer_top, track_tokens):
                    return
        if self._book_token(request, token, output.sampled_log_probs[i], output.sampled_top_n[i], tokenizer_top,
                            track_tokens):
            return
        if accepted is not None:  # take the rejected drafts back out of the cache; keep the next drafts
            self.context.rewind_request(request.request_id, entry.draft_tokens - len(accepted))
            self.speculative_drafts[request.request_id] = output.draft_tokens[i]

    def _book_token(self, request: DynamicInferenceRequest, token: int, log_prob: float | None,
                    top_n: list[tuple[int, float]] | None, tokenizer_top: Callable, track_tokens: bool) -> bool:
        """Append one generated ``token`` (log-probs, event, listeners); finish the request and return True if it stops."""
        params = request.sampling_params
        request.generated_tokens.append(token)
        if params.return_log_probs:
            request.generated_log_probs = (request.generated_log_probs or []) + [log_prob]
        if params.top_n_logprobs and top_n is not None:
            request.generated_top_n_logprobs = (request.generated_top_n_logprobs or []) + [
                {tokenizer_top([tok]): lp for tok, lp in top_n}
            ]
        if track_tokens:
            request.add_event(DynamicInferenceEventType.GENERATED_TOKEN, payload=token)
        self._notify_token(request, token)
        if not self._should_stop(request, token):
            return False
        self.running.remove(request.request_id)
        self._attach_routing(request)
        self.context.release_request(request.request_id)
        self._finish(request, Status.COMPLETED)
        return True

    def _attach_routing(self, request: DynamicInferenceRequest) -> None:
        """With routing replay, give a finishing request (still holding its blocks) ``routing_indices``: every
        token but the last generated one went through the model."""
        routing = self.context.moe_routing_metadata
        if routing is not None:
            num_tokens = self._sequence_length(request) - 1
            request.routing_indices = routing.request_routing_indices(request.request_id, num_tokens)

    def _should_stop(self, request: DynamicInferenceRequest, token: int) -> bool:
        """Whether ``request`` is done after ``token``; sets ``request.finish_reason`` ("stop" / "length")."""
        params = request.sampling_params
        reason = None
        if token == self.controller.termination_id(params):
            reason = "stop"
        elif params.stop_words and any(
            self.controller.detokenize(request.generated_tokens[-64:]).endswith(w) for w in params.stop_words
        ):
            reason = "stop"
        else:
            reason = self._stops_by_length(request, len(request.generated_tokens))
        request.finish_reason = reason
        return reason is not None

    def _stops_by_length(self, request: DynamicInferenceRequest, generated: int) -> str | None:
        """``"length"`` when ``generated`` tokens reach one of the request's length limits."""
        params = request.sampling_params
        total = request.prompt_length + generated
        if params.num_tokens_to_generate is not None and generated >= params.num_tokens_to_generate:
            return "length"
        if params.num_tokens_total is not None and total >= params.num_tokens_total:
            return "length"
        if total >= self.context.max_sequence_length:
            return "length"
        return None
