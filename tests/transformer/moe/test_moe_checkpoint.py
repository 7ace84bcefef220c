"""MoE checkpoints reshard: saved at EP=2 x TP=2 (SequentialMLP), loaded at EP=1 x TP=1 (grouped experts) and EP=4.

Every layout must give the same per-token losses (a function of the full-vocabulary logits) on a
fixed batch. Loading into a model with a different number of experts fails with an error that
names the tensor and both global shapes (experts are a dimension of the router and expert tensors).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.transformer.moe.moe_parallel_utils import batches, build

WORLD = 4


def _losses(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    ids, pos, labels = batches(1, seed=11)[0]
    with torch.no_grad():
        return model(ids, pos, None, labels=labels)


def _run(ckpt: str, tp: int, ep: int, grouped: bool, save: bool, num_experts: int = 4,
         **overrides) -> torch.Tensor:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(5 if save else 6)
        torch.manual_seed(5 if save else 6)
        model = build("deepseek", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                      sequence_parallel=tp > 1, moe_grouped_gemm=grouped, num_moe_experts=num_experts, **overrides)
        if save:
            for m in model.modules():
                if getattr(m, "expert_bias", None) is not None:
                    m.expert_bias.copy_(torch.linspace(-0.1, 0.1, num_experts))
            dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        else:
            state = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
            model.load_state_dict(state, strict=False)
        return _losses(model)
    finally:
        parallel_state.destroy_model_parallel()


def _load_mismatched(ckpt: str) -> str:
    try:
        _run(ckpt, 1, 1, False, save=False, num_experts=8)
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return str(err)
    return ""


@pytest.mark.slow
def test_moe_checkpoint_reshards_across_ep_tp_and_expert_layouts(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_on_ranks(WORLD, _run, ckpt, 2, 2, False, True)
    for tp, ep, grouped in ((1, 1, True), (1, 4, False), (2, 2, True)):
        loaded = run_on_ranks(WORLD, _run, ckpt, tp, ep, grouped, False)
        for got in loaded:
            torch.testing.assert_close(got, saved[0], rtol=1e-5, atol=1e-5)
    messages = run_on_ranks(WORLD, _load_mismatched, ckpt)
    assert all("shape mismatch" in m and "(2, 4, 16)" in m and "(2, 8, 16)" in m for m in messages), messages[0]



@pytest.mark.slow
def test_dense_and_moe_layers_mixed_reshard_under_their_own_keys(tmp_path):
    """``moe_layer_freq=[0, 1]``: layers of two kinds are saved under ``decoder.layers.<i>.`` (Megatron-Core's
    non-homogeneous layout) and still reshard across EP, TP and the expert layouts."""
    ckpt = str(tmp_path / "ckpt")
    mixed = dict(moe_layer_freq=[0, 1])
    saved = run_on_ranks(WORLD, _run, ckpt, 2, 2, False, True, **mixed)
    for tp, ep, grouped in ((1, 1, True), (1, 4, False)):
        loaded = run_on_ranks(WORLD, _run, ckpt, tp, ep, grouped, False, **mixed)
        for got in loaded:
            torch.testing.assert_close(got, saved[0], rtol=1e-5, atol=1e-5)
    keys = dist_checkpointing.load_tensors_metadata(ckpt)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in keys and "decoder.layers.1.mlp.router.weight" in keys
    assert "decoder.layers.mlp.linear_fc1.weight" not in keys
