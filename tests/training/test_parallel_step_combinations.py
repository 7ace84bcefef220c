"""Combined parallel layouts and training options through the real step path equal one process.

The companion of ``test_parallel_step_equivalence.py`` (same runner, same comparison: every tensor of the
sharded state dict after 3 steps, each step's loss and grad norm, 1e-5 in fp32, replicas identical), for what
its 2-rank layouts with default options leave out:

- on 2 ranks, the paths: the interleaved schedule (PP=2 x VPP=2, by ``virtual_pipeline_model_parallel_size`` and
  by a ``pipeline_model_parallel_layout`` string; with ``overlap_p2p_comm`` and the schedule launching each chunk's
  gradient reduction, Megatron-LM's ``align_grad_reduce``), ``account_for_embedding/loss_in_pipeline_split``,
  explicit layouts with MTP, DDP with ``overlap_grad_reduce`` / ``overlap_param_gather`` and small buckets (the
  distributed optimizer and the plain all-reduce) or ``average_in_collective``, ``gradient_accumulation_fusion``
  (also under TP + SP and with ``defer_embedding_wgrad_compute``), the precision-aware optimizer; and the maths,
  which the one-process reference shares (``TrainOptions``): Adam and SGD, a ``clip_grad`` small enough that every
  step clips, weight decay with ``apply_wd_to_qk_layernorm`` or ``config_overrides`` that exempt the embeddings,
  4 micro-batches per rank with and without ``calculate_per_token_loss``;
- on 4 ranks, the combined layouts TP2(SP) x PP2 (also with VPP=2), TP2 x DP2 (distributed optimizer, SGD),
  TP2(SP) x CP2, CP2 x PP2, PP2 x DP2 (overlapped all-reduce), PP2 x VPP2 x DP2 (distributed optimizer with
  aligned, overlapped reduction and gather), DP4 with two distributed-optimizer instances, and for MoE DP2 x EP2
  (distributed optimizer; all-to-all dispatcher), PP2 x EP2 and TP2(SP) x EP2 with the experts' TP size 2 and 1.

Each case trains its features in one rank-pool call (the 2-rank cases' core features unmarked, the rest and
every 4-rank case marked slow); the one-process references are cached per loss normalisation, ``TrainOptions``
and feature. The hybrid model keeps its 4-layer pattern, so cases that change the decoder depth leave it out.
Layouts with CP train with ``calculate_per_token_loss``: without it each CP rank divides its loss sum by its own
token count (Megatron-Core's rule), a mean of the CP ranks' means that equals one process's token mean only when
every CP rank holds as many unmasked tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.dist_harness import run_on_ranks
from tests.training.parallel_step_compare import differences_from_one_process, mean_losses
from tests.training.parallel_step_features import FEATURES, Layout, TrainOptions, one_process
from tests.training.parallel_step_runner import assemble, train_features

_SUBSET = ("gpt", "qk_layernorm", "tied", "mla", "moe_shared_bias", "mtp", "hybrid")
_DENSE = ("gpt", "qk_layernorm", "tied", "mla", "mtp", "hybrid")
_NO_HYBRID = tuple(name for name in _SUBSET if name != "hybrid")
_NO_MTP_HYBRID = tuple(name for name in _NO_HYBRID if name != "mtp")
# Plus features whose weights also take paths other than a linear layer's own GEMM (absorbed MLA under DSA, the
# gated delta net's shared norm, grouped experts): where gradient_accumulation_fusion is most likely to lose them.
_WIDE = _SUBSET + ("dsa", "gdn", "moe_grouped")
_EXPERTS = ("moe_shared_bias", "moe_grouped", "moe_sequential", "moe_latent", "moe_quantile")

# A clip far below the grad norms (about 1 to 3 here), so every step clips; SGD needs a larger learning rate than
# Adam for a missing reduction to move the weights well past the tolerance.
_CLIP = TrainOptions(clip_grad=0.05)
_SGD = TrainOptions(optimizer="sgd", lr=0.05, clip_grad=0.05, wd_rule="qk_layernorm")


@dataclass(frozen=True)
class Case:
    """A layout on ``world`` ranks, the features it trains and those that run in the edit-test loop (``core``;
    the rest are marked slow)."""

    layout: Layout
    world: int
    features: tuple[str, ...]
    core: tuple[str, ...] = ()


CASES: tuple[Case, ...] = (
    # 2 ranks: the interleaved schedule, pipeline splits and layout strings.
    Case(Layout("pp2_vpp2", pp=2, vp=2, train=TrainOptions(num_layers=4)), 2, _WIDE,
         core=("gpt", "tied", "moe_shared_bias", "mtp", "hybrid")),
    Case(Layout("pp2_vpp2_aligned_overlap_p2p_per_token", pp=2, vp=2, overlap_grad_reduce=True, bucket_size=600,
                align_sync=True, per_token=True, config_extra=(("overlap_p2p_comm", True), ("batch_p2p_comm", False)),
                train=TrainOptions(num_layers=4)), 2, _WIDE, core=("gpt", "mla")),
    Case(Layout("pp2_vpp2_account_overlap_per_token", pp=2, vp=2, account_embedding=True, account_loss=True,
                per_token=True, overlap_grad_reduce=True, bucket_size=600,
                train=TrainOptions(num_layers=6, global_microbatches=4, clip_grad=0.05)), 2, _NO_HYBRID,
         core=("tied", "mla")),
    Case(Layout("pp2_account_embedding", pp=2, account_embedding=True,
                train=TrainOptions(num_layers=3, wd_rule="overrides")), 2,
         _NO_HYBRID, core=("tied",)),
    Case(Layout("pp2_layout_string_sgd", pp=2, pipeline_layout="Ettt|tL",
                train=TrainOptions(num_layers=4, optimizer="sgd", lr=0.05, clip_grad=0.05)), 2,
         _NO_MTP_HYBRID, core=("gpt",)),
    Case(Layout("pp2_layout_string_mtp", pp=2, pipeline_layout="Et|ttmL", per_token=True,
                train=TrainOptions(num_layers=3)), 2, ("mtp",), core=("mtp",)),
    Case(Layout("pp2_vpp2_layout_string", pp=2, vp=2, pipeline_layout="E|tt|t|tL",
                train=TrainOptions(num_layers=4)), 2, _NO_MTP_HYBRID, core=("tied",)),
    Case(Layout("pp2_defer_wgrad_fusion", pp=2, grad_accum_fusion=True, defer_embedding_wgrad=True, per_token=True,
                train=_CLIP), 2, _SUBSET, core=("tied",)),
    # 2 ranks: overlapped DDP, fused weight gradients, optimizers, clipping and weight-decay rules.
    Case(Layout("dp2_distopt_overlap", distributed_optimizer=True, overlap_grad_reduce=True,
                overlap_param_gather=True, bucket_size=600, train=TrainOptions(global_microbatches=8)), 2, _SUBSET,
         core=("gpt", "moe_shared_bias", "hybrid")),
    Case(Layout("dp2_distopt_overlap_fusion_per_token", distributed_optimizer=True, overlap_grad_reduce=True,
                overlap_param_gather=True, bucket_size=600, grad_accum_fusion=True, per_token=True,
                train=TrainOptions(global_microbatches=8, clip_grad=0.05)), 2, _WIDE, core=("tied", "mla")),
    Case(Layout("dp2_distopt_average_in_collective", distributed_optimizer=True,
                ddp_extra=(("average_in_collective", True),)), 2, _SUBSET, core=("moe_shared_bias",)),
    Case(Layout("dp2_precision_aware", distributed_optimizer=True, precision_aware=True,
                train=TrainOptions(clip_grad=0.05, wd_rule="overrides")), 2, _SUBSET, core=("gpt",)),
    Case(Layout("dp2_sgd_overlap", overlap_grad_reduce=True, bucket_size=600, train=_SGD), 2, _SUBSET,
         core=("qk_layernorm", "moe_shared_bias")),
    Case(Layout("dp2_distopt_sgd", distributed_optimizer=True, per_token=True, train=_SGD), 2, _SUBSET,
         core=("mla",)),
    Case(Layout("tp2_sp_fusion", tp=2, sp=True, grad_accum_fusion=True, per_token=True,
                train=TrainOptions(clip_grad=0.05, wd_rule="overrides")), 2, _WIDE,
         core=("tied", "moe_shared_bias", "dsa", "gdn")),
    # 4 ranks: combined layouts.
    Case(Layout("tp2_sp_pp2", tp=2, sp=True, pp=2, train=TrainOptions(wd_rule="overrides")), 4, _SUBSET),
    Case(Layout("tp2_dp2_distopt_sgd", tp=2, distributed_optimizer=True, per_token=True, train=_SGD), 4, _DENSE),
    Case(Layout("tp2_sp_cp2", tp=2, sp=True, cp=2, per_token=True), 4, _SUBSET),
    Case(Layout("dp2_ep2_distopt", ep=2, distributed_optimizer=True), 4, _EXPERTS),
    Case(Layout("dp2_ep2_alltoall", ep=2, per_token=True, config_extra=(("moe_token_dispatcher_type", "alltoall"),)),
         4, _EXPERTS),
    Case(Layout("pp2_dp2_overlap", pp=2, overlap_grad_reduce=True, bucket_size=600,
                train=TrainOptions(global_microbatches=8, clip_grad=0.05)), 4, _SUBSET),
    Case(Layout("pp2_vpp2_dp2_distopt_aligned", pp=2, vp=2, distributed_optimizer=True, overlap_grad_reduce=True,
                overlap_param_gather=True, align_sync=True, bucket_size=600,
                train=TrainOptions(num_layers=4, global_microbatches=8)), 4, _SUBSET),
    Case(Layout("tp2_sp_pp2_vpp2", tp=2, sp=True, pp=2, vp=2, per_token=True, train=TrainOptions(num_layers=4)), 4,
         _SUBSET),
    Case(Layout("cp2_pp2", cp=2, pp=2, per_token=True), 4, _SUBSET),
    Case(Layout("pp2_ep2_distopt", pp=2, ep=2, distributed_optimizer=True), 4, _EXPERTS),
    Case(Layout("dp4_distopt_two_instances", distributed_optimizer=True, optimizer_instances=2,
                train=TrainOptions(global_microbatches=8)), 4, _SUBSET),
    Case(Layout("tp2_sp_ep2", tp=2, sp=True, ep=2, per_token=True), 4, _EXPERTS),
    Case(Layout("tp2_sp_ep2_etp1", tp=2, sp=True, ep=2, etp=1), 4, _EXPERTS),
    Case(Layout("tp2_sp_ep2_etp1_alltoall", tp=2, sp=True, ep=2, etp=1, distributed_optimizer=True,
                config_extra=(("moe_token_dispatcher_type", "alltoall"),)), 4, _EXPERTS),
)


# The unmarked cases take about 26 s on 2 cores, the whole file about 125 s.
def _params() -> list[Any]:
    params = []
    for case in CASES:
        core = tuple(name for name in case.features if name in case.core)
        more = tuple(name for name in case.features if name not in case.core)
        if core:
            params.append(pytest.param(case, core, id=f"{case.layout.name}-core"))
        if more:
            params.append(pytest.param(case, more, id=f"{case.layout.name}-more", marks=pytest.mark.slow))
    return params


_REFERENCES: dict[tuple[Layout, str], dict[str, Any]] = {}


def _references(layout: Layout, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The one-process runs of ``names`` that ``layout`` must reproduce (cached; one rank-pool call)."""
    reference = one_process(layout)
    missing = [name for name in names if (reference, name) not in _REFERENCES]
    if missing:
        for name, result in run_on_ranks(1, train_features, missing, reference)[0].items():
            initial, init_problems = assemble([result["initial"]])
            final, final_problems = assemble([result["final"]])
            assert not init_problems + final_problems, init_problems + final_problems
            _REFERENCES[(reference, name)] = dict(initial=initial, final=final, losses=mean_losses([result]),
                                                  grad_norms=result["grad_norms"])
    return {name: _REFERENCES[(reference, name)] for name in names}


@pytest.mark.distributed_debug_off  # PP and the MTP roll under CP send/recv on groups that later run collectives
@pytest.mark.parametrize("case,names", _params())
def test_combined_training_matches_one_process(case: Case, names: tuple[str, ...]) -> None:
    assert set(names) <= set(FEATURES), set(names) - set(FEATURES)
    references = _references(case.layout, names)
    clip = case.layout.train.clip_grad
    for name in names:  # the small clips must really clip (the grad norm is taken before clipping)
        if clip < 0.5:
            assert min(references[name]["grad_norms"]) > clip, (name, references[name]["grad_norms"], clip)
    initial = {name: ref["initial"] for name, ref in references.items()}
    per_rank = run_on_ranks(case.world, train_features, list(names), case.layout, initial)
    differences = [d for name in names for d in differences_from_one_process(name, references[name], [r[name] for r in per_rank])]
    assert not differences, (f"{case.layout.name}: parallel training differs from one process:\n"
                             + "\n".join(differences))


def test_cases_cover_the_combined_layouts_and_options() -> None:
    """Every 2-rank case has unmarked features; the 4-rank layouts and the options the brief of this audit names
    are all present."""
    assert all(case.core for case in CASES if case.world == 2)
    layouts = [case.layout for case in CASES]
    assert any(lay.vp and not lay.pipeline_layout for lay in layouts)
    assert any(lay.vp and lay.pipeline_layout for lay in layouts)
    assert any(lay.overlap_param_gather and lay.distributed_optimizer for lay in layouts)
    four_per_rank = {lay.per_token for case, lay in zip(CASES, layouts)
                     if lay.train.global_microbatches // lay.dp(case.world) == 4}
    assert four_per_rank == {True, False}
    assert {lay.train.optimizer for lay in layouts} == {"adam", "sgd"}
    assert {lay.train.wd_rule for lay in layouts} == {"standard", "qk_layernorm", "overrides"}
    assert any(lay.grad_accum_fusion and lay.tp > 1 for lay in layouts)
    assert any(lay.precision_aware for lay in layouts) and any(lay.defer_embedding_wgrad for lay in layouts)
    assert any(lay.account_embedding for lay in layouts) and any(lay.account_loss for lay in layouts)
    four = {(lay.tp, lay.sp, lay.pp, lay.cp, lay.ep, lay.etp) for case, lay in zip(CASES, layouts) if case.world == 4}
    assert {(2, True, 2, 1, 1, None), (2, False, 1, 1, 1, None), (2, True, 1, 2, 1, None), (1, False, 1, 1, 2, None),
            (1, False, 2, 1, 1, None), (2, True, 1, 1, 2, None), (2, True, 1, 1, 2, 1)} <= four
