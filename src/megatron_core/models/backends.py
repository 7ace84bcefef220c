"""Backend spec providers at Megatron-Core's path; the code lives in :mod:`megatron_core.transformer.backends`."""

from megatron_core.transformer.backends import BackendSpecProvider, LocalSpecProvider

__all__ = ["BackendSpecProvider", "LocalSpecProvider"]
