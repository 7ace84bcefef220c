"""Absorbed MLA under tensor parallelism (with and without sequence parallelism) equals one process (2 gloo ranks).

One ``AbsorbedMLASelfAttention`` layer (dense causal core attention over the absorbed layout) with TP=2 holds the
single-process layer's weights split over the heads; its output, input gradient and every parameter gradient
(gathered over TP) equal the single-process run's, with and without q LoRA and with the fused RoPE. Under
sequence parallelism each rank holds half the tokens. A distributed checkpoint saved by the absorbed layer at TP=2
loads into standard MLA at TP=1 bit for bit, and the reverse. (DSA on the absorbed layer under TP / SP:
``experimental_attention_variant/test_dsa_tp.py``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from megatron_core.transformer.spec_utils import build_module
from tests.dist_harness import run_on_ranks
from tests.transformer.absorbed_mla_common import (
    TOL,
    absorbed_attention_spec,
    inputs,
    layer_pair,
    mla_config,
    perturb_norms,
    run_layer,
    standard_attention_spec,
)

_COLUMN = ("linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
           "linear_kv_down_proj.weight", "linear_kv_up_proj.weight")


def _shard(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    if name.endswith(_COLUMN):
        return full.chunk(2, dim=0)[rank]
    if name.endswith("linear_proj.weight"):
        return full.chunk(2, dim=1)[rank]
    return full


def _unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    if name.endswith(_COLUMN):
        return torch.cat(pieces, dim=0)
    if name.endswith("linear_proj.weight"):
        return torch.cat(pieces, dim=1)
    torch.testing.assert_close(pieces[1], pieces[0], **TOL)  # replicated: the same gradient on both ranks
    return pieces[0]


def _check_tp(overrides: dict) -> str:
    single = {k: v for k, v in overrides.items() if k != "sequence_parallel"}
    _, ref = layer_pair(mla_config(**single))
    x, w = inputs()
    want_out, want_dx, want_grads = run_layer(ref, x, w)
    state = {k: v.detach().clone() for k, v in ref.named_parameters()}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        cfg = mla_config(tensor_model_parallel_size=2, **overrides)
        layer = build_module(absorbed_attention_spec(cfg.qk_layernorm), config=cfg, layer_number=1)
        perturb_norms(layer)
        rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(_shard(name, state[name], rank))
        sp = cfg.sequence_parallel
        x_local, w_local = (x.chunk(2, dim=0)[rank], w.chunk(2, dim=0)[rank]) if sp else (x, w)
        out, dx, grads = run_layer(layer, x_local, w_local)
        if sp:
            want_out, want_dx = want_out.chunk(2, dim=0)[rank], want_dx.chunk(2, dim=0)[rank]
        torch.testing.assert_close(out, want_out, **TOL)
        torch.testing.assert_close(dx, want_dx, **TOL)
        assert sorted(grads) == sorted(want_grads)
        for name, param in layer.named_parameters():
            grad = grads[name].clone()
            if getattr(param, "sequence_parallel", False):  # the gradient finalisation's SP all-reduce
                dist.all_reduce(grad, group=group)
            pieces = [torch.empty_like(grad) for _ in range(2)]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            torch.testing.assert_close(_unshard(name, pieces), want_grads[name], **TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return f"tp=2 {overrides}"
    finally:
        parallel_state.destroy_model_parallel()


CASES = {
    "tp2": dict(),
    "tp2_sp": dict(sequence_parallel=True),
    "tp2_sp_no_q_lora": dict(sequence_parallel=True, q_lora_rank=None, qk_layernorm=False),
    "tp2_no_q_lora": dict(q_lora_rank=None, qk_layernorm=False),
    "tp2_sp_rope_fusion": dict(sequence_parallel=True, apply_rope_fusion=True),
}


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_tp_matches_single_process(overrides: dict):
    assert len(run_on_ranks(2, _check_tp, overrides)) == 2


def _checkpoint_between_classes(ckpt_dir: str) -> int:
    """Absorbed TP=2 -> standard TP=1 and standard TP=1 -> absorbed TP=2 through ``dist_checkpointing``."""
    _, ref = layer_pair(mla_config())
    state = {k: v.detach().clone() for k, v in ref.named_parameters()}
    plan = ((2, absorbed_attention_spec, "save", "a2"), (1, standard_attention_spec, "load", "a2"),
            (1, standard_attention_spec, "save", "s1"), (2, absorbed_attention_spec, "load", "s1"))
    for tp, spec, action, ckpt in plan:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(99)
            torch.manual_seed(99)
            layer = build_module(spec(), config=mla_config(tensor_model_parallel_size=tp), layer_number=1)
            rank = parallel_state.get_tensor_model_parallel_rank()
            shards = {name: _shard(name, full, rank) if tp == 2 else full for name, full in state.items()}
            path = f"{ckpt_dir}/{ckpt}"
            if action == "save":
                with torch.no_grad():
                    for name, param in layer.named_parameters():
                        param.copy_(shards[name])
                dist_checkpointing.save(layer.sharded_state_dict(), path)
                continue
            layer.load_state_dict(dist_checkpointing.load(layer.sharded_state_dict(), path), strict=False)
            for name, param in layer.named_parameters():
                torch.testing.assert_close(param, shards[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        finally:
            parallel_state.destroy_model_parallel()
    return len(state)


def test_distributed_checkpoint_moves_between_absorbed_and_standard_mla(tmp_path):
    assert run_on_ranks(2, _checkpoint_between_classes, str(tmp_path)) == [7, 7]  # parameters checked per rank
