"""Constant and ramp-up microbatch calculators."""

from __future__ import annotations

import pytest

from megatron_core import num_microbatches_calculator as nmc


@pytest.fixture(autouse=True)
def _reset():
    nmc.unset_num_microbatches_calculator()
    yield
    nmc.unset_num_microbatches_calculator()


def test_constant():
    nmc.init_num_microbatches_calculator(0, None, 32, 2, 4)
    assert nmc.get_num_microbatches() == 4
    assert nmc.get_current_global_batch_size() == 32
    assert nmc.get_micro_batch_size() == 2
    nmc.update_num_microbatches(1000)
    assert nmc.get_num_microbatches() == 4
    with pytest.raises(RuntimeError, match="already initialized"):
        nmc.init_num_microbatches_calculator(0, None, 32, 2, 4)


def test_constant_errors_and_decrease():
    with pytest.raises(ValueError, match=r"global batch size \(30\).*micro batch size \(2\).*data parallel size \(4\)"):
        nmc.init_num_microbatches_calculator(0, None, 30, 2, 4)
    nmc.init_num_microbatches_calculator(0, None, 30, 2, 4, decrease_batch_size_if_needed=True)
    assert nmc.get_num_microbatches() == 3
    assert nmc.get_current_running_global_batch_size() == 24
    assert nmc.get_current_global_batch_size() == 30


def test_rampup():
    # 8 -> 32 in steps of 8 over 300 samples: 100 samples per increment.
    nmc.init_num_microbatches_calculator(0, [8, 8, 300], 32, 2, 2)
    expected = {0: 8, 99: 8, 100: 16, 250: 24, 300: 32, 301: 32}
    for consumed, gbs in expected.items():
        nmc.update_num_microbatches(consumed)
        assert nmc.get_current_global_batch_size() == gbs
        assert nmc.get_num_microbatches() == gbs // 4


def test_rampup_errors():
    with pytest.raises(ValueError, match=r"interval \(24\).*increment \(5\)"):
        nmc.init_num_microbatches_calculator(0, [8, 5, 300], 32, 2, 2)
    with pytest.raises(ValueError, match="rampup_batch_size"):
        nmc.init_num_microbatches_calculator(0, [8, 8], 32, 2, 2)
    nmc.init_num_microbatches_calculator(0, [6, 2, 100], 12, 2, 2)
    with pytest.raises(ValueError, match=r"current global batch size \(6\)"):
        nmc.update_num_microbatches(0)
    with pytest.raises(RuntimeError, match="not initialized"):
        nmc.unset_num_microbatches_calculator()
        nmc.get_num_microbatches()
