"""Read a SLURM job's rank layout from its environment (Megatron-Core's ``_slurm_utils``).

Each helper returns ``None`` outside a SLURM job (no ``SLURM_NTASKS``) or when its variable is unset.
"""

from __future__ import annotations

import os


def _slurm_int(variable: str) -> int | None:
    if not is_slurm_job() or variable not in os.environ:
        return None
    value = os.environ[variable]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"SLURM variable {variable}={value!r} is not an integer") from None


def is_slurm_job() -> bool:
    """True when this process runs under SLURM (``SLURM_NTASKS`` is set)."""
    return "SLURM_NTASKS" in os.environ


def resolve_slurm_rank() -> int | None:
    """Global rank from ``SLURM_PROCID``."""
    return _slurm_int("SLURM_PROCID")


def resolve_slurm_world_size() -> int | None:
    """World size from ``SLURM_NTASKS``."""
    return _slurm_int("SLURM_NTASKS")


def resolve_slurm_local_rank() -> int | None:
    """Rank on this node from ``SLURM_LOCALID``."""
    return _slurm_int("SLURM_LOCALID")
