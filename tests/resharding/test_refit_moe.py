"""``swap_model_weights`` of a MoE GPT from expert parallelism EP=2 into EP=1 (and back) on 2 gloo ranks.

Grouped experts are one stacked ``weight [local experts, out, in]`` per linear, marked ``allreduce = False``,
which the planner shards along dim 0 over the EP group; sequential experts (``local_experts.K``) are matched
by their global expert index. Every destination piece of the
sharded state dict (the global checkpoint layout, independent of EP) must equal the source's global tensor
exactly, including the DeepSeek-like router's persistent ``expert_bias`` buffer; the EP=1 model's logits
equal a single-process model loaded with the source's global tensors (exactly).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron_core.process_groups_config import ProcessGroupCollection
from megatron_core.resharding import swap_model_weights
from megatron_core.resharding.refit import clear_all_caches
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import MAX_SEQ, VOCAB, batch
from tests.transformer.moe.moe_parallel_utils import FLAVOURS, load_globals, shards

CFG = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
           num_moe_experts=4, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
           add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
           **FLAVOURS["deepseek"])


def _model(pgs, seed: int, grouped: bool) -> GPTModel:
    torch.manual_seed(seed)
    config = TransformerConfig(**CFG, moe_grouped_gemm=grouped)
    model = GPTModel(config, get_gpt_decoder_block_spec(config, False), VOCAB, MAX_SEQ,
                     position_embedding_type="rope", pg_collection=pgs)
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def _globals(model) -> dict[str, torch.Tensor]:
    mine = {}
    for shard in shards(model):
        mine.setdefault(shard.key, []).append((shard.global_shape, shard.global_slice(), shard.data.detach().clone()))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, pieces in part.items():
            for shape, where, data in pieces:
                out.setdefault(key, torch.zeros(shape, dtype=data.dtype))[where] = data
    return out


def _pgs(ep_ranks: list[int]) -> tuple[ProcessGroupCollection, list]:
    me, created = dist.get_rank(), []
    pgs = ProcessGroupCollection()

    def group(role_rows: list[list[int]], *roles: str) -> None:
        for row in role_rows:
            g = dist.new_group(row)
            created.append(g)
            if me in row:
                for role in roles:
                    setattr(pgs, role, g)

    world = list(range(dist.get_world_size()))
    group([[r] for r in world], "tp", "mp", "pp", "cp", "expt_tp")
    group([world], "dp", "dp_cp", "tp_dp_cp")
    ep_rows = [ep_ranks] if len(ep_ranks) > 1 else [[r] for r in world]
    group(ep_rows, "ep", "tp_ep")
    group([[r] for r in world] if len(ep_ranks) > 1 else [world], "expt_dp")
    return pgs, created


def _moe_case(src_ep: int, dst_ep: int, grouped: bool) -> str:
    world = list(range(dist.get_world_size()))
    src_pgs, c1 = _pgs(world if src_ep > 1 else [0])
    dst_pgs, c2 = _pgs(world if dst_ep > 1 else [0])
    try:
        src, dst = _model(src_pgs, 1234, grouped), _model(dst_pgs, 77, grouped)
        src_g, before = _globals(src), _globals(dst)
        assert set(src_g) == set(before) and any(not torch.equal(before[k], src_g[k]) for k in src_g)
        swap_model_weights(src, dst, "gloo")
        after = _globals(dst)
        for key, value in after.items():
            assert torch.equal(value, src_g[key]), key
        for name, buf in dst.named_buffers():
            if name.endswith("expert_bias"):
                assert torch.equal(buf, dict(src.named_buffers())[name]), name
        if dst_ep == 1:
            ref = _model(None, 5, grouped)
            load_globals(ref, src_g)
            for name, buf in ref.named_buffers():
                if name.endswith("expert_bias"):
                    buf.copy_(dict(src.named_buffers())[name])
            ids, pos, _ = batch()
            with torch.no_grad():
                assert torch.equal(dst(ids, pos, None), ref(ids, pos, None))
        return "ok"
    finally:
        clear_all_caches()
        for g in c1 + c2:
            dist.destroy_process_group(g)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
@pytest.mark.parametrize("src_ep,dst_ep", [(2, 1), (1, 2)])
def test_refit_moe_expert_parallel_change(src_ep: int, dst_ep: int, grouped: bool):
    assert run_on_ranks(2, _moe_case, src_ep, dst_ep, grouped) == ["ok"] * 2
