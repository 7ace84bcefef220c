"""One rank of the desync check: all_reduce a tensor whose length depends on the rank, report what happened.

Run as ``python _desync_rank.py RANK WORLD_SIZE STORE_FILE RESULT_FILE``; ranks meet through a FileStore.
The outcome (exception type, whether it is a RuntimeError, its message) is written to RESULT_FILE as JSON
so the test can inspect it even if another rank died.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main(rank: int, world_size: int, store_file: str, result_file: str) -> None:
    """Join the group, run the mismatched all_reduce, write the outcome, leave cleanly."""
    store = dist.FileStore(store_file, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=20))
    outcome: dict[str, object] = {"rank": rank, "shape": [4 + rank], "error": None, "is_runtime_error": False,
                                  "message": ""}
    try:
        dist.all_reduce(torch.ones(4 + rank))
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        outcome.update(error=type(exc).__name__, is_runtime_error=isinstance(exc, RuntimeError), message=str(exc))
    with open(result_file, "w") as handle:
        json.dump(outcome, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
