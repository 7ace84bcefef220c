"""Former path of :mod:`megatron_core.training.architecture`, where the code lives."""

from megatron_core.training.architecture import *  # noqa: F403
