"""GPTModel + optimizer checkpoint saved at (TP, PP) = (2, 2) on 4 ranks, loaded under other layouts.

Each target layout loads the checkpoint with ``load_checkpoint``, must produce the same full-vocab
logits, and saves again: the re-saved checkpoint's global tensors (model and every optimizer state,
read back with ``load_plain_tensors``) must equal the original's exactly. Targets alternate the
distributed optimizer on and off; the bf16 case also carries the fp32 main params (``fp32_param``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.dist_checkpointing import load_plain_tensors
from megatron_core.training import get_checkpoint_name, load_checkpoint, save_checkpoint
from tests.dist_checkpointing.gpt_training import build, logits, train_step
from tests.dist_harness import run_on_ranks

WORLD = 4
FP32_TARGETS = [(1, 1, True), (2, 1, False), (1, 2, True), (4, 1, False)]  # (tp, pp, distributed optimizer)
BF16_TARGETS = [(1, 1, True), (2, 1, False)]


def _save_source(save_dir: str, bf16: bool, tp: int = 2, pp: int = 2, vpp: int | None = None) -> torch.Tensor | None:
    chunks, opt, sched = build(tp, pp, bf16=bf16, vpp=vpp)
    for step in range(1, 4):
        train_step(chunks, opt, sched, step)
    save_checkpoint(save_dir, 3, chunks, opt, sched)
    return logits(chunks)


def _load_target(save_dir: str, resave_dir: str, tp: int, pp: int, distributed_optimizer: bool,
                 bf16: bool, source_dp: int = 1) -> torch.Tensor | None:
    chunks, opt, sched = build(tp, pp, distributed_optimizer=distributed_optimizer, bf16=bf16, seed=4321)
    state = load_checkpoint(save_dir, chunks, opt, sched)
    assert state["iteration"] == 3
    assert sched.num_steps == 3 * 4 * source_dp, sched.num_steps  # 3 steps x (2 microbatches x 2) x DP
    save_checkpoint(resave_dir, 3, chunks, opt, sched)
    return logits(chunks)


def _last_stage_logits(per_rank: list) -> torch.Tensor:
    found = [x for x in per_rank if x is not None]
    assert found
    for x in found[1:]:
        assert torch.equal(x, found[0])
    return found[0]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_gpt_reshards_model_and_optimizer(tmp_path, bf16):
    source = str(tmp_path / "source")
    reference = _last_stage_logits(run_on_ranks(WORLD, _save_source, source, bf16))
    saved = load_plain_tensors(get_checkpoint_name(source, 3))
    names = {k.split(".")[2] for k in saved if k.startswith("optimizer.state.")}
    assert names == ({"exp_avg", "exp_avg_sq", "fp32_param"} if bf16 else {"exp_avg", "exp_avg_sq"}), names
    assert any(k.startswith("decoder.layers.") for k in saved)
    for tp, pp, dist_opt in BF16_TARGETS if bf16 else FP32_TARGETS:
        resave = str(tmp_path / f"tp{tp}_pp{pp}_{dist_opt}")
        got = _last_stage_logits(run_on_ranks(WORLD, _load_target, source, resave, tp, pp, dist_opt, bf16))
        tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, reference, **tol, msg=lambda m, t=(tp, pp): f"logits at (tp, pp)={t}: {m}")
        again = load_plain_tensors(get_checkpoint_name(resave, 3))
        assert again.keys() == saved.keys(), sorted(again.keys() ^ saved.keys())
        for key, value in saved.items():
            assert torch.equal(again[key], value), f"{key} changed after resharding to tp={tp} pp={pp} dist={dist_opt}"


def test_virtual_pipeline_chunks_reshard(tmp_path):
    """Chunks ``model0``/``model1`` of PP2 x VPP2 (DP2) load as one chunk at TP2 (DP2) and vice versa."""
    source = str(tmp_path / "vpp")
    reference = _last_stage_logits(run_on_ranks(WORLD, _save_source, source, False, 1, 2, 2))
    saved = load_plain_tensors(get_checkpoint_name(source, 3))
    resave = str(tmp_path / "tp2")
    got = _last_stage_logits(run_on_ranks(WORLD, _load_target, source, resave, 2, 1, True, False, 2))
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    again = load_plain_tensors(get_checkpoint_name(resave, 3))
    assert again.keys() == saved.keys(), sorted(again.keys() ^ saved.keys())
    for key, value in saved.items():
        assert torch.equal(again[key], value), f"{key} changed after resharding from PP2 x VPP2 to TP2"
