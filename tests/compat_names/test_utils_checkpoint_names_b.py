"""Megatron-Core 0.19 names of utils, inference_request and dist_checkpointing (part B), against
megatron-core 0.16.1 (``megatron.core``) where it has them, else hand-written references."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch

from megatron_core import utils
from megatron_core.dist_checkpointing import ShardedTensor, mapping, optimizer, validation
from megatron_core.dist_checkpointing import utils as ckpt_utils
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.strategies import common
from megatron_core.inference import inference_request as ir


def test_decorators_and_markers():
    import megatron.core.utils as oracle

    def f(x):
        return x

    assert utils.null_decorator(f) is f and utils.null_decorator(configs=[1])(f) is f
    assert utils.internal_api(f) is f and f._internal_api is True
    guarded = utils.deprecate_args("old", message="no {name}")(lambda a, **k: a)
    assert guarded(3, new=1) == 3
    with pytest.raises(TypeError, match="no old"):
        guarded(3, old=1)
    with pytest.warns(UserWarning):
        assert utils.deprecate_inference_params(None, "p") == oracle.deprecate_inference_params(None, "p") == "p"
    assert utils.deprecate_inference_params("c", "p") == oracle.deprecate_inference_params("c", "p") == "c"
    cfg = type("C", (), {"fp8": None, "fp4": "nvfp4"})()
    assert utils.is_using_quantization_scales(cfg) == oracle.is_using_quantization_scales(cfg) == "nvfp4"


def test_optional_package_versions_do_not_raise():
    assert str(utils.get_mamba_version()) == "0.0.0" and not utils.is_mamba_min_version("0.1")
    assert str(utils.get_causal_conv1d_version()) == "0.0.0" and not utils.is_causal_conv1d_min_version("1.0")


def test_asyncio_helpers(caplog):
    loop = utils.get_asyncio_loop()
    assert utils.get_asyncio_loop() is loop

    @utils.trace_async_exceptions(verbose=True)
    async def ok():
        return 5

    @utils.trace_async_exceptions
    async def gen():
        yield 1
        yield 2

    async def collect():
        assert utils.get_asyncio_loop() is asyncio.get_running_loop()
        return [x async for x in gen()]

    with caplog.at_level(logging.INFO):
        assert loop.run_until_complete(ok()) == 5
    assert "completed in" in caplog.text
    assert loop.run_until_complete(collect()) == [1, 2]

    @utils.trace_async_exceptions
    async def boom():
        raise RuntimeError("x")

    with pytest.raises(SystemExit):
        loop.run_until_complete(boom())
    with pytest.raises(TypeError):
        utils.trace_async_exceptions(lambda: 1)


def test_wgrad_input_preparation_matches_oracle():
    import megatron.core.utils as oracle

    g, x = torch.randn(4, 2, 3).transpose(0, 1), torch.randn(2, 4, 5)
    for ours, ref in zip(utils.prepare_input_tensors_for_wgrad_compute(g, x),
                         oracle.prepare_input_tensors_for_wgrad_compute(g, x)):
        assert ours.is_contiguous()
        torch.testing.assert_close(ours, ref)


def test_tensor_and_ndarray_serialization_round_trip():
    t = torch.arange(6).view(2, 3)  # (megatron-core's serialize_tensor needs CUDA for its NVTX range)
    assert ir.serialize_tensor(t) == [[0, 1, 2], [3, 4, 5]]
    assert torch.equal(ir.deserialize_tensor(ir.serialize_tensor(t)), t)
    a = np.arange(4, dtype=np.int32).reshape(2, 2)
    obj = ir.serialize_ndarray(a)
    assert obj == {"data": [[0, 1], [2, 3]], "dtype": "int32"}
    back = ir.deserialize_ndarray(obj)
    assert back.dtype == np.int32 and np.array_equal(back, a)
    with pytest.raises(ValueError, match="not numeric"):
        ir.deserialize_ndarray({"data": [1], "dtype": "object"})
    request = {"tokens": ("tensor", [1, 2]), "other": ["tensor", [3]], "x": 1}
    assert ir.unwrap_serialized_tensors(request) == {"tokens": [1, 2], "other": [3], "x": 1}


def test_optim_param_to_id_map_matches_oracle():
    from megatron.core.dist_checkpointing.optimizer import get_optim_param_to_id_map as oracle

    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    assert optimizer.get_optim_param_to_id_map([p, q, p]) == oracle([p, q, p]) == {id(p): 0, id(q): 1}
    assert isinstance(optimizer.KEEP_VARS_HINT, str)
    assert mapping.FactoryBuildFn is not None and mapping.FactoryMergeFn is not None


def test_debug_time_and_msg(caplog):
    log = logging.getLogger("part_b_test")
    with caplog.at_level(logging.DEBUG, logger="part_b_test"):
        with ckpt_utils.debug_time("outer", log):
            with ckpt_utils.debug_time("inner"):
                ckpt_utils.debug_msg("hello")
    assert "outer.inner hello" in caplog.text
    assert "outer.inner took" in caplog.text and "outer took" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="part_b_test"):
        with ckpt_utils.debug_time("fast", log, threshold=60.0):
            pass
    assert "fast" not in caplog.text


def test_force_all_tensors_to_non_fp8():
    from megatron_core.distributed.fp8_params import make_fp8_param

    weight = torch.nn.Parameter(torch.randn(4, 4))
    fp8 = make_fp8_param(weight)
    sd = {"w": ShardedTensor.from_rank_offsets("w", fp8), "x": ShardedTensor.from_rank_offsets("x", torch.ones(2))}
    ckpt_utils.force_all_tensors_to_non_fp8(sd)
    assert sd["w"].data.dtype == torch.float32 and torch.equal(sd["x"].data, torch.ones(2))
    torch.testing.assert_close(sd["w"].data, weight.detach(), rtol=0.07, atol=0.07)


def _sh(key, value, offset=0, parts=1):
    return ShardedTensor.from_rank_offsets(key, value, (0, offset, parts))


def test_strict_load_helpers_match_oracle():
    from megatron.core.dist_checkpointing import validation as oracle
    from megatron.core.dist_checkpointing.core import CheckpointingException as OracleError
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as OracleST

    ckpt = {"a": _sh("a", torch.zeros(2)), "c": _sh("c", torch.zeros(2))}
    request = {"a": _sh("a", torch.zeros(2)), "b": _sh("b", torch.zeros(2))}
    local = [sh.without_data() for sh in request.values()]
    for strict in validation.StrictHandling:
        if strict == validation.StrictHandling.ASSUME_OK_UNEXPECTED:
            continue
        o_ckpt = {k: OracleST.from_rank_offsets(k, torch.zeros(2)) for k in ckpt}
        o_req = {k: OracleST.from_rank_offsets(k, torch.zeros(2)) for k in request}
        o_local = [sh.without_data() for sh in o_req.values()]
        raising = strict.value.startswith("raise")
        if raising:
            with pytest.raises(CheckpointingException):
                validation.validate_integrity_and_strict_load(request, strict, False, local, [local], ckpt)
            with pytest.raises(OracleError):
                oracle.validate_integrity_and_strict_load(o_req, oracle.StrictHandling(strict.value), False,
                                                          o_local, [o_local], o_ckpt)
            continue
        ours = validation.validate_integrity_and_strict_load(dict(request), strict, False, local, [local], ckpt)
        ref = oracle.validate_integrity_and_strict_load(o_req, oracle.StrictHandling(strict.value), False,
                                                        o_local, [o_local], o_ckpt)
        assert sorted(ours[0]) == sorted(ref[0]) and ours[1:] == ref[1:], strict
    assert validation.adjust_non_strict_load({"a": ckpt["a"], "c": ckpt["c"]}, {"c"}) == {"a": ckpt["a"]}
    validation.maybe_report_missing_and_unexpected_keys(set(), set())
    with pytest.raises(CheckpointingException, match="'x'"):
        validation.maybe_report_missing_and_unexpected_keys({"x"}, set())
    overlap = [[_sh("t", torch.zeros(2), 0, 2).without_data()], [_sh("t", torch.zeros(2), 0, 2).without_data()]]
    with pytest.raises(CheckpointingException, match="invalid sharding"):
        validation.validate_integrity_and_strict_load({}, validation.StrictHandling.ASSUME_OK_UNEXPECTED, True,
                                                      global_metadata=overlap)


def test_common_pt_helpers_and_verify_checkpoint(tmp_path):
    from megatron_core import dist_checkpointing

    common.save_common({"iteration": 3, "t": torch.ones(2)}, tmp_path)
    assert (tmp_path / common.COMMON_STATE_FNAME).is_file()
    loaded = common.load_common(tmp_path)
    assert loaded["iteration"] == 3 and torch.equal(loaded["t"], torch.ones(2))
    import megatron.core.dist_checkpointing.strategies.common as oracle  # the same file name and format

    assert common.COMMON_STATE_FNAME == oracle.COMMON_STATE_FNAME
    assert torch.load(tmp_path / "common.pt", weights_only=True)["iteration"] == 3
    with pytest.raises(CheckpointingException, match="plain data"):
        common.save_common({"bad": object()}, tmp_path / "x")
    with pytest.raises(CheckpointingException, match="does not exist"):
        common.load_common(tmp_path / "missing")
    with pytest.raises(CheckpointingException, match="does not exist"):
        validation.verify_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointingException, match="not a distributed checkpoint"):
        validation.verify_checkpoint(tmp_path)
    ckpt = tmp_path / "ckpt"
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, ckpt)
    validation.verify_checkpoint(ckpt)
