"""``PartitionAdapter``: cut MIMO's combined ``[s, b, h]`` embeddings (and labels / loss mask) along the sequence.

Context parallelism keeps this rank's two load-balanced chunks of every tensor; sequence parallelism then
scatters the embeddings over the tensor-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core._ground import get_pg_size
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.transformer.context_parallel_batch import get_batch_on_this_cp_rank


@dataclass(frozen=True)
class PartitionConfig:
    """What sharding to apply: sequence parallelism over ``tp_group``, context parallelism over ``cp_group``.

    Build it with ``from_mp_config`` so that the groups are filled in.
    """

    seq_parallel: bool
    use_cp: bool
    tp_comm_overlap: bool
    max_seq_len: int
    kv_format: str = "sbhd"
    cp_group: Any = None
    tp_group: Any = None

    @classmethod
    def from_mp_config(cls, mp: ModelParallelConfig, *, max_seq_len: int, kv_format: str = "sbhd",
                       cp_group: Any = None, tp_group: Any = None) -> PartitionConfig:
        """From a model-parallel config; missing groups come from ``parallel_state``."""
        if not isinstance(mp, ModelParallelConfig):
            raise TypeError(f"PartitionConfig.from_mp_config expects a ModelParallelConfig, got {type(mp).__name__}")
        if mp.context_parallel_size > 1 and cp_group is None:
            cp_group = parallel_state.get_context_parallel_group()
        if mp.sequence_parallel and tp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group()
        return cls(seq_parallel=mp.sequence_parallel, use_cp=cp_group is not None and get_pg_size(cp_group) > 1,
                   tp_comm_overlap=mp.tp_comm_overlap, max_seq_len=max_seq_len, kv_format=kv_format,
                   cp_group=cp_group, tp_group=tp_group)


def _is_thd(packed_seq_params: Any) -> bool:
    return packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "sbhd") == "thd"


class PartitionAdapter:
    """Applies a ``PartitionConfig`` to the language model's inputs."""

    def __init__(self, cfg: PartitionConfig) -> None:
        self.cfg = cfg

    def _shard_factor(self) -> int | None:
        tp, cp = get_pg_size(self.cfg.tp_group), get_pg_size(self.cfg.cp_group)
        if self.cfg.use_cp:
            return 2 * cp * (tp if self.cfg.seq_parallel else 1)
        return tp if self.cfg.seq_parallel else None

    def shard(self, embeddings: torch.Tensor | None, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
              packed_seq_params: Any = None) -> tuple:
        """``(embeddings [s/(cp*tp), b, h], labels [b, s/cp], loss_mask [b, s/cp], packed_seq_params)``.

        ``embeddings`` is ``[s, b, h]`` (``None`` on later pipeline stages); labels and loss mask are
        ``[b, s]`` and are only cut by context parallelism (the loss runs on the full CP-local sequence).
        """
        factor = self._shard_factor()
        if embeddings is not None and factor is not None and not _is_thd(packed_seq_params):
            if embeddings.shape[0] % factor:
                raise ValueError(f"MIMO sequence/context parallelism: the combined sequence length "
                                 f"{embeddings.shape[0]} must be divisible by {factor}")
            if self.cfg.seq_parallel and self.cfg.tp_comm_overlap and embeddings.shape[0] != self.cfg.max_seq_len:
                raise ValueError(f"tp_comm_overlap needs the combined sequence length ({embeddings.shape[0]}) to "
                                 f"equal the language model's max_sequence_length ({self.cfg.max_seq_len})")
        if self.cfg.use_cp:
            if _is_thd(packed_seq_params):
                raise NotImplementedError("MIMO context parallelism with packed (thd) sequences is not supported")
            batch = {"embeddings": None if embeddings is None else embeddings.transpose(0, 1).contiguous(),
                     "labels": labels, "loss_mask": loss_mask}
            batch = get_batch_on_this_cp_rank(batch, cp_group=self.cfg.cp_group)
            embeddings, labels, loss_mask = batch["embeddings"], batch["labels"], batch["loss_mask"]
            if embeddings is not None:
                embeddings = embeddings.transpose(0, 1).contiguous()
        if self.cfg.seq_parallel and embeddings is not None:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, group=self.cfg.tp_group)
        return embeddings, labels, loss_mask, packed_seq_params

__all__ = ["PartitionAdapter", "PartitionConfig"]
