"""The tiny MIMO VLM of ``mimo_fixture`` on two colocated grids with different TP x DP (4 gloo ranks).

``build(enc_tp, enc_dp, lm_tp, lm_dp)`` makes the grids (tp fastest, then cp, pp, dp), every group the model
and the MIMO optimizer read, and the ``MimoModel`` whose encoder runs on the first grid and language model on
the second, with the single-process reference's weights (``reference_state``) sharded over each grid's TP.
The global batch holds one image per sample; ``local_batch`` cuts it as the colocated bridge expects.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_core import tensor_parallel
from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.models.mimo import MimoModel, MimoModelConfig, VisionModalitySubmodules
from megatron_core.models.vision import CLIPViTModel, MultimodalProjector, get_vit_layer_with_local_spec
from megatron_core.process_groups_config import ProcessGroupCollection
from megatron_core.transformer.spec_utils import ModuleSpec
from tests.models.gpt_test_utils import shard, unshard
from tests.models.mimo import mimo_fixture as f
from tests.models.multimodal import llava_fixture as lf

DIMS = ["tp", "cp", "pp", "dp"]
GROUP_DIMS = (["tp"], ["cp"], ["pp"], ["dp"], ["tp", "cp"], ["dp", "cp"], ["tp", "pp"], ["tp", "cp", "dp", "pp"])
SAMPLES = 4


def grid_on(shape: list[int], rank_offset: int = 0) -> HyperCommGrid:
    """A grid of ``shape`` over ``DIMS`` from ``rank_offset``, with every group of ``GROUP_DIMS`` created."""
    g = HyperCommGrid(shape, DIMS, rank_offset)
    for dims in GROUP_DIMS:
        g.create_pg(dims)
    return g


def grid(tp: int, dp: int) -> HyperCommGrid:
    """A ``[tp, 1, 1, dp]`` grid from rank 0 with its groups."""
    return grid_on([tp, 1, 1, dp])


def groups(g: HyperCommGrid) -> ProcessGroupCollection:
    """The model-side groups of a grid."""
    return ProcessGroupCollection(tp=g.get_pg("tp"), cp=g.get_pg("cp"), pp=g.get_pg("pp"), dp=g.get_pg("dp"),
                                  tp_cp=g.get_pg(["tp", "cp"]), dp_cp=g.get_pg(["dp", "cp"]),
                                  mp=g.get_pg(["tp", "pp"]))


def config(enc_tp: int = 1, lm_tp: int = 1, enc_pgs=None, lm_pgs=None, grid_map=None) -> MimoModelConfig:
    """The tiny VLM's MIMO config with explicit groups per module."""
    language = ModuleSpec(module=GPTModel, params=dict(
        config=lf.language_config(tensor_model_parallel_size=lm_tp), transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=f.VOCAB, max_sequence_length=f.MAX_SEQ, position_embedding_type="rope",
        scatter_embedding_sequence_parallel=False, pg_collection=lm_pgs))
    clip = ModuleSpec(module=CLIPViTModel, params=dict(
        pg_collection=enc_pgs, transformer_config=lf.vision_config(tensor_model_parallel_size=enc_tp),
        transformer_layer_spec=get_vit_layer_with_local_spec(), patch_dim=lf.PATCH, img_h=f.IMG, img_w=f.IMG))
    projector = ModuleSpec(module=MultimodalProjector, params=dict(
        config=lf.projection_config(tensor_model_parallel_size=enc_tp), submodules=lf.projection_spec(),
        projector_type="mlp", input_size=lf.V_HIDDEN, pg_collection=enc_pgs))
    vision = ModuleSpec(module=VisionModalitySubmodules, params=dict(pg_collection=enc_pgs),
                        submodules={"encoders": {"clip_encoder": clip}, "input_projections": [projector]})
    return MimoModelConfig(language_model_spec=language, modality_submodules_spec={"images": vision},
                           special_token_ids={"images": f.IMAGE_TOKEN_ID}, module_to_grid_map=grid_map)


def make(cfg: MimoModelConfig) -> MimoModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MimoModel(cfg)


def reference_state() -> dict[str, torch.Tensor]:
    """The single-process model's (randomized) weights."""
    torch.manual_seed(1)
    model = make(config())
    lf.randomize(model, seed=2)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def global_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, labels, loss_mask, images)`` of ``SAMPLES`` samples, one image each."""
    ids, images = f.batch([1] * SAMPLES, seed=3)
    gen = torch.Generator().manual_seed(4)
    labels = torch.randint(0, f.VOCAB - 1, ids.shape, generator=gen)
    loss_mask = (torch.rand(ids.shape, generator=gen) > 0.2).float()
    return ids, labels, loss_mask, images


def is_language(name: str) -> bool:
    return name.startswith("language_model.")


@dataclass
class Hetero:
    """The distributed model and what the checks need about its layout."""

    model: MimoModel
    enc_grid: HyperCommGrid
    lm_grid: HyperCommGrid
    enc_tp: int
    lm_tp: int

    def tp_of(self, name: str) -> tuple[int, object]:
        g = self.lm_grid if is_language(name) else self.enc_grid
        return (self.lm_tp if is_language(name) else self.enc_tp), g.get_pg("tp")

    def dp_group(self, name: str) -> object:
        return (self.lm_grid if is_language(name) else self.enc_grid).get_pg("dp")

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Copy TP=1 weights into this rank's shards."""
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                tp, group = self.tp_of(name)
                param.copy_(shard(name, state[name], tp, dist.get_rank(group), is_language(name)))

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """A TP shard (weight or gradient) of ``name`` reassembled to the TP=1 layout."""
        tp, group = self.tp_of(name)
        pieces = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return unshard(name, pieces, is_language(name))

    def sum_grads_over_dp(self) -> None:
        """Sum every gradient over its module's DP group (per-token-loss reduction)."""
        for name, param in self.model.named_parameters():
            dist.all_reduce(param.grad, group=self.dp_group(name))

    def local_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, slice]:
        """This rank's language samples and encoder images (and the language slice of the global batch)."""
        ids, labels, loss_mask, images = global_batch()
        enc_dp, lm_dp = self.enc_grid.get_pg("dp"), self.lm_grid.get_pg("dp")
        lm_size = SAMPLES // dist.get_world_size(lm_dp)
        lm = slice(dist.get_rank(lm_dp) * lm_size, (dist.get_rank(lm_dp) + 1) * lm_size)
        enc_size = SAMPLES // dist.get_world_size(enc_dp)
        enc = slice(dist.get_rank(enc_dp) * enc_size, (dist.get_rank(enc_dp) + 1) * enc_size)
        inputs = {"images": {"clip_encoder": {"x": images[enc]}}}
        return ids[lm], labels[lm], loss_mask[lm], inputs, lm


def build(enc_tp: int, enc_dp: int, lm_tp: int, lm_dp: int, state: dict[str, torch.Tensor]) -> Hetero:
    """The heterogeneous model on this rank, with ``state`` loaded."""
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    enc_grid, lm_grid = grid(enc_tp, enc_dp), grid(lm_tp, lm_dp)
    cfg = config(enc_tp, lm_tp, groups(enc_grid), groups(lm_grid), {"images": enc_grid, "language": lm_grid})
    hetero = Hetero(make(cfg), enc_grid, lm_grid, enc_tp, lm_tp)
    hetero.load(state)
    return hetero


def destroy(hetero: Hetero) -> None:
    """Release the bridge's and the grids' groups."""
    hetero.model.destroy()
    hetero.enc_grid.destroy()
    hetero.lm_grid.destroy()
