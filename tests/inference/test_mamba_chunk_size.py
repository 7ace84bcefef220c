"""``MambaInferenceStateConfig.mamba_chunk_size`` is the SSD scan chunk of the dynamic engine's prefill steps
(Megatron-Core's meaning), and prefill results do not depend on it (fp32, CPU).

A HybridModel whose mixers scan in chunks of 4 prefills a 13-token prompt (and a second request joining with 5
tokens) under contexts whose chunk size is 1, 3, 4 and 128: the scan is called with the context's chunk size,
and every position's logits and every Mamba layer's stored states agree across them within 1e-5, and with the
full-sequence forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.contexts.dynamic_context import StepEntry
from megatron_core.ssm import mamba_inference
from tests.inference.hybrid_fixture import MAX_SEQ, build_hybrid, prompts

CHUNKS = (1, 3, 4, 128)


@pytest.fixture(scope="module")
def model():
    return build_hybrid("M*M-", seed=3, chunk_size=4)


@torch.no_grad()
def _prefill(model, chunk: int, ids: list[list[int]]) -> tuple[dict, list[torch.Tensor]]:
    """Logits rows of each request after one prefill step, and every Mamba layer's states of both requests."""
    mamba = dataclasses.replace(MambaInferenceStateConfig.from_model(model), mamba_chunk_size=chunk)
    ctx = DynamicInferenceContext(model.config, InferenceConfig(
        mamba_inference_state_config=mamba, block_size_tokens=4, buffer_size_gb=0.01, max_sequence_length=MAX_SEQ,
        max_requests=2, materialize_only_last_token_logits=False))
    entries = []
    for rid, tokens in enumerate(ids):
        ctx.add_request(rid)
        entries.append(StepEntry(rid, tokens, 0))
    for e in entries:
        assert ctx.grow_request(e.request_id, e.start + len(e.tokens))
    ctx.initialize_attention_state(entries)
    input_ids, position_ids = ctx.current_input_and_position_ids()
    logits = model(input_ids, position_ids, None, inference_context=ctx)[0]
    ctx.commit_step()
    rows = {e.request_id: logits[e.logit_rows].clone() for e in ctx.step_entries}
    states = []
    for number in sorted(ctx.mamba_slots.conv_states):
        conv, ssm = ctx.mamba_states_cache(number)
        states += [conv[: len(ids)].clone(), ssm[: len(ids)].clone()]
    return rows, states


def test_prefill_uses_the_configured_chunk_and_does_not_depend_on_it(model, monkeypatch) -> None:
    ids = prompts([13, 5], seed=4)
    seen: list[int] = []
    scan = mamba_inference.ssd_chunk_scan

    def recording_scan(*args, **kwargs):
        seen.append(args[5])  # the chunk size the real scan runs with
        return scan(*args, **kwargs)

    monkeypatch.setattr(mamba_inference, "ssd_chunk_scan", recording_scan)
    results = {}
    for chunk in CHUNKS:
        seen.clear()
        results[chunk] = _prefill(model, chunk, ids)
        assert seen and set(seen) == {chunk}
    ref_rows, ref_states = results[4]  # the mixers' own chunk size
    with torch.no_grad():
        for rid, tokens in enumerate(ids):
            full = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)[0]
            torch.testing.assert_close(ref_rows[rid], full, rtol=1e-5, atol=1e-5)
    for chunk, (rows, states) in results.items():
        for rid in ref_rows:
            torch.testing.assert_close(rows[rid], ref_rows[rid], rtol=1e-5, atol=1e-5, msg=f"chunk {chunk}")
        assert len(states) == len(ref_states) == 4
        for got, want in zip(states, ref_states):
            assert want.abs().max() > 0
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"chunk {chunk}")
