"""Verify MTP drafts and draft the next ones: the speculative half of a dynamic step (``num_speculative_tokens > 0``).

A decoding request feeds its last token followed by the drafts of the previous step (``StepEntry.draft_tokens``),
so the forward gives one logits row per fed token. Every row is sampled with the request's own settings (top-k
1 is greedy); draft ``j`` is accepted when it equals the token chosen at the row before it and all earlier drafts
were accepted (Megatron-Core 0.19's rule, also under sampling: a draft is kept when the main model's sample
agrees with it). The request then emits the accepted drafts and the token chosen at its last accepted row.

Then the MTP layers draft the next step's tokens, conditioned on verified tokens only: depth 0 takes the
decoder's hidden state at the last accepted row and the token just chosen; each further depth takes the previous
depth's hidden state and draft (:meth:`~megatron_core.models.common.language_module.language_module.LanguageModule.compute_mtp_single_step`).
Drafts are sampled with the request's settings too. Prefilling requests that finish their prompt draft the same
way from their last row.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers.step_output import (
    DynamicStepOutput,
    chunk_log_probs,
    top_n_log_probs,
)

__all__ = ["accepted_prefix_length", "num_mtp_depths", "speculative_step"]


def num_mtp_depths(model_config: Any, num_speculative_tokens: int) -> int:
    """MTP depths run per step: ``num_speculative_tokens`` (each depth one draft), checked against the model.

    A model with ``mtp_use_repeated_layer`` chains its one MTP layer as often as asked; otherwise each draft
    needs its own MTP layer, so ``num_speculative_tokens`` may not exceed ``mtp_num_layers``.
    """
    layers = getattr(model_config, "mtp_num_layers", None) or 0
    if layers < 1:
        raise ValueError(f"InferenceConfig.num_speculative_tokens ({num_speculative_tokens}) drafts with the model's "
                         f"MTP layers, but its config has mtp_num_layers={layers or None} (needs >= 1)")
    if not getattr(model_config, "mtp_use_repeated_layer", False) and num_speculative_tokens > layers:
        raise ValueError(f"InferenceConfig.num_speculative_tokens ({num_speculative_tokens}) exceeds the model's "
                         f"mtp_num_layers ({layers}): each draft needs its own MTP layer unless "
                         "mtp_use_repeated_layer=True")
    return num_speculative_tokens


def accepted_prefix_length(drafts: list[int], chosen: list[int]) -> int:
    """How many leading ``drafts`` match ``chosen`` (the model's token at the row before each draft)."""
    count = 0
    for draft, token in zip(drafts, chosen):
        if draft != token:
            break
        count += 1
    return count


def speculative_step(controller: Any, logits: torch.Tensor,
                     params_by_request: dict[Any, SamplingParams]) -> DynamicStepOutput:
    """Sample, verify and draft for the step laid out in the context (``logits`` ``[L, V]`` from its forward)."""
    context = controller.inference_wrapped_model.inference_context
    entries = context.step_entries
    rows: list[int] = []
    params: list[SamplingParams] = []
    for entry in entries:
        if entry.sample:
            entry_rows = entry.logit_rows if entry.draft_tokens else entry.logit_rows[-1:]
            rows.extend(entry_rows)
            params.extend([params_by_request[entry.request_id]] * len(entry_rows))
    chosen = controller.sampler.sample(logits[rows], params).tolist() if rows else []
    want_log_probs = any(p.return_log_probs or p.top_n_logprobs for p in params_by_request.values())
    log_probs = torch.log_softmax(logits.float(), dim=-1) if want_log_probs else None
    out = DynamicStepOutput()
    hidden_rows, base_tokens, base_positions, draft_params = [], [], [], []
    at = 0
    for entry in entries:
        p = params_by_request[entry.request_id]
        token = lp = top = chunk_lp = chunk_top = None
        accepted: list[int] | None = None
        accepted_lp: list[float] | None = None
        accepted_top: list[Any] | None = None
        if entry.sample:
            n = entry.draft_tokens + 1 if entry.draft_tokens else 1
            picks = chosen[at : at + n]
            at += n
            drafts = entry.tokens[len(entry.tokens) - entry.draft_tokens :] if entry.draft_tokens else []
            a = accepted_prefix_length(drafts, picks)
            accepted, token = drafts[:a], picks[a]
            entry_rows = entry.logit_rows if entry.draft_tokens else entry.logit_rows[-1:]
            final_row = entry_rows[a]
            hidden_rows.append(final_row)
            base_tokens.append(token)
            base_positions.append(entry.start + (a + 1 if entry.draft_tokens else len(entry.tokens)))
            draft_params.append(p)
            if log_probs is not None and (p.return_log_probs or p.top_n_logprobs):
                accepted_lp = [float(log_probs[entry_rows[j], t]) for j, t in enumerate(accepted)]
                accepted_top = [top_n_log_probs(log_probs[entry_rows[j]], p.top_n_logprobs) for j in range(a)]
                lp = float(log_probs[final_row, token])
                top = top_n_log_probs(log_probs[final_row], p.top_n_logprobs)
        if log_probs is not None and entry.all_logits and (p.return_log_probs or p.top_n_logprobs):
            chunk_lp, chunk_top = chunk_log_probs(log_probs, entry, p.top_n_logprobs)
        out.sampled_tokens.append(token)
        out.sampled_log_probs.append(lp)
        out.sampled_top_n.append(top)
        out.chunk_log_probs.append(chunk_lp)
        out.chunk_top_n.append(chunk_top)
        out.accepted_tokens.append(accepted)
        out.accepted_log_probs.append(accepted_lp)
        out.accepted_top_n.append(accepted_top)
    drafts_by_row = _draft(controller, context, hidden_rows, base_tokens, base_positions, draft_params)
    it = iter(drafts_by_row)
    out.draft_tokens = [next(it) if entry.sample else None for entry in entries]
    return out


def _draft(controller: Any, context: Any, hidden_rows: list[int], base_tokens: list[int],
           base_positions: list[int], params: list[SamplingParams]) -> list[list[int]]:
    """``context.num_speculative_tokens`` MTP drafts after each base token (one list per sampling entry)."""
    hidden_states = context.mtp_decoder_hidden_states
    context.mtp_decoder_hidden_states = None
    if not hidden_rows:
        return []
    if hidden_states is None:
        raise RuntimeError("speculative decoding: the model left no decoder hidden states in the context "
                           "(its forward must store them when context.keep_mtp_hidden_states is set)")
    model = controller.inference_wrapped_model.inner_model
    device = hidden_states.device
    hidden = hidden_states[torch.tensor(hidden_rows, device=device)]  # [N, 1, h]
    ids = torch.tensor([base_tokens], dtype=torch.long, device=device)
    positions = torch.tensor([base_positions], dtype=torch.long, device=device)
    repeated = bool(getattr(model.config, "mtp_use_repeated_layer", False))
    depths = []
    for depth in range(context.num_speculative_tokens):
        hidden, mtp_logits = model.compute_mtp_single_step(hidden, ids, positions + depth,
                                                           depth=None if repeated else depth)
        mtp_logits = mtp_logits[:, 0, :]
        if controller.vocab_size is not None:
            mtp_logits = mtp_logits[:, : controller.vocab_size]
        ids = controller.sampler.sample(mtp_logits, params).view(1, -1)
        depths.append(ids[0])
    return torch.stack(depths, dim=1).tolist()
