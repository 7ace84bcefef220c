"""``megatron.training.utils.common_utils`` of the stand-in."""

from __future__ import annotations

import os


def get_local_rank_preinit() -> int:
    """The local rank before ``torch.distributed`` is initialised: ``LOCAL_RANK``, else ``SLURM_LOCALID``, else 0."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
