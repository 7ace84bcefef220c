"""The bridge takes parallel sizes and ranks from a passed ``pg_collection`` (a role it leaves unset is one rank),
never from ``parallel_state`` (single process: stand-in groups report the sizes and ranks to the bridge's lookups)."""

from __future__ import annotations

import pytest

from megatron_core import parallel_state
from megatron_core.models.hf import AutoBridge, model_view
from megatron_core.models.hf.model_view import expert_ep_rank, group_rank_size
from megatron_core.process_groups_config import ProcessGroupCollection
from tests.models.hf.hf_models import make_hf_model

pytest.importorskip("transformers")


class _Group:
    """A stand-in process group of ``size`` ranks seen from rank ``rank``."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def groups(monkeypatch) -> ProcessGroupCollection:
    """tp of 2 ranks (this is rank 1), ep of 4 (rank 3), the rest unset; ``parallel_state`` is not set up."""
    monkeypatch.setattr(model_view, "get_pg_size", lambda group: 1 if group is None else group.size())
    monkeypatch.setattr(model_view, "get_pg_rank", lambda group: 0 if group is None else group.rank())
    assert not parallel_state.model_parallel_is_initialized()
    return ProcessGroupCollection(tp=_Group(2, 1), ep=_Group(4, 3), expt_tp=None)


def test_ranks_and_sizes_come_from_the_collection(groups: ProcessGroupCollection) -> None:
    assert group_rank_size("tp", groups)[:2] == (1, 2)
    assert expert_ep_rank(groups) == 3
    assert group_rank_size("expt_tp", groups)[:2] == (0, 1)  # unset in the collection: one rank, no global fallback
    assert group_rank_size("dp_cp", groups)[:2] == (0, 1)


def test_transformer_config_takes_the_collection_layout(tmp_path, groups: ProcessGroupCollection) -> None:
    make_hf_model("llama", tmp_path / "llama", vocab_size=96)
    bridge = AutoBridge.from_hf_pretrained(tmp_path / "llama", load_weights=False)
    config = bridge.transformer_config(pg_collection=groups)
    assert config.tensor_model_parallel_size == 2 and config.pipeline_model_parallel_size == 1
    assert config.virtual_pipeline_model_parallel_size is None
