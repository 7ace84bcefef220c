"""Model families an exporter recognises (Megatron-Core's ``export.model_type.ModelType``)."""

from __future__ import annotations

from enum import Enum


class ModelType(Enum):
    """Architecture family of the exported model; values 1..8 as in Megatron-Core."""

    gpt = 1
    gptnext = 2
    llama = 3
    falcon = 4
    starcoder = 5
    mixtral = 6
    gemma = 7
    nemotron_nas = 8
