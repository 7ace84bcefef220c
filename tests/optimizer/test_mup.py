"""``get_mup_config_overrides``: muP's per-group learning rates and Adam eps (Megatron-Core 0.19's rules).

megatron-core 0.16.1 has no muP, so the expected groups are hand-computed from 0.19's source: with width
multiplier m, Adam gives the hidden matrices ``lr / m``, ``min_lr / m`` and ``eps / m`` and leaves the embedding
class (embeddings, output layer) and 1-D params at the base values; SGD multiplies the vector-like params' lr by m.
Also: the muP coordinate check (activation changes stay O(1) across widths) and TP=2 against one process.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import (
    OptimizerConfig,
    ParamKey,
    get_megatron_optimizer,
    get_mup_config_overrides,
    get_standard_config_overrides,
)
from megatron_core.optimizer.param_groups import get_param_groups_from_overrides
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks

LR, MIN_LR, EPS = 1e-3, 1e-5, 1e-8


def _gpt(width: int = 64, base: int | None = 16, tp: int = 1, seed: int = 0,
         position_embedding_type: str = "learned_absolute") -> GPTModel:
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=width, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, use_mup=base is not None,
                            mup_base_hidden_size=base, tensor_model_parallel_size=tp, init_method_std=0.05)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                    position_embedding_type=position_embedding_type)


def _overrides(config: OptimizerConfig, model: GPTModel, optimizer_type: str = "adam") -> dict:
    return {**get_standard_config_overrides(config),
            **get_mup_config_overrides(config, model.config.mup_width_mult, optimizer_type)}


def _group_of(groups: list[dict], model: torch.nn.Module) -> dict[str, dict]:
    by_id = {id(p): g for g in groups for p in g["params"]}
    return {name: by_id[id(p)] for name, p in model.named_parameters()}


def _is_hidden(name: str, param: torch.nn.Parameter) -> bool:
    return param.dim() == 2 and "embedding" not in name and "output_layer" not in name


def test_adam_groups_of_a_gpt_model():
    model = _gpt()  # m = 4
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR, adam_eps=EPS, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, [model], _overrides(config, model))
    groups = _group_of(optimizer.optimizer.param_groups, model)
    hidden = [n for n, p in model.named_parameters() if _is_hidden(n, p)]
    assert len(hidden) == 8  # qkv, proj, fc1, fc2 of two layers
    for name, param in model.named_parameters():
        group = groups[name]
        if _is_hidden(name, param):
            expected = (LR * 0.25, MIN_LR * 0.25, EPS * 0.25, 1.0, False)
        else:  # embeddings, output layer, biases and norms: the base lr and eps
            expected = (LR, MIN_LR, EPS, 0.0 if param.dim() == 1 else 1.0, True)
        got = (group["max_lr"], group["min_lr"], group["eps"], group["wd_mult"], group["default_config"])
        assert got == pytest.approx(expected, rel=1e-12, abs=0), name
        assert group["lr"] == pytest.approx(expected[0], rel=1e-12)
    # one step on every param: Adam's first step with the group's lr and eps (AdamW decay lr * wd)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, torch.arange(16).expand(2, 16), None, labels=torch.roll(ids, -1, 1)).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    for name, param in model.named_parameters():
        lr, eps, wd = groups[name]["lr"], groups[name]["eps"], groups[name]["weight_decay"]
        expected = before[name] * (1 - lr * wd) - lr * grads[name] / (grads[name].abs() + eps)
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_sgd_scales_vector_like_lr():
    model = _gpt()
    config = OptimizerConfig(optimizer="sgd", lr=LR, min_lr=MIN_LR)
    overrides = get_mup_config_overrides(config, 4.0, "sgd")
    assert [o for o in overrides.values()] == [{"max_lr": LR * 4, "min_lr": MIN_LR * 4}]
    groups = _group_of(get_param_groups_from_overrides([model], config, _overrides(config, model, "sgd")), model)
    for name, param in model.named_parameters():
        expected = (LR, MIN_LR) if _is_hidden(name, param) else (LR * 4, MIN_LR * 4)
        assert (groups[name]["max_lr"], groups[name]["min_lr"]) == pytest.approx(expected), name
        assert "eps" not in groups[name]


def test_decoupled_lr_keeps_embedding_and_output(caplog):
    model = _gpt()
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR, adam_eps=EPS, decoupled_lr=2e-4, decoupled_min_lr=2e-6)
    with caplog.at_level(logging.WARNING):
        overrides = _overrides(config, model)
    assert "decoupled_lr" in caplog.text and "eps scaling still applies" in caplog.text
    groups = _group_of(get_param_groups_from_overrides([model], config, overrides), model)
    for name, param in model.named_parameters():
        group = groups[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert (group["max_lr"], group["min_lr"], "eps" in group) == (2e-4, 2e-6, False), name
        elif _is_hidden(name, param):
            assert (group["max_lr"], group["min_lr"], group["eps"]) == pytest.approx((LR / 4, MIN_LR / 4, EPS / 4))
        else:
            assert (group["max_lr"], group["min_lr"], "eps" in group) == (LR, MIN_LR, False), name


def test_predicates_on_tagged_params():
    """The classes as Megatron-Core tags them: attribute first, then ``shared_embedding``, then the name."""
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR)
    (key, override), = get_mup_config_overrides(config, 2.0).items()
    assert override == pytest.approx({"max_lr": LR / 2, "min_lr": MIN_LR / 2, "eps": config.adam_eps / 2})
    matrix, vector = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    tagged, shared = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4, 4))
    tagged.is_embedding_parameter, shared.shared_embedding = True, True
    assert key.matches(matrix, "decoder.layers.0.mlp.linear_fc1.weight")
    assert key.matches(matrix, "output_layer.weight")  # untagged output layer (no use_mup): a hidden matrix
    assert not key.matches(matrix, "embedding.word_embeddings.weight")
    assert not key.matches(vector, "decoder.layers.0.mlp.linear_fc1.bias")
    assert not key.matches(tagged, "decoder.layers.0.mlp.linear_fc1.weight")
    assert not key.matches(shared, "output_layer.weight")


def test_muon_and_other_optimizers(caplog):
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR)
    with caplog.at_level(logging.WARNING):
        (key, override), = get_mup_config_overrides(config, 2.0, "muon").items()
    assert "muon_scale_mode='spectral'" in caplog.text
    assert override == pytest.approx({"max_lr": LR / 2, "min_lr": MIN_LR / 2})
    muon_matrix, output = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4, 4))
    output.is_embedding_or_output_parameter = True
    assert not key.matches(muon_matrix, "decoder.layers.0.mlp.linear_fc1.weight")  # Muon scales it itself
    assert key.matches(output, "output_layer.weight")
    (_, lion), = get_mup_config_overrides(config, 2.0, "lion").items()
    assert lion == pytest.approx({"max_lr": LR / 2, "min_lr": MIN_LR / 2})
    assert get_mup_config_overrides(config, 1.0) == {}
    assert isinstance(key, ParamKey)


@pytest.mark.parametrize("mult", [0, -2.0, float("nan"), float("inf"), True])
def test_invalid_width_mult_raises(mult):
    with pytest.raises(ValueError, match="mup_width_mult"):
        get_mup_config_overrides(OptimizerConfig(lr=LR), mult)


def _coord_check(width: int, mup: bool, steps: int = 4) -> dict[str, float]:
    """Mean |change| of each layer's output and of the logits after ``steps`` Adam steps at lr 1e-2."""
    model = _gpt(width, 64 if mup else None, position_embedding_type="rope")
    config = OptimizerConfig(lr=1e-2, min_lr=0.0, weight_decay=0.0)
    overrides = _overrides(config, model) if mup else get_standard_config_overrides(config)
    optimizer = get_megatron_optimizer(config, [model], overrides)
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(8, 16)
    acts: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: acts.__setitem__(f"layer{i}", out[0].detach()))

    def snapshot() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            logits = model(tokens, positions, None)
        return {"logits": logits, **acts}

    start = snapshot()
    for _ in range(steps):
        optimizer.zero_grad()
        model(tokens, positions, None, labels=torch.roll(tokens, -1, 1)).mean().backward()
        optimizer.step()
    end = snapshot()
    return {k: (end[k] - start[k]).abs().mean().item() for k in start}


def test_coordinate_check():
    """muP: the change of every layer's output and of the logits is width-independent (within 2x from 64 to
    256); the standard parametrisation's grows with the width (over 2x for the logits, 4x for the layers)."""
    mup = [_coord_check(w, True) for w in (64, 128, 256)]
    sp = [_coord_check(w, False) for w in (64, 256)]
    for key in mup[0]:
        values = [m[key] for m in mup]
        assert max(values) / min(values) < 2.0, (key, values)
        assert mup[0][key] > 0.05, (key, values)  # it did train
    assert sp[1]["logits"] / sp[0]["logits"] > 2.0, sp
    assert all(sp[1][k] / sp[0][k] > 4.0 for k in ("layer0", "layer1")), sp


# ---- TP=2 against one process ----------------------------------------------------------------------------------

_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "word_embeddings.weight",
           "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def _shard(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    if name.endswith(_COLUMN):
        return full.chunk(2, dim=0)[rank]
    return full.chunk(2, dim=1)[rank] if name.endswith(_ROW) else full


def _train_step(model: GPTModel) -> tuple[torch.Tensor, dict, dict]:
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR, adam_eps=1e-6, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, [model], _overrides(config, model))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    loss = model(ids, torch.arange(16).expand(2, 16), None, labels=torch.roll(ids, -1, 1))
    loss.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _tp_check() -> int:
    reference = _gpt(seed=3)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_loss, ref_grads, ref_after = _train_step(reference)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = _gpt(tp=2)
        rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_shard(name, start[name], rank))
        loss, grads, after = _train_step(model)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, _shard(name, ref_grads[name], rank), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"grad {n}: {m}")
            # Adam's first step is ~lr * sign(grad): 2e-5 (< lr / m = 2.5e-4) absorbs a rounding flip of a tiny grad
            torch.testing.assert_close(after[name], _shard(name, ref_after[name], rank), rtol=0, atol=2e-5,
                                       msg=lambda m, n=name: f"param {n}: {m}")
        dist.barrier()
        return len(grads)
    finally:
        parallel_state.destroy_model_parallel()


def test_tensor_parallel_matches_single_process():
    counts = run_on_ranks(2, _tp_check)
    assert counts[0] == counts[1] > 20


# ---- the distributed optimizer with muP's per-group eps ------------------------------------------------------

def _dist_opt_run(flat: bool) -> tuple[bool, dict]:
    from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer
    from tests.optimizer.dp_step import dp_train_step

    parallel_state.initialize_model_parallel()
    previous = DistributedOptimizer.flat_shard_step
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = _gpt(seed=7)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                      model)
        DistributedOptimizer.flat_shard_step = flat
        config = OptimizerConfig(lr=LR, min_lr=MIN_LR, clip_grad=0.0, use_distributed_optimizer=True,
                                 use_precision_aware_optimizer=True)
        opt = get_megatron_optimizer(config, [ddp], _overrides(config, model))
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(9))
        for _ in range(2):
            dp_train_step(ddp, opt, tokens)
        return opt._flat is None, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        DistributedOptimizer.flat_shard_step = previous
        parallel_state.destroy_model_parallel()


def _dist_opt_check() -> bool:
    fell_back, flat_forced = _dist_opt_run(True)
    _, per_tensor = _dist_opt_run(False)
    for name, value in per_tensor.items():
        torch.testing.assert_close(flat_forced[name], value, rtol=0, atol=0)
    return fell_back


def test_distributed_optimizer_takes_per_group_eps():
    """The flat fused Adam step needs one eps for all groups: with muP's it falls back to the per-tensor step."""
    assert run_on_ranks(2, _dist_opt_check) == [True, True]
