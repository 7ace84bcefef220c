"""``examples/pretrain_gpt.py`` with one rank SIGKILLed in the middle of writing one checkpoint (for a test).

Run under torchrun exactly as ``pretrain_gpt.py`` (same flags). With ``CRASH_RANK=r`` and
``CRASH_ITERATION=n`` in the environment, rank ``r`` writes half of the first buffer of its first
checkpoint shard file of iteration ``n`` (``__<rank>_*.distcp``, through the hashing file writer
every save uses), flushes it to disk, records the file and byte count in ``CRASH_MARKER`` and kills
itself with SIGKILL: a crash in the middle of a multi-rank save, at a deterministic point.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import pretrain_gpt  # noqa: E402

from gpt_training import checkpointing  # noqa: E402
from megatron_core.dist_checkpointing import manifest  # noqa: E402

_SAVING: dict[str, int | None] = {"iteration": None}
_CRASH_RANK = int(os.environ["CRASH_RANK"])
_CRASH_ITERATION = int(os.environ["CRASH_ITERATION"])
_original_save = checkpointing.Checkpointer.save
_original_write = manifest._HashingWriter.write


def _save(self, iteration: int) -> None:
    _SAVING["iteration"] = iteration
    try:
        _original_save(self, iteration)
    finally:
        _SAVING["iteration"] = None


def _write(self, b) -> int:
    rank = int(os.environ.get("RANK", "0"))
    if rank == _CRASH_RANK and _SAVING["iteration"] == _CRASH_ITERATION:
        view = memoryview(b).cast("B")
        half = max(len(view) // 2, 1)
        self.raw.write(view[:half])
        self.raw.flush()
        os.fsync(self.raw.fileno())
        Path(os.environ["CRASH_MARKER"]).write_text(json.dumps(
            {"rank": rank, "iteration": _CRASH_ITERATION, "file": str(self.raw.name), "bytes_written": half,
             "bytes_total": len(view)}))
        os.kill(os.getpid(), signal.SIGKILL)
    return _original_write(self, b)


checkpointing.Checkpointer.save = _save
manifest._HashingWriter.write = _write

if __name__ == "__main__":
    pretrain_gpt.main(sys.argv[1:])
