"""Checks that a quantized model's calibration reached every quantizer that needs it.

Model Optimizer calibrates weight quantizers from the weights themselves, but activation quantizers
only from the batches the ``forward_loop`` runs: a loop that runs no batch (an empty dataset, a
wrong ``max_steps``) leaves them without an amax, and the model then quantizes with whatever scale
a later forward finds. :func:`check_calibrated` turns that into an error naming the quantizers.
"""

from __future__ import annotations

import torch

from megatron_core.post_training.modelopt._backend import modelopt_modules

__all__ = ["check_calibrated", "uncalibrated_quantizers"]


def uncalibrated_quantizers(model: torch.nn.Module) -> list[str]:
    """Names of the enabled static quantizers of ``model`` that hold no amax yet."""
    quantizer_cls = modelopt_modules("checking calibration").nn.TensorQuantizer
    missing = []
    for name, module in model.named_modules():
        if not isinstance(module, quantizer_cls) or not module.is_enabled:
            continue
        if getattr(module, "_dynamic", False) or getattr(module, "_disabled", False):
            continue
        block_sizes = module.block_sizes or {}
        if block_sizes.get("type") == "dynamic" and getattr(module, "is_mx_format", False):
            continue  # MX formats take every scale from the data; there is nothing to calibrate
        if module.amax is None:
            missing.append(name)
    return missing


def check_calibrated(model: torch.nn.Module) -> None:
    """``ValueError`` naming every enabled quantizer of ``model`` that calibration did not reach."""
    missing = uncalibrated_quantizers(model)
    if missing:
        raise ValueError(
            f"{len(missing)} quantizers hold no calibrated amax (did the forward_loop run any batch?): "
            + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        )
