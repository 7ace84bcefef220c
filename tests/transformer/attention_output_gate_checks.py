"""Rank functions of ``test_attention_output_gate.py`` (module level, so the gloo ranks can import them).

A tiny GPT model with ``attention_output_gate`` (q/k norms, GQA) under TP=2 against the one-process model on the
same weights, and its distributed checkpoint saved at one TP size and loaded at another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from tests.models.gpt_test_utils import batch, build, llama_like, loss_and_grads, shard, unshard

TP = 2


def spec() -> dict:
    """The gated model: 8 query heads in 4 groups, per-head q/k RMSNorm, SwiGLU."""
    return llama_like(attention_output_gate=True, qk_layernorm=True)


def reference() -> tuple[dict, torch.Tensor, dict]:
    """``(weights, per-token loss, gradients)`` of the one-process model."""
    torch.manual_seed(1234)
    return loss_and_grads(build(spec()))


def _gather(value: torch.Tensor, name: str, partial_sum: bool = False) -> torch.Tensor:
    """The TP=1 tensor of ``name`` from each rank's ``value`` (summed first when each rank holds a partial sum:
    the gradient of a norm under sequence parallelism)."""
    group = parallel_state.get_tensor_model_parallel_group()
    value = value.detach().clone()
    if partial_sum:
        dist.all_reduce(value, group=group)
    pieces = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, value.contiguous(), group=group)
    return unshard(name, pieces, gated=True)


def tp_matches_one_process(overrides: dict) -> list[str]:
    """TP=2 (with ``overrides``) on the reference weights: loss, logits and every gradient within 1e-5."""
    ref_state, ref_loss, ref_grads = reference()
    torch.manual_seed(1234)
    ref_model = build(spec())
    ids, pos, labels = batch()
    with torch.no_grad():
        ref_logits = ref_model(ids, pos, None)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(spec(), tensor_model_parallel_size=TP, **overrides)
        rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, ref_state[name], TP, rank, gated=True))
            local = model(ids, pos, None)  # [b, s, vocab / TP]
            pieces = [torch.empty_like(local) for _ in range(TP)]
            dist.all_gather(pieces, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        torch.testing.assert_close(torch.cat(pieces, dim=-1), ref_logits, rtol=1e-5, atol=1e-5)
        loss = model(ids, pos, None, labels=labels)
        loss.sum().backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        checked = []
        for name, param in model.named_parameters():
            partial = overrides.get("sequence_parallel", False) and getattr(param, "sequence_parallel", False)
            torch.testing.assert_close(_gather(param.grad, name, partial),
                                       ref_grads[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
            checked.append(name)
        return checked
    finally:
        parallel_state.destroy_model_parallel()


def checkpoint_reshards(ckpt: str, save_tp: int, load_tp: int) -> int:
    """Save the reference weights at ``save_tp``, load at ``load_tp`` into other weights: equal bit for bit."""
    state = reference()[0]
    for tp, action in ((save_tp, "save"), (load_tp, "load")):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(99)
            torch.manual_seed(99)
            model = build(spec(), tensor_model_parallel_size=tp)
            rank = parallel_state.get_tensor_model_parallel_rank()
            if action == "save":
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        param.copy_(shard(name, state[name], tp, rank, gated=True))
                dist_checkpointing.save(model.sharded_state_dict(), ckpt)
                continue
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt), strict=False)
            for name, param in model.named_parameters():
                torch.testing.assert_close(_gather(param, name), state[name], rtol=0, atol=0,
                                           msg=lambda m, n=name: f"{n}: {m}")
        finally:
            parallel_state.destroy_model_parallel()
    return len(state)


def all_checks(ckpt_dir: str) -> list[list[str]]:
    """TP=2 plain and with sequence parallelism, then TP=2 -> TP=1 and TP=1 -> TP=2 checkpoints (one pool call)."""
    out = [tp_matches_one_process({}), tp_matches_one_process({"sequence_parallel": True})]
    checkpoint_reshards(f"{ckpt_dir}/tp2", 2, 1)
    checkpoint_reshards(f"{ckpt_dir}/tp1", 1, 2)
    return out
