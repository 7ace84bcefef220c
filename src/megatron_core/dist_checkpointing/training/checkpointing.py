"""Former path of :mod:`megatron_core.training.checkpointing`, where the code lives."""

from megatron_core.training.checkpointing import *  # noqa: F403
