"""Tokenize, run the model, sample, detokenize."""

from megatron_core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

__all__ = ["TextGenerationController"]
