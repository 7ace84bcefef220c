"""A distributed checkpoint of a model family saved under one layout resumes exactly under another.

For the families of the family training audit (BERT, T5 with relative positions, pure Mamba, LLaVA whole and
with a frozen vision tower, MIMO) and pairs of layouts (TP=2 -> one process, PP=2 -> TP=2, DP=2 with the
distributed optimizer -> one process, one process -> DP=2 with the distributed optimizer, TP=2 + SP -> PP=2,
CP=2 -> one process), layout A trains 2 Adam steps through the real path, saves model + optimizer with
``save_checkpoint`` and trains a third step; layout B builds the model from other weights, loads the checkpoint
with ``load_checkpoint`` and trains the same third step. The checks are those of
``test_checkpoint_reshard_features``: B's loaded tensors and re-saved optimizer state equal the checkpoint's
exactly, every Adam step count is 2, and B's third step equals A's (every tensor, loss and grad norm, 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.dist_harness import run_on_ranks
from tests.training.family_checkpoint_runner import load_resave_continue, train_save_continue
from tests.training.family_step_features import FAMILIES, FAMILY_LAYOUTS, one_process
from tests.training.parallel_step_features import Layout
from tests.training.test_checkpoint_reshard_features import _load_problems, _plain, _resume_problems


@dataclass(frozen=True)
class Pair:
    """Save ``families`` under ``a``, resume under ``b`` (both with the same loss normalisation)."""

    name: str
    a: Layout
    b: Layout
    families: tuple[str, ...]


_L = FAMILY_LAYOUTS
_ONE = one_process(_L["tp2"])
PAIRS = (
    Pair("tp2_to_one", _L["tp2"], _ONE, ("bert", "t5_relative", "llava_frozen_vision", "mimo")),
    Pair("pp2_to_tp2", _L["pp2"], _L["tp2"], ("bert", "mamba", "llava")),
    Pair("dp2_distopt_to_one", _L["dp2_distopt"], _ONE, ("t5_relative", "llava", "mimo")),
    Pair("one_to_dp2_distopt", _ONE, _L["dp2_distopt"], ("bert", "mamba", "llava_frozen_vision")),
    Pair("tp2_sp_to_pp2", _L["tp2_sp"], _L["pp2"], ("mamba", "llava")),
    Pair("cp2_to_one", _L["cp2"], one_process(_L["cp2"]), ("mamba", "llava")),
)


def _world(layout: Layout) -> int:
    return 1 if layout.name.startswith("one_process") else 2


@pytest.mark.distributed_debug_off  # PP sends/receives on groups that later run collectives
@pytest.mark.parametrize("pair", [pytest.param(pair, id=pair.name) for pair in PAIRS])
def test_family_checkpoint_reshards_and_resumes_exactly(tmp_path, pair: Pair) -> None:
    """Save ``pair.families`` under ``pair.a`` after 2 steps, load under ``pair.b``: same tensors, same Adam state,
    and the next step equals the one ``pair.a`` took."""
    assert pair.a.per_token == pair.b.per_token, pair.name
    root, resave_root = str(tmp_path / "a"), str(tmp_path / "b")
    names = list(pair.families)
    a = run_on_ranks(_world(pair.a), train_save_continue, names, pair.a, root)
    b = run_on_ranks(_world(pair.b), load_resave_continue, names, pair.b, root, resave_root)
    differences: list[Any] = []
    for name in names:
        per_rank_a, per_rank_b = [r[name] for r in a], [r[name] for r in b]
        differences += _load_problems(name, _plain(root, name), _plain(resave_root, name), per_rank_b)
        differences += _resume_problems(name, per_rank_a, per_rank_b)
    assert not differences, f"{pair.name}: resuming under another layout differs:\n" + "\n".join(differences)


def test_pairs_cover_every_family() -> None:
    """Every family but the frozen-language LLaVA (its trained part is the vision tower, covered by the whole
    LLaVA) is resharded, each one out of or into more than one layout."""
    covered = [name for pair in PAIRS for name in pair.families]
    assert set(covered) == set(FAMILIES) - {"llava_frozen_language", "t5"}, set(FAMILIES) - set(covered)
    assert all(covered.count(name) >= 2 for name in set(covered)), covered
