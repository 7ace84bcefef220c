"""Former path of :mod:`megatron_core.dist_checkpointing.tracker`, where the code lives."""

from megatron_core.dist_checkpointing.tracker import *  # noqa: F403
