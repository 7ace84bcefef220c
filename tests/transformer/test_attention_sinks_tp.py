"""A GPT-OSS-shaped dense GPTModel (learnable attention sinks, sliding windows on every other layer, YaRN, the
offset / clamped quick-GELU GLU, biases) under TP=2, with and without sequence parallelism (the latter with selective
recompute of the core attention), matches the single-process model on the same weights: per-token loss and every
gradient (the sinks' included), fp32 on gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.activations import quick_gelu
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like, loss_and_grads, shard, unshard

TP = 2
CASES = [dict(), dict(sequence_parallel=True, recompute_granularity="selective")]  # core attention recomputed


def _spec() -> dict:
    spec = llama_like(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                      activation_func_clamp_value=0.05, softmax_type="learnable", window_size=(2, 0),
                      window_attn_skip_freq=2, yarn_rotary_scaling_factor=4.0,
                      yarn_original_max_position_embeddings=4, yarn_correction_range_round_to_int=False)
    spec["model"] = dict(position_embedding_type="yarn", rotary_base=1000)
    return spec


def _shard(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    if name.endswith("softmax_offset"):
        return full.chunk(TP, dim=0)[rank]
    return shard(name, full, TP, rank, gated=True)


def _unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    if name.endswith("softmax_offset"):
        return torch.cat(pieces, dim=0)
    return unshard(name, pieces, gated=True)


def _reference() -> tuple[dict, torch.Tensor, dict]:
    torch.manual_seed(1234)
    model = build(_spec())
    with torch.no_grad():  # sinks of a few units, so that they matter
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.softmax_offset.copy_(torch.linspace(-2, 2, 8))
    return loss_and_grads(model)


def _check(overrides: dict) -> list[str]:
    ref_state, ref_loss, ref_grads = _reference()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(_spec(), tensor_model_parallel_size=TP, **overrides)
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_shard(name, ref_state[name], rank))
        ids, pos, labels = batch()
        loss = model(ids, pos, None, labels=labels)
        loss.sum().backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        checked = []
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            pieces = [torch.empty_like(grad) for _ in range(TP)]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            torch.testing.assert_close(_unshard(name, pieces), ref_grads[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
            checked.append(name)
        return checked
    finally:
        parallel_state.destroy_model_parallel()


def _check_cases() -> list[list[str]]:
    return [_check(overrides) for overrides in CASES]


def test_gpt_oss_like_model_under_tensor_parallelism_matches_one_process():
    for checked in run_on_ranks(TP, _check_cases):
        assert len(checked) == len(CASES)
        sinks = [n for n in checked[0] if n.endswith("core_attention.softmax_offset")]
        assert sinks == [f"decoder.layers.{i}.self_attention.core_attention.softmax_offset" for i in range(2)]
