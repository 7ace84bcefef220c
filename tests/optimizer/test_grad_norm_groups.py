"""Separately clipped gradient groups (``param.grad_norm_group = "mtp"``, Megatron-Core 0.19).

Parameters tagged with a registered group (the MTP block's, with ``mtp_detach_heads``) leave the main gradient norm
(the one ``step`` returns and checks) and, with clipping on, are clipped by their own group's norm.

* One process: the main / group gradient split, an unknown group raising ``ValueError``, ``has_grad_norm_group``,
  and ``clip_grad_norm`` clipping each set by its own norm (a group below ``clip_grad`` left exactly as it was).
* On 4 CPU ranks (fp32), against a single-process reference that clips the two sets by hand: ``TiedNetTP`` with
  its LayerNorm tagged, trained 3 steps with every step clipping both sets, under DP=4 (plain and distributed
  optimizer, the latter also with its flat fused step forced on), TP=2 x DP=2, and a chain of two optimizers (one of them for ``allreduce=False`` params, as experts
  get): weights within 1e-5, the returned main norms and ``grad_norms_by_group`` equal the reference's.
* The MTP block tags its parameters only with ``mtp_detach_heads``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import (
    ChainedOptimizer,
    DistributedOptimizer,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from tests.dist_harness import run_on_ranks
from tests.distributed import tiny_models as tm

CLIP = 1e-3  # below both norms: every step clips both sets
STEPS = 3
GROUPED = ("ln.weight", "ln.bias")


def _fp32_optimizer(params: list[torch.nn.Parameter]) -> FP32Optimizer:
    return FP32Optimizer(torch.optim.AdamW(params, lr=0.01), OptimizerConfig(lr=0.01, clip_grad=1.0))


def _tagged(*values: float, group: str | None = "mtp") -> list[torch.nn.Parameter]:
    params = []
    for value in values:
        param = torch.nn.Parameter(torch.zeros(4, 4))
        param.grad = torch.full((4, 4), value)
        if group is not None:
            param.grad_norm_group = group
        params.append(param)
    return params


def test_main_and_group_gradients_are_split():
    main, mtp = _tagged(1.0, 2.0, group=None), _tagged(3.0, 4.0)
    opt = _fp32_optimizer(main + mtp)
    assert [g is p.grad for g, p in zip(opt.get_grads_for_grad_norm(), main)] == [True, True]
    assert [g is p.grad for g, p in zip(opt.get_grads_for_grad_norm("mtp"), mtp)] == [True, True]
    assert opt.get_grad_norm() == pytest.approx(math.sqrt(16 * (1 + 4)))  # the main gradients only
    untagged = _fp32_optimizer(_tagged(1.0, 2.0, 3.0, group=None))
    assert len(untagged.get_grads_for_grad_norm()) == 3 and untagged.get_grads_for_grad_norm("mtp") == []


def test_unknown_group_raises_naming_it():
    opt = _fp32_optimizer(_tagged(1.0, group="unregistered"))
    with pytest.raises(ValueError, match="Unknown grad_norm_group 'unregistered'"):
        opt.get_grads_for_grad_norm()
    with pytest.raises(ValueError, match="Unknown grad_norm_group 'other'"):
        opt.get_grads_for_grad_norm("other")


def test_has_grad_norm_group():
    assert _fp32_optimizer(_tagged(1.0, group=None)).has_grad_norm_group("mtp") is False
    assert _fp32_optimizer(_tagged(1.0, group=None) + _tagged(1.0)).has_grad_norm_group("mtp") is True


def test_clip_grad_norm_clips_each_set_by_its_own_norm():
    (main,), (small,) = _tagged(10.0, group=None), _tagged(1e-3)
    opt = _fp32_optimizer([main, small])
    before = small.grad.clone()
    norm = opt.clip_grad_norm(1.0)
    assert norm == pytest.approx(40.0)  # the main norm, measured before clipping
    assert main.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(small.grad, before)  # its own norm (4e-3) is below the clip: untouched
    assert opt.grad_norms_by_group == {"mtp": pytest.approx(4e-3)}
    (main,), (large,) = _tagged(1e-3, group=None), _tagged(10.0)
    opt = _fp32_optimizer([main, large])
    opt.clip_grad_norm(1.0)
    assert main.grad.norm().item() == pytest.approx(4e-3) and large.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def _reference() -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """TiedNet trained with the two sets clipped by hand: (weights, main norms, group norms)."""
    model = tm.make_reference()
    params = dict(model.named_parameters())
    groups = [{"params": [p for p in params.values() if p.dim() > 1], "weight_decay": tm.WD},
              {"params": [p for p in params.values() if p.dim() == 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=tm.LR)
    main_norms, group_norms = [], []
    for x, y in tm.make_data(STEPS):
        opt.zero_grad()
        for xm, ym in zip(x.chunk(tm.NUM_MICROBATCHES), y.chunk(tm.NUM_MICROBATCHES)):
            (F.mse_loss(model(xm), ym) / tm.NUM_MICROBATCHES).backward()
        main = [p for name, p in params.items() if name not in GROUPED]
        main_norms.append(float(torch.nn.utils.clip_grad_norm_(main, CLIP)))
        group_norms.append(float(torch.nn.utils.clip_grad_norm_([params[name] for name in GROUPED], CLIP)))
        opt.step()
    return {name: p.detach().clone() for name, p in params.items()}, main_norms, group_norms


def _train(layout: str) -> dict:
    tp = 2 if layout == "tp2" else 1
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    distributed = layout in ("dp4_distopt", "dp4_flat", "chain")
    model = tm.TiedNetTP(tm.make_reference())
    for name in GROUPED:
        model.get_parameter(name).grad_norm_group = "mtp"
    if layout == "chain":
        for param in model.l1.parameters():
            param.allreduce = False  # an expert param: a second optimizer in a chain
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed), model)
    previous = DistributedOptimizer.flat_shard_step
    DistributedOptimizer.flat_shard_step = layout == "dp4_flat"  # the flat fused step (CUDA's default) forced on
    try:
        opt = get_megatron_optimizer(OptimizerConfig(lr=tm.LR, weight_decay=tm.WD, clip_grad=CLIP,
                                                     use_distributed_optimizer=distributed), [ddp])
    finally:
        DistributedOptimizer.flat_shard_step = previous
    if layout == "dp4_flat":  # the flat step runs; the norm reads the main params' gradients, set by set
        assert opt._flat is not None and not opt._norm_over_flat_shards
    assert isinstance(opt, ChainedOptimizer) == (layout == "chain")
    main_norms, group_norms = [], []
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    for x, y in tm.make_data(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for xm, ym in tm.microbatches(x, y, dp_rank, dp_size):
            (F.mse_loss(ddp(xm.unsqueeze(0)), ym.unsqueeze(0)) / tm.NUM_MICROBATCHES).backward()
        finalize_model_grads([ddp])
        success, norm, _ = opt.step()
        assert success
        main_norms.append(norm)
        group_norms.append(opt.grad_norms_by_group["mtp"])
    assert not opt._fold_clipping_into_adam()  # one clip factor for all cannot serve two sets
    return {"weights": {k: v.detach().clone() for k, v in model.reference_view().items()},
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(), "main_norms": main_norms,
            "group_norms": group_norms}


@pytest.mark.parametrize("layout", ["dp4", "dp4_distopt", "dp4_flat", "tp2", "chain"])
def test_separate_group_clipping_matches_one_process(layout: str):
    weights, main_norms, group_norms = _reference()
    assert min(main_norms) > CLIP and min(group_norms) > CLIP  # both sets clipped at every step
    for result in run_on_ranks(4, _train, layout):
        assert result["main_norms"] == pytest.approx(main_norms, rel=1e-5)
        assert result["group_norms"] == pytest.approx(group_norms, rel=1e-5)
        for name, value in result["weights"].items():
            want = weights[name]
            if value.shape != want.shape:
                want = want.chunk(2, dim=1 if name == "l2.weight" else 0)[result["tp_rank"]]
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name}")


@pytest.mark.parametrize("detach", [False, True])
def test_mtp_block_tags_its_parameters_only_with_detached_heads(detach: bool):
    from megatron_core.models.gpt import GPTModel
    from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron_core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, mtp_num_layers=1,
                               mtp_detach_heads=detach, use_cpu_initialization=True)
    block = get_gpt_decoder_block_spec(config, False)
    model = GPTModel(config, block, 32, 16, mtp_block_spec=get_gpt_mtp_block_spec(config, block, False))
    tagged = {name for name, p in model.named_parameters() if getattr(p, "grad_norm_group", None) == "mtp"}
    mtp = {name for name, _ in model.named_parameters() if name.startswith("mtp.")}
    assert mtp and tagged == (mtp if detach else set())
