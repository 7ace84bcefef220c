"""Helpers for the resharding tests: tiny GPT models on hand-made TP x PP x DP groups, and their full weights.

:func:`make_groups` builds a :class:`ProcessGroupCollection` for a layout of ``ranks`` (every rank of the
world must call it, since ``new_group`` is collective); :func:`build_model` builds this rank's GPT chunk of a
``llama_like``/``gpt2_like`` spec with a given seed; :func:`full_weights` gathers a model's TP shards and
pipeline stages back into the single-process state dict.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from megatron_core.process_groups_config import ProcessGroupCollection
from megatron_core.transformer import TransformerConfig
from tests.models.gpt_test_utils import gpt_provider, unshard


class Layout:
    """``ranks`` laid out as TP (fastest) x PP x DP; this rank's groups, or ``None`` when it is not a member."""

    def __init__(self, ranks: list[int], tp: int, pp: int = 1) -> None:
        self.ranks, self.tp, self.pp = ranks, tp, pp
        self.dp = len(ranks) // (tp * pp)
        grid = torch.tensor(ranks).reshape(self.dp, pp, tp)
        self.created: list = []
        me = dist.get_rank()
        self.pgs = ProcessGroupCollection() if me in ranks else None
        for role, rows in (("tp", grid.reshape(-1, tp)), ("pp", grid.permute(0, 2, 1).reshape(-1, pp)),
                           ("dp", grid.permute(1, 2, 0).reshape(-1, self.dp))):
            for row in rows.tolist():
                group = dist.new_group(row)
                self.created.append(group)
                if me in row:
                    setattr(self.pgs, role, group)
                    if role == "tp":
                        self.pgs.mp = group
                    if role == "dp":
                        self.pgs.dp_cp = group

    def destroy(self) -> None:
        """Free every group this layout created."""
        for group in self.created:
            dist.destroy_process_group(group)


def build_model(spec: dict, layout: Layout, seed: int):
    """This rank's chunk of the ``spec`` GPT under ``layout`` (``None`` off the layout), weights from ``seed``.

    ``use_cpu_initialization`` cuts every TP shard from the seed's single-process weights; pipeline
    stages then get the seed's weights of their global layers copied in.
    """
    if layout.pgs is None:
        return None
    pp_rank, pp = layout.pgs.pp.rank(), layout.pp
    torch.manual_seed(seed)
    model = gpt_provider(spec, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                         config=TransformerConfig(**spec["config"]), pg_collection=layout.pgs)
    return model


def full_weights(model, layout: Layout, gated: bool) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` gathered over TP and keyed by its global single-process name (this stage)."""
    out = {}
    offset = min(layer.layer_number for layer in model.decoder.layers) - 1 if len(model.decoder.layers) else 0
    tp_group = layout.pgs.tp
    for name, param in model.named_parameters():
        pieces = [torch.empty_like(param) for _ in range(tp_group.size())]
        dist.all_gather(pieces, param.detach().contiguous(), group=tp_group)
        key = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
        out[key] = unshard(name, pieces, gated)
    return out
