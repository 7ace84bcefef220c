"""num_microbatches_calculator, Megatron-Core 0.19's surface: step batch-size schedules, optional ramp-up."""

from __future__ import annotations

import pytest

from megatron_core import num_microbatches_calculator as nmc


@pytest.fixture(autouse=True)
def _reset():
    nmc.unset_num_microbatches_calculator()
    yield
    nmc.unset_num_microbatches_calculator()


def test_keyword_only_call_without_rampup():
    nmc.init_num_microbatches_calculator(rank=0, global_batch_size=32, micro_batch_size=8, data_parallel_size=2)
    assert nmc.get_num_microbatches() == 2
    with pytest.raises(AssertionError, match="already initialized"):  # Megatron-Core asserts
        nmc.init_num_microbatches_calculator(rank=0, global_batch_size=32, micro_batch_size=8, data_parallel_size=2)
    nmc.reconfigure_num_microbatches_calculator(rank=0, global_batch_size=33, micro_batch_size=8,
                                                data_parallel_size=2, decrease_batch_size_if_needed=True)
    assert (nmc.get_current_global_batch_size(), nmc.get_current_running_global_batch_size()) == (33, 32)


def test_step_schedule_follows_thresholds_in_samples_and_tokens():
    nmc.init_num_microbatches_calculator(0, micro_batch_size=2, data_parallel_size=4,
                                         step_batch_size_schedule="0:8, 1K:16 2.5k:64")
    expected = {0: 8, 999: 8, 1000: 16, 2499: 16, 2500: 64, 10**9: 64}
    for consumed, gbs in expected.items():
        nmc.update_num_microbatches(consumed)
        assert (nmc.get_current_global_batch_size(), nmc.get_num_microbatches()) == (gbs, gbs // 8)
    calc = nmc.StepBatchsizeNumMicroBatchesCalculator(1, 1, False, 0, "0:4 1M:8", seq_length=1000)
    calc.update(999, consistency_check=True)
    assert calc.get_current_global_batch_size() == 4
    calc.update(1000, consistency_check=True)  # 1M tokens / 1000 = 1000 samples
    assert calc.get_current_global_batch_size() == 8
    assert calc.global_batch_size == 8


def test_step_schedule_checks_divisibility_only_when_asked():
    calc = nmc.StepBatchsizeNumMicroBatchesCalculator(1, 512, False, 0, "0:256 200000:512")
    assert calc.get_current_global_batch_size() == 256  # construction does not check
    with pytest.raises(ValueError, match=r"current global batch size \(256\).*micro_batch_size \(1\)"):
        calc.update(0, consistency_check=True)
    calc.update(200000, consistency_check=True)
    assert calc.num_micro_batches == 1  # what calc.get() returns


@pytest.mark.parametrize("schedule, match", [
    ("5:16 10:32", "threshold 0"),
    ("0:16 10:32 10:64", "strictly increasing"),
    ("0:16 10", "THRESHOLD:BATCH_SIZE"),
    ("0:0", "positive"),
    ("0:x", "invalid number"),
])
def test_step_schedule_validation(schedule, match):
    with pytest.raises(ValueError, match=match):
        nmc.StepBatchsizeNumMicroBatchesCalculator(1, 1, False, 0, schedule)


def test_step_schedule_refuses_decrease_and_requires_a_batch_size():
    with pytest.raises(ValueError, match="decrease_batch_size_if_needed"):
        nmc.init_num_microbatches_calculator(0, None, None, 8, 2, True, step_batch_size_schedule="0:16 100:32")
    with pytest.raises(AssertionError, match="global_batch_size is required"):
        nmc.init_num_microbatches_calculator(0, micro_batch_size=8, data_parallel_size=2)


def test_rampup_still_ramps_and_warns_deprecated(caplog):
    with caplog.at_level("WARNING", logger=nmc.__name__):
        nmc.init_num_microbatches_calculator(0, [8, 8, 300], 32, 2, 2)
    assert "deprecated" in caplog.text
    nmc.update_num_microbatches(100)
    assert nmc.get_current_global_batch_size() == 16
