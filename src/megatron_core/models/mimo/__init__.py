"""MIMO (multi-input multi-output): modality encoders and projections spliced into a language model's input.

``MimoModel`` is built from a ``MimoModelConfig``: a language-model spec plus one ``ModalitySubmodules`` spec
and one special token id per modality; ``get_mimo_optimizer`` gives it one optimizer per module.
"""

from megatron_core.models.mimo.config.base_configs import MimoModelConfig
from megatron_core.models.mimo.model import MimoModel
from megatron_core.models.mimo.optimizer import MimoOptimizer, get_mimo_optimizer
from megatron_core.models.mimo.submodules.audio import AudioModalitySubmodules
from megatron_core.models.mimo.submodules.base import ModalitySubmodules
from megatron_core.models.mimo.submodules.vision import VisionModalitySubmodules

__all__ = [
    "MimoModelConfig",
    "MimoModel",
    "MimoOptimizer",
    "get_mimo_optimizer",
    "ModalitySubmodules",
    "VisionModalitySubmodules",
    "AudioModalitySubmodules",
]
