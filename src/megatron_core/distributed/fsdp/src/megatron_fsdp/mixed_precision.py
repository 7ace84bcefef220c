"""``MixedPrecisionPolicy``: Megatron-FSDP's precision settings (0.19's ``megatron_fsdp.mixed_precision``).

Megatron-FSDP names three dtypes: the main (optimizer) weights, the main gradients and the gradient
communication. FSDP2 names others: the dtype its sharded parameters are kept in (those are what the
optimizer updates), the compute dtype it casts them to after each all-gather (``param_dtype``) and the
reduction dtype (``reduce_dtype``). :func:`torch_mixed_precision` translates one into the other for a
module whose parameters are in ``compute_dtype``:

- sharded (main) parameters: ``main_params_dtype``, or the module's own dtype when it is None;
- FSDP2 ``param_dtype``: the module's own dtype when it differs from the main dtype, else None (no cast);
- FSDP2 ``reduce_dtype``: ``grad_comm_dtype``, else ``main_grads_dtype``, else None (the compute dtype);
- main gradients: FSDP2 hands the optimizer gradients in the sharded parameters' dtype, so
  ``main_grads_dtype`` must be None or that dtype (otherwise a ``ValueError``).

0.19's FP8 helpers of this module (``is_float8tensor``, ``fp8_quantize``, transpose caches,
``get_quantized_model_init_context_cls``, ...) operate on Transformer Engine tensors inside Megatron-FSDP's
own buffers and have no counterpart here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_POLICY", "MixedPrecisionPolicy", "torch_mixed_precision"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Megatron-FSDP's mixed precision: main weight, main gradient and gradient communication dtypes."""

    main_params_dtype: torch.dtype | None = torch.float32
    """Dtype of the sharded weights the optimizer updates; None keeps the module's own dtype."""

    main_grads_dtype: torch.dtype | None = None
    """Dtype of the gradients handed to the optimizer; None (FSDP2: the main weights' dtype) or that dtype."""

    grad_comm_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in; None uses ``main_grads_dtype`` (or the compute dtype when that is None)."""


DEFAULT_POLICY = MixedPrecisionPolicy()
"""The default policy (fp32 main weights), shared: the dataclass is frozen."""


def torch_mixed_precision(policy: MixedPrecisionPolicy,
                          compute_dtype: torch.dtype) -> tuple[torch.dtype, torch.distributed.fsdp.MixedPrecisionPolicy]:
    """``(main parameter dtype, FSDP2 policy)`` serving ``policy`` for a module computing in ``compute_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

    main_dtype = policy.main_params_dtype or compute_dtype
    if policy.main_grads_dtype is not None and policy.main_grads_dtype != main_dtype:
        raise ValueError(
            f"MixedPrecisionPolicy.main_grads_dtype ({policy.main_grads_dtype}) must be None or the main parameter "
            f"dtype ({main_dtype}, from main_params_dtype={policy.main_params_dtype} and the module's "
            f"{compute_dtype}): FSDP2 hands the optimizer gradients in the dtype of its sharded parameters")
    reduce_dtype = policy.grad_comm_dtype or policy.main_grads_dtype
    torch_policy = TorchMixedPrecisionPolicy(param_dtype=compute_dtype if compute_dtype != main_dtype else None,
                                             reduce_dtype=reduce_dtype)
    return main_dtype, torch_policy
