"""Former path of :mod:`megatron_core.training.model_config`, where the code lives."""

from megatron_core.training.model_config import *  # noqa: F403
