"""Turns one forward into next tokens (Megatron-Core's ``TextGenerationController``).

The controller owns the tokenizer side (``tokenize_prompt``, ``detokenize_generations``) and the
per-step work of the dynamic engine: feed the context's flattened step to the model
(:meth:`generate_output_tokens_dynamic_batch`), sample one token for every request whose chunk
ended its sequence, and compute the log-probs asked for. Sampling uses one ``torch.Generator``
seeded from ``model.config.inference_sampling_seed`` (default 42), so a run with the same
requests in the same order reproduces. With ``model.config.moe_enable_routing_replay`` each dynamic
forward records the model's routers into the context's ``moe_routing_metadata``.

Tokenizers are duck-typed like Megatron's: ``tokenize(text) -> list[int]``,
``detokenize(ids) -> str``, ``eod``, and optionally ``bos`` and ``vocab_size``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
    AbstractModelInferenceWrapper,
)
from megatron_core.inference.sampling.torch_sampling import TorchSampling
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import _static_batch
from megatron_core.inference.text_generation_controllers.speculative_step import speculative_step
from megatron_core.inference.text_generation_controllers.step_output import (
    DynamicStepOutput,
    chunk_log_probs,
    top_n_log_probs,
)
from megatron_core.transformer.moe.router_replay import RouterReplay

__all__ = ["TextGenerationController", "DynamicStepOutput"]

DEFAULT_SAMPLING_SEED = 42


class TextGenerationController:
    """Tokenizer plus model wrapper plus sampler."""

    def __init__(self, inference_wrapped_model: AbstractModelInferenceWrapper, tokenizer: Any) -> None:
        self.inference_wrapped_model = inference_wrapped_model
        self.tokenizer = tokenizer
        self.model_config = inference_wrapped_model.config
        self.vocab_size = getattr(tokenizer, "vocab_size", None) if tokenizer is not None else None
        # moe_enable_routing_replay: this model's routers, recorded in every dynamic step (layer order).
        self.router_replays: list[RouterReplay] | None = None
        if getattr(self.model_config, "moe_enable_routing_replay", False):
            self.router_replays = [m.router_replay for m in inference_wrapped_model.model.modules()
                                   if isinstance(getattr(m, "router_replay", None), RouterReplay)]
        self.reset_sampling_seed(getattr(self.model_config, "inference_sampling_seed", DEFAULT_SAMPLING_SEED))

    def reset_sampling_seed(self, seed: int) -> None:
        """Restart the sampling generator from ``seed``."""
        self.sampling_seed = int(seed)
        self.sampling_rng = torch.Generator(device=self.inference_wrapped_model.device)
        self.sampling_rng.manual_seed(self.sampling_seed)
        self.sampler = TorchSampling(self.sampling_rng, self.vocab_size)

    # ---- tokenizer side ---------------------------------------------------------------------------

    @staticmethod
    def tokenize_prompt(tokenizer: Any, prompt: str, add_BOS: bool = False) -> list[int]:
        """Token ids of ``prompt`` (with the tokenizer's BOS in front when ``add_BOS``)."""
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
        tokens = list(tokenizer.tokenize(prompt))
        if add_BOS:
            bos = getattr(tokenizer, "bos", None)
            if bos is None:
                raise ValueError("SamplingParams.add_BOS is True but the tokenizer has no bos token")
            tokens = [bos, *tokens]
        return tokens

    def detokenize(self, tokens: list[int]) -> str:
        """Text of ``tokens`` (empty without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.detokenize(list(tokens))

    def detokenize_generations(
        self, tokens: list[int], termination_id: int | None, detokenize_stop_sequence: bool = False,
        return_segments: bool = False,
    ) -> tuple[str, list[str] | None]:
        """Generated text (the termination token dropped unless ``detokenize_stop_sequence``) and per-token segments."""
        if termination_id is not None and tokens and tokens[-1] == termination_id and not detokenize_stop_sequence:
            tokens = tokens[:-1]
        text = self.detokenize(tokens)
        segments = [self.detokenize([t]) for t in tokens] if return_segments else None
        return text, segments

    def termination_id(self, sampling_params: SamplingParams) -> int | None:
        """The token that ends generation: ``sampling_params.termination_id``, else the tokenizer's ``eod``."""
        if sampling_params.termination_id is not None:
            return sampling_params.termination_id
        return getattr(self.tokenizer, "eod", None) if self.tokenizer is not None else None

    # ---- sampling ---------------------------------------------------------------------------------

    def sample_from_logits(
        self, last_token_logits: torch.Tensor, sampling_params: SamplingParams | list[SamplingParams],
        vocab_size: int | None = None, generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Token ids ``[n]`` for ``last_token_logits`` ``[n, V]`` (one settings object, or one per row)."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * last_token_logits.shape[0]
        sampler = self.sampler
        if generator is not None or vocab_size is not None:
            sampler = TorchSampling(generator or self.sampling_rng, vocab_size or self.vocab_size)
        return sampler.sample(last_token_logits, params)

    # ---- static batches (the legacy static engine) -----------------------------------------------

    def prep_inference_input(
        self, prompts_tokens: torch.Tensor, active_requests: dict[Any, Any], use_attention_mask: bool = False,
    ) -> dict[str, Any]:
        """The wrapper's inputs for a padded ``[b, s]`` batch (causal attention: no mask is built)."""
        return self.inference_wrapped_model.prep_inference_input(prompts_tokens)

    def generate_all_output_tokens_static_batch(
        self, active_requests: dict[Any, Any], active_streams: dict[Any, Any] | None = None,
    ) -> dict[Any, Any]:
        """Generate a whole batch to completion (see ``_static_batch``); the requests, filled in."""
        return _static_batch.generate_all_output_tokens_static_batch(self, active_requests, active_streams)

    # ---- one dynamic step -------------------------------------------------------------------------

    def _forward_step(self) -> torch.Tensor:
        """Run the step laid out in the context (its tokens are cached afterwards); logits ``[L, V]``."""
        context = self.inference_wrapped_model.inference_context
        input_ids, position_ids = context.current_input_and_position_ids()
        inputs = {"tokens": input_ids, "position_ids": position_ids, "attention_mask": None}
        routing = getattr(context, "moe_routing_metadata", None) if self.router_replays is not None else None
        if routing is None:
            logits = self.inference_wrapped_model.run_one_forward_step(inputs)[0]
        else:  # rollout routing replay: keep each token's experts
            with routing.recording(self.router_replays):
                logits = self.inference_wrapped_model.run_one_forward_step(inputs)[0]
            routing.store_step()
        context.commit_step()
        if self.vocab_size is not None:
            logits = logits[:, : self.vocab_size]
        return logits

    def _sample_entries(self, logits: torch.Tensor, params_by_request: dict[Any, SamplingParams]) -> torch.Tensor:
        """Next tokens, on the logits' device, of the step's entries that sample (in entry order)."""
        entries = self.inference_wrapped_model.inference_context.step_entries
        sample_rows = [e.logit_rows[-1] for e in entries if e.sample]
        if not sample_rows:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        sample_params = [params_by_request[e.request_id] for e in entries if e.sample]
        if sample_rows == list(range(len(sample_rows))):  # decode steps: the first rows, no index tensor
            sample_logits = logits[: len(sample_rows)]
        else:
            sample_logits = logits[sample_rows]
        return self.sampler.sample(sample_logits, sample_params)

    def sample_step_on_device(self, params_by_request: dict[Any, SamplingParams]) -> torch.Tensor:
        """Run the laid-out step and sample, without waiting for the device: tokens ``[n]`` stay where they are.

        For steps whose every entry samples and asks for no log-probs (the engine overlaps such
        decode steps with its host work).
        """
        return self._sample_entries(self._forward_step(), params_by_request)

    def generate_output_tokens_dynamic_batch(self, params_by_request: dict[Any, SamplingParams]) -> DynamicStepOutput:
        """Run the step laid out in the context; sample and score per entry."""
        logits = self._forward_step()
        if getattr(self.inference_wrapped_model.inference_context, "num_speculative_tokens", 0):
            return speculative_step(self, logits, params_by_request)
        entries = self.inference_wrapped_model.inference_context.step_entries
        sampled = self._sample_entries(logits, params_by_request).tolist()
        want_log_probs = any(p.return_log_probs or p.top_n_logprobs for p in params_by_request.values())
        it = iter(sampled)
        if not want_log_probs:  # the usual step: tokens only
            return DynamicStepOutput.tokens_only([next(it) if entry.sample else None for entry in entries])
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        out = DynamicStepOutput()
        for entry in entries:
            params = params_by_request[entry.request_id]
            token = next(it) if entry.sample else None
            out.sampled_tokens.append(token)
            lp = top = chunk_lp = chunk_top = None
            if params.return_log_probs or params.top_n_logprobs:
                if entry.sample:
                    row = log_probs[entry.logit_rows[-1]]
                    lp = float(row[token])
                    top = top_n_log_probs(row, params.top_n_logprobs)
                if entry.all_logits:
                    chunk_lp, chunk_top = chunk_log_probs(log_probs, entry, params.top_n_logprobs)
            out.sampled_log_probs.append(lp)
            out.sampled_top_n.append(top)
            out.chunk_log_probs.append(chunk_lp)
            out.chunk_top_n.append(chunk_top)
        return out

