"""``LayerWiseDistributedOptimizer``: whole-parameter sharding over DP ranks, against one process with plain Adam.

A small GPT trained under DDP on 2 and 4 gloo ranks with the layer-wise optimizer (inner Adam, clipping active)
must match one process with plain Adam (fp32, 1e-6). The owner of each parameter is checked against Megatron-Core
0.19's ping-pong rule worked out by hand; checkpoints are saved on 4 ranks and resumed on 4 and on 2.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import (
    FP32Optimizer,
    LayerWiseDistributedOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    is_managed_by_layer_wise_optimizer,
)
from megatron_core.optimizer.layer_wise_optimizer import tag_params_for_buffer_routing
from megatron_core.training import load_checkpoint, save_checkpoint
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.optimizer.dp_step import dp_train_step

VOCAB, SEQ, BATCH, LR, CLIP = 64, 8, 8, 1e-3, 0.05
EPS = 1e-6  # Adam's eps: gradients far below it do not amplify reduction-order rounding


def _gpt(seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=False)


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(n)]


def _config(**kw) -> OptimizerConfig:
    return OptimizerConfig(lr=LR, weight_decay=0.1, clip_grad=CLIP, adam_eps=EPS, **kw)


def _reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, plain Adam (FP32Optimizer), the full batch each step."""
    model = _gpt()
    opt = get_megatron_optimizer(_config(), [model])
    assert isinstance(opt, FP32Optimizer)
    norms = []
    for tokens in _batches(steps):
        opt.zero_grad()
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _layer_wise_model(init: bool = True):
    if init:
        parallel_state.initialize_model_parallel()
    model = _gpt()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(_config(use_layer_wise_distributed_optimizer=True), [ddp])
    assert isinstance(opt, LayerWiseDistributedOptimizer)
    return model, ddp, opt


def _train_layer_wise(steps: int):
    model, ddp, opt = _layer_wise_model()
    plain_model = _gpt()  # the same DDP run with plain Adam on every rank
    plain_ddp = DistributedDataParallel(plain_model.config, DistributedDataParallelConfig(), plain_model)
    plain_opt = get_megatron_optimizer(_config(), [plain_ddp])
    norms = [None] * steps
    for i, tokens in enumerate(_batches(steps)):
        dp_train_step(ddp, opt, tokens)
        norms[i] = opt.get_grad_norm()  # the clipped gradients' norm: the global clip target
        dp_train_step(plain_ddp, plain_opt, tokens)
    owned = sorted(n for n, p in model.named_parameters() if any(p is q for q in opt.get_parameters()))
    has_state = all(len(opt.chained_optimizers[0].optimizer.state[p]) > 0 for p in opt.get_parameters())
    diff_to_plain_ddp = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain_model.parameters()))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, owned, norms, has_state, diff_to_plain_ddp


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process_adam_with_clipping(world):
    ref, ref_norms = _reference(3)
    assert all(n > CLIP for n in ref_norms)  # clipping is active on every step
    results = run_on_ranks(world, _train_layer_wise, 3)
    owned = [set(r[1]) for r in results]
    assert set().union(*owned) == set(ref) and sum(map(len, owned)) == len(ref)  # a partition of the params
    assert all(owned)
    for params, _, norms, has_state, diff_to_plain_ddp in results:
        # plain Adam under the same DDP reduction: equal up to the order of the global norm's sum (clip factor)
        assert has_state and diff_to_plain_ddp <= 1e-6
        for name, expected in ref.items():
            torch.testing.assert_close(params[name], expected, rtol=0, atol=1e-6, msg=name)
        assert norms == pytest.approx([CLIP] * 3, rel=1e-4)  # after clipping, the global norm is the target


# numels in definition order; sorted ascending they get the ping-pong ranks 0 1 2 3 3 2 1 0 0 1 (4 ranks)
_DENSE = [7, 3, 9, 1, 10, 5, 2, 8, 4, 6]
_EXPERT = [5, 1, 3]
_EXPECTED_OWNERS = {
    4: ({1: 0, 8: 0, 9: 0, 2: 1, 7: 1, 10: 1, 3: 2, 6: 2, 4: 3, 5: 3}, {1: 0, 3: 1, 5: 2}),
    # 2 ranks: loop 0 1 1 0 over numels 1..10 -> 0 1 1 0 0 1 1 0 0 1
    2: ({1: 0, 2: 1, 3: 1, 4: 0, 5: 0, 6: 1, 7: 1, 8: 0, 9: 0, 10: 1}, {1: 0, 3: 1, 5: 1}),
}


def _ownership():
    parallel_state.initialize_model_parallel()
    dense = [torch.nn.Parameter(torch.zeros(n)) for n in _DENSE]
    expert = [torch.nn.Parameter(torch.zeros(n)) for n in _EXPERT]
    adam = torch.optim.Adam([{"params": dense[:6]}, {"params": dense[6:]}], lr=LR)
    sgd = torch.optim.SGD([{"params": expert, "is_expert_parallel": True}], lr=LR)
    opt = LayerWiseDistributedOptimizer([adam, sgd], OptimizerConfig(lr=LR))
    size = lambda params: [[p.numel() for p in group] for group in params]  # noqa: E731
    local = [[p.numel() for p in g["params"]] for g in adam.param_groups + sgd.param_groups]
    return size(opt.dp_cp_params_list), size(opt.expt_dp_params_list), local


@pytest.mark.parametrize("world", [2, 4])
def test_ownership_follows_megatrons_ping_pong_rule(world):
    dense_owner, expert_owner = _EXPECTED_OWNERS[world]
    for rank, (dense_lists, expert_lists, local) in enumerate(run_on_ranks(world, _ownership)):
        for owner, numels in enumerate(dense_lists):
            assert sorted(numels) == sorted(n for n, r in dense_owner.items() if r == owner)
        for owner, numels in enumerate(expert_lists):
            assert sorted(numels) == sorted(n for n, r in expert_owner.items() if r == owner)
        # this rank's groups keep only its own params, in the sorted (ascending numel) order
        assert local[0] == sorted(n for n in _DENSE[:6] if dense_owner[n] == rank)
        assert local[1] == sorted(n for n in _DENSE[6:] if dense_owner[n] == rank)
        assert local[2] == sorted(n for n in _EXPERT if expert_owner[n] == rank)


def _save_then_continue(path: str):
    model, ddp, opt = _layer_wise_model()
    batches = _batches(3)
    for tokens in batches[:2]:
        dp_train_step(ddp, opt, tokens)
    save_checkpoint(path, 2, [ddp], opt, None)
    dp_train_step(ddp, opt, batches[2])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _load_then_continue(path: str):
    model, ddp, opt = _layer_wise_model()
    load_checkpoint(path, [ddp], opt, None, load_rng=False)
    dp_train_step(ddp, opt, _batches(3)[2])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_checkpoint_round_trip_and_different_dp_size(tmp_path):
    expected = run_on_ranks(4, _save_then_continue, str(tmp_path))[0]
    for world in (4, 2):
        for params in run_on_ranks(world, _load_then_continue, str(tmp_path)):
            for name, value in expected.items():
                torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6, msg=f"dp={world} {name}")


def _local_state_dict_round_trip():
    model, ddp, opt = _layer_wise_model()
    for tokens in _batches(2):
        dp_train_step(ddp, opt, tokens)
    saved = copy.deepcopy(opt.state_dict())  # torch's load_state_dict keeps the same tensors
    fresh_model, fresh_ddp, fresh = _layer_wise_model(init=False)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(saved)
    for tokens in _batches(3)[2:]:
        dp_train_step(ddp, opt, tokens)
        dp_train_step(fresh_ddp, fresh, tokens)
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))


def test_local_state_dict_round_trip():
    assert all(run_on_ranks(2, _local_state_dict_round_trip))


def _tags_and_buffers():
    parallel_state.initialize_model_parallel()
    model = _gpt()
    tag_params_for_buffer_routing([model])
    tags = {n: p.is_managed_by_layer_wise_optimizer for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    names = {id(p): n for n, p in model.named_parameters()}
    buffers = [sorted(names[id(p)] for p in buffer.params) for buffer in ddp.buffers]
    return tags, buffers


def test_tag_params_for_buffer_routing():
    tags, buffers = run_on_ranks(2, _tags_and_buffers)[0]
    matrices = [f"decoder.layers.{i}.{m}.weight" for i in range(2)
                for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    # 2-D and not an embedding/output weight; the learned position table is 2-D without that flag, so it is in
    expected_true = set(matrices) | {"embedding.position_embeddings.weight"}
    assert {n for n, t in tags.items() if t} == expected_true
    assert tags["embedding.word_embeddings.weight"] is False and tags["output_layer.weight"] is False
    assert all(not tags[n] for n in tags if n.endswith(".bias") or "layernorm" in n)
    # DDP keeps the tagged params in a buffer of their own
    assert sorted(map(frozenset, buffers), key=len) == sorted(
        [frozenset(expected_true), frozenset(set(tags) - expected_true)], key=len)


def test_is_managed_rule():
    weight = torch.nn.Parameter(torch.zeros(3, 4))
    assert is_managed_by_layer_wise_optimizer(weight)
    assert not is_managed_by_layer_wise_optimizer(torch.nn.Parameter(torch.zeros(4)))
    assert not is_managed_by_layer_wise_optimizer(torch.nn.Parameter(torch.zeros(2, 3, 4)))
    weight.is_embedding_or_output_parameter = True
    assert not is_managed_by_layer_wise_optimizer(weight)


def test_single_process_equals_plain_adam():
    ref, _ = _reference(2)
    model = _gpt()
    opt = get_megatron_optimizer(_config(use_layer_wise_distributed_optimizer=True), [model])
    assert isinstance(opt, LayerWiseDistributedOptimizer) and opt.dp_cp_params_list is None
    for tokens in _batches(2):
        opt.zero_grad()
        model(tokens[:, :-1], torch.arange(SEQ).expand(BATCH, SEQ), None, labels=tokens[:, 1:]).mean().backward()
        assert opt.step()[0]
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), ref[name], rtol=0, atol=1e-6, msg=name)


def test_bad_input_raises_naming_values():
    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(ValueError, match=r"config.fp16=True"):
        LayerWiseDistributedOptimizer([torch.optim.Adam(params)], OptimizerConfig(lr=LR, fp16=True))
    with pytest.raises(ValueError, match=r"overlap_param_gather=True"):
        LayerWiseDistributedOptimizer([torch.optim.Adam(params)],
                                      OptimizerConfig(lr=LR, overlap_param_gather=True))
    with pytest.raises(ValueError, match=r"init_state_fn_list has 2 entries for 1 optimizers"):
        LayerWiseDistributedOptimizer([torch.optim.Adam(params)], OptimizerConfig(lr=LR),
                                      init_state_fn_list=[None, None])
    with pytest.raises(ValueError, match="empty list"):
        LayerWiseDistributedOptimizer([], OptimizerConfig(lr=LR))
    with pytest.raises(TypeError, match="FP32Optimizer"):
        inner = torch.optim.Adam(params)
        LayerWiseDistributedOptimizer([FP32Optimizer(inner, OptimizerConfig(lr=LR))], OptimizerConfig(lr=LR))
    model = _gpt()
    with pytest.raises(ValueError, match=r"use_distributed_optimizer=True"):
        get_megatron_optimizer(_config(use_layer_wise_distributed_optimizer=True, use_distributed_optimizer=True),
                               [model])
