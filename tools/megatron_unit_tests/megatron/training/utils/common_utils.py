"""``megatron.training.utils.common_utils`` of the stand-in: ``get_local_rank_preinit``."""

from __future__ import annotations

import os


def get_local_rank_preinit() -> int:
    """This process's local rank from the launcher's environment (``LOCAL_RANK``, default 0)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
