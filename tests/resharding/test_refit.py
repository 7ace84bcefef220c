"""``swap_model_weights`` between GPT layouts on gloo CPU ranks (colocated and on disjoint rank sets).

Each case builds a source and a destination GPT from different seeds, refits, and checks that every
destination weight, gathered over TP and pipeline stages, is bit-identical to the source's gathered
weight, that the destination's logits equal a single-process model holding the source's weights (exactly
at TP=1; ``rtol=atol=1e-5`` under TP, whose row-parallel sums add in another order), and that a second
refit after the source changed copies again through the cached plan. Covered: TP=2 -> 1 (GPT-2-like:
biases, tied embeddings, learned positions), TP=1 -> 2 and TP=2 x PP=2 -> TP=4 (Llama-like: GQA fused
QKV and SwiGLU fc1, whose stride-2 layout changes with the TP split), PP=2 -> PP=1, DP=2 x TP=2 -> TP=1 on
disjoint ranks, over the gloo service and the NCCL-named service on the gloo group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_core.resharding import swap_model_weights
from megatron_core.resharding.copy_services import NCCLCopyService
from megatron_core.resharding.refit import clear_all_caches
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, gpt2_like, llama_like
from tests.resharding.layouts import Layout, build_model, full_weights

SPECS = {"llama": llama_like, "gpt2": gpt2_like}


def _all_weights(model, layout: Layout, gated: bool) -> dict[str, torch.Tensor]:
    """The whole model's single-process weights, assembled from every rank's stages."""
    mine = full_weights(model, layout, gated) if model is not None else {}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part)
    return out


def _logits(model, layout: Layout) -> torch.Tensor:
    ids, pos, _ = batch()
    with torch.no_grad():
        local = model(ids, pos, None)
    pieces = [torch.empty_like(local) for _ in range(layout.pgs.tp.size())]
    dist.all_gather(pieces, local.contiguous(), group=layout.pgs.tp)
    return torch.cat(pieces, dim=-1)


def _reference_logits(spec: dict, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    model = build(spec)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    ids, pos, _ = batch()
    with torch.no_grad():
        return model(ids, pos, None)


def _refit_case(kind: str, src_ranks: list[int], src_tp: int, src_pp: int, dst_ranks: list[int], dst_tp: int,
                dst_pp: int, method: str) -> str:
    spec = SPECS[kind]()
    gated = spec["config"].get("gated_linear_unit", False)
    src_layout, dst_layout = Layout(src_ranks, src_tp, src_pp), Layout(dst_ranks, dst_tp, dst_pp)
    try:
        src = build_model(spec, src_layout, seed=1234)
        dst = build_model(spec, dst_layout, seed=77)
        src_full = _all_weights(src, src_layout, gated)
        before = _all_weights(dst, dst_layout, gated)
        assert any(not torch.equal(before[k], src_full[k]) for k in before)
        service = method if method == "gloo" else NCCLCopyService()
        for round_ in range(2):
            if round_:  # the source trains on: the cached plan must move the new values
                with torch.no_grad():
                    for p in (src.parameters() if src is not None else []):
                        p.mul_(1.5)
                src_full = _all_weights(src, src_layout, gated)
            swap_model_weights(src, dst, service)
            after = _all_weights(dst, dst_layout, gated)
            assert set(after) == set(before)
            for name, value in after.items():
                expected = src_full[name] if name in src_full else src_full["embedding.word_embeddings.weight"]
                assert torch.equal(value, expected), f"round {round_}: {name} differs"
        if dst is not None and dst_pp == 1:
            ref = _reference_logits(spec, src_full)
            got = _logits(dst, dst_layout)
            if dst_tp == 1:
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        return "ok"
    finally:
        clear_all_caches()
        src_layout.destroy()
        dst_layout.destroy()


def _mismatch_case() -> str:
    layout = Layout([0, 1], 2)
    src_layout = Layout([0, 1], 1)
    try:
        src = build_model(llama_like(ffn_hidden_size=64), src_layout, seed=1)
        dst = build_model(llama_like(ffn_hidden_size=32), layout, seed=1)
        with pytest.raises(ValueError, match=r"'decoder\.layers\.0\.mlp\.linear_fc1\.weight'.*source shape "
                                             r"\(128, 32\).*destination shape \(32, 32\)"):
            swap_model_weights(src, dst, "gloo")
        return "ok"
    finally:
        clear_all_caches()
        layout.destroy()
        src_layout.destroy()


def test_mismatched_models_raise_value_error():
    assert run_on_ranks(2, _mismatch_case) == ["ok"] * 2


CASES_2 = {
    "gpt2_tp2_to_tp1": ("gpt2", [0, 1], 2, 1, [0, 1], 1, 1, "gloo"),
    "llama_tp1_to_tp2": ("llama", [0, 1], 1, 1, [0, 1], 2, 1, "nccl"),
    "llama_pp2_to_pp1": ("llama", [0, 1], 1, 2, [0, 1], 1, 1, "gloo"),
    "gpt2_pp1_to_pp2_tied": ("gpt2", [0, 1], 1, 1, [0, 1], 1, 2, "gloo"),
}
CASES_4 = {
    "llama_tp2pp2_to_tp4": ("llama", [0, 1, 2, 3], 2, 2, [0, 1, 2, 3], 4, 1, "gloo"),
    "llama_disjoint_tp2dp1_to_tp1dp2": ("llama", [0, 1], 2, 1, [2, 3], 1, 1, "nccl"),
}


@pytest.mark.parametrize("case", sorted(CASES_2))
def test_refit_two_ranks(case: str):
    assert run_on_ranks(2, _refit_case, *CASES_2[case]) == ["ok"] * 2


@pytest.mark.parametrize("case", sorted(CASES_4))
def test_refit_four_ranks(case: str):
    assert run_on_ranks(4, _refit_case, *CASES_4[case]) == ["ok"] * 4
