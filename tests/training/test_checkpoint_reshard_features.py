"""A distributed checkpoint saved under one parallel layout resumes exactly under another, feature by feature.

For each model feature of the parallel-training audit (``parallel_step_features.FEATURES``) and each pair of
layouts (TP=2 -> one process, one process -> TP=2, PP=2 -> one process, EP=2 -> one process for the MoE
features, DP=2 with the distributed optimizer -> one process and back, TP=2 -> PP=2; and TP=2 -> DP=2, one
process -> EP=2, EP=2 with the distributed optimizer -> one process, TP=2 + SP -> EP=2), layout A trains 2 Adam
steps through the real path (``get_model``, DDP, ``get_megatron_optimizer``, ``get_forward_backward_func``),
saves model + optimizer with ``save_checkpoint`` and trains a third step; layout B builds the model from other
weights, loads the checkpoint with ``load_checkpoint`` and trains the same third step. Checked:

1. every tensor of B's sharded state dict after the load equals the checkpoint's global tensor, exactly;
2. the optimizer state B holds (Adam's ``exp_avg`` / ``exp_avg_sq`` of every parameter, saved again from B and
   read back unsharded) equals the saved one exactly, and every parameter state's step count is 2;
3. B's third step equals A's: every tensor afterwards, the loss and the grad norm (1e-5).

"One process" runs on a rank pool of one rank, so every pair but TP=2 -> PP=2 also changes the world size.
Under TP the MoE features need sequence parallelism (refused without it), so the TP pairs train the dense ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from megatron_core.dist_checkpointing import load_plain_tensors
from megatron_core.training import get_checkpoint_name
from tests.dist_harness import run_on_ranks
from tests.training.checkpoint_reshard_runner import (
    SAVED_AT,
    checkpoint_dir,
    load_resave_continue,
    train_save_continue,
)
from tests.training.parallel_step_features import FEATURES, LAYOUTS, Layout
from tests.training.parallel_step_runner import assemble

TOL = dict(rtol=1e-5, atol=1e-5)
OPTIMIZER_PREFIX = "optimizer.state."

_DENSE = ("gpt", "qk_layernorm", "qk_l2_norm", "tied", "learned_absolute", "gpt2", "output_gate", "sinks",
          "mla", "mla_no_q_lora", "dsa", "gdn", "mtp", "hybrid", "hybrid_gdn")
_MOE = ("moe_grouped", "moe_sequential", "moe_shared_bias", "moe_latent", "moe_quantile")
_ALL = _DENSE + _MOE


def _one(per_token: bool) -> Layout:
    return Layout("one_process_per_token" if per_token else "one_process_mean", per_token=per_token)


@dataclass(frozen=True)
class Pair:
    """Save under ``a``, resume under ``b`` (both with the same loss normalisation); ``core`` runs unmarked, the
    other ``features`` are marked slow."""

    name: str
    a: Layout
    b: Layout
    features: tuple[str, ...]
    core: tuple[str, ...]


PAIRS = (
    Pair("tp2_to_one", LAYOUTS["tp2"], _one(True), _DENSE, ("gpt", "mla")),
    Pair("one_to_tp2", _one(True), LAYOUTS["tp2"], _DENSE, ("tied", "hybrid")),
    Pair("pp2_to_one", LAYOUTS["pp2"], _one(False), _ALL, ("mtp", "dsa")),
    Pair("ep2_to_one", LAYOUTS["ep2"], _one(True), _MOE, ("moe_shared_bias",)),
    Pair("dp2_distopt_to_one", LAYOUTS["dp2_distopt"], _one(False), _ALL, ("gpt2",)),
    Pair("one_to_dp2_distopt", _one(False), LAYOUTS["dp2_distopt"], _ALL, ("moe_grouped",)),
    Pair("tp2_to_pp2", LAYOUTS["tp2"], replace(LAYOUTS["pp2"], per_token=True), _DENSE, ("qk_layernorm", "gdn")),
    # TP=2 -> plain DP=2 keeps the world size; the expert pairs shard whole experts by EP after one process, take
    # the dense parameters out of the distributed optimizer beside EP, and turn TP-sharded experts (TP=2 + SP)
    # into whole experts spread over EP=2.
    Pair("tp2_to_dp2", LAYOUTS["tp2"], Layout("dp2", per_token=True), _DENSE, ("output_gate",)),
    Pair("one_to_ep2", _one(True), LAYOUTS["ep2"], _MOE, ("moe_latent",)),
    Pair("ep2_distopt_to_one", replace(LAYOUTS["ep2"], distributed_optimizer=True), _one(True), _MOE,
         ("moe_quantile",)),
    Pair("tp2_sp_to_ep2", LAYOUTS["tp2_sp"], replace(LAYOUTS["ep2"], per_token=False), _MOE, ("moe_sequential",)),
)


def _world(layout: Layout) -> int:
    return 1 if layout.name.startswith("one_process") else 2


def _params() -> list[Any]:
    params = []
    for pair in PAIRS:
        more = tuple(name for name in pair.features if name not in pair.core)
        params.append(pytest.param(pair, pair.core, id=f"{pair.name}-core"))
        if more:
            params.append(pytest.param(pair, more, id=f"{pair.name}-more", marks=pytest.mark.slow))
    return params


def _plain(root: str, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``name``'s checkpoint under ``root``, unsharded (model and optimizer states)."""
    tensors = load_plain_tensors(get_checkpoint_name(checkpoint_dir(root, name), SAVED_AT))
    return {key: value for key, value in tensors.items() if isinstance(value, torch.Tensor)}


def _step_loss(per_rank: list[dict[str, Any]]) -> torch.Tensor:
    """The extra step's token-mean loss from the loss-holding ranks' ``[sum, count]``."""
    total = sum(r["loss"] for r in per_rank if r["loss"] is not None)
    return total[0] / total[1]


def _load_problems(name: str, saved: dict[str, torch.Tensor], resaved: dict[str, torch.Tensor],
                   b: list[dict[str, Any]]) -> list[str]:
    """Checks 1 and 2: the loaded model tensors and the optimizer state B holds equal the checkpoint's."""
    loaded, problems = assemble([r["loaded"] for r in b])
    out = [f"{name}: after the load: {p}" for p in problems]
    model_keys = {key for key in saved if not key.startswith(OPTIMIZER_PREFIX)}
    if loaded.keys() != model_keys:
        out.append(f"{name}: model tensors differ from the checkpoint's: {sorted(loaded.keys() ^ model_keys)}")
    out += [f"{name}: {key} after the load differs from the saved tensor (max {(loaded[key] - saved[key]).abs().max()})"
            for key in sorted(loaded.keys() & model_keys) if not torch.equal(loaded[key], saved[key])]
    if resaved.keys() != saved.keys():
        out.append(f"{name}: re-saved tensors differ from the saved ones: {sorted(resaved.keys() ^ saved.keys())}")
    out += [f"{name}: {key} re-saved from B differs from the saved one (max {(resaved[key] - saved[key]).abs().max()})"
            for key in sorted(resaved.keys() & saved.keys()) if not torch.equal(resaved[key], saved[key])]
    if not any(key.startswith(OPTIMIZER_PREFIX) for key in saved):
        out.append(f"{name}: the checkpoint holds no optimizer state")
    steps = {s for r in b for s in r["adam_steps"]}
    if steps != {SAVED_AT}:
        out.append(f"{name}: Adam step counts after the load {sorted(steps)}, saved at {SAVED_AT}")
    return out


def _resume_problems(name: str, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """Check 3: B's step after the load equals A's step after the save."""
    final_a, problems_a = assemble([r["final"] for r in a])
    final_b, problems_b = assemble([r["final"] for r in b])
    out = [f"{name}: layout A: {p}" for p in problems_a] + [f"{name}: layout B: {p}" for p in problems_b]
    if final_a.keys() != final_b.keys():
        out.append(f"{name}: tensors differ: {sorted(final_a.keys() ^ final_b.keys())}")
    for key in sorted(final_a.keys() & final_b.keys()):
        try:
            torch.testing.assert_close(final_b[key], final_a[key], **TOL)
        except AssertionError as error:
            out.append(f"{name}: {key} after the resumed step: {str(error).splitlines()[2:4]}")
    loss_a, loss_b = _step_loss(a), _step_loss(b)
    if not torch.allclose(loss_b, loss_a, **TOL):
        out.append(f"{name}: resumed step loss {loss_b.item()} != {loss_a.item()}")
    norm_a = a[0]["grad_norm"]  # the global norm: every rank of A reports it
    for rank, r in enumerate(b):
        if abs(r["grad_norm"] - norm_a) > TOL["atol"] + TOL["rtol"] * abs(norm_a):
            out.append(f"{name}: rank {rank} resumed grad norm {r['grad_norm']} != {norm_a}")
    return out


@pytest.mark.distributed_debug_off  # PP sends/receives on groups that later run collectives
@pytest.mark.parametrize("pair,names", _params())
def test_checkpoint_reshards_and_resumes_exactly(tmp_path, pair: Pair, names: tuple[str, ...]) -> None:
    """Save ``names`` under ``pair.a`` after 2 steps, load under ``pair.b``: same tensors, same Adam state, and the
    next step equals the one ``pair.a`` took."""
    assert set(names) <= set(FEATURES), set(names) - set(FEATURES)
    root, resave_root = str(tmp_path / "a"), str(tmp_path / "b")
    a = run_on_ranks(_world(pair.a), train_save_continue, list(names), pair.a, root)
    b = run_on_ranks(_world(pair.b), load_resave_continue, list(names), pair.b, root, resave_root)
    differences = []
    for name in names:
        per_rank_a, per_rank_b = [r[name] for r in a], [r[name] for r in b]
        differences += _load_problems(name, _plain(root, name), _plain(resave_root, name), per_rank_b)
        differences += _resume_problems(name, per_rank_a, per_rank_b)
    assert not differences, f"{pair.name}: resuming under another layout differs:\n" + "\n".join(differences)


def test_pairs_cover_every_feature() -> None:
    """Every feature reshards out of PP and the distributed optimizer and into it; the TP pairs leave out only the
    MoE features (refused under TP without sequence parallelism) and the EP pair takes only them."""
    assert set(_ALL) == set(FEATURES)
    by_name = {pair.name: pair for pair in PAIRS}
    for name in ("pp2_to_one", "dp2_distopt_to_one", "one_to_dp2_distopt"):
        assert set(by_name[name].features) == set(FEATURES), name
    for pair in PAIRS:
        assert pair.core and set(pair.core) <= set(pair.features), pair.name
        if any(layout.tp > 1 and not layout.sp for layout in (pair.a, pair.b)):
            assert set(pair.features) == set(_DENSE), pair.name
        if any(layout.ep > 1 for layout in (pair.a, pair.b)):
            assert set(pair.features) == set(_MOE), pair.name
