"""The combined 1F1B schedule under the interleaved pipeline: PP=2 x VPP=2 x EP=2 on 4 gloo ranks.

Each rank holds two one-layer chunks of a 4-layer MoE GPT; with ``overlap_moe_expert_parallel_comm`` every
step of the interleaved schedule runs a forward and a backward interleaved node by node (one extra
warm-up forward per rank). Losses and every gradient must equal the flag-off run and the single-process
reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel.combined_1f1b_utils import (
    EP,
    PlanRuns,
    forward_step,
    grads_by_key,
    micro_batches,
)
from tests.transformer.moe.moe_parallel_utils import (
    FLAVOURS,
    MAX_SEQ,
    SEQ,
    VOCAB,
    global_tensors,
    load_globals,
)

WORLD, PP, VPP, MICRO = 4, 2, 2, 4
BASE = dict(num_layers=4, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
            num_moe_experts=4, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
            **FLAVOURS["mixtral"])


def _model(config: TransformerConfig, pre_process: bool, post_process: bool, vp_stage: int | None) -> GPTModel:
    spec = get_gpt_decoder_block_spec(config, False, vp_stage=vp_stage)
    mtp = get_gpt_mtp_block_spec(config, spec, False, vp_stage=vp_stage) if config.mtp_num_layers else None
    return GPTModel(config, spec, VOCAB, MAX_SEQ, position_embedding_type="rope", pre_process=pre_process,
                    post_process=post_process, vp_stage=vp_stage, mtp_block_spec=mtp)


def _reference(before: dict, data_rank: int, mtp: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from megatron_core.transformer.moe import MoEAuxLossAutoScaler
    from megatron_core.transformer.mtp_loss import MTPLossAutoScaler
    from tests.pipeline_parallel.combined_1f1b_utils import global_grads

    model = _model(TransformerConfig(**_base(mtp)), True, True, None)
    load_globals(model, before)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / MICRO))
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / MICRO))
    losses = []
    for ids, pos, labels in micro_batches(data_rank, MICRO):
        loss = model(ids, pos, None, labels=labels).float().mean()
        (loss / MICRO).backward()
        losses.append(loss.detach())
    return losses, global_grads(model)


def _base(mtp: bool) -> dict:
    """The model's fields; with ``mtp`` one multi-token-prediction depth (on the last stage's last chunk)."""
    return {**BASE, "mtp_num_layers": 1} if mtp else BASE


def _run(overlap: bool, overlap_p2p: bool, before: dict, mtp: bool) -> tuple[list[torch.Tensor], dict]:
    config = TransformerConfig(**_base(mtp), pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=VPP,
                               pipeline_dtype=torch.float32, expert_model_parallel_size=EP,
                               moe_token_dispatcher_type="alltoall", bf16=True, overlap_p2p_comm=overlap_p2p,
                               overlap_moe_expert_parallel_comm=overlap)
    chunks = []
    for v in range(VPP):
        chunk = _model(config, parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                       parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v), v)
        load_globals(chunk, before)
        chunks.append(chunk)
    data = micro_batches(parallel_state.get_data_parallel_rank(), MICRO)
    with PlanRuns.record() as runs:
        logs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(data) for _ in chunks], model=chunks,
            num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    # One more warm-up forward than the plain schedule (2 (p - r - 1) + (V - 1) N), then paired steps.
    total, pp_rank = MICRO * VPP, parallel_state.get_pipeline_model_parallel_rank()
    warmup = min(2 * (PP - pp_rank - 1) + (VPP - 1) * PP + 1, total)
    expected = (warmup, total - warmup, warmup) if overlap else (0, 0, 0)
    assert (runs.forward, runs.both, runs.backward) == expected, vars(runs)
    grads = {}
    for chunk in chunks:
        grads.update(grads_by_key(chunk))
    return [d["lm loss"] for d in logs], grads


def _sum_over_embedding_group(grads: dict) -> None:
    """Add the word-embedding gradients of the first and last stages (what ``finalize_model_grads`` does)."""
    import torch.distributed as dist

    pieces = sorted(p for p, (key, _, _) in grads.items() if key.startswith("embedding.word_embeddings"))
    assert len(pieces) == 1, pieces
    key, where, grad = grads[pieces[0]]
    grad = grad.clone()
    dist.all_reduce(grad, group=parallel_state.get_embedding_group())
    grads[pieces[0]] = (key, where, grad)


def _check(overlap_p2p: bool, mtp: bool = False) -> str:
    torch.manual_seed(1234)
    before = global_tensors(_model(TransformerConfig(**_base(mtp)), True, True, None))
    refs = [_reference(before, r, mtp) for r in range(EP)]
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP,
                                             virtual_pipeline_model_parallel_size=VPP, expert_model_parallel_size=EP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_data_parallel_rank()
        off_losses, off_grads = _run(False, overlap_p2p, before, mtp)
        on_losses, on_grads = _run(True, overlap_p2p, before, mtp)
        assert len(on_losses) == len(off_losses)
        if parallel_state.is_pipeline_last_stage():
            assert len(on_losses) == MICRO
            torch.testing.assert_close(torch.stack(on_losses), torch.stack(off_losses), rtol=0, atol=0)
            torch.testing.assert_close(torch.stack(on_losses), torch.stack(refs[rank][0]), rtol=1e-5, atol=1e-6)
        assert on_grads.keys() == off_grads.keys()
        if mtp:  # the MTP depth's copy of the word embeddings on the last stage: its gradient joins the first's
            _sum_over_embedding_group(on_grads)
            _sum_over_embedding_group(off_grads)
        for piece, (key, where, grad) in on_grads.items():
            # With MTP the tied word embeddings sum their gradient paths in another order: equal to rounding.
            exact = not (mtp and key.startswith("embedding.word_embeddings"))
            torch.testing.assert_close(grad, off_grads[piece][2], rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7,
                                       msg=lambda m, k=piece: f"flag on vs off {k}: {m}")
            sources = range(EP) if ".experts." in key else [rank]
            want = sum(refs[r][1][key] for r in sources)[where]
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=piece: f"vs single process {k}: {m}")
        return "ok"
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("overlap_p2p", [False, True])
def test_interleaved_overlap_matches_flag_off_and_single_process(overlap_p2p: bool):
    assert run_on_ranks(WORLD, _check, overlap_p2p) == ["ok"] * WORLD


def test_interleaved_overlap_with_an_mtp_depth_matches_flag_off_and_single_process():
    assert run_on_ranks(WORLD, _check, False, True) == ["ok"] * WORLD
