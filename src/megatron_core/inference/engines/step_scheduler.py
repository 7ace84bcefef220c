"""Which tokens each request feeds in the next step (the scheduling half of ``DynamicInferenceEngine``).

Order of a step: decoding requests (oldest first; one that needs a KV block when none is free is
paused), then requests in the middle of their prefill (next chunk), then waiting requests (FIFO,
only while nobody is paused). When nothing at all can run, the youngest running request is
evicted (blocks freed, re-queued at the front with its prompt plus generated tokens).

With speculative decoding a decoding request also feeds the MTP drafts of its previous step, as many as fit in
the step budget, its length limits and the KV blocks (none, and just its token, when they do not fit).
"""

from __future__ import annotations

from typing import Any

from megatron_core.inference.contexts.dynamic_context import StepEntry
from megatron_core.inference.inference_request import DynamicInferenceRequest, Status


class StepScheduler:
    """Mixin over the engine's ``context``, ``requests``, ``waiting``, ``running``, ``paused_request_ids``,
    ``speculative_drafts`` and ``_suspects``."""

    def _sequence_length(self, request: DynamicInferenceRequest) -> int:
        """Tokens of the request so far: prompt plus generated (no list is built: this runs per request per step)."""
        return len(request.prompt_tokens) + len(request.generated_tokens)

    def _tokens(self, request: DynamicInferenceRequest, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + generated, copying only that range."""
        prompt, generated = request.prompt_tokens, request.generated_tokens
        n = len(prompt)
        if end <= n:
            return list(prompt[start:end])
        if start >= n:
            return generated[start - n : end - n]
        return list(prompt[start:]) + generated[: end - n]

    def _can_chunk(self, request: DynamicInferenceRequest) -> bool:
        return self.context.enable_chunked_prefill or request.num_evictions > 0

    def _entry(self, request: DynamicInferenceRequest, start: int, n: int) -> StepEntry:
        length = self._sequence_length(request)
        end = start + n
        params = request.sampling_params
        prompt_lp_left = len(request.prompt_log_probs or []) < request.prompt_length - 1
        all_logits = bool(params.return_log_probs or params.top_n_logprobs) and not params.skip_prompt_log_probs
        all_logits = all_logits and n > 1 and prompt_lp_left
        return StepEntry(
            request.request_id, self._tokens(request, start, end), start, sample=end == length, all_logits=all_logits,
            next_token=self._tokens(request, end, end + 1)[0] if end < length else None,
        )

    def _chunk_size(self, request: DynamicInferenceRequest, pending: int, budget: int, extra_slots: int) -> int:
        """Tokens to feed now: bounded by the step budget and the KV room (``extra_slots`` free + owned)."""
        if not self._can_chunk(request):
            return pending if pending <= min(budget, extra_slots) else 0
        return max(0, min(pending, budget, extra_slots))

    def _room(self, request_id: Any) -> int:
        """Token slots request ``request_id`` could use: its unused owned slots plus all free blocks."""
        ctx = self.context
        owned = len(ctx.request_blocks[request_id]) * ctx.block_size_tokens - ctx.kv_length(request_id)
        return owned + ctx.block_allocator.get_active_avail() * ctx.block_size_tokens

    def _decode_entry(self, request: DynamicInferenceRequest, kv: int, drafts: list[int] | None = None) -> StepEntry:
        """The entry of a decoding request: its last token, at position ``kv``, sampled (then ``drafts`` to verify)."""
        generated = request.generated_tokens
        token = generated[-1] if generated else request.prompt_tokens[-1]
        if drafts:
            return StepEntry(request.request_id, [token, *drafts], kv, draft_tokens=len(drafts))
        return StepEntry(request.request_id, [token], kv)

    def _draft_room(self, request: DynamicInferenceRequest, kv: int, budget: int) -> int:
        """Drafts worth feeding after the token at ``kv``: within the step budget, ``max_sequence_length`` and the
        tokens the request may still generate (a step emits at most one token more than it verifies)."""
        params = request.sampling_params
        length = kv + 1
        room = min(budget - 1, self.context.max_sequence_length - length - 1)
        if params.num_tokens_to_generate is not None:
            room = min(room, params.num_tokens_to_generate - len(request.generated_tokens) - 1)
        if params.num_tokens_total is not None:
            room = min(room, params.num_tokens_total - length - 1)
        return max(0, room)

    def _schedule(self) -> list[StepEntry]:
        ctx = self.context
        budget = ctx.max_tokens
        entries: list[StepEntry] = []
        paused: list[Any] = []
        prefilling: list[Any] = []
        requests, kv_lengths, blocks_of = self.requests, ctx.request_kv_length, ctx.request_blocks
        block_size, max_length = ctx.block_size_tokens, ctx.max_sequence_length
        for request_id in self.running:  # decoding requests, oldest first (one pass: this runs every step)
            request = requests[request_id]
            kv = kv_lengths[request_id]
            pending = len(request.prompt_tokens) + len(request.generated_tokens) - kv
            if pending > 1:
                prefilling.append(request_id)
                continue
            if pending != 1 or budget < 1:
                continue
            drafts = self.speculative_drafts.get(request_id) if self.speculative_drafts else None
            if drafts:  # speculative decoding: the last token and the drafts to verify, when they fit
                drafts = drafts[: self._draft_room(request, kv, budget)]
                if drafts and ctx.grow_request(request_id, kv + 1 + len(drafts)):
                    entries.append(self._decode_entry(request, kv, drafts))
                    budget -= 1 + len(drafts)
                    continue
            # Room in the blocks it holds (the usual case) or one more block.
            if (kv < len(blocks_of[request_id]) * block_size and kv < max_length) or ctx.grow_request(request_id, kv + 1):
                entries.append(self._decode_entry(request, kv))
                budget -= 1
            else:
                paused.append(request_id)
        for request_id in prefilling:  # requests in the middle of their prefill
            request = requests[request_id]
            kv = kv_lengths[request_id]
            pending = self._sequence_length(request) - kv
            n = self._chunk_size(request, pending, budget, self._room(request_id))
            if n == 0:
                paused.append(request_id)
                continue
            ctx.grow_request(request_id, kv + n)
            entries.append(self._entry(request, kv, n))
            budget -= n
        while self.waiting and not paused and budget > 0 and ctx.total_request_count < ctx.max_requests:
            request = self.requests[self.waiting[0]]
            length = self._sequence_length(request)
            hashes, max_cached = self._prefix_cache_query(request, length)
            matched = ctx.matched_prefix_blocks(hashes, max_cached)
            cached = len(matched) * ctx.block_size_tokens
            # Pinning matched blocks that sit in the evictable pool takes them out of what can be allocated.
            free_blocks = ctx.block_allocator.get_active_avail() - ctx.block_allocator.count_evictable(matched)
            n = self._chunk_size(request, length - cached, budget, free_blocks * ctx.block_size_tokens)
            if n == 0:
                break
            self.waiting.popleft()
            ctx.add_request(request.request_id, hashes, matched)
            request.num_cached_tokens = cached
            ctx.grow_request(request.request_id, cached + n)
            self.running.append(request.request_id)
            request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
            entries.append(self._entry(request, cached, n))
            budget -= n
        self.paused_request_ids = paused
        for request_id in paused:
            request = self.requests[request_id]
            request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
            if ctx.inference_config.track_paused_request_events:
                request.add_event_pause()
        return entries

    def _prefix_cache_query(self, request: DynamicInferenceRequest, length: int) -> tuple[list[int], int]:
        """The prompt-block hashes to look up and how many tokens may come from the cache.

        At least the sequence's last token is computed (its logits give the next token), and requests
        that want prompt log-probs compute their whole prompt.
        """
        params = request.sampling_params
        wants_prompt_log_probs = bool(params.return_log_probs or params.top_n_logprobs) and not params.skip_prompt_log_probs
        if not request.precomputed_block_hashes or wants_prompt_log_probs:
            return [], 0
        return request.precomputed_block_hashes, min(len(request.prompt_tokens), length - 1)

    def _evict_youngest(self) -> None:
        request_id = self.running.pop()
        request = self.requests[request_id]
        self.context.release_request(request_id)
        self.speculative_drafts.pop(request_id, None)
        request.add_event_evict()
        request.status = Status.WAITING_IN_QUEUE
        self.waiting.appendleft(request_id)
        self.evicted_request_count += 1

    def schedule_requests(self) -> list[StepEntry]:
        """The entries of the next step (pausing and evicting as needed); empty when idle.

        A request isolated after a failed step (:mod:`.fault_isolation`) runs in a step of its own.
        """
        if self._suspects:
            isolated = self._schedule_isolated()
            if isolated is not None:
                return isolated
        while True:
            entries = self._schedule()
            if entries or not self.running:
                return entries
            self._evict_youngest()
