"""Loading a quantized layer's quantizer buffers (amax, scales) from a checkpoint in the layer's own shapes.

Checkpoints store Model Optimizer's quantizer buffers flattened or in a resharding-friendly shape
(``[1]``, ``[rows, columns]``, per expert); a layer views each loaded buffer in its own shape before the
regular ``_load_from_state_dict``. A buffer whose element count differs was calibrated with another recipe
(or another layout): that is refused, naming the key and both sizes.
"""

from __future__ import annotations

import torch


def view_quantizer_buffers(module: torch.nn.Module, state_dict: dict, prefix: str) -> None:
    """Reshape ``state_dict``'s quantizer entries under ``prefix`` to ``module``'s own buffer shapes, in place.

    ``ValueError`` naming the key when a loaded buffer holds another number of values than the module's.
    """
    own = module.state_dict(prefix="", keep_vars=True)
    for key in list(state_dict):
        name = key[len(prefix):]
        if not key.startswith(prefix) or "_quantizer." not in name or name not in own:
            continue
        loaded = state_dict[key]
        if loaded.numel() != own[name].numel():
            raise ValueError(
                f"{key}: the checkpoint holds {loaded.numel()} values ({tuple(loaded.shape)}), this layer's "
                f"quantizer needs {own[name].numel()} ({tuple(own[name].shape)}); the checkpoint was quantized "
                "with another recipe or another layout")
        state_dict[key] = loaded.reshape(own[name].shape)
