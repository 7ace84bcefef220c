"""Megatron-Core's generalized tensor parallelism (GTP) entry point: ``HAVE_GTP`` is ``False`` here.

Megatron-Core 0.19 builds GTP on Transformer Engine and exports ``HAVE_GTP`` from this module so that its
callers can skip every GTP code path with ``if HAVE_GTP:``. This library has no GTP, so the flag is ``False``
and, as in Megatron-Core without Transformer Engine, the GTP functions themselves are not defined (importing
one raises ``ImportError``). Code that gates on the flag runs unchanged; see ``docs/compat.md``.
"""

from __future__ import annotations

HAVE_GTP: bool = False
"""Whether generalized tensor parallelism is available (never, in this library)."""

__all__ = ["HAVE_GTP"]
