"""The ``torch_dist`` backend: shards stored as PyTorch Distributed Checkpoint (DCP) files.

On disk: ``__<rank>_<n>.distcp`` data files plus DCP's ``.metadata`` (written by the
coordinator once every rank has written its data), exactly as ``torch.distributed.checkpoint``
lays them out, so other DCP tools can read our checkpoints. We drive DCP's planner and storage
layers ourselves instead of calling ``dcp.save``/``dcp.load``: planning (small collectives)
happens on the caller's thread, file writing can run in the background, and loading reads
``.metadata`` through a restricted unpickler, reads into fresh buffers and needs no collectives.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import (
    CheckpointingConfig,
    CheckpointingException,
    maybe_load_config,
)
from megatron_core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
from megatron_core.dist_checkpointing.manifest import HashingFileSystem
from megatron_core.dist_checkpointing.mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from megatron_core.dist_checkpointing.safe_load import read_dcp_metadata
from megatron_core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron_core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy, LoadShardedStrategy
from megatron_core.dist_checkpointing.strategies.dcp_planners import ShardsLoadPlanner, ShardsSavePlanner

BACKEND = "torch_dist"
VERSION = 1


def _sharded_leaves(sharded_state_dict: ShardedStateDict) -> list[ShardedBase]:
    return [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedBase)]


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Save shards with DCP. Only main replicas are written unless ``keep_only_main_replica`` is off.

    With ``keep_only_main_replica=False`` every replica offers its shard and DCP's planner keeps
    each on the rank with the fewest bytes planned so far: the fully parallel save.
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, keep_only_main_replica: bool = True,
                 thread_count: int = 1, process_group: Any = None) -> None:
        super().__init__(backend, version)
        if backend != BACKEND:
            raise CheckpointingException(f"TorchDistSaveShardedStrategy writes backend {BACKEND!r}, not {backend!r}")
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.process_group = process_group
        self.last_planned_bytes = 0

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> AsyncRequest:
        """Plan collectively and stage private CPU copies; the request's ``async_fn`` writes files."""
        return self._plan(sharded_state_dict, checkpoint_dir, clone=True)

    def save_request(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike,
                     stage: bool) -> AsyncRequest:
        """Plan collectively; with ``stage`` also copy every tensor so training may go on."""
        return self._plan(sharded_state_dict, checkpoint_dir, clone=stage)

    def _plan(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike,
              clone: bool) -> AsyncRequest:
        group = self.process_group
        rank = collectives.get_rank(group)
        shards = _sharded_leaves(sharded_state_dict)
        if self.keep_only_main_replica:
            shards = [sh for sh in shards if is_main_replica(sh.replica_id)]
        planner = ShardsSavePlanner(shards, clone=clone)
        self.last_planned_bytes = planner.planned_bytes()
        writer = FileSystemWriter(checkpoint_dir, thread_count=self.thread_count, sync_files=True, overwrite=True)
        writer.fs = HashingFileSystem()  # every file is hashed while it is written (the SHA-256 manifest)
        coordinator = rank == 0
        planner.set_up_planner(is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        all_plans = collectives.all_gather_object(writer.prepare_local_plan(planner.create_local_plan()), group)
        payload: tuple = (None, None, None)
        if coordinator:
            try:
                global_plans, metadata = planner.create_global_plan(all_plans)
                payload = (writer.prepare_global_plan(global_plans), metadata, None)
            except Exception as e:  # noqa: BLE001 - sent to every rank below
                payload = (None, None, f"{type(e).__name__}: {e}")
        global_plans, metadata, error = collectives.broadcast_object(payload, 0, group)
        if error is not None:
            raise CheckpointingException(f"planning the save of {checkpoint_dir} failed: {error}")
        final_plan = planner.finish_plan(global_plans[rank])
        results: dict[str, Any] = {}

        def write() -> None:
            results["write"] = writer.write_data(final_plan, planner).wait()

        request = AsyncRequest(write, (), [])

        def finish() -> None:
            gathered = collectives.all_gather_object((results.get("write"), dict(writer.fs.digests)), group)
            if coordinator:
                writer.finish(metadata, [r for r, _ in gathered])
                for _, digests in gathered:
                    request.file_digests.update(digests)
                request.file_digests.update(writer.fs.digests)
            collectives.barrier(group)

        request.add_finalize_fn(finish)
        return request


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Load shards from DCP files into fresh buffers, resharding to whatever layout is requested.

    An instance remembers what it read of each checkpoint directory (``metadata.json``, DCP's
    ``.metadata``): one load passes its strategy on, so each file is read once.
    """

    def __init__(self) -> None:
        self._metadata_cache: dict[str, Metadata] = {}
        self._config_cache: dict[str, CheckpointingConfig] = {}

    def metadata(self, checkpoint_dir: str | os.PathLike) -> Metadata:
        """The checkpoint's DCP metadata (read safely, validated, cached per directory)."""
        key = os.path.abspath(checkpoint_dir)
        if key not in self._metadata_cache:
            self._metadata_cache[key] = read_dcp_metadata(checkpoint_dir)
        return self._metadata_cache[key]

    def checkpoint_config(self, checkpoint_dir: str | os.PathLike) -> CheckpointingConfig | None:
        """The checkpoint's ``metadata.json`` (:func:`..core.maybe_load_config`; a valid one is cached per directory)."""
        key = os.path.abspath(checkpoint_dir)
        if key not in self._config_cache:
            config = maybe_load_config(checkpoint_dir)
            if config is None:
                return None
            self._config_cache[key] = config
        return self._config_cache[key]

    def check_checkpoint_compatibility(self, checkpoint_dir: str | os.PathLike) -> None:
        """``checkpoint_dir`` must be a distributed checkpoint whose ``metadata.json`` names this backend and version."""
        config = self.checkpoint_config(checkpoint_dir)
        if config is None:
            raise CheckpointingException(f"{checkpoint_dir} is not a distributed checkpoint (no valid metadata.json)")
        self.check_backend_compatibility(config.sharded_backend)
        self.check_version_compatibility(config.sharded_backend_version)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
        """Read every shard of ``sharded_state_dict``; local to this rank (no collectives)."""
        metadata = self.metadata(checkpoint_dir)
        planner = ShardsLoadPlanner(_sharded_leaves(sharded_state_dict), metadata)
        reader = FileSystemReader(checkpoint_dir)
        reader.set_up_storage_reader(metadata, False, rank=collectives.get_rank(), use_collectives=False)
        per_file: dict[str, list] = defaultdict(list)
        for item in planner.create_local_plan().items:
            per_file[metadata.storage_data[item.storage_index].relative_path].append(item)
        for file_name, items in sorted(per_file.items()):
            try:
                reader.read_data(LoadPlan(items), planner).wait()
            except CheckpointingException:
                raise
            except Exception as e:  # noqa: BLE001 - name the file and keys of any read failure
                keys = sorted({item.storage_index.fqn for item in items})
                raise CheckpointingException(
                    f"reading {os.path.join(checkpoint_dir, file_name)} (keys {keys[:5]}"
                    f"{' ...' if len(keys) > 5 else ''}) failed: {type(e).__name__}: {e}"
                ) from e

        def loaded(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                return planner.loaded_tensor(x)
            if isinstance(x, ShardedObject):
                return planner.loaded_object(x)
            return x

        return dict_list_map_outplace(loaded, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike) -> ShardedStateDict:
        """A data-less ShardedTensor (the whole global tensor, main replica) per stored tensor."""
        out = {}
        for key, md in self.metadata(checkpoint_dir).state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                shape = tuple(md.size)
                out[key] = ShardedTensor(key, None, md.properties.dtype, shape, shape, (0,) * len(shape),
                                         (1,) * len(shape))
        return out

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike) -> ShardedStateDict:
        """:meth:`load_tensors_metadata` plus a data-less ShardedObject per stored object shard."""
        out = self.load_tensors_metadata(checkpoint_dir)
        for key, md in self.metadata(checkpoint_dir).state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata) and "/shard_" in key:
                out[key] = ShardedObject.empty_from_unique_key(key)
        return out

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Only ``torch_dist`` checkpoints are readable."""
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"checkpoint was written by backend {loaded_backend!r}; only {BACKEND!r} is supported"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Only version 1 exists."""
        if loaded_version != VERSION:
            raise CheckpointingException(f"{BACKEND} checkpoint version {loaded_version} is not supported")

