"""Gradient clipping under TP/PP/DP sharding equals ``torch.nn.utils.clip_grad_norm_`` on one process.

A tiny GPT with tied input/output embeddings trains 3 steps (SGD, clip active) on 4 gloo ranks as
TP=2 x PP=2 with sequence parallelism (replicated LayerNorm params, tied weight on both stages)
and as DP=2 x PP=2 with the distributed optimizer (sharded main grads, DP replicas). Every step's
grad norm must equal ``clip_grad_norm_`` over the unsharded model, so each replicated or tied
element is counted once; the final weights must equal the single-process run's; the first and
last stage's copies of the tied embedding stay identical after every step.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.pipeline_parallel import forward_backward_no_pipelining, get_forward_backward_func
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import gpt2_like, unshard
from tests.pipeline_parallel.gpt_stages import (
    EMBEDDING,
    MBS,
    SEQ,
    TIED_LAST,
    StageChunks,
    gpt_forward_step,
    make_batches,
    reference_state,
)

WORLD, STEPS, MICROBATCHES, LR, CLIP = 4, 3, 2, 0.5, 0.05
SPEC = gpt2_like(num_layers=2)
LAYOUTS = {
    "tp2_pp2_sp": dict(tp=2, pp=2, sequence_parallel=True, distopt=False),
    "dp2_pp2_distopt": dict(tp=1, pp=2, sequence_parallel=False, distopt=True),
}


def _batches(step: int, dp: int) -> list[dict]:
    return make_batches(MICROBATCHES * dp, seed=100 + step)


@functools.cache
def _reference(dp: int):
    """Single process: fwd/bwd on all DP replicas' microbatches, clip_grad_norm_, plain SGD."""
    model, start = reference_state(SPEC)
    norms = []
    for step in range(STEPS):
        model.zero_grad()
        batches = _batches(step, dp)
        forward_backward_no_pipelining(forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=model,
                                       num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        with torch.no_grad():
            for param in model.parameters():
                param -= LR * param.grad
    return start, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(layout: str, start: dict):
    c = LAYOUTS[layout]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=c["tp"], pipeline_model_parallel_size=c["pp"])
    torch.manual_seed(1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(**SPEC["config"], tensor_model_parallel_size=c["tp"],
                               pipeline_model_parallel_size=c["pp"], pipeline_dtype=torch.float32,
                               sequence_parallel=c["sequence_parallel"], finalize_model_grads_func=finalize_model_grads)
    stages = StageChunks(SPEC, config, start)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=c["distopt"]),
                                  stages.chunks[0])
    config.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0,
                                                 clip_grad=CLIP, use_distributed_optimizer=c["distopt"]), [ddp])
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    norms, tied = [], []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        mine = _batches(step, dp)[dp_rank * MICROBATCHES:(dp_rank + 1) * MICROBATCHES]
        get_forward_backward_func()(forward_step_func=gpt_forward_step, data_iterator=iter(mine), model=[ddp],
                                    num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
        params = stages.params()
        tied.append(params.get(EMBEDDING, params.get(TIED_LAST)))
    return {"norms": norms, "params": stages.params(), "tied": tied, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "dp_rank": dp_rank, "first": parallel_state.is_pipeline_first_stage()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_clipped_steps_match_clip_grad_norm_on_unsharded_model(layout):
    dp = WORLD // (LAYOUTS[layout]["tp"] * LAYOUTS[layout]["pp"])
    start, ref_norms, ref_params = _reference(dp)
    assert min(ref_norms) > CLIP, "clipping must be active for this test to mean anything"
    per_rank = run_on_ranks(WORLD, _train, layout, start)
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    tied: dict[tuple[int, int], dict[bool, list[torch.Tensor]]] = {}
    for r in per_rank:
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        tied.setdefault((r["tp_rank"], r["dp_rank"]), {})[r["first"]] = r["tied"]
        for name, value in r["params"].items():
            pieces.setdefault(name, {})[r["tp_rank"]] = value
    for name, by_tp in pieces.items():
        ref_name = EMBEDDING if name == TIED_LAST else name
        full = unshard(ref_name, [by_tp[t] for t in sorted(by_tp)], gated=False)
        torch.testing.assert_close(full, ref_params[ref_name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert {EMBEDDING, TIED_LAST} <= set(pieces)
    for by_stage in tied.values():
        for first_copy, last_copy in zip(by_stage[True], by_stage[False]):
            assert torch.equal(first_copy, last_copy), "tied embedding copies diverged"
