"""Reading checkpoint files without executing code from them.

PyTorch DCP stores its ``.metadata`` file with plain ``pickle`` and reads it back with plain
``pickle.load``, so a crafted checkpoint could run arbitrary code when loaded. Here it is read
with :class:`RestrictedUnpickler`, which only resolves DCP's metadata dataclasses (and the subclasses older
megatron-core releases pickled, :class:`MCoreMetadata` / :class:`MCoreSavePlan`), ``torch.Size``,
dtypes, layouts and paths; any other global raises before anything is constructed. Every other
file goes through ``torch.load(weights_only=True)``. Storage entries must name plain files inside
the checkpoint directory, and each (file, offset, length) must lie within the file, so a
truncated or tampered checkpoint is reported (with the file and key) before any data is copied.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from megatron_core.dist_checkpointing.core import CheckpointingException

DCP_METADATA_FNAME = ".metadata"

_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # megatron-core's checkpoints also record every rank's save plan (``Metadata.all_local_plans``)
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class MCoreMetadata(Metadata):
    """DCP ``Metadata`` as older megatron-core releases pickled it (their own subclass, for optimizer states).

    Megatron-Core keeps the name so such ``.metadata`` files unpickle; :class:`RestrictedUnpickler` maps
    it here, so they read as ordinary ``Metadata``.
    """


class MCoreSavePlan(SavePlan):
    """DCP ``SavePlan`` as older megatron-core releases pickled it (in ``Metadata.all_local_plans``).

    Kept, like :class:`MCoreMetadata`, so older ``.metadata`` files unpickle.
    """


_LEGACY_MCORE_CLASSES = {"MCoreMetadata": MCoreMetadata, "MCoreSavePlan": MCoreSavePlan}
_LEGACY_MCORE_MODULES = ("megatron.core.dist_checkpointing.strategies.torch",
                         "megatron_core.dist_checkpointing.strategies.torch")


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP metadata classes and plain torch value types."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module in _LEGACY_MCORE_MODULES and name in _LEGACY_MCORE_CLASSES:
            return _LEGACY_MCORE_CLASSES[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")


def read_dcp_metadata(checkpoint_dir: str | os.PathLike) -> Metadata:
    """DCP's ``.metadata`` of ``checkpoint_dir``, unpickled safely and checked for consistency."""
    path = Path(checkpoint_dir) / DCP_METADATA_FNAME
    if not path.is_file():
        raise CheckpointingException(f"{path} is missing: the checkpoint is incomplete")
    try:
        with open(path, "rb") as f:
            metadata = RestrictedUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt or hostile file
        raise CheckpointingException(f"cannot read {path}: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointingException(f"{path} does not hold DCP Metadata (got {type(metadata).__name__})")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointingException(f"{path} has no storage table")
    check_storage_table(checkpoint_dir, metadata)
    return metadata


def check_storage_table(checkpoint_dir: str | os.PathLike, metadata: Metadata) -> None:
    """Every storage entry must name a plain file in ``checkpoint_dir`` and fit inside it."""
    root = Path(checkpoint_dir)
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        where = f"storage entry for key {getattr(index, 'fqn', index)!r}"
        if not isinstance(rel, str) or not rel or rel != os.path.basename(rel) or rel in (".", ".."):
            raise CheckpointingException(f"{where}: file name {rel!r} is not a plain file inside {root}")
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            raise CheckpointingException(f"{where}: invalid byte range offset={offset!r} length={length!r}")
        if rel not in sizes:
            file_path = root / rel
            if not file_path.is_file():
                raise CheckpointingException(f"{where}: data file {file_path} is missing")
            sizes[rel] = file_path.stat().st_size
        if offset + length > sizes[rel]:
            raise CheckpointingException(
                f"{where}: bytes [{offset}, {offset + length}) lie beyond the end of {root / rel} "
                f"({sizes[rel]} bytes): the file is truncated"
            )


def torch_load_safe(source: str | os.PathLike | io.BytesIO, what: str) -> Any:
    """``torch.load(source, weights_only=True)`` on CPU; errors name ``what``."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - report any failure with its location
        raise CheckpointingException(f"cannot load {what}: {type(e).__name__}: {e}") from e
