"""Megatron-FSDP's ``fully_shard`` (on PyTorch FSDP2) matches single-process training.

A small Linear/LayerNorm model (and the library's GPTModel) is wrapped at every supported
``zero_dp_strategy`` on 2 CPU ranks and with HSDP (2 x 2) on 4, trained with AdamW through the returned
optimizer: losses, gathered gradients and weights equal the single-process run's (fp32, 1e-5). Also:
gradient accumulation with ``sync_model_each_microbatch=False``, meta-device init, a DCP round trip of the
model and optimizer state dicts, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from megatron_core.distributed.fsdp.src.megatron_fsdp import (
    MegatronFSDP,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
    fully_shard_model,
    fully_shard_optimizer,
)
from tests.dist_harness import run_on_ranks
from tests.distributed.fsdp import fully_shard_toy as toy

TOL = dict(rtol=1e-5, atol=1e-5)
UNITS = [toy.Block, "torch.nn.Linear"]


def _assert_close_dicts(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _hsdp_kwargs() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    mesh[("dp_outer", "dp_shard")]._flatten("hsdp")
    return dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                hybrid_fsdp_group=mesh["hsdp"].get_group())


def _check_training(strategy, hsdp: bool, microbatches: int = 1, sync_each: bool = True,
                    last_microbatch: str = "no_sync") -> dict:
    ref_losses, ref_grads, ref_weights = toy.reference()
    module = toy.build()
    mesh_kwargs = _hsdp_kwargs() if hsdp else {}
    model, opt = fully_shard(module, toy.optimizer(module.parameters()), fsdp_unit_modules=UNITS,
                             zero_dp_strategy=strategy, sync_model_each_microbatch=sync_each, **mesh_kwargs)
    assert isinstance(model, MegatronFSDP) and model.module is module
    params = list(model.parameters())
    assert all(type(p).__name__ == "DTensor" for p in params)
    local = sum(p.to_local().numel() for p in params)
    total = sum(p.numel() for p in params)
    before_last = (lambda m: m.set_model_auto_sync(True)) if last_microbatch == "auto_sync" else None
    losses, grads = toy.train(model, opt, microbatches=microbatches, before_last=before_last)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for got, want in zip(grads, ref_grads):
        _assert_close_dicts(got, want)
    _assert_close_dicts(toy.weights(model), ref_weights)
    return {"local": local, "total": total, "strategy": model.data_parallel_sharding_strategy}


@pytest.mark.parametrize("strategy", [0, 1, 2, 3, "optim_grads_params", ShardingStrategy.OPTIM_GRADS])
def test_each_strategy_matches_single_process(strategy):
    results = run_on_ranks(2, _check_training, strategy, False)
    name = results[0]["strategy"]
    if name == "no_shard":
        assert all(r["local"] == r["total"] for r in results)  # replicated
    else:
        assert sum(r["local"] for r in results) == results[0]["total"]  # every element on exactly one rank


def test_dp4_with_empty_shards_matches_single_process():
    results = run_on_ranks(4, _check_training, 3, False)
    assert sum(r["local"] for r in results) == results[0]["total"]  # the 3-row head leaves one rank without rows


@pytest.mark.parametrize("strategy", [0, 1, 3])
def test_hsdp_2x2_matches_single_process(strategy):
    results = run_on_ranks(4, _check_training, strategy, True)
    if strategy:
        assert sum(r["local"] for r in results) == 2 * results[0]["total"]  # sharded over 2, replicated twice


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_gradient_accumulation_with_no_sync(strategy):
    run_on_ranks(2, _check_training, strategy, False, 2, False)


@pytest.mark.parametrize("strategy", [1, 3])
def test_hsdp_gradient_accumulation_with_auto_sync_on_last_microbatch(strategy):
    run_on_ranks(4, _check_training, strategy, True, 2, False, "auto_sync")


def _check_unsynced_grads_are_hidden_and_refused(strategy: int) -> dict:
    module = toy.build()
    model, opt = fully_shard(module, toy.optimizer(module.parameters()), zero_dp_strategy=strategy,
                             sync_model_each_microbatch=False)
    x, y = toy.batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    hidden = all(p.grad is None for group in opt.param_groups for p in group["params"])  # the sharded ones
    with pytest.raises(RuntimeError, match="without reducing"):
        opt.step()
    return {"hidden": hidden}


@pytest.mark.parametrize("strategy", [0, 1])
def test_unreduced_gradients_are_not_stepped_on(strategy):
    results = run_on_ranks(2, _check_unsynced_grads_are_hidden_and_refused, strategy)
    assert all(r["hidden"] for r in results)


def _check_meta_init(strategy: int, hsdp: bool = False) -> None:
    cpu = toy.build(seed=99)
    meta = toy.build(seed=99, device="meta")
    model = fully_shard_model(meta, fsdp_unit_modules=UNITS, zero_dp_strategy=strategy,
                              init_model_with_meta_device=True, **(_hsdp_kwargs() if hsdp else {}))
    assert not any(p.is_meta for p in model.parameters())
    _assert_close_dicts(toy.weights(model), {n: p.detach() for n, p in cpu.named_parameters()})


@pytest.mark.parametrize("strategy", [1, 3])
def test_meta_device_init_equals_cpu_init(strategy):
    run_on_ranks(2, _check_meta_init, strategy)


def test_meta_device_init_equals_cpu_init_hsdp():
    run_on_ranks(4, _check_meta_init, 3, True)


def _check_dcp_round_trip(strategy: int, hsdp: bool, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    mesh_kwargs = _hsdp_kwargs() if hsdp else {}
    module = toy.build()
    model, opt = fully_shard(module, toy.optimizer(module.parameters()), fsdp_unit_modules=UNITS,
                             zero_dp_strategy=strategy, **mesh_kwargs)
    toy.train(model, opt, steps=1)
    assert all(key.startswith("module.") for key in model.state_dict())
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path)
    saved_weights = toy.weights(model)
    saved_state = {i: {k: toy.full(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}

    other = toy.build(seed=5)
    model2, opt2 = fully_shard(other, toy.optimizer(other.parameters()), fsdp_unit_modules=UNITS,
                               zero_dp_strategy=strategy, **mesh_kwargs)
    state = {"model": model2.state_dict(), "optimizer": opt2.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    _assert_close_dicts(toy.weights(model2), saved_weights)
    loaded_state = {i: {k: toy.full(v) for k, v in s.items()} for i, s in opt2.state_dict()["state"].items()}
    assert loaded_state.keys() == saved_state.keys()
    for index, values in saved_state.items():
        _assert_close_dicts(loaded_state[index], values)
    assert float(saved_state[0]["step"]) == 1.0
    # Training goes on identically from the original and from the loaded copy.
    losses, _ = toy.train(model, opt, steps=1, first_step=1)
    losses2, _ = toy.train(model2, opt2, steps=1, first_step=1)
    assert losses == losses2
    _assert_close_dicts(toy.weights(model2), toy.weights(model))


@pytest.mark.parametrize("strategy", [0, 1, 3])
def test_dcp_save_load_round_trip(strategy, tmp_path):
    run_on_ranks(2, _check_dcp_round_trip, strategy, False, str(tmp_path / "ckpt"))


def test_dcp_save_load_round_trip_hsdp(tmp_path):
    run_on_ranks(4, _check_dcp_round_trip, 3, True, str(tmp_path / "ckpt"))


def _check_units_and_resharding() -> dict:
    out = {}
    for strategy in (2, 3):
        module = toy.build()
        model = fully_shard_model(module, fsdp_unit_modules=["tests.distributed.fsdp.fully_shard_toy.Block"],
                                  zero_dp_strategy=strategy)
        assert len(model.units) == toy.BLOCKS + 1 and model.units[-1] is module
        model(toy.batch(0)[0])
        # optim_grads keeps the gathered weights from forward to backward; optim_grads_params frees them.
        out[strategy] = type(module.blocks[0].fc1.weight).__name__
    return out


def test_unit_modules_by_path_and_reshard_after_forward():
    result = run_on_ranks(2, _check_units_and_resharding)[0]
    assert result == {2: "Parameter", 3: "DTensor"}


def _check_broadcast_params(strategy: int) -> None:
    model = fully_shard_model(toy.build(), zero_dp_strategy=strategy, **(_hsdp_kwargs() if strategy else {}))
    before = toy.weights(model)
    if dist.get_rank() >= 2:  # the second replica drifts
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().add_(1.0)
    model.broadcast_params()
    _assert_close_dicts(toy.weights(model), before)


@pytest.mark.parametrize("strategy", [0, 3])
def test_broadcast_params_restores_the_first_replica(strategy):
    run_on_ranks(4, _check_broadcast_params, strategy)


def _check_bf16_module() -> dict:
    ref_losses, _, _ = toy.reference(steps=2)
    module = toy.build().to(torch.bfloat16)
    module.register_buffer("marker", torch.ones(1, dtype=torch.bfloat16))
    model, opt = fully_shard(module, toy.optimizer(module.parameters()), fsdp_unit_modules=UNITS,
                             mixed_precision_policy=MixedPrecisionPolicy(grad_comm_dtype=torch.float32))
    main_dtypes = {p.dtype for p in model.parameters()}
    assert module.marker.dtype == torch.bfloat16  # buffers keep the module's dtype
    out_dtype = model(toy.batch(0)[0]).dtype
    losses, grads = toy.train(model, opt, steps=2)
    grad_dtypes = {g.dtype for g in grads[0].values()}
    return {"main": main_dtypes, "out": out_dtype, "grads": grad_dtypes, "losses": losses, "ref": ref_losses}


def test_mixed_precision_policy_keeps_fp32_main_weights_and_computes_in_module_dtype():
    result = run_on_ranks(2, _check_bf16_module)[0]
    assert result["main"] == {torch.float32} and result["grads"] == {torch.float32}
    assert result["out"] == torch.bfloat16
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["ref"]), rtol=3e-2, atol=3e-2)


def _check_per_token_loss() -> None:
    module = toy.build()
    model = fully_shard_model(module, calculate_per_token_loss=True)
    x, y = toy.batch(0)
    rank = dist.get_rank()
    torch.nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4],
                                 reduction="sum").backward()
    reference = toy.build()
    torch.nn.functional.mse_loss(reference(x), y, reduction="sum").backward()
    _assert_close_dicts({n: toy.full(p.grad) for n, p in model.module.named_parameters()},
                        {n: p.grad for n, p in reference.named_parameters()})


def test_calculate_per_token_loss_sums_gradients():
    run_on_ranks(2, _check_per_token_loss)


def _check_gpt() -> None:
    from megatron_core import parallel_state
    from tests.models.gpt_test_utils import SEQ, VOCAB, build, llama_like

    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(1234)
        reference = build(llama_like())
        torch.manual_seed(1234)
        module = build(llama_like())
        ref_opt = toy.optimizer(reference.parameters(), eps=1e-6)
        model, opt = fully_shard(module, toy.optimizer(module.parameters(), eps=1e-6),
                                 fsdp_unit_modules=["megatron_core.transformer.transformer_layer.TransformerLayer"])
        rank, world = dist.get_rank(), dist.get_world_size()
        positions = torch.arange(SEQ).unsqueeze(0)
        for step in range(2):
            tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))
            ref_opt.zero_grad()
            ref_loss = reference(tokens[:, :-1], positions.expand(4, SEQ), None, labels=tokens[:, 1:]).mean()
            ref_loss.backward()
            ref_opt.step()
            mine = tokens[rank * 4 // world:(rank + 1) * 4 // world]
            opt.zero_grad()
            loss = model(mine[:, :-1], positions.expand(mine.shape[0], SEQ), None, labels=mine[:, 1:]).mean()
            loss.backward()
            _assert_close_dicts({n: toy.full(p.grad) for n, p in model.module.named_parameters()},
                                {n: p.grad for n, p in reference.named_parameters()})
            opt.step()
            total = loss.detach().reshape(1)
            dist.all_reduce(total)
            torch.testing.assert_close(total / world, ref_loss.detach().reshape(1), **TOL)
        _assert_close_dicts(toy.weights(model), {n: p.detach() for n, p in reference.named_parameters()})
    finally:
        parallel_state.destroy_model_parallel()


def test_gpt_model_matches_single_process():
    run_on_ranks(2, _check_gpt)


class _NoReset(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 4))


def _refusals() -> list[str]:
    module = toy.build()
    group = dist.new_group([0, 1])
    cases = [
        (dict(nccl_ub=True), "nccl_ub"), (dict(fsdp_double_buffer=True), "fsdp_double_buffer"),
        (dict(keep_fp8_transpose_cache=True), "keep_fp8_transpose_cache"),
        (dict(use_decoupled_grad=True), "use_decoupled_grad"), (dict(cuda_graph_mode=True), "cuda_graph_mode"),
        (dict(maxpool_double_buffer=True), "maxpool_double_buffer"),
        (dict(enable_fine_grained_param_gather=True), "enable_fine_grained_param_gather"),
        (dict(fsdp_group_ag=group), "fsdp_group_ag"), (dict(hybrid_fsdp_expt_group=group), "hybrid_fsdp_expt_group"),
        (dict(zero_dp_strategy=4), "zero_dp_strategy"), (dict(zero_dp_strategy="zero3"), "zero_dp_strategy"),
        (dict(init_model_with_meta_device=True, zero_dp_strategy=0), "init_model_with_meta_device"),
        (dict(mixed_precision_policy=MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)), "main_grads_dtype"),
    ]
    messages = []
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=name) as err:
            fully_shard_model(module, **kwargs)
        messages.append(str(err.value))
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    for kwargs, name in [
        (dict(outer_dp_sharding_strategy=1, zero_dp_strategy=3, hybrid_fsdp_group=group), "outer_dp_sharding"),
        (dict(outer_dp_sharding_strategy=1, zero_dp_strategy=2, hybrid_fsdp_group=group), "optim_grads_params"),
        (dict(outer_dp_sharding_strategy=2, hybrid_fsdp_group=group), "outer_dp_sharding_strategy"),
        (dict(), "hybrid_fsdp_group"),
    ]:
        with pytest.raises(ValueError, match=name) as err:
            fully_shard_model(module, device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", **kwargs)
        messages.append(str(err.value))
    with pytest.raises(ValueError, match="reset_parameters"):
        fully_shard_model(_NoReset().to("meta"), init_model_with_meta_device=True)
    with pytest.raises(ValueError, match="MegatronFSDP"):
        fully_shard_optimizer(torch.optim.AdamW(toy.build().parameters()))
    return messages


def test_refusals_name_the_argument():
    messages = run_on_ranks(2, _refusals)[0]
    assert any("FSDP2" in m for m in messages)
