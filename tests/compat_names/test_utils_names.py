"""Megatron-Core ``utils`` names: unwrap_model, version checks, NVTX, multi-tensor helpers, StragglerDetector."""

from __future__ import annotations

import logging
import sys
import time
import types

import pytest
import torch
from packaging.version import Version

from megatron_core import _nvtx, _version_utils, device, utils
from megatron_core.distributed import DistributedDataParallel
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.pipeline_parallel import wrapped_model
from megatron_core.transformer.module import Float16Module


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = ModelParallelConfig()
        self.lin = torch.nn.Linear(2, 2)


class _Other(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def test_unwrap_model_strips_megatron_wrappers_only():
    inner = _Inner()
    wrapped = Float16Module(ModelParallelConfig(bf16=True), inner)
    assert utils.unwrap_model(wrapped) is inner
    assert utils.unwrap_model([wrapped, inner]) == [inner, inner]
    other = _Other(inner)
    assert utils.unwrap_model(other) is other  # not a known wrapper type
    assert utils.unwrap_model(other, module_instances=(_Other,)) is inner


def test_unwrap_model_through_ddp():
    inner = _Inner()
    ddp = object.__new__(DistributedDataParallel)  # a DDP instance without building buffers (needs no group)
    torch.nn.Module.__init__(ddp)
    ddp.module = inner
    assert utils.unwrap_model(ddp) is inner


def test_wrapped_model_helpers_are_one_implementation():
    assert utils.get_attr_wrapped_model is wrapped_model.get_attr_wrapped_model
    assert utils.get_model_config is wrapped_model.get_model_config
    inner = _Inner()
    assert utils.get_model_config(_Other(inner)) is inner.config


def test_torch_version_checks():
    assert utils.get_torch_version() == Version(torch.__version__)
    assert utils.is_torch_min_version("1.0")
    assert not utils.is_torch_min_version("999.0")
    current = str(utils.get_torch_version())
    assert utils.is_torch_min_version(current) and not utils.is_torch_min_version(current, check_equality=False)


def test_missing_packages_report_no_version(monkeypatch):
    monkeypatch.setattr(_version_utils, "_cache", {})
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert utils.get_te_version() == Version("0.0.0")
    assert not utils.is_te_min_version("0.1")
    assert utils.get_flashinfer_version() is None
    assert not utils.is_flashinfer_min_version("0.1")


def test_installed_package_versions(monkeypatch):
    monkeypatch.setattr(_version_utils, "_cache", {})
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.3.0"))
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.2.5"))
    assert utils.get_te_version() == Version("2.3.0")
    assert utils.is_te_min_version("2.3.0") and not utils.is_te_min_version("2.3.0", check_equality=False)
    assert utils.is_flashinfer_min_version("0.2") and not utils.is_flashinfer_min_version("0.3")


def _named_caller():
    utils.nvtx_range_push()
    utils.nvtx_range_pop()


def test_nvtx_ranges_go_through_the_device_module(monkeypatch):
    emitted = []
    monkeypatch.setattr(device, "nvtx_range_push", lambda msg: emitted.append(("push", msg)))
    monkeypatch.setattr(device, "nvtx_range_pop", lambda: emitted.append(("pop", None)))
    monkeypatch.setattr(_nvtx, "_nvtx_range_messages", [])
    utils.configure_nvtx_profiling(False)
    utils.nvtx_range_push("off")
    utils.nvtx_range_pop("wrong")  # disabled: no checks, nothing emitted
    assert emitted == []
    utils.configure_nvtx_profiling(True)
    try:
        utils.nvtx_range_push("fwd", suffix="layer0")
        with pytest.raises(ValueError, match="does not match"):
            utils.nvtx_range_pop("bwd")
        utils.nvtx_range_push("a")
        utils.nvtx_range_pop("a")
        with pytest.raises(RuntimeError, match="no NVTX range is open"):
            utils.nvtx_range_pop("a")
        _named_caller()

        @utils.nvtx_decorator()
        def decorated():
            return 7

        assert decorated() == 7
    finally:
        utils.configure_nvtx_profiling(False)
    names = [m for kind, m in emitted if kind == "push"]
    assert names[0] == "fwd.layer0"
    assert f"{__name__}._named_caller" in names
    assert names[-1].endswith(".decorated")
    assert [k for k, _ in emitted].count("pop") == 3


def test_nvtx_without_cuda_is_a_noop(monkeypatch):
    monkeypatch.setattr(device, "cuda_available", lambda: False)
    called = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda *a: called.append(a))
    device.nvtx_range_push("x")
    device.nvtx_range_pop()
    assert called == []


def test_log_single_rank(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    log = logging.getLogger("test_log_single_rank")
    with caplog.at_level(logging.INFO, logger=log.name):
        utils.log_single_rank(log, logging.INFO, "zero")
        utils.log_single_rank(log, logging.INFO, "one", rank=1)
    assert [r.getMessage() for r in caplog.records] == ["one"]


def test_multi_tensor_helpers_match_torch():
    torch.manual_seed(0)
    a = [torch.randn(3, 4), torch.randn(5)]
    b = [torch.randn(2, 2)]
    total, per = utils.local_multi_tensor_l2_norm(1024, None, [a, b], True)
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in a + b]))
    torch.testing.assert_close(total, expected.reshape(1))
    torch.testing.assert_close(per, torch.stack([t.norm() for t in a]))
    assert utils.local_multi_tensor_l2_norm(1024, None, [a], False)[1] is None
    dst = [torch.empty_like(t) for t in a]
    utils.local_multi_tensor_applier(utils.local_multi_tensor_scale, None, [a, dst], 0.5)
    for s, d in zip(a, dst):
        torch.testing.assert_close(d, s * 0.5)
    seen = []
    utils.local_multi_tensor_applier(lambda chunk, flag, lists, x: seen.append((chunk, x)), None, [a], 3)
    assert seen == [(65536, 3)]


def test_dtensor_helpers_pass_plain_tensors_through():
    t = torch.ones(3)
    assert utils.to_local_if_dtensor(t) is t
    assert utils.get_data_parallel_group_if_dtensor(t) is None


@pytest.fixture
def straggler():
    utils.StragglerDetector._configured = False
    detector = utils.StragglerDetector()
    detector.__dict__.clear()
    detector._initialised = False
    detector.__init__()
    yield detector
    utils.StragglerDetector._configured = False


def test_straggler_detector_single_process(straggler, caplog):
    assert straggler is utils.StragglerDetector()  # a singleton
    assert not straggler.enabled and not straggler.configured
    with straggler:  # not configured: timing is off
        pass
    assert straggler.elapsed() == (0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        straggler.configure(world=2, rank=2)
    straggler.configure(world=1, rank=0, enabled=True)
    assert straggler.configured and straggler.enabled and straggler.world_size == 1 and straggler.my_rank == 0
    straggler.configure(world=8, rank=3)  # only the first configure counts
    assert straggler.world_size == 1
    for _ in range(2):
        with straggler(bdata=True):
            time.sleep(0.01)
        with straggler:
            time.sleep(0.02)
    compute_ms, data_ms, *_ = straggler.elapsed()
    assert compute_ms >= 35 and 8 <= data_ms < compute_ms
    assert straggler.elapsed()[0] == 0  # elapsed() resets
    with straggler:
        time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="megatron_core._straggler"):
        assert straggler.report(total_flops=1e12, log_interval=1)
    assert "MnRtt/Rnk" in caplog.text and "MxEtpt/Rnk" in caplog.text
    straggler.toggle = True
    straggler.report(total_flops=1e12, log_interval=1)
    assert not straggler.enabled
    with straggler:
        pass
    assert straggler.elapsed() == (0, 0, 0, 0, 0, 0)


def test_viewless_tensors_and_small_helpers():
    base = torch.randn(4, 4, requires_grad=True)
    view = base[1]
    assert view._base is not None
    detached = utils.make_viewless_tensor(view.detach(), requires_grad=False, keep_graph=False)
    assert detached._base is None and torch.equal(detached, view.detach())
    kept = utils.make_viewless_tensor(view, requires_grad=True, keep_graph=True)
    assert kept._base is None
    kept.sum().backward()
    expected = torch.zeros(4, 4)
    expected[1] = 1
    torch.testing.assert_close(base.grad, expected)
    plain = torch.ones(2)
    assert utils.make_viewless_tensor(plain, False, True) is plain
    with pytest.raises(ValueError, match="view"):
        utils.assert_viewless_tensor([plain, view])
    utils.safely_set_viewless_tensor_data(plain, torch.zeros(3))
    assert plain.shape == (3,)
    wrapped = utils.WrappedTensor(plain)
    assert wrapped.unwrap() is plain
    with pytest.raises(RuntimeError):
        wrapped.unwrap()
    assert [utils.round_up_to_nearest_multiple(v, 4) for v in (1, 4, 5)] == [4, 4, 8]
    assert utils.accepts_parameter(lambda a, b=1: 0, "b") and utils.accepts_parameter(lambda **kw: 0, "z")
    assert not utils.accepts_parameter(lambda a: 0, "b")
    inner = _Inner()
    inner.model_type = "decoder"
    assert utils.get_model_type(_Other(inner)) == "decoder" and utils.get_model_xattn(inner) is False
    assert utils.is_submodule(inner.lin, inner) and not utils.is_submodule(inner, inner)
    assert utils.is_submodule(inner, inner, strict=False)
    assert utils.get_tensor_model_parallel_group_if_none(None) is None  # torch.distributed not initialized
    sharded = utils.make_tp_sharded_tensor_for_checkpoint(torch.ones(2, 3), "w", tp_axis=0)
    assert sharded.key == "w" and sharded.global_shape == (2, 3)
