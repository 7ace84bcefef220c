"""Former path of :mod:`megatron_core.training.rng`, where the code lives."""

from megatron_core.training.rng import *  # noqa: F403
