"""The hybrid layer stack at Megatron-Core's path ``ssm.mamba_block`` (before 0.19); the code lives in
:mod:`megatron_core.transformer.hybrid_stack`."""

from megatron_core.transformer.hybrid_stack import *  # noqa: F403
from megatron_core.transformer.hybrid_stack import __all__ as __all__
