"""Fine-grained activation offloading under interleaved pipeline parallelism (2 gloo ranks, 2 virtual stages).

Each rank trains its two chunks for three iterations of four micro-batches, without and then with offloading
every dense module, and compares its losses and gradients bit for bit; the offload manager must have ordered
the chunks of both virtual stages (the backward runs each group of micro-batches through the last stage first) and moved bytes. The
no-offload run is itself checked against the single-process model.
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.pipeline_parallel import forward_backward_no_pipelining, get_forward_backward_func
from megatron_core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import llama_like
from tests.pipeline_parallel.gpt_stages import (
    MBS,
    SEQ,
    StageChunks,
    gpt_forward_step,
    make_batches,
    reference_state,
)

MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
MICROBATCHES, ITERATIONS = 4, 3
SPEC = llama_like(num_layers=4)


def _train_pipeline(ref_state: dict, offload: bool, recompute: bool) -> tuple[list, list, dict]:
    PipelineOffloadManager.reset_instance()
    extra = dict(fine_grained_activation_offloading=True, offload_modules=MODULES,
                 min_offloaded_tensor_size=8) if offload else {}
    if recompute:
        extra.update(recompute_granularity="selective", recompute_modules=["mlp"])
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(**SPEC["config"], pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                               pipeline_dtype=torch.float32, **extra)
    stages = StageChunks(SPEC, config, ref_state)
    losses, grads = [], []
    for it in range(ITERATIONS):
        for chunk in stages.chunks:
            chunk.zero_grad()
        batches = make_batches(MICROBATCHES, seed=it)
        out = get_forward_backward_func()(
            forward_step_func=gpt_forward_step, data_iterator=[iter(batches) for _ in stages.chunks],
            model=stages.chunks, num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
        losses.append([d["lm loss"] for d in out])
        grads.append(stages.grads(False))
    manager = PipelineOffloadManager.get_instance()
    record = {"summary": dict(manager.offload_summary_bytes),
              "stages": [c.vpp_rank for c in manager._cached_chunks_backward],
              "chunks": len(manager._cached_chunks_forward)}
    return losses, grads, record


def _offload_vs_plain(ref_state: dict, recompute: bool) -> dict:
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    plain_losses, plain_grads, _ = _train_pipeline(ref_state, offload=False, recompute=recompute)
    losses, grads, record = _train_pipeline(ref_state, offload=True, recompute=recompute)
    PipelineOffloadManager.reset_instance()
    for it in range(ITERATIONS):
        assert [float(x) for x in losses[it]] == [float(x) for x in plain_losses[it]], it
        for name, grad in grads[it].items():
            torch.testing.assert_close(grad, plain_grads[it][name], rtol=0, atol=0,
                                       msg=lambda m, n=name, i=it: f"iteration {i} {n}: {m}")
    return {"record": record, "losses": plain_losses, "grads": plain_grads[-1],
            "is_last": parallel_state.is_pipeline_last_stage()}


def _single_process(ref_model) -> tuple[list, dict]:
    losses = []
    for it in range(ITERATIONS):
        ref_model.zero_grad()
        out = forward_backward_no_pipelining(
            forward_step_func=gpt_forward_step, data_iterator=iter(make_batches(MICROBATCHES, seed=it)),
            model=ref_model, num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
        losses.append([d["lm loss"] for d in out])
    return losses, {k: p.grad.detach().clone() for k, p in ref_model.named_parameters()}


def _check(recompute: bool) -> None:
    ref_model, ref_state = reference_state(SPEC)
    ref_losses, ref_grads = _single_process(ref_model)
    per_rank = run_on_ranks(2, _offload_vs_plain, ref_state, recompute)
    for r in per_rank:
        record = r["record"]
        assert record["chunks"] == 2 * MICROBATCHES  # one handler per micro-batch and virtual stage
        # The backward runs each group of pp=2 micro-batches through the last virtual stage first.
        assert record["stages"] == [1, 1, 0, 0] * (MICROBATCHES // 2)
        assert set(record["summary"]) == set(MODULES) and all(b > 0 for b in record["summary"].values())
        if r["is_last"]:
            for it in range(ITERATIONS):
                torch.testing.assert_close(torch.stack(r["losses"][it]), torch.stack(ref_losses[it]),
                                           rtol=1e-5, atol=1e-5)
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_interleaved_pipeline_offload_matches_no_offload():
    _check(recompute=False)


def test_interleaved_pipeline_offload_with_recompute():
    _check(recompute=True)
