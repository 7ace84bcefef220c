"""``qk_l2_norm``, ``no_rope_freq`` and ``mrope_section`` under model parallelism, on 2 gloo ranks, fp32.

A GPTModel with all three (multimodal RoPE from ``[3, b, s]`` positions, every 2nd layer without RoPE, L2-normalised
queries and keys) matches the single-process model on the same weights, per-token loss and every gradient:
TP=2 with and without sequence parallelism, and CP=2 (each rank feeds its load-balanced token chunks and the
positions of the whole sequence). Under PP=2 the layers look their flag up by global layer number: a
``no_rope_freq`` whose only NoPE layer sits on the second stage trains like the single-process model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.pipeline_parallel import forward_backward_no_pipelining, get_forward_backward_func
from megatron_core.transformer import TransformerConfig
from megatron_core.utils import get_batch_on_this_cp_rank
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import VOCAB, build, llama_like, shard, unshard
from tests.pipeline_parallel.gpt_stages import (
    MBS,
    SEQ,
    StageChunks,
    gpt_forward_step,
    make_batches,
    reference_state,
)

TOL = dict(rtol=1e-5, atol=1e-5)
S, B = 8, 2


def _spec() -> dict:
    spec = llama_like(num_attention_heads=4, num_query_groups=2, qk_l2_norm=True, no_rope_freq=2,
                      mrope_section=[1, 1, 2])
    spec["model"] = dict(position_embedding_type="mrope")
    return spec


def _data(s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [b, s], labels [b, s], positions [3, b, s])`` with distinct temporal / height / width positions."""
    gen = torch.Generator().manual_seed(7)
    ids, labels = torch.randint(0, VOCAB, (B, s), generator=gen), torch.randint(0, VOCAB, (B, s), generator=gen)
    return ids, labels, torch.randint(0, s, (3, B, s), generator=gen)


def _reference(s: int) -> tuple[dict, torch.Tensor, dict]:
    torch.manual_seed(1234)
    model = build(_spec())
    ids, labels, positions = _data(s)
    loss = model(ids, positions, None, labels=labels)
    loss.sum().backward()
    return ({k: v.detach().clone() for k, v in model.named_parameters()}, loss.detach(),
            {k: v.grad.detach().clone() for k, v in model.named_parameters()})


def _load_and_grads(model: torch.nn.Module, state: dict, run, tp: int) -> tuple[torch.Tensor, dict]:
    """Load ``state`` (TP shards), run ``run(model) -> loss``, return the loss and the full gradients (summed over
    CP, SP gradients over TP, TP shards reassembled)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_group, cp_group = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, state[name], tp, tp_rank, gated=True))
    loss = run(model)
    loss.sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=cp_group)
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=tp_group)
        pieces = [torch.empty_like(grad) for _ in range(tp)]
        dist.all_gather(pieces, grad.contiguous(), group=tp_group)
        grads[name] = unshard(name, pieces, gated=True)
    return loss.detach(), grads


def _check_tp() -> list[str]:
    state, ref_loss, ref_grads = _reference(S)
    done = []
    for sp in (False, True):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            model = build(_spec(), tensor_model_parallel_size=2, sequence_parallel=sp)
            ids, labels, positions = _data(S)
            loss, grads = _load_and_grads(
                model, state, lambda m, i=ids, p=positions, t=labels: m(i, p, None, labels=t), 2)
            torch.testing.assert_close(loss, ref_loss, **TOL)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name, sp=sp: f"sp={sp} {n}: {m}")
            done.append(f"sp={sp}")
        finally:
            parallel_state.destroy_model_parallel()
    return done


def _check_cp() -> list[int]:
    s = 16
    state, ref_loss, ref_grads = _reference(s)
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(_spec(), context_parallel_size=2, cp_comm_type="p2p")
        ids, labels, positions = _data(s)
        local = get_batch_on_this_cp_rank({"tokens": ids, "labels": labels})
        loss, grads = _load_and_grads(
            model, state, lambda m: m(local["tokens"], positions, None, labels=local["labels"]), 1)
        rank, c = parallel_state.get_context_parallel_rank(), s // 4
        kept = list(range(rank * c, (rank + 1) * c)) + list(range((3 - rank) * c, (4 - rank) * c))
        torch.testing.assert_close(loss, ref_loss[:, kept], **TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
        return kept
    finally:
        parallel_state.destroy_model_parallel()


def test_tensor_parallel_matches_one_process():
    assert run_on_ranks(2, _check_tp) == [["sp=False", "sp=True"]] * 2


def test_context_parallel_mrope_matches_one_process():
    kept = run_on_ranks(2, _check_cp)
    assert kept == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]


def _pp_spec(no_rope_freq) -> dict:
    return llama_like(num_layers=4, no_rope_freq=no_rope_freq, init_method_std=0.3)  # logits where RoPE matters


def _pp_reference(no_rope_freq, batches: list[dict]) -> tuple[dict, list[torch.Tensor], dict]:
    model, state = reference_state(_pp_spec(no_rope_freq))
    losses = forward_backward_no_pipelining(forward_step_func=gpt_forward_step, data_iterator=iter(batches),
                                            model=model, num_microbatches=len(batches), seq_length=SEQ,
                                            micro_batch_size=MBS)
    return state, [d["lm loss"] for d in losses], {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _check_pp() -> dict:
    batches = make_batches(2, seed=5)
    flags = [0, 0, 1, 0]  # the NoPE layer is global layer 3: the second stage's first layer
    state, ref_losses, ref_grads = _pp_reference(flags, batches)
    _, plain_losses, _ = _pp_reference(None, batches)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        spec = _pp_spec(flags)
        config = TransformerConfig(**spec["config"], pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
        stages = StageChunks(spec, config, state)
        losses = get_forward_backward_func()(
            forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=stages.chunks[0],
            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS)
        grads = stages.grads(use_main_grad=False)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
        layers = [layer.self_attention.layer_number for layer in stages.chunks[0].decoder.layers]
        out = {"layers": layers, "grads": len(grads)}
        if parallel_state.is_pipeline_last_stage():
            torch.testing.assert_close(torch.stack([d["lm loss"] for d in losses]), torch.stack(ref_losses), **TOL)
            out["rope_effect"] = (torch.stack(ref_losses) - torch.stack(plain_losses)).abs().max().item()
        return out
    finally:
        parallel_state.destroy_model_parallel()


def test_pipeline_stages_use_global_layer_numbers():
    first, last = run_on_ranks(2, _check_pp)
    assert first["layers"] == [1, 2] and last["layers"] == [3, 4]
    assert first["grads"] > 0 and last["grads"] > 0
    assert last["rope_effect"] > 1e-3, last["rope_effect"]
