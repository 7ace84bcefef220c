"""``dist_checkpointing.load`` returns exactly the keys requested, so strict ``load_state_dict`` works.

A SwiGLU GPT (4 layers) saved at TP=2 is loaded on two pipeline stages (PP=2), saved again, and
loaded into TP=1, each time with ``load_state_dict(strict=True)``. Every load must return exactly
the keys of the sharded state dict passed in (no entries of another stage's ``linear_fc1``), the PP=2
re-save must hold bit-identical global tensors, and the logits of every layout match the TP=2
model's (fp32; only the reduction order differs).
"""

from __future__ import annotations

import torch

from megatron_core import dist_checkpointing, parallel_state
from megatron_core.dist_checkpointing import load_plain_tensors
from tests.dist_checkpointing.gpt_training import build, logits
from tests.dist_harness import run_on_ranks


def _save(directory: str, tp: int, pp: int) -> torch.Tensor | None:
    chunks, _, _ = build(tp, pp, seed=7)
    dist_checkpointing.save(chunks[0].module.sharded_state_dict(), directory)
    out = logits(chunks)
    parallel_state.destroy_model_parallel()
    return out


def _load_strict(directory: str, tp: int, pp: int, resave: str | None) -> tuple[list[str], list[str], object]:
    chunks, _, _ = build(tp, pp, seed=99)
    model = chunks[0].module
    request = model.sharded_state_dict()
    own = set(request)
    loaded = dist_checkpointing.load(request, directory)
    extra, missing = sorted(set(loaded) - own), sorted(own - set(loaded))
    model.load_state_dict(loaded, strict=True)
    if resave is not None:
        dist_checkpointing.save(model.sharded_state_dict(), resave)
    out = logits(chunks)
    parallel_state.destroy_model_parallel()
    return extra, missing, out


def _only(per_rank: list) -> torch.Tensor:
    found = [x for x in per_rank if x is not None]
    assert found
    return found[0]


def test_tp2_to_pp2_to_tp1_swiglu_strict(tmp_path) -> None:
    tp2, pp2 = str(tmp_path / "tp2"), str(tmp_path / "pp2")
    reference = _only(run_on_ranks(2, _save, tp2, 2, 1))
    results = run_on_ranks(2, _load_strict, tp2, 1, 2, pp2)
    for rank, (extra, missing, _) in enumerate(results):
        assert extra == [] and missing == [], f"stage {rank}: extra keys {extra}, missing keys {missing}"
    before, after = load_plain_tensors(tp2), load_plain_tensors(pp2)
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    torch.testing.assert_close(_only([r[2] for r in results]), reference, rtol=1e-5, atol=1e-5)
    extra, missing, out = run_on_ranks(1, _load_strict, pp2, 1, 1, None)[0]
    assert extra == [] and missing == [], (extra, missing)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
