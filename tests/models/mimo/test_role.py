"""MIMO's rank roles and layouts: ``RankRole.build`` on hand-made grid maps, against hand-computed roles.

Grids are real ``HyperCommGrid`` objects sized for an 8-rank world (``WORLD_SIZE``); the rank whose role is
asked for is patched in, so no process group is needed.
"""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.models.mimo import MimoModel, MimoModelConfig
from megatron_core.models.mimo.config.role import (
    MIMO_LANGUAGE_MODULE_KEY,
    ModuleLayout,
    ModuleStageInfo,
    RankRole,
)
from tests.models.mimo import mimo_fixture as f

DIMS = ["tp", "cp", "dp", "pp"]


@pytest.fixture(autouse=True)
def _world_of_eight(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")


def _role_of(rank: int, grid_map: dict, monkeypatch) -> RankRole:
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)
    return RankRole.build(["images", "audio"], grid_map)


def test_colocated_without_grid_map_or_on_shared_ranks(monkeypatch):
    role = RankRole.build(["images", "audio"])
    assert role.mode is ModuleLayout.COLOCATED
    assert role.modules == {name: ModuleStageInfo(True, True) for name in ("images", "audio", "language")}
    assert role.has_language_module and role.has_modality_modules
    assert role.modality_module_names == ["images", "audio"]
    shared = {"images": HyperCommGrid([2, 1, 4, 1], DIMS), "audio": HyperCommGrid([8, 1, 1, 1], DIMS),
              MIMO_LANGUAGE_MODULE_KEY: HyperCommGrid([4, 1, 2, 1], DIMS)}
    assert _role_of(5, shared, monkeypatch).mode is ModuleLayout.COLOCATED


def test_non_colocated_roles_and_pipeline_stages(monkeypatch):
    # images: ranks 0-1 (pp=2, tp=1); audio: rank 2; language: ranks 4-7 (tp=2, pp=2) -- rank 3 is idle.
    grid_map = {"images": HyperCommGrid([1, 1, 1, 2], DIMS), "audio": HyperCommGrid([1], ["tp"], rank_offset=2),
                MIMO_LANGUAGE_MODULE_KEY: HyperCommGrid([2, 1, 1, 2], DIMS, rank_offset=4)}
    # pp is the slowest axis: ranks 4,5 are pp stage 0 (tp 0,1) and ranks 6,7 stage 1.
    expected = {
        0: {"images": ModuleStageInfo(True, False)},
        1: {"images": ModuleStageInfo(False, True)},
        2: {"audio": ModuleStageInfo(True, True)},
        4: {"language": ModuleStageInfo(True, False)},
        5: {"language": ModuleStageInfo(True, False)},
        6: {"language": ModuleStageInfo(False, True)},
        7: {"language": ModuleStageInfo(False, True)},
    }
    for rank, modules in expected.items():
        role = _role_of(rank, grid_map, monkeypatch)
        assert role.mode is ModuleLayout.NON_COLOCATED
        assert role.modules == modules, rank
        name = next(iter(modules))
        assert role.is_first_stage(name) == modules[name].is_first_stage
        assert role.is_last_stage(name) == modules[name].is_last_stage
        assert not role.is_first_stage("absent") and not role.is_last_stage("absent")
        assert role.has_language_module == (rank >= 4) and role.has_modality_modules == (rank < 4)
    with pytest.raises(RuntimeError, match=r"rank 3 is in no module grid"):
        _role_of(3, grid_map, monkeypatch)


def test_partially_overlapping_grids_are_rejected(monkeypatch):
    grid_map = {"images": HyperCommGrid([4], ["tp"]), "audio": HyperCommGrid([4], ["tp"], rank_offset=4),
                MIMO_LANGUAGE_MODULE_KEY: HyperCommGrid([4], ["tp"], rank_offset=2)}
    with pytest.raises(ValueError, match=r"'images' spans ranks \[0, 4\) and 'language' spans \[2, 6\)"):
        _role_of(0, grid_map, monkeypatch)


def test_config_grid_map_keys_are_validated():
    grid = HyperCommGrid([2], ["tp"])
    with pytest.raises(ValueError, match=r"missing \['language'\], extra \['vision'\]"):
        MimoModelConfig(modality_submodules_spec={"images": f.vision_spec()},
                        module_to_grid_map={"images": grid, "vision": grid})


def test_colocated_grids_whose_dp_sizes_do_not_divide_are_rejected():
    grid_map = {"images": HyperCommGrid([2, 1, 3, 1], DIMS), "language": HyperCommGrid([3, 1, 2, 1], DIMS)}
    with warnings.catch_warnings(), pytest.raises(
            ValueError, match=r"'images' -> 'language': the DP sizes must divide one another, got src dp 3"):
        warnings.simplefilter("ignore")
        MimoModel(f.config(grid_map=grid_map))


def test_non_colocated_model_builds_only_this_ranks_modules(monkeypatch):
    grid_map = {"images": HyperCommGrid([1, 1, 1, 1], DIMS), "language": HyperCommGrid([1, 1, 1, 1], DIMS, 1)}
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    encoder = MimoModel(f.config(grid_map=grid_map))
    assert encoder.language_model is None and list(encoder.modality_submodules) == ["images"]
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 1)
    language = MimoModel(f.config(grid_map=grid_map))
    assert language.language_model is not None and len(language.modality_submodules) == 0


def test_non_colocated_encoder_rank_outputs(monkeypatch):
    grid_map = {"images": HyperCommGrid([1, 1, 1, 1], DIMS), "language": HyperCommGrid([1, 1, 1, 1], DIMS, 1)}
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    encoder = MimoModel(f.config(grid_map=grid_map))
    text_ids, _ = f.batch([0, 0])
    out, _ = encoder(text_ids)
    assert set(out) == {"images"} and out["images"].shape == (0, 64)
    ids, images = f.batch([1])
    out, _ = encoder(ids, modality_inputs={"images": {"clip_encoder": {"x": images}}})
    assert out["images"].shape == (f.TOKENS_PER_IMAGE, 64)
    with pytest.raises(ValueError, match=r"input_ids hold 'images' tokens \(id 127\) but no 'images' inputs"):
        encoder(ids)
