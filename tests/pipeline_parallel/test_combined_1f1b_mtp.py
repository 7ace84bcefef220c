"""The combined 1F1B schedule with a multi-token-prediction depth (EP=2 on 2 gloo ranks, no pipelining).

With ``overlap_moe_expert_parallel_comm`` the MTP depth is scheduled as a layer after the decoder's
(``models.common.fine_grained_callables.build_mtp_layer_callables``): its projection and inner MoE layer's
slots interleave with another micro-batch's backward like any layer. The logged losses, the MTP loss and
every gradient (the MTP depth's included) must equal the flag-off run bit for bit (the tied word embeddings'
to rounding: their three gradient paths are summed in another order).
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.transformer.multi_token_prediction import MTPLossLoggingHelper
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel.combined_1f1b_utils import (
    EP,
    PlanRuns,
    forward_step,
    grads_by_key,
    micro_batches,
)
from tests.transformer.moe.moe_parallel_utils import SEQ, build, global_tensors, load_globals

MICRO = 3


def _build(flavour: str, **overrides) -> GPTModel:
    plain = build(flavour, mtp_num_layers=1, **overrides)
    config = plain.config
    spec = get_gpt_decoder_block_spec(config, False)
    return GPTModel(config, spec, plain.vocab_size, plain.max_sequence_length, position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(config, spec.layer_specs[-1], False))


def _run(flavour: str, overlap: bool, before: dict) -> tuple[list, torch.Tensor, dict]:
    model = _build(flavour, expert_model_parallel_size=EP, moe_token_dispatcher_type="alltoall", bf16=True,
                   overlap_moe_expert_parallel_comm=overlap)
    load_globals(model, before)
    MTPLossLoggingHelper.tracker.clear()
    rank = parallel_state.get_data_parallel_rank()
    with PlanRuns.record() as runs:
        logs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches(rank, MICRO)), model=[model],
            num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    assert (runs.forward, runs.both, runs.backward) == ((1, MICRO - 1, 1) if overlap else (0, 0, 0)), vars(runs)
    mtp_loss = MTPLossLoggingHelper.tracker["loss_values"].clone()
    MTPLossLoggingHelper.tracker.clear()
    return [d["lm loss"] for d in logs], mtp_loss, grads_by_key(model)


def _check(flavour: str) -> int:
    torch.manual_seed(1234)
    before = global_tensors(_build(flavour))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        off_losses, off_mtp, off_grads = _run(flavour, False, before)
        on_losses, on_mtp, on_grads = _run(flavour, True, before)
        torch.testing.assert_close(torch.stack(on_losses), torch.stack(off_losses), rtol=0, atol=0)
        assert off_mtp.abs().sum() > 0
        torch.testing.assert_close(on_mtp, off_mtp, rtol=0, atol=0)
        assert on_grads.keys() == off_grads.keys()
        mtp_pieces = 0
        for piece, (key, _, grad) in on_grads.items():
            # The tied word embeddings sum three gradient paths (input lookup, MTP lookup, output layer), which the
            # plan's nodes accumulate in another order: equal to rounding; everything else bit for bit.
            tol = dict(rtol=1e-6, atol=1e-7) if key.startswith("embedding.word_embeddings") else dict(rtol=0, atol=0)
            torch.testing.assert_close(grad, off_grads[piece][2], **tol,
                                       msg=lambda m, k=piece: f"{flavour} flag on vs off {k}: {m}")
            if key.startswith("mtp.") and not key.endswith("expert_bias"):
                assert grad.abs().sum() > 0, f"no gradient reached {piece}"
                mtp_pieces += 1
        return mtp_pieces
    finally:
        parallel_state.destroy_model_parallel()


def test_mtp_depth_in_the_plan_matches_flag_off():
    counts = run_on_ranks(2, _check, "mixtral")
    assert all(c > 0 for c in counts)


def test_mtp_depth_with_shared_experts_matches_flag_off():
    counts = run_on_ranks(2, _check, "deepseek")
    assert all(c > 0 for c in counts)
