"""The partial distributed optimizer (``num_distributed_optimizer_instances``) on 4 CPU ranks.

The groups follow Megatron-Core 0.19's layout (contiguous instances; the inter group joins the ranks holding
the same shard), and training with 2 instances equals training with 1 and one process on the same weights and
data: every parameter after 3 optimizer steps, dense and MoE (experts on the expert buffers), with and without
overlapped gradient reduction, and with expert parallelism (EP=2: the expert buffers' instances are single
ranks, so each expert shard is reduced across instances only).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron_core.parallel_state.optimizer_instances import hierarchical_group_ranks
from megatron_core.process_groups_config import ProcessGroupCollection
from megatron_core.training import load_checkpoint, save_checkpoint
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import MAX_SEQ, VOCAB, llama_like
from tests.optimizer.dp_step import dp_train_step

WORLD, STEPS = 4, 3
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.0)


def test_hierarchical_group_ranks_follow_megatrons_example():
    levels = hierarchical_group_ranks(list(range(16)), [2, 2, 4])
    assert levels[0][:2] == [[0, 1], [2, 3]] and len(levels[0]) == 8
    assert levels[1][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert levels[2] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    with pytest.raises(ValueError, match="multiply to 8, but there are 16"):
        hierarchical_group_ranks(list(range(16)), [2, 4])


def _groups(tp: int, ep: int, instances: int) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             num_distributed_optimizer_instances=instances)
    try:
        ranks = dist.get_process_group_ranks
        inter = parallel_state.get_inter_distributed_optimizer_instance_group(check_initialized=False)
        pgs = ProcessGroupCollection.use_mpu_process_groups(["intra_dp_cp", "intra_expt_dp", "inter_dist_opt"])
        return {
            "intra_dp_cp": ranks(parallel_state.get_data_parallel_group(True, partial_data_parallel=True)),
            "intra_expt_dp": ranks(parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True)),
            "inter": None if inter is None else ranks(inter),
            "instance": ranks(parallel_state.get_intra_distributed_optimizer_instance_group()),
            "partial_rank": parallel_state.get_data_parallel_rank(True, partial_data_parallel=True),
            "collection_matches": pgs.inter_dist_opt is inter and pgs.intra_dp_cp is not None,
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp,ep,instances,expected", [
    (1, 1, 2, {0: ([0, 1], [0, 1], [0, 2], [0, 1]), 3: ([2, 3], [2, 3], [1, 3], [2, 3])}),
    (2, 1, 2, {0: ([0], [0], [0, 2], [0, 1]), 3: ([3], [3], [1, 3], [2, 3])}),
    (1, 2, 2, {0: ([0, 1], [0], [0, 2], [0, 1]), 3: ([2, 3], [3], [1, 3], [2, 3])}),
    (1, 1, 1, {0: ([0, 1, 2, 3], [0, 1, 2, 3], None, [0, 1, 2, 3]), 3: ([0, 1, 2, 3], [0, 1, 2, 3], None,
                                                                        [0, 1, 2, 3])}),
])
def test_instance_groups_match_megatrons_layout(tp, ep, instances, expected):
    results = run_on_ranks(WORLD, _groups, tp, ep, instances)
    for rank, (intra, intra_expert, inter, instance) in expected.items():
        got = results[rank]
        assert (got["intra_dp_cp"], got["intra_expt_dp"], got["inter"], got["instance"]) == \
               (intra, intra_expert, inter, instance), (rank, got)
        assert got["collection_matches"]
    assert results[3]["partial_rank"] == results[3]["intra_dp_cp"].index(3)


def _partial_dp_needs_context_parallel():
    parallel_state.initialize_model_parallel()
    try:
        with pytest.raises(ValueError, match="with_context_parallel=True"):
            parallel_state.get_data_parallel_group(partial_data_parallel=True)
        with pytest.raises(RuntimeError, match="num_distributed_optimizer_instances > 1"):
            parallel_state.get_inter_distributed_optimizer_instance_group()
        model = _model({}, {n: p.detach().clone() for n, p in _model({}, None).named_parameters()})
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                   num_distributed_optimizer_instances=2)
        with pytest.raises(ValueError, match=r"the intra_dp_cp group has 4 ranks.*expected 2|inter_dist_opt"):
            DistributedDataParallel(model.config, ddp_config, model)
    finally:
        parallel_state.destroy_model_parallel()


def test_mismatched_groups_and_partial_without_cp_raise():
    run_on_ranks(WORLD, _partial_dp_needs_context_parallel)


def _global_name(name: str, ep: int) -> str:
    """The one-process name of a parameter of expert-parallel rank ``parallel_state``'s (local expert i is global
    expert ``ep_rank * local + i``)."""
    if ep == 1 or ".local_experts." not in name:
        return name
    head, tail = name.split(".local_experts.")
    index, rest = tail.split(".", 1)
    local = MOE["num_moe_experts"] // ep
    return f"{head}.local_experts.{parallel_state.get_expert_model_parallel_rank() * local + int(index)}.{rest}"


def _model(moe: dict, weights: dict[str, torch.Tensor] | None, ep: int = 1) -> GPTModel:
    spec = llama_like(**moe)
    config = TransformerConfig(**spec["config"], expert_model_parallel_size=ep)
    layer_spec = get_gpt_layer_local_spec(num_experts=moe.get("num_moe_experts"))
    torch.manual_seed(1234)
    model = GPTModel(config, layer_spec, VOCAB, MAX_SEQ, **spec["model"])
    if weights is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(weights[_global_name(name, ep)])
    return model


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (4, 9), generator=gen) for _ in range(STEPS)]


def _optimizer_config(moe: dict, **kw) -> OptimizerConfig:
    """Adam for the dense model; SGD with momentum for MoE, whose rarely routed experts get gradients so small
    that Adam's normalisation turns fp32 rounding of the reduction order into 1e-5 differences."""
    kind = dict(optimizer="sgd", sgd_momentum=0.9, lr=0.5) if moe else dict(optimizer="adam", lr=1e-2)
    return OptimizerConfig(weight_decay=0.1, clip_grad=1.0, **kind, **kw)


def _train_distributed(moe: dict, weights: dict, instances: int, overlap: bool, ep: int = 1,
                       ) -> dict[str, torch.Tensor]:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep,
                                             num_distributed_optimizer_instances=instances)
    try:
        model = _model(moe, weights, ep)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, num_distributed_optimizer_instances=instances,
            overlap_grad_reduce=overlap, bucket_size=2000 if overlap else None), model)
        opt = get_megatron_optimizer(_optimizer_config(moe, use_distributed_optimizer=True), [ddp])
        dist_opts = [o for o in getattr(opt, "chained_optimizers", [opt]) if isinstance(o, DistributedOptimizer)]
        # dense: one instance's DP ranks; experts: one instance's expert DP ranks (WORLD / ep of them in all)
        assert dist_opts and all(o.data_parallel_world_size * instances in (WORLD, WORLD // ep) for o in dist_opts)
        assert {o.distributed_optimizer_instance_id for o in dist_opts} == {dist.get_rank() // (WORLD // instances)}
        for tokens in _batches():
            dp_train_step(ddp, opt, tokens)
        return {_global_name(n, ep): p.detach().clone() for n, p in model.named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()


def _build_distributed(weights: dict, instances: int):
    model = _model(MOE, weights)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=instances), model)
    return model, ddp, get_megatron_optimizer(_optimizer_config(MOE, use_distributed_optimizer=True), [ddp])


def _save_then_resume(weights: dict, path: str, save_instances: int, load_instances: int) -> dict:
    """Train with ``save_instances``, checkpoint before the last step and take it; resume the checkpoint with
    ``load_instances`` into a zeroed model and take the last step again."""
    batches = _batches()
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=save_instances)
    try:
        model, ddp, opt = _build_distributed(weights, save_instances)
        for tokens in batches[:-1]:
            dp_train_step(ddp, opt, tokens)
        save_checkpoint(path, STEPS - 1, [ddp], opt, None)
        dp_train_step(ddp, opt, batches[-1])
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=load_instances)
    try:
        model, ddp, opt = _build_distributed({n: torch.zeros_like(w) for n, w in weights.items()}, load_instances)
        load_checkpoint(path, [ddp], opt, None, load_rng=False)
        dp_train_step(ddp, opt, batches[-1])
        return {"trained": trained, "resumed": {n: p.detach().clone() for n, p in model.named_parameters()}}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("save_instances,load_instances", [(2, 2), (2, 1), (1, 2)])
def test_checkpoint_resumes_across_instance_counts(tmp_path, save_instances, load_instances):
    weights = {n: p.detach().clone() for n, p in _model(MOE, None).named_parameters()}
    results = run_on_ranks(WORLD, _save_then_resume, weights, str(tmp_path / "ckpt"), save_instances,
                           load_instances)
    for result in results:
        for name, value in result["trained"].items():
            torch.testing.assert_close(result["resumed"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _train_single(moe: dict, weights: dict) -> dict[str, torch.Tensor]:
    model = _model(moe, weights)
    opt = get_megatron_optimizer(_optimizer_config(moe), [model])
    for tokens in _batches():
        opt.zero_grad()
        seq = tokens.shape[1] - 1
        positions = torch.arange(seq).unsqueeze(0).expand(tokens.shape[0], seq)
        model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
        assert opt.step()[0]
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("moe", [{}, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_two_instances_train_like_one_and_like_one_process(moe, overlap):
    weights = {n: p.detach().clone() for n, p in _model(moe, None).named_parameters()}
    reference = _train_single(moe, weights)
    one = run_on_ranks(WORLD, _train_distributed, moe, weights, 1, overlap)
    two = run_on_ranks(WORLD, _train_distributed, moe, weights, 2, overlap)
    for name, expected in reference.items():
        assert not torch.equal(expected, weights[name]), name  # every parameter moved
        for rank in range(WORLD):  # fp32 rounding of the differently ordered sums: about 1e-7
            torch.testing.assert_close(one[rank][name], expected, rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(two[rank][name], expected, rtol=1e-5, atol=1e-6, msg=name)
            assert torch.equal(two[rank][name], two[0][name]), name  # the instances stay identical


def test_two_instances_with_expert_parallelism_train_like_one_process():
    weights = {n: p.detach().clone() for n, p in _model(MOE, None).named_parameters()}
    reference = _train_single(MOE, weights)
    two = run_on_ranks(WORLD, _train_distributed, MOE, weights, 2, True, 2)
    for rank in range(WORLD):
        assert len(two[rank]) < len(reference)  # each EP rank holds half of the experts
        for name, value in two[rank].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)
