"""Small Megatron-Core modules: typed_torch, msc_utils, _rank_utils, _slurm_utils, config, enums, timers,
pipeline_parallel.utils without a process group, and the aliases at Megatron's module paths."""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import time

import pytest
import torch

import megatron_core
from megatron_core import _rank_utils, _slurm_utils, config, enums, msc_utils, timers, typed_torch
from megatron_core.pipeline_parallel import utils as pp_utils


def test_typed_torch():
    assert typed_torch.not_none(0) == 0
    with pytest.raises(ValueError, match="not None"):
        typed_torch.not_none(None)
    lin = torch.nn.Linear(2, 2)
    assert typed_torch.apply_module(lin) is lin
    with pytest.raises(TypeError):
        typed_torch.apply_module(object())

    def source(a: int, b: str = "x") -> float:
        return 0.0

    @typed_torch.copy_signature(source)
    def wrapper(*args, **kwargs) -> str:
        return str(source(*args, **kwargs))

    assert list(inspect.signature(wrapper).parameters) == ["a", "b"]
    assert inspect.signature(wrapper).return_annotation == "str"

    class Target:
        def method(self, x: int, y: int) -> int:
            return x + y

    @typed_torch.copy_signature(Target.method, handle_first_src_param="skip", handle_return_type="overwrite")
    def free(*args, **kwargs):
        return None

    assert list(inspect.signature(free).parameters) == ["x", "y"]
    assert inspect.signature(free).return_annotation == "int"
    with pytest.raises(ValueError, match="handle_return_type"):
        typed_torch.copy_signature(source, handle_return_type="bogus")


def test_msc_falls_back_to_the_local_filesystem(tmp_path, monkeypatch):
    monkeypatch.setattr(msc_utils, "_msc", None)  # package absent
    msc_utils.MultiStorageClientFeature.enable()
    try:
        assert not msc_utils.MultiStorageClientFeature.is_enabled()
        maybe = msc_utils.maybe_msc
        assert maybe.open is open and maybe.os is os and maybe.torch is torch
        p = maybe.Path(tmp_path) / "f.txt"
        with maybe.open(p, "w") as f:
            f.write("hi")
        assert maybe.os.path.exists(p) and maybe.path_isdir(tmp_path) and not maybe.path_isdir(p)
        with pytest.raises(AttributeError):
            maybe.no_such_thing  # noqa: B018
        with pytest.raises(RuntimeError, match="not installed"):
            msc_utils.MultiStorageClientFeature.import_package()
        assert {"open", "os", "Path", "torch"} <= set(dir(maybe))
        flag = pickle.loads(pickle.dumps(msc_utils.MultiStorageClientFeature))
        assert flag._enabled
    finally:
        msc_utils.MultiStorageClientFeature.disable()


def test_msc_uses_the_package_when_enabled(monkeypatch):
    class FakeMsc:
        def open(self, *a):
            return "msc-open"

    monkeypatch.setattr(msc_utils, "_msc", FakeMsc())
    assert msc_utils.maybe_msc.open is open  # installed but disabled
    msc_utils.MultiStorageClientFeature.enable()
    try:
        assert msc_utils.maybe_msc.open() == "msc-open"
        assert msc_utils.maybe_msc.os is os  # not provided by the package: local fallback
    finally:
        msc_utils.MultiStorageClientFeature.disable()


def test_rank_utils_fallback_order(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.warns(UserWarning, match="rank 0"):
        assert _rank_utils.safe_get_rank() == 0
    with pytest.warns(UserWarning, match="world size 1"):
        assert _rank_utils.safe_get_world_size() == 1
    assert _slurm_utils.resolve_slurm_rank() is None and not _slurm_utils.is_slurm_job()
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert (_rank_utils.safe_get_rank(), _rank_utils.safe_get_world_size()) == (5, 8)
    assert _slurm_utils.resolve_slurm_local_rank() == 1
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (_rank_utils.safe_get_rank(), _rank_utils.safe_get_world_size()) == (3, 4)
    monkeypatch.setenv("SLURM_LOCALID", "x")
    with pytest.raises(ValueError, match="SLURM_LOCALID"):
        _slurm_utils.resolve_slurm_local_rank()


def test_config_and_enums():
    old = config.ENABLE_EXPERIMENTAL
    try:
        config.set_experimental_flag(True)
        assert config.is_experimental_enabled() and config.ENABLE_EXPERIMENTAL
        config.set_experimental_flag(False)
        assert not config.is_experimental_enabled()
    finally:
        config.ENABLE_EXPERIMENTAL = old
    from megatron_core.transformer.enums import ModelType

    assert enums.ModelType is ModelType and enums.ModelType.encoder_or_decoder.value == 1
    assert enums.Fp8Recipe("mxfp8") == "mxfp8"


def test_pp_stage_predicates_without_groups():
    assert pp_utils.is_pp_first_stage(None) and pp_utils.is_pp_last_stage(None)
    assert pp_utils.is_vp_first_stage(None, None) and pp_utils.is_vp_last_stage(0, 1)
    assert pp_utils.is_vp_first_stage(0, 3) and not pp_utils.is_vp_first_stage(2, 3)
    assert pp_utils.is_vp_last_stage(2, 3) and not pp_utils.is_vp_last_stage(1, 3)
    with pytest.raises(ValueError, match="vp_size"):
        pp_utils.is_vp_first_stage(1, None)
    with pytest.raises(ValueError, match=r"\[0, vp_size=3\)"):
        pp_utils.is_vp_last_stage(3, 3)


def test_timers_single_process(caplog):
    t = timers.Timers(log_level=1, log_option="minmax")
    fwd = t("forward", log_level=1)
    assert isinstance(t("debug", log_level=2), timers.DummyTimer)
    with pytest.raises(RuntimeError):
        t("debug", log_level=2).elapsed()
    fwd.start()
    with pytest.raises(RuntimeError, match="already been started"):
        fwd.start()
    time.sleep(0.02)
    fwd.stop()
    with pytest.raises(RuntimeError, match="not started"):
        fwd.stop()
    assert fwd.elapsed(reset=False) >= 0.015
    with pytest.raises(ValueError, match="log level"):
        t("forward", log_level=0)
    with caplog.at_level(logging.INFO, logger="megatron_core.timers"):
        t.log(["forward"], normalizer=2)
    assert "(min, max) time across ranks (ms):" in caplog.text and "forward" in caplog.text
    assert fwd.elapsed() == 0.0 and fwd.active_time() >= 0.015
    fwd.set_elapsed(0.5)

    class Writer:
        scalars = {}

        def add_scalar(self, name, value, step):
            self.scalars[name] = (value, step)

    w = Writer()
    t.write(["forward"], w, iteration=3)
    assert w.scalars == {"forward-time": (0.5, 3)}
    with pytest.raises(ValueError, match="log_option"):
        timers.Timers(1, "median")
    t_all = timers.Timers(2, "all")
    t_all("x").set_elapsed(0.25)
    assert "rank  0: 250.00" in t_all.get_all_timers_string()
    assert megatron_core.Timers is timers.Timers


def test_aliases_at_megatron_paths():
    from megatron_core.dist_checkpointing import sharded_module
    from megatron_core.dist_checkpointing.strategies import torch as strategies_torch
    from megatron_core.dist_checkpointing.strategies import torch_dist
    from megatron_core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
    )
    from megatron_core.optimizer.clip_grads import param_is_not_shared
    from megatron_core.optimizer_param_scheduler import get_canonical_lr_for_logging
    from megatron_core.transformer import module, pipeline_layout, pipeline_parallel_layer_layout
    from megatron_core.transformer import utils as transformer_utils

    assert module.param_is_not_shared is param_is_not_shared
    assert pipeline_parallel_layer_layout.PipelineParallelLayerLayout is pipeline_layout.PipelineParallelLayerLayout
    assert transformer_utils.make_sharded_tensors_for_checkpoint is sharded_module.make_sharded_tensors_for_checkpoint
    assert transformer_utils.sharded_state_dict_default is sharded_module.sharded_state_dict_default
    assert strategies_torch.TorchDistSaveShardedStrategy is torch_dist.TorchDistSaveShardedStrategy
    assert strategies_torch.TorchDistLoadShardedStrategy is torch_dist.TorchDistLoadShardedStrategy
    name, mods = strategies_torch.get_async_strategy("mcore")
    assert name == "mcore" and "AsyncCallsQueue" in mods
    assert strategies_torch.get_async_strategy("mcore", "AsyncRequest")[1] is mods["AsyncRequest"]
    with pytest.raises(ModuleNotFoundError, match="nvidia-resiliency-ext"):
        strategies_torch.get_async_strategy("nvrx")
    with pytest.raises(ValueError, match="not supported"):
        strategies_torch.get_async_strategy("other")
    # The mcore strategy now provides the async writer (it was missing, and asking for it raised KeyError).
    from megatron_core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    assert strategies_torch.get_async_strategy("mcore", "FileSystemWriterAsync")[1] is FileSystemWriterAsync
    with pytest.raises(KeyError, match="NoSuchPart"):
        strategies_torch.get_async_strategy("mcore", "NoSuchPart")

    init_num_microbatches_calculator(0, None, 8, 2, 2)
    assert get_num_microbatches() == 2
    destroy_num_microbatches_calculator()
    with pytest.raises(RuntimeError):
        get_num_microbatches()

    groups = [{"lr": 0.1, "default_config": False}, {"lr": 0.2, "default_config": True}, {"lr": 0.3}]
    assert get_canonical_lr_for_logging(groups) == 0.2
    assert get_canonical_lr_for_logging([{"lr": 0.1, "default_config": False}]) is None
    assert get_canonical_lr_for_logging([{"lr": 0.4}, {"lr": 0.5}]) is None

    lin = transformer_utils.get_linear_layer(3, 2, lambda w: torch.nn.init.constant_(w, 0.5))
    assert torch.equal(lin.weight, torch.full((2, 3), 0.5)) and not lin.bias.any()
    scores = torch.zeros(2, 2)
    transformer_utils.attention_mask_func(scores, torch.tensor([[False, True], [False, False]]))
    assert scores[0, 1] == -10000.0 and scores[0, 0] == 0.0


def test_transformer_utils_masks_and_gelus():
    import torch.nn.functional as F

    from megatron_core.transformer import utils as tu

    assert torch.equal(tu.get_default_causal_mask(3, "cpu"), torch.tensor(
        [[False, True, True], [False, False, True], [False, False, False]]))
    swa = tu.get_sliding_window_causal_mask(4, 4, (1, 0), "cpu")
    allowed = ~swa
    assert allowed[3].tolist() == [False, False, True, True] and allowed[0].tolist() == [True, False, False, False]
    assert tu.is_layer_window_attention((4, 0), None, 3)
    assert not tu.is_layer_window_attention(None, 2, 3)
    assert [tu.is_layer_window_attention((4, 0), 2, n) for n in (1, 2, 3, 4)] == [True, False, True, False]
    assert tu.is_layer_window_attention((4, 0), [0, 1], 2) and not tu.is_layer_window_attention((4, 0), [0, 1], 1)
    with pytest.raises(ValueError, match="window_attn_skip_freq"):
        tu.is_layer_window_attention((4, 0), "2", 1)
    x = torch.randn(32, dtype=torch.float64)
    torch.testing.assert_close(tu.openai_gelu(x), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(tu.erf_gelu(x), F.gelu(x), rtol=1e-5, atol=1e-5)
