"""The hybrid layer stack at its earlier path in this library; the code lives in
:mod:`megatron_core.transformer.hybrid_stack`."""

from megatron_core.transformer.hybrid_stack import *  # noqa: F403
from megatron_core.transformer.hybrid_stack import __all__ as __all__
