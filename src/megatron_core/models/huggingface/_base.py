"""``HuggingFaceModule``, the base of the Hugging Face wrappers (Megatron-Core's ``models/huggingface/module.py``).

It lives apart from ``module.py`` (which re-exports it) so that the wrappers can import it while
``module.build_hf_model`` imports the wrappers.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.transformer.module import MegatronModule

__all__ = ["HuggingFaceModule"]


class HuggingFaceModule(MegatronModule):
    """Base of the Hugging Face wrappers: a ``MegatronModule`` whose submodules' parameters are TP-averaged.

    The wrapped model is not tensor-parallel: every TP rank holds and runs all of it. Hugging Face kernels are
    not bitwise deterministic, so the replicas' gradients may differ slightly; the parameters carry
    ``average_gradients_across_tp_domain = True`` so that ``finalize_model_grads`` averages them over TP.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Keep the pipeline's input tensor (``self.input_tensor``); the wrapped model does not read it."""
        self.input_tensor = input_tensor

    def __setattr__(self, name: str, value: Any) -> None:
        """Assign as ``torch.nn.Module`` does; a module's parameters are then marked for averaging over TP."""
        super().__setattr__(name, value)
        if isinstance(value, torch.nn.Module):
            for param in value.parameters(recurse=True):
                param.average_gradients_across_tp_domain = True
