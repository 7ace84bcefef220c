"""Where a save may go: a checkpoint never removes what it did not write.

``save`` writes into ``<dir>.tmp-<id>`` and renames it to ``<dir>``. What already sits at
``<dir>`` decides whether that is allowed:

- nothing, or an empty directory: saved;
- a complete checkpoint: refused unless ``overwrite=True``;
- a directory holding only files this library writes (the leftovers of an interrupted save):
  replaced;
- a directory holding anything else (a README, notes, another program's output): refused,
  naming what is there, unless ``overwrite=True`` (the caller asked to replace it);
- a regular file or any other non-directory: always an error, nothing is renamed aside.

Temporary directories of earlier interrupted saves (``<dir>.tmp-*``) carry a marker file and are
removed only when they hold nothing but our own files.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from megatron_core.dist_checkpointing.core import CheckpointingException, check_is_distributed_checkpoint

IN_PROGRESS_MARKER = ".mcore_save_in_progress"
MANIFEST_FNAME = "sha256_manifest.json"

# Every file name ``save`` (and the DCP writer under it) creates inside a checkpoint directory.
_OWN_FILE = re.compile(
    r"^(?:\.metadata|\.metadata\.tmp|__\d+(?:_\d+)?\.distcp|__\d+\.metadata(?:\.tmp)?|common\.pt|metadata\.json"
    rf"|{re.escape(MANIFEST_FNAME)}|{re.escape(IN_PROGRESS_MARKER)}|integrity\.json|\..+\.tmp)$"
)
_SHOWN = 10


def is_own_file(name: str) -> bool:
    """Whether ``name`` (a file name inside a checkpoint directory) is one this library writes."""
    return bool(_OWN_FILE.match(name))


def foreign_entries(directory: str | os.PathLike) -> list[str]:
    """Entries of ``directory`` that this library did not write (sub-directories always count)."""
    out = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) or not entry.is_file(follow_symlinks=False) \
                or not is_own_file(entry.name):
            out.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
    return out


def _listing(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def check_save_target(final_dir: str | os.PathLike, overwrite: bool) -> None:
    """Raise ``CheckpointingException`` unless saving into ``final_dir`` would only replace our own files."""
    path = Path(final_dir)
    if path.is_symlink() and not path.is_dir():
        raise CheckpointingException(f"checkpoint path {path} is a broken symbolic link; refusing to save over it")
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointingException(
            f"checkpoint path {path} exists and is not a directory (a regular file or other non-directory); "
            "refusing to save over it: remove it or choose another path")
    if check_is_distributed_checkpoint(path) and not overwrite:
        raise CheckpointingException(f"{path} already holds a complete checkpoint; pass overwrite=True to replace it")
    foreign = foreign_entries(path)
    if foreign and not overwrite:
        raise CheckpointingException(
            f"{path} is not empty and holds files this library did not write: {_listing(foreign)}; saving would "
            "remove them. Save into a new or empty directory, move them away, or pass overwrite=True to "
            "replace the directory with its contents")


def replace_target(tmp_dir: Path, final_dir: Path, overwrite: bool) -> Path | None:
    """Check ``final_dir`` again and move it out of the way; returns the moved-aside path to delete later."""
    check_save_target(final_dir, overwrite)
    if not final_dir.exists():
        return None
    if not any(final_dir.iterdir()):
        final_dir.rmdir()
        return None
    old = final_dir.with_name(f"{final_dir.name}.old-{tmp_dir.name.rsplit('-', 1)[-1]}")
    os.rename(final_dir, old)
    return old


def remove_stale_tmp_dirs(final_dir: Path) -> list[Path]:
    """Remove ``<final_dir>.tmp-*`` directories of our own interrupted saves; returns those kept."""
    kept = []
    prefix = f"{final_dir.name}.tmp-"
    parent = final_dir.parent
    if not parent.is_dir():
        return kept
    for entry in parent.iterdir():
        if not entry.name.startswith(prefix) or not entry.is_dir() or entry.is_symlink():
            continue
        if (entry / IN_PROGRESS_MARKER).is_file() and not foreign_entries(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:
            kept.append(entry)
    return kept
