"""FP8 delayed scaling under TP=2 with sequence parallelism, against one process, and its checkpoint across TP sizes.

Every amax is max-reduced over the tensor-parallel group before it is recorded, so the two ranks'
scales are bit-identical (``torch.equal``), step after step, and equal to the one-process model's: the
amax of the same tensor, max over its shards, except that a tensor computed in another summation
order (an output gradient, an input after a row-parallel reduction) may have an amax one fp32 ulp
away, so the scale comparison is ``rtol=1e-6`` (most scale vectors are bit-identical, which is
checked too). With those scales the quantized operands are the same up to fp32 noise, so loss, logits
and every gradient equal one process within 1e-5 relative to the tensor's largest value (a value on
an fp8 rounding boundary could flip; none does on this model and batch). A
``dist_checkpointing`` checkpoint saved at TP=2 carries the scaling state (``_extra_state``, one per
layer, replicated over TP) and loads at TP=1.

As in Megatron-Core the amaxes are reduced over data- and context-parallel ranks too (the TP x DP x CP
group): at DP=2 each rank's scales equal those of one process on both ranks' micro-batches together
(``loss.sum()``, so the output gradients are the same tensors), and its summed gradients equal that
process's; at CP=2 (each rank holds half of every sequence) the scales, per-token losses and summed
gradients equal one process on the whole sequences.
"""

from __future__ import annotations

import torch

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from megatron_core.fp8 import convert_to_float8
from megatron_core.utils import get_batch_on_this_cp_rank
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import VOCAB, batch, build, llama_like, shard

DP_STEPS = 2

SPEC = llama_like(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
STEPS = 3
TOL = 1e-5
SCALE_RTOL = 1e-6


def _scales(model) -> dict[str, torch.Tensor]:
    return {n: m.fp8_scale.clone() for n, m in model.named_modules() if hasattr(m, "fp8_scale")}


def _histories(model) -> dict[str, torch.Tensor]:
    return {n: m.fp8_amax_history.clone() for n, m in model.named_modules() if hasattr(m, "fp8_amax_history")}


def _steps(model, tp_group=None) -> tuple[list[dict], torch.Tensor, torch.Tensor, dict]:
    """Scales before every step, then the last step's loss, full logits and gradients (one batch, no update).

    The logits come from an evaluation forward before each training step (same scales, nothing recorded)."""
    ids, pos, labels = batch()
    scales = []
    for _ in range(STEPS):
        scales.append(_scales(model))
        model.zero_grad()
        model.eval()  # an evaluation forward uses the scales without recording
        with torch.no_grad():
            logits = model(ids, pos, None)
        model.train()
        if tp_group is not None:
            pieces = [torch.empty_like(logits) for _ in range(2)]
            torch.distributed.all_gather(pieces, logits.contiguous(), group=tp_group)
            logits = torch.cat(pieces, dim=-1)
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    return scales, loss.detach(), logits.detach(), grads


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < TOL, f"{what}: relative error {err:.2e} >= {TOL}"


def _tp2_sp_against_one_process(ckpt: str) -> int:
    torch.manual_seed(0)
    ref = build(SPEC)
    state = {k: v.detach().clone() for k, v in ref.named_parameters()}
    convert_to_float8(ref, emulate=True)
    ref_scales, ref_loss, ref_logits, ref_grads = _steps(ref)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        model = build(SPEC, tensor_model_parallel_size=2, sequence_parallel=True)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], 2, rank, True))
        convert_to_float8(model, emulate=True)
        scales, loss, logits, grads = _steps(model, group)
        exact = 0
        for step, (got, want) in enumerate(zip(scales + [_scales(model)], ref_scales + [_scales(ref)])):
            for name in want:
                both = [torch.empty_like(got[name]) for _ in range(2)]
                torch.distributed.all_gather(both, got[name], group=group)
                assert torch.equal(both[0], both[1]), f"step {step} {name}: the ranks' scales differ {both}"
                torch.testing.assert_close(got[name], want[name], rtol=SCALE_RTOL, atol=0,
                                           msg=lambda m, s=step, n=name: f"step {s} {n}: {m}")
                exact += int(torch.equal(got[name], want[name]))
        assert _scales(ref)["decoder.layers.1.self_attention.linear_proj"].ne(1).all()  # the scales did move
        _close(loss, ref_loss, "loss")
        assert logits.shape[-1] == VOCAB
        _close(logits, ref_logits, "logits")
        for name, grad in grads.items():
            if getattr(model.get_parameter(name), "sequence_parallel", False):
                torch.distributed.all_reduce(grad, group=group)  # what DDP does for SP-replicated weights
            _close(grad, shard(name, ref_grads[name], 2, rank, True), name)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        saved, saved_scales = _histories(model), _scales(model)
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        fresh = build(SPEC)
        convert_to_float8(fresh, emulate=True)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
        loaded = _histories(fresh)
        for name, history in saved.items():
            assert torch.equal(loaded[name], history), name
            assert torch.equal(_scales(fresh)[name], saved_scales[name]), name
            torch.testing.assert_close(loaded[name], _histories(ref)[name], rtol=SCALE_RTOL, atol=0)
        return exact
    finally:
        parallel_state.destroy_model_parallel()


def test_delayed_fp8_tp2_sp_equals_one_process_and_checkpoint_loads_at_tp1(tmp_path):
    exact = run_on_ranks(2, _tp2_sp_against_one_process, str(tmp_path / "ckpt"), timeout=280)
    assert exact[0] == exact[1] >= (STEPS + 1) * 8 // 2, exact  # most scale vectors are bit-identical to one process


def _dp_steps(model, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    for _ in range(DP_STEPS):
        model.zero_grad()
        model(ids, pos, None, labels=labels).float().sum().backward()
    model.eval()
    with torch.no_grad():
        logits = model(ids, pos, None)
    model.train()
    return logits, {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _dp2_against_one_process() -> int:
    rank = torch.distributed.get_rank()
    batches = [batch(3), batch(4)]
    torch.manual_seed(0)
    ref = build(SPEC)
    state = ref.state_dict()
    convert_to_float8(ref, emulate=True)
    ref_logits, ref_grads = _dp_steps(ref, torch.cat([b[0] for b in batches]), torch.cat([b[2] for b in batches]))
    alone = build(SPEC)
    alone.load_state_dict(state)
    convert_to_float8(alone, emulate=True)
    _dp_steps(alone, batches[rank][0], batches[rank][2])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        model = build(SPEC)
        model.load_state_dict(state)
        convert_to_float8(model, emulate=True)
        logits, grads = _dp_steps(model, batches[rank][0], batches[rank][2])
        group = parallel_state.get_data_parallel_group()
        moved = 0
        for name, scale in _scales(model).items():
            both = [torch.empty_like(scale) for _ in range(2)]
            torch.distributed.all_gather(both, scale, group=group)
            assert torch.equal(both[0], both[1]), f"{name}: the DP ranks' scales differ {both}"
            torch.testing.assert_close(scale, _scales(ref)[name], rtol=SCALE_RTOL, atol=0)
            moved += int(not torch.equal(scale, _scales(alone)[name]))
        half = ref_logits.shape[0] // 2
        _close(logits, ref_logits[rank * half:(rank + 1) * half], "logits")
        for name, grad in grads.items():
            torch.distributed.all_reduce(grad, group=group)
            _close(grad, ref_grads[name], name)
        return moved
    finally:
        parallel_state.destroy_model_parallel()


def test_delayed_fp8_amax_is_reduced_over_data_parallel_ranks():
    moved = run_on_ranks(2, _dp2_against_one_process, timeout=280)
    assert min(moved) > 0, moved  # some scale differs from the one a rank would compute from its own batch


def _dp2_tp_only_amax_red() -> int:
    """With ``tp_only_amax_red`` nothing is reduced over DP: each rank's scales are those of its own batch alone."""
    spec = llama_like(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max",
                      tp_only_amax_red=True)
    ids, _, labels = [batch(3), batch(4)][torch.distributed.get_rank()]
    torch.manual_seed(0)
    alone = build(spec)
    state = alone.state_dict()
    convert_to_float8(alone, emulate=True)
    _dp_steps(alone, ids, labels)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        model = build(spec)
        model.load_state_dict(state)
        convert_to_float8(model, emulate=True)
        _dp_steps(model, ids, labels)
        differ = 0
        for name, scale in _scales(model).items():
            assert torch.equal(scale, _scales(alone)[name]), f"{name}: reduced beyond the TP group"
            both = [torch.empty_like(scale) for _ in range(2)]
            torch.distributed.all_gather(both, scale, group=parallel_state.get_data_parallel_group())
            differ += int(not torch.equal(both[0], both[1]))
        return differ
    finally:
        parallel_state.destroy_model_parallel()


def test_tp_only_amax_red_keeps_data_parallel_ranks_apart():
    differ = run_on_ranks(2, _dp2_tp_only_amax_red, timeout=280)
    assert min(differ) > 0, differ  # the two batches give the ranks different scales


def _cp_steps(model, batch: dict) -> torch.Tensor:
    for _ in range(DP_STEPS):
        model.zero_grad()
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss.sum().backward()
    return loss.detach()


def _cp2_against_one_process() -> str:
    gen = torch.Generator().manual_seed(3)
    seq = 16
    ids, labels = (torch.randint(0, VOCAB, (2, seq), generator=gen) for _ in range(2))
    full = {"tokens": ids, "labels": labels, "position_ids": torch.arange(seq).expand(2, seq).contiguous()}
    torch.manual_seed(0)
    ref = build(SPEC)
    state = ref.state_dict()
    convert_to_float8(ref, emulate=True)
    ref_loss = _cp_steps(ref, full)
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        model = build(SPEC, context_parallel_size=2, cp_comm_type="p2p")
        model.load_state_dict(state)
        convert_to_float8(model, emulate=True)
        loss = _cp_steps(model, get_batch_on_this_cp_rank(dict(full)))
        group = parallel_state.get_context_parallel_group()
        rank = parallel_state.get_context_parallel_rank()
        for name, scale in _scales(model).items():
            both = [torch.empty_like(scale) for _ in range(2)]
            torch.distributed.all_gather(both, scale, group=group)
            assert torch.equal(both[0], both[1]), f"{name}: the CP ranks' scales differ {both}"
            torch.testing.assert_close(scale, _scales(ref)[name], rtol=SCALE_RTOL, atol=0)
        quarter = seq // 4  # rank r holds chunks r and 3 - r of 4 (load balancing)
        mine = list(range(rank * quarter, (rank + 1) * quarter)) + list(range((3 - rank) * quarter, (4 - rank) * quarter))
        _close(loss, ref_loss[:, mine], "per-token loss")
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            torch.distributed.all_reduce(grad, group=group)
            _close(grad, ref.get_parameter(name).grad, name)
        return "ok"
    finally:
        parallel_state.destroy_model_parallel()


def test_delayed_fp8_amax_is_reduced_over_context_parallel_ranks():
    assert run_on_ranks(2, _cp2_against_one_process, timeout=280) == ["ok", "ok"]
