"""Tensor, sequence and context parallelism of the gated delta net against one process (CPU ranks, gloo), and its
checkpoint across TP sizes.

A ``G*G-`` hybrid model at TP x CP (x SP) matches the single-process model on the same weights and tokens: logits,
per-token loss and every gradient (fp32, 1e-5). Packed documents split over CP match one process too, a TP=2
checkpoint loads at TP=1 with the same logits, and head counts the TP x CP ranks cannot split raise ``ValueError``.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.ssm import gdn_parallel_checks


@pytest.mark.parametrize("tp,cp,sp", [(2, 1, True), (2, 2, False), (2, 2, True)], ids=["tp2-sp", "tp2-cp2",
                                                                                      "tp2-cp2-sp"])
def test_hybrid_model_matches_one_process(tp: int, cp: int, sp: bool) -> None:
    results = run_on_ranks(tp * cp, gdn_parallel_checks.check_hybrid_parallel, tp, cp, sp)
    assert all(r["grads"] == results[0]["grads"] > 20 and r["gdn_layers"] == 2 for r in results)
    # 8 value heads: each rank runs the recurrence for 8 / (TP * CP) of them.
    assert {r["value_heads_here"] for r in results} == {8 // (tp * cp)}


def test_packed_documents_over_context_parallel() -> None:
    assert sorted(run_on_ranks(2, gdn_parallel_checks.check_packed_cp, 2)) == [0, 1]


def test_tp2_checkpoint_loads_at_tp1(tmp_path) -> None:
    ckpt = str(tmp_path / "gdn")
    saved = run_on_ranks(2, gdn_parallel_checks.save_checkpoint, ckpt, 2)
    torch.testing.assert_close(saved[1], saved[0], rtol=0, atol=0)
    ((before, after),) = run_on_ranks(1, gdn_parallel_checks.load_checkpoint, ckpt, 1)
    assert not torch.allclose(before, saved[0])
    torch.testing.assert_close(after, saved[0], rtol=1e-5, atol=1e-5)


def test_heads_not_divisible_by_tp_times_cp_raise() -> None:
    message = run_on_ranks(8, gdn_parallel_checks.check_bad_parallel_config, 4, 2)[0]
    assert "linear_num_key_heads (4) must be divisible by tensor_model_parallel_size * context_parallel_size " \
           "(4 * 2 = 8)" in message
