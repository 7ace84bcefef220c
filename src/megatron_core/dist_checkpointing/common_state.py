"""The common (non-sharded) state of a checkpoint: where it lives and how it is written and read.

Megatron-Core 0.19 stores the common state as one more DCP byte entry, the ShardedObject
``common_state`` (unique key ``common_state/shard_0_1``, written by rank 0 as ``torch.save``);
megatron-core <= 0.18 keeps it in a separate ``common.pt``. :mod:`.serialization` writes either
layout and reads both (``common.pt`` first, as 0.19 does), always with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.mapping import ShardedObject, StateDict
from megatron_core.dist_checkpointing.safe_load import torch_load_safe
from megatron_core.dist_checkpointing.strategies import TorchDistLoadShardedStrategy

__all__ = [
    "COMMON_STATE_FNAME",
    "COMMON_STATE_KEY",
    "COMMON_STATE_UNIQUE_KEY",
    "CONTENT_METADATA_KEY",
    "check_common_strategy",
    "common_state_object",
    "read_common_state",
    "serialize_common",
]

COMMON_STATE_FNAME = "common.pt"
CONTENT_METADATA_KEY = "content_metadata"
COMMON_STATE_KEY = "common_state"
"""Key of the ShardedObject holding the common state (megatron-core 0.19's layout)."""
COMMON_STATE_UNIQUE_KEY = f"{COMMON_STATE_KEY}/shard_0_1"


def check_common_strategy(common_strategy: Any) -> None:
    """Refuse a ``common_strategy`` other than ``None`` or torch (megatron-core <= 0.18's argument)."""
    if common_strategy not in (None, "torch", ("torch", 1)):
        raise CheckpointingException(f"common_strategy {common_strategy!r} is not supported; common state is 'torch'")


def common_state_object(common_state: StateDict, rank: int) -> ShardedObject:
    """The common state as megatron-core 0.19 stores it: one object, written by rank 0 only."""
    return ShardedObject(COMMON_STATE_KEY, common_state, (1,), (0,), replica_id=rank)


def serialize_common(common_state: StateDict) -> bytes:
    """``torch.save`` bytes of ``common_state``, checked to load back with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(common_state, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - explain which rule the common state broke
        raise CheckpointingException(
            "the common (non-sharded) state must be plain data (tensors, numbers, strings, lists, dicts) so it can "
            f"be loaded with weights_only=True; {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from e
    return data


def read_common_state(checkpoint_dir: str | os.PathLike,
                      strategy: TorchDistLoadShardedStrategy | None = None) -> StateDict:
    """The common state with its content metadata, from ``common.pt`` or the DCP ``common_state`` entry
    (read through ``strategy``, which keeps the ``.metadata`` it reads)."""
    path = Path(checkpoint_dir) / COMMON_STATE_FNAME
    if path.is_file():  # megatron-core <= 0.18 layout (and ours with common_strategy="torch")
        common = torch_load_safe(path, str(path))
        where = str(path)
    else:
        # A wrapping strategy (FullyParallelLoadStrategyWrapper) would run collectives and cache a distribution
        # for this one-entry request: the common state is read locally, through the strategy it wraps.
        strategy = getattr(strategy, "base_strategy", strategy) or TorchDistLoadShardedStrategy()
        if COMMON_STATE_UNIQUE_KEY not in strategy.metadata(checkpoint_dir).state_dict_metadata:
            raise CheckpointingException(
                f"{checkpoint_dir} holds no common state: neither {COMMON_STATE_FNAME} nor the DCP entry "
                f"{COMMON_STATE_UNIQUE_KEY!r}; the checkpoint is incomplete"
            )
        request = {COMMON_STATE_KEY: ShardedObject.empty_from_unique_key(COMMON_STATE_UNIQUE_KEY)}
        common = strategy.load(request, checkpoint_dir)[COMMON_STATE_KEY]
        where = f"{checkpoint_dir} entry {COMMON_STATE_UNIQUE_KEY!r}"
    if not isinstance(common, dict):
        raise CheckpointingException(f"{where} holds a {type(common).__name__}, expected a dict")
    return common
