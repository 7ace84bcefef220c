"""Model FLOPs utilisation (MFU) of a GPT training step: the one formula and the peak-FLOP/s table.

Convention of PaLM (appendix B) and nanoGPT: a training step costs ``6 N + 12 L W T`` FLOPs per
token, where ``N`` is the number of (active, for MoE) parameters without the input embedding,
``L`` the number of layers, ``W = num_attention_heads * kv_channels`` the attention width and
``T`` the sequence length; the attention term is not halved for causal masking. MFU is the
achieved FLOP/s over the device's dense bf16 peak. The example training loop and the benchmarks
use these functions, so their MFU figures agree.
"""

from __future__ import annotations

from megatron_core import device

__all__ = ["PEAK_FLOPS", "device_peak_flops", "model_flops_utilization", "training_flops_per_token"]

PEAK_FLOPS: dict[str, float] = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 peak FLOP/s by (a substring of) the device name."""


def training_flops_per_token(num_params_no_embedding: int, num_layers: int, attention_width: int,
                             seq_length: int) -> float:
    """``6 N + 12 L W T``: forward plus backward FLOPs per trained token (see the module docstring)."""
    return 6.0 * num_params_no_embedding + 12.0 * num_layers * attention_width * seq_length


def device_peak_flops(device_name: str | None = None) -> float | None:
    """Dense bf16 peak of ``device_name`` (default: the current device), None where unknown (CPUs)."""
    if device_name is None:
        device_name = device.get_device_name()
    return next((peak for key, peak in PEAK_FLOPS.items() if key in device_name), None)


def model_flops_utilization(tokens_per_second: float, flops_per_token: float, peak_flops: float,
                            num_devices: int = 1) -> float:
    """MFU as a fraction: achieved FLOP/s over ``num_devices`` times the per-device peak."""
    if peak_flops <= 0 or num_devices < 1:
        raise ValueError(f"peak_flops ({peak_flops}) must be > 0 and num_devices ({num_devices}) >= 1")
    return tokens_per_second * flops_per_token / (peak_flops * num_devices)
