"""megatron_core.training_metrics: the one MFU formula and peak table used by the example and the benchmarks."""

from __future__ import annotations

import pytest

from megatron_core import training_metrics as tm


def test_flops_per_token_is_6n_plus_12lwt():
    assert tm.training_flops_per_token(1000, 2, 64, 128) == 6 * 1000 + 12 * 2 * 64 * 128


def test_peak_table_and_mfu():
    assert tm.device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert tm.device_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert tm.device_peak_flops("cpu") is None
    assert tm.model_flops_utilization(1000.0, 1e9, 1e13, num_devices=2) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="peak_flops"):
        tm.model_flops_utilization(1.0, 1.0, 0.0)

