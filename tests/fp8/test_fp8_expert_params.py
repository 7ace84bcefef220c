"""FP8 parameters for the MoE experts (``fp8_param``): row-wise FP8 expert weights, on CPU (fp32 emulation).

A tiny Mixtral-like MoE GPT (grouped experts, ``fp8_recipe='tensorwise'``) trains with Adam under DDP + the
distributed optimizer. With ``fp8_param`` the experts' grouped weights are FP8 parameters holding, per (expert,
output feature), the power-of-two scale and e4m3 codes their FP8 grouped GEMM casts in the forward from a
high-precision weight, and the distributed optimizer writes them once per step (the dense layers' weights become
tensorwise FP8 parameters, as before).

* fp8_param against fp8_param=False (the experts' fp32 weights cast in every forward; torchao's tensorwise recipe
  for the dense layers), 3 steps: the experts quantize the same values with the same scales, so their GEMMs give
  the same numbers bit for bit; the dense FP8-parameter GEMMs differ from torchao's by fp32 summation order only
  (ours pads the weight-gradient GEMM's token dimension to 16). Loss, logits and every parameter's gradient
  (``main_grad``) at every step agree within 1e-6 relative to the tensor's largest value (fp32), the main weights
  within 1e-6 absolute (Adam's first steps move each weight by about ``lr``, so a rounding-level difference in a
  near-zero gradient may move one by up to ``0.1 * lr``: at most 1% of them, as tests/fp8/test_fp8_param.py
  states). The expert FP8 bytes and scales after every step equal the codes and scales the forward casts from the
  fp8_param=False run's weights.
  Measured: all equal (losses, logits, gradients, main weights, expert bytes and scales).
* DP=2 (each rank the same micro-batch, so that every FP8 scale, including the experts' per-column weight-gradient
  scales taken over a rank's own rows, is that of one process) against one process: losses and main weights equal
  within 1e-6 relative, FP8 bytes and scales equal; the per-row amax of a row split between two ranks' shards is
  max-reduced (checked on its own with an uneven split: the bytes and scales of one process, exactly).
* EP=2 (alltoall dispatcher; the dense layers DP=2 on the same micro-batch; weights loaded from the one-process
  model's globals): losses within 1e-6 relative of one process, the local experts' scales equal and their bytes
  but 0.1% (an fp32 summation-order difference may move a main weight across a rounding boundary). Measured: DP=2
  and EP=2 losses, main weights and bytes all equal to one process.
* The expert weights are 1 byte per element, in the model and in the DDP expert buffer (uint8), and the GEMM reads
  the stored codes (no weight cast in the forward).
* Checkpoints: the state dict and the sharded (dist_checkpointing) state dict hold the dequantized expert weights;
  loading them into a fresh fp8_param model re-quantizes them to the same values; the distributed optimizer's state
  round-trips (``state_dict`` and, through ``save_checkpoint`` / ``load_checkpoint``, the model-space sharded state
  of the chained dense and expert optimizers, the experts' in per-expert slices), the next step continuing the run
  exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.distributed.fp8_params import (
    dequantize_fp8_tensor,
    is_fp8_param,
    make_fp8_param,
    quantize_param_shard,
)
from megatron_core.fp8 import convert_to_float8
from megatron_core.fp8 import fp8_param_grouped as fpg
from megatron_core.fp8.grouped_gemm import e4m3_codes
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.cuda_process_group import one_rank_nccl_group
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import MAX_SEQ
from tests.transformer.moe.moe_parallel_utils import batches, build, global_tensors, load_globals

pytest.importorskip("torchao.float8")

FP8 = dict(fp8="e4m3", fp8_recipe="tensorwise", moe_grouped_gemm=True, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
STEPS = 3
LR = 1e-2
TOL = 1e-6
MAIN_ATOL, MAIN_OFF_FRACTION, MAIN_MAX_ABS = 1e-6, 1e-2, 0.1 * LR
EXPERT_KEYS = ("experts.linear_fc1.weight", "experts.linear_fc2.weight")


def _build(fp8_param: bool, seed: int = 0, model=None):
    if model is None:
        torch.manual_seed(seed)
        model = build("mixtral", fp8_param=fp8_param, **FP8)
    convert_to_float8(model, emulate=True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=fp8_param), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, use_distributed_optimizer=True), [ddp])
    return model, ddp, opt


def _step(model, ddp, opt, batch) -> dict:
    """One training step; the loss, logits and every parameter's gradient (``main_grad``) before the update."""
    ids, pos, labels = batch
    opt.zero_grad()
    ddp.zero_grad_buffer()
    logits = ddp(ids, pos, None)
    loss = ddp(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    assert opt.step()[0]
    return dict(loss=loss.detach().clone(), logits=logits.detach().clone(), grads=grads)


def _expert_fp8(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (bytes, scales)}`` of the expert FP8 parameters."""
    return {n: (p.detach().view(torch.uint8).clone(), p.fp8_scale.clone())
            for n, p in model.named_parameters() if is_fp8_param(p) and n.endswith(EXPERT_KEYS)}


def _forward_casts(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What the FP8 grouped GEMM's forward casts from each (high-precision) expert weight: bytes and multipliers."""
    out = {}
    for n, p in model.named_parameters():
        if n.endswith(EXPERT_KEYS):
            codes, inverse = e4m3_codes(p.detach(), -1)
            out[n] = (codes.to(torch.float8_e4m3fn).view(torch.uint8), inverse.reciprocal().reshape(-1))
    return out


def _main_weights(model, opt) -> dict[str, torch.Tensor]:
    """The full fp32 main weights (each rank's slices assembled over the data-parallel group)."""
    names = {id(p): n for n, p in model.named_parameters()}
    owned = {}
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for e in inner._entries():
            owned[names[id(e.model_param)]] = (e.param_range.start, e.main_param.detach().clone())
    group = parallel_state.get_data_parallel_group()
    full = {}
    for name, p in model.named_parameters():
        flat = torch.zeros(p.numel())
        if name in owned:
            start, value = owned[name]
            flat[start:start + value.numel()] = value
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(flat, group=group)
        full[name] = flat
    return full


def _train(fp8_param: bool) -> dict:
    model, ddp, opt = _build(fp8_param)
    batch = batches(1)[0]
    steps, fp8, casts = [], [], []
    for _ in range(STEPS):
        steps.append(_step(model, ddp, opt, batch))
        fp8.append(_expert_fp8(model) if fp8_param else {})
        casts.append({} if fp8_param else _forward_casts(model))
    expert = [p for n, p in model.named_parameters() if n.endswith(EXPERT_KEYS)]
    expert_buffers = [(b.param_data.dtype, b.param_data.numel()) for b in ddp.expert_parallel_buffers]
    flat_steps = [getattr(inner, "_flat", None) is not None for inner in getattr(opt, "chained_optimizers", [opt])]
    return dict(steps=steps, fp8=fp8, casts=casts, main=_main_weights(model, opt), flat_steps=flat_steps,
                expert_bytes=[(p.dtype, p.element_size(), p.numel()) for p in expert], expert_buffers=expert_buffers)


def _split_row_quantization() -> dict:
    """A row-wise FP8 parameter quantized from two uneven shards (rows split between ranks) by quantize_param_shard."""
    torch.manual_seed(5)
    value = torch.randn(3, 24, 40) * torch.logspace(-2, 1, 24)[None, :, None]
    param = make_fp8_param(torch.nn.Parameter(value.clone()), scaling="rowwise")
    param.detach().zero_()
    param.fp8_scale.zero_()
    rank, cut = torch.distributed.get_rank(), 1013  # inside row 25 (of 72)
    start, end = (0, cut) if rank == 0 else (cut, value.numel())
    quantize_param_shard([param], [value.reshape(-1)[start:end]], [start], parallel_state.get_data_parallel_group())
    bytes_ = param.detach().view(torch.uint8).reshape(-1).clone()
    full = torch.zeros_like(bytes_)
    full[start:end] = bytes_[start:end]
    torch.distributed.all_reduce(full, group=parallel_state.get_data_parallel_group())  # each byte from its owner
    want = make_fp8_param(torch.nn.Parameter(value), scaling="rowwise")
    return dict(bytes=full, scale=param.fp8_scale.clone(), want_bytes=want.detach().view(torch.uint8).reshape(-1),
                want_scale=want.fp8_scale)


def _ep2_train() -> dict:
    """EP=2 (alltoall dispatcher, the dense layers DP=2, each rank the same micro-batch) from the global weights of
    the one-process model: losses and the local experts' FP8 bytes and scales."""
    torch.manual_seed(0)
    globals_ = global_tensors(build("mixtral", fp8_param=True, **FP8))  # the weights _build(True) starts from
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model = build("mixtral", fp8_param=True, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                      **FP8)
        load_globals(model, globals_)
        model, ddp, opt = _build(True, model=model)
        batch = batches(1)[0]
        losses = [_step(model, ddp, opt, batch)["loss"] for _ in range(STEPS)]
        return dict(losses=losses, fp8=_expert_fp8(model), rank=parallel_state.get_expert_model_parallel_rank())
    finally:
        parallel_state.destroy_model_parallel()


def _dp_pool(ckpt: str | None) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        out = dict(train=_train(True))
        if torch.distributed.get_world_size() == 2:
            out["split"] = _split_row_quantization()
        else:
            out["hp"] = _train(False)
            out["ckpt"] = _checkpoint(ckpt)
    finally:
        parallel_state.destroy_model_parallel()
    if torch.distributed.get_world_size() == 2:
        out["ep2"] = _ep2_train()
    return out


def _checkpoint(ckpt: str) -> dict:
    """State-dict and sharded round trips of an fp8_param MoE model, and the distributed optimizer's state."""
    model, ddp, opt = _build(True)
    batch = batches(1)[0]
    _step(model, ddp, opt, batch)
    saved = _expert_fp8(model)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    expert_entries = {k: v for k, v in state.items() if ".experts.linear_fc" in k and ".weight" in k}
    dequantized = {n: dequantize_fp8_tensor(p) for n, p in model.named_parameters() if n.endswith(EXPERT_KEYS)}
    dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    opt_state = copy.deepcopy(opt.state_dict())  # the live moments change in the next step
    after_save = _step(model, ddp, opt, batch)
    after_fp8 = _expert_fp8(model)

    fresh, fresh_ddp, fresh_opt = _build(True, seed=7)
    before_load = _expert_fp8(fresh)
    fresh.load_state_dict(state)
    from_state_dict = _expert_fp8(fresh)
    fresh2, fresh2_ddp, fresh2_opt = _build(True, seed=7)
    fresh2.load_state_dict(dist_checkpointing.load(fresh2.sharded_state_dict(), ckpt))
    from_sharded = _expert_fp8(fresh2)
    fresh2_opt.load_state_dict(opt_state)
    from_optimizer = _expert_fp8(fresh2)
    resumed = _step(fresh2, fresh2_ddp, fresh2_opt, batch)
    training = _training_checkpoint(ckpt + "_training")
    bf16 = _bf16_grouped_optimizer_checkpoint(ckpt + "_bf16")
    return dict(training=training, bf16=bf16, saved=saved, expert_entries=expert_entries, dequantized=dequantized, before_load=before_load,
                from_state_dict=from_state_dict, from_sharded=from_sharded, from_optimizer=from_optimizer,
                after_save=after_save, after_fp8=after_fp8, resumed=resumed, resumed_fp8=_expert_fp8(fresh2))


def _optimizer_state(opt) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (main weight shard, exp_avg)}`` of every parameter of the chained (dense, expert) optimizers."""
    out = {}
    for inner in opt.chained_optimizers:
        for e in inner._entries():
            state = inner.optimizer.state.get(e.main_param, {})
            out[e.name] = (e.main_param.detach().clone(), state["exp_avg"].clone())
    return out


def _training_checkpoint(ckpt: str) -> dict:
    """``save_checkpoint`` / ``load_checkpoint`` with the chained dense and expert distributed optimizers: main
    weights and moments (the experts' in per-expert slices), FP8 bytes and the next step."""
    from megatron_core.training.checkpointing import load_checkpoint, save_checkpoint

    model, ddp, opt = _build(True)
    batch = batches(1)[0]
    _step(model, ddp, opt, batch)
    save_checkpoint(ckpt, 1, [ddp], opt, None)
    saved, saved_fp8 = _optimizer_state(opt), _expert_fp8(model)
    after = _step(model, ddp, opt, batch)
    fresh, fresh_ddp, fresh_opt = _build(True, seed=7)
    load_checkpoint(ckpt, [fresh_ddp], fresh_opt, None, load_rng=False)
    loaded, loaded_fp8 = _optimizer_state(fresh_opt), _expert_fp8(fresh)
    resumed = _step(fresh, fresh_ddp, fresh_opt, batch)
    return dict(saved=saved, loaded=loaded, saved_fp8=saved_fp8, loaded_fp8=loaded_fp8, after=after["loss"],
                resumed=resumed["loss"])


def _bf16_grouped_optimizer_checkpoint(ckpt: str) -> dict:
    """``save_checkpoint`` / ``load_checkpoint`` of a bf16 grouped-experts MoE (no FP8) with the non-distributed
    mixed-precision optimizers (dense and expert, chained): every fp32 main weight and moment."""
    from megatron_core.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron_core.transformer.module import Float16Module

    def make(seed: int):
        torch.manual_seed(seed)
        model = build("mixtral", bf16=True, **{k: v for k, v in FP8.items() if not k.startswith("fp8")})
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(),
                                      Float16Module(model.config, model))
        return ddp, get_megatron_optimizer(OptimizerConfig(lr=LR, bf16=True), [ddp])

    def states(opt) -> list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]]:
        out = []
        for inner in opt.chained_optimizers:
            model_of = inner._main_to_model()
            for group in inner.optimizer.param_groups:
                for main in group["params"]:
                    shape = tuple(model_of.get(id(main), main).shape)
                    out.append((shape, main.detach().clone(), inner.optimizer.state[main]["exp_avg"].clone()))
        return out

    ddp, opt = make(0)
    ids, pos, labels = batches(1)[0]
    opt.zero_grad()
    ddp.zero_grad_buffer()
    ddp(ids, pos, None, labels=labels).float().mean().backward()
    finalize_model_grads([ddp])
    assert opt.step()[0]
    save_checkpoint(ckpt, 1, [ddp], opt, None)
    fresh_ddp, fresh_opt = make(7)
    load_checkpoint(ckpt, [fresh_ddp], fresh_opt, None, load_rng=False)
    return dict(saved=states(opt), loaded=states(fresh_opt))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One DP=1 pool call (fp8_param and not, checkpoints) and one DP=2 pool call."""
    ckpt = str(tmp_path_factory.mktemp("fp8_expert_ckpt"))
    dp1 = run_on_ranks(1, _dp_pool, ckpt, timeout=280)[0]
    dp2 = run_on_ranks(2, _dp_pool, None, timeout=280)
    return dp1, dp2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().clamp(min=1e-30)
    return ((got - want).abs().max() / scale).item()


def _assert_main_close(got: dict, want: dict) -> None:
    off = total = 0
    for name, value in want.items():
        diff = (got[name] - value).abs()
        assert diff.max() <= MAIN_MAX_ABS, (name, diff.max())
        off += int((diff > MAIN_ATOL).sum())
        total += value.numel()
    assert off <= MAIN_OFF_FRACTION * total, (off, total)


@pytest.mark.slow  # the module's two rank pools (DP=1, DP=2): ~30 s on 2 busy cores
def test_fp8_expert_params_equal_high_precision_experts_cast_in_forward(runs):
    dp1, _ = runs
    fp8, hp = dp1["train"], dp1["hp"]
    for step, (got, want) in enumerate(zip(fp8["steps"], hp["steps"])):
        assert _rel(got["loss"], want["loss"]) < TOL, (step, got["loss"], want["loss"])
        assert _rel(got["logits"], want["logits"]) < TOL, step
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            assert grad.abs().max() > 0 or ".experts." not in name, name
            assert _rel(got["grads"][name], grad) < TOL, (step, name, _rel(got["grads"][name], grad))
    for step, (stored, cast) in enumerate(zip(fp8["fp8"], hp["casts"])):
        assert stored.keys() == cast.keys() and len(stored) == 4  # fc1 and fc2 of both layers
        for name, (bits, scale) in cast.items():
            flips = int((stored[name][0] != bits).sum())
            assert torch.equal(stored[name][1], scale), (step, name)
            assert flips <= 1e-3 * bits.numel(), (step, name, flips)  # a main weight may differ by an fp32 ulp
    _assert_main_close(fp8["main"], hp["main"])
    assert fp8["steps"][-1]["loss"] < fp8["steps"][0]["loss"]  # it trains


@pytest.mark.slow  # the module's two rank pools (DP=1, DP=2): ~30 s on 2 busy cores
def test_fp8_expert_params_dp2_equal_one_process(runs):
    dp1, dp2 = runs
    ref = dp1["train"]
    for rank in dp2:
        got = rank["train"]
        for a, b in zip(got["steps"], ref["steps"]):
            assert _rel(a["loss"], b["loss"]) < TOL
        for name, value in ref["main"].items():
            assert _rel(got["main"][name], value) < TOL, name
        for name, (bits, scale) in ref["fp8"][-1].items():
            assert torch.equal(got["fp8"][-1][name][0], bits) and torch.equal(got["fp8"][-1][name][1], scale), name


@pytest.mark.slow  # the module's two rank pools (DP=1, DP=2): ~30 s on 2 busy cores
def test_fp8_expert_params_ep2_equal_one_process(runs):
    dp1, dp2 = runs
    ref = dp1["train"]
    for rank in dp2:
        got = rank["ep2"]
        for a, b in zip(got["losses"], ref["steps"]):
            assert _rel(a, b["loss"]) < TOL, (a, b["loss"])
        local = slice(2 * got["rank"], 2 * got["rank"] + 2)  # 4 experts, 2 per rank
        for name, (bits, scale) in ref["fp8"][-1].items():
            want_bits, want_scale = bits[local], scale.view(4, -1)[local].reshape(-1)
            flips = int((got["fp8"][name][0] != want_bits).sum())
            assert torch.equal(got["fp8"][name][1], want_scale), name
            assert flips <= 1e-3 * want_bits.numel(), (name, flips)


@pytest.mark.slow  # the module's two rank pools (DP=1, DP=2): ~30 s on 2 busy cores
def test_row_split_between_ranks_quantizes_as_one_process(runs):
    _, dp2 = runs
    for rank in dp2:
        split = rank["split"]
        assert torch.equal(split["scale"], split["want_scale"])
        assert torch.equal(split["bytes"], split["want_bytes"])


@pytest.mark.slow  # the module's two rank pools (DP=1, DP=2): ~30 s on 2 busy cores
def test_fp8_expert_params_are_one_byte(runs):
    dp1, dp2 = runs
    for run in (dp1["train"], dp2[0]["train"]):
        assert len(run["expert_bytes"]) == 4
        assert all(dtype == torch.float8_e4m3fn and size == 1 for dtype, size, _ in run["expert_bytes"])
        expert_numel = sum(numel for _, _, numel in run["expert_bytes"])
        uint8 = [numel for dtype, numel in run["expert_buffers"] if dtype == torch.uint8]
        assert len(uint8) == 1 and uint8[0] >= expert_numel, run["expert_buffers"]
    hp = dp1["hp"]
    assert all(size == 4 for _, size, _ in hp["expert_bytes"])  # fp32 experts without fp8_param


def _fp8_param_runs_flat_and_per_tensor() -> dict:
    """The DP=2 FP8-parameter run (dense and expert weights FP8) with the flat fused Adam step and without it."""
    from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer

    previous = DistributedOptimizer.flat_shard_step
    parallel_state.initialize_model_parallel()
    try:
        out = {}
        for flat in (True, False):
            DistributedOptimizer.flat_shard_step = flat
            out[flat] = _train(True)
        return out
    finally:
        DistributedOptimizer.flat_shard_step = previous  # the rank pool's processes serve later tests
        parallel_state.destroy_model_parallel()


@pytest.mark.slow  # a DP=2 pool call: two 3-step runs
def test_flat_adam_step_quantizes_fp8_params_as_the_per_tensor_step():
    """With FP8 parameters the distributed optimizer's flat fused Adam step (one kernel per bucket shard, then the
    quantization) gives the per-tensor step's losses, gradients, main weights and FP8 bytes and scales (the two
    differ only in the fp32 rounding of the clip factor)."""
    for result in run_on_ranks(2, _fp8_param_runs_flat_and_per_tensor, timeout=280):
        flat, per_tensor = result[True], result[False]
        assert flat["flat_steps"] == [True, True] and per_tensor["flat_steps"] == [False, False]  # dense, experts
        for step, (got, want) in enumerate(zip(flat["steps"], per_tensor["steps"])):
            assert _rel(got["loss"], want["loss"]) < TOL, (step, got["loss"], want["loss"])
            for name, grad in want["grads"].items():
                assert _rel(got["grads"][name], grad) < TOL, (step, name)
        for step, (got, want) in enumerate(zip(flat["fp8"], per_tensor["fp8"])):
            assert got.keys() == want.keys() and len(got) == 4
            for name, (bits, scale) in want.items():
                assert torch.equal(got[name][1], scale), (step, name)
                assert int((got[name][0] != bits).sum()) <= 1e-3 * bits.numel(), (step, name)
        _assert_main_close(flat["main"], per_tensor["main"])
        assert flat["steps"][-1]["loss"] < flat["steps"][0]["loss"]


def _values(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The values of row-wise FP8 bytes and their per-row multipliers."""
    return bits.view(torch.float8_e4m3fn).float().reshape(scale.numel(), -1) / scale[:, None]


@pytest.mark.slow  # the module's two rank pools (DP=1, DP=2): ~30 s on 2 busy cores
def test_fp8_expert_params_checkpoint_round_trip(runs):
    ck = runs[0]["ckpt"]
    # The state dict holds each expert's dequantized weight (fp32) under weight{e}.
    for name, value in ck["dequantized"].items():
        prefix = name[:-len("weight")]
        for e in range(value.shape[0]):
            entry = ck["expert_entries"][f"{prefix}weight{e}"]
            assert entry.dtype == torch.float32 and torch.equal(entry, value[e]), (name, e)
    # A fresh model (another seed) loads them into the same values: state dict and sharded checkpoint. (Bytes and
    # scales may differ: a row whose largest code rounded down to 224 re-quantizes with twice the scale, the same
    # values.) With the optimizer's state the bytes and scales are those the main weights give, exactly.
    for name, (bits, scale) in ck["saved"].items():
        assert not torch.equal(_values(*ck["before_load"][name]), _values(bits, scale))
        for loaded in (ck["from_state_dict"], ck["from_sharded"]):
            assert torch.equal(_values(*loaded[name]), _values(bits, scale)), name
        loaded = ck["from_optimizer"][name]
        assert torch.equal(loaded[0], bits) and torch.equal(loaded[1], scale), name
    # save_checkpoint / load_checkpoint with the distributed optimizers: every main weight and moment (the experts'
    # included) comes back, the FP8 bytes are those the main weights give, and the next step continues exactly.
    training = ck["training"]
    assert training["saved"].keys() == training["loaded"].keys()
    assert sum(".experts." in n for n in training["saved"]) == 4
    for name, (main, exp_avg) in training["saved"].items():
        assert torch.equal(training["loaded"][name][0], main) and torch.equal(training["loaded"][name][1], exp_avg)
    for name, (bits, scale) in training["saved_fp8"].items():
        assert torch.equal(training["loaded_fp8"][name][0], bits) and torch.equal(training["loaded_fp8"][name][1], scale)
    assert torch.equal(training["resumed"], training["after"])
    # The same for bf16 grouped experts with the non-distributed optimizers (fp32 main weights and moments).
    saved, loaded = ck["bf16"]["saved"], ck["bf16"]["loaded"]
    assert len(saved) == len(loaded) and sum(len(shape) == 3 for shape, _, _ in saved) == 4  # the experts' weights
    for (shape, main, exp_avg), (loaded_shape, loaded_main, loaded_exp_avg) in zip(saved, loaded):
        assert shape == loaded_shape and torch.equal(loaded_main, main) and torch.equal(loaded_exp_avg, exp_avg)
    # With the optimizer's state the next step continues the run exactly.
    assert torch.equal(ck["resumed"]["loss"], ck["after_save"]["loss"])
    for name, (bits, scale) in ck["after_fp8"].items():
        assert torch.equal(ck["resumed_fp8"][name][0], bits) and torch.equal(ck["resumed_fp8"][name][1], scale)


def test_grouped_gemm_reads_the_stored_codes(monkeypatch):
    """The forward of an FP8 expert parameter casts the input only (the weight enters as its stored codes)."""
    torch.manual_seed(0)
    weight = make_fp8_param(torch.nn.Parameter(torch.randn(2, 32, 16) * 0.1), scaling="rowwise")
    weight.main_grad = torch.zeros(2, 32, 16)
    casts = []
    original = fpg.quantize_dequantize_e4m3

    def spy(t, dim):
        casts.append(tuple(t.shape))
        return original(t, dim)

    monkeypatch.setattr(fpg, "quantize_dequantize_e4m3", spy)
    x = torch.randn(24, 16)
    with torch.no_grad():
        out = fpg.fp8_param_grouped_gemm(x, weight, counts=[10, 14])
    assert casts == [(24, 16)]
    want = torch.cat([original(x[:10], -1) @ dequantize_fp8_tensor(weight)[0].t(),
                      original(x[10:], -1) @ dequantize_fp8_tensor(weight)[1].t()])
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_fp8_expert_param_needs_main_grad():
    weight = make_fp8_param(torch.nn.Parameter(torch.randn(2, 16, 16)), scaling="rowwise")
    x = torch.randn(4, 16, requires_grad=True)
    out = fpg.fp8_param_grouped_gemm(x, weight, counts=[2, 2])
    with pytest.raises(RuntimeError, match="main_grad"):
        out.sum().backward()
    with pytest.raises(ValueError, match="scaling"):
        make_fp8_param(torch.nn.Parameter(torch.randn(4)), scaling="rowwise")
    with pytest.raises(ValueError, match="row-wise"):
        fpg.fp8_param_grouped_gemm(x, make_fp8_param(torch.nn.Parameter(torch.randn(2, 16, 16))), counts=[2, 2])


def _sgm_operands(dtype: torch.dtype, device: str = "cpu"):
    from tests.fp8.test_fp8_scaled_grouped_mm import COUNTS, _operands

    x, w, dy = (t.to(device) for t in _operands(4, dtype))
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return x, w, dy, ends


def _hp_and_fp8_param_paths(x, w, dy, ends, compile_backend: str | None) -> tuple[tuple, tuple]:
    """``(out, dx, dW)`` of ScaledGroupedMm on the high-precision weight and of ScaledGroupedMmFp8Param on the same
    weight made an FP8 parameter (``dW`` from its ``main_grad``), eager or compiled with ``fullgraph=True``."""
    from megatron_core.fp8 import scaled_grouped_mm as sgm

    def hp_step(x, w):
        return sgm.ScaledGroupedMm.apply(x, w, ends)

    def fp8_step(x, w, main_grad):
        return fpg.ScaledGroupedMmFp8Param.apply(x, w, ends, w.fp8_scale, main_grad, "empty")

    if compile_backend is not None:
        hp_step = torch.compile(hp_step, backend=compile_backend, fullgraph=True)
        fp8_step = torch.compile(fp8_step, backend=compile_backend, fullgraph=True)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    out1 = hp_step(x1, w1)
    out1.backward(dy)
    x2 = x.clone().requires_grad_()
    w2 = make_fp8_param(torch.nn.Parameter(w.clone()), scaling="rowwise")
    w2.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    w2.grad_added_to_main_grad = False
    out2 = fp8_step(x2, w2, w2.main_grad)
    out2.backward(dy)
    assert w2.grad is not None and w2.grad.dtype == torch.float8_e4m3fn  # a placeholder (DDP's hook drops it)
    return (out1.detach(), x1.grad, w1.grad.float()), (out2.detach(), x2.grad, w2.main_grad)


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_scaled_grouped_mm_with_fp8_param_equals_the_cast_in_forward(monkeypatch, compile_backend):
    """The Hopper path with pre-quantized weights (``torch._scaled_grouped_mm`` replaced by its fp32 statement, as in
    tests/fp8/test_fp8_scaled_grouped_mm.py) gives what ScaledGroupedMm gives on the high-precision weight, bit for bit:
    the same codes and scales enter the same GEMMs; ``dW`` lands in ``main_grad``. Eager and compiled (fullgraph)."""
    from megatron_core.fp8 import scaled_grouped_mm as sgm
    from tests.fp8.test_fp8_scaled_grouped_mm import _reference_kernel

    monkeypatch.setattr(sgm, "_KERNEL", _reference_kernel)
    x, w, dy, ends = _sgm_operands(torch.float32)
    hp, fp8 = _hp_and_fp8_param_paths(x, w, dy, ends, compile_backend)
    for got, want in zip(fp8, hp):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad_in_gemm", [False, True], ids=["wgrad-add", "wgrad-in-gemm"])
@pytest.mark.parametrize("compile_backend", [None, "inductor"])
def test_hopper_fp8_param_grouped_gemm_equals_the_bf16_weight_path(compile_backend, wgrad_in_gemm, monkeypatch):
    """On Hopper (bf16, the real kernel and Triton casts): the forward with the FP8 parameter equals the bf16-weight path
    bit for bit; the gradients (dx, and dW in main_grad against the bf16 weight's gradient) within 1e-2 relative; also
    with the weight gradient added into main_grad by the Triton grouped GEMM (``ACCUMULATE_WGRAD_IN_GEMM``)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (FP8 grouped GEMMs)")
    monkeypatch.setattr(fpg, "ACCUMULATE_WGRAD_IN_GEMM", wgrad_in_gemm)
    x, w, dy, ends = _sgm_operands(torch.bfloat16, "cuda")
    hp, fp8 = _hp_and_fp8_param_paths(x, w, dy, ends, compile_backend)
    assert torch.equal(fp8[0], hp[0])
    for got, want in zip(fp8[1:], hp[1:]):
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert error < 1e-2, error


def test_fp8_expert_params_keep_their_bytes_through_a_dtype_cast():
    """``Float16Module`` (``.to(bfloat16)``) leaves the experts' FP8 bytes and scales as they are and makes bf16 their
    high-precision dtype (of their gradients and of their checkpointed values)."""
    from megatron_core.transformer.module import Float16Module

    torch.manual_seed(0)
    model = build("mixtral", fp8_param=True, bf16=True, **FP8)
    convert_to_float8(model, emulate=True)
    before = _expert_fp8(model)
    assert len(before) == 4
    wrapped = Float16Module(model.config, model)
    for name, (bits, scale) in _expert_fp8(model).items():
        assert torch.equal(bits, before[name][0]) and torch.equal(scale, before[name][1]), name
        assert model.get_parameter(name).fp8_hp_dtype == torch.bfloat16
    state = wrapped.state_dict()
    entries = [k for k in state if ".experts.linear_fc" in k and ".weight" in k]
    assert len(entries) == 4 * 4 and all(state[k].dtype == torch.bfloat16 for k in entries)


def test_emulated_fp8_param_grouped_gemm_compiles_without_graph_breaks():
    """The CPU (emulated) path under ``torch.compile(fullgraph=True)`` (``aot_eager``): output, input gradient and
    ``main_grad`` equal eager's bit for bit; the weight's autograd gradient is the placeholder."""
    torch.manual_seed(0)
    hp = torch.randn(3, 32, 16) * 0.1
    x = torch.randn(40, 16)
    dy = torch.randn(40, 32)
    counts = [8, 0, 32]

    def run(compiled: bool):
        weight = make_fp8_param(torch.nn.Parameter(hp.clone()), scaling="rowwise")
        weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(3, 32, 16), False
        fn = lambda inp, w: fpg.fp8_param_grouped_gemm(inp, w, counts=counts, emulate=True)  # noqa: E731
        if compiled:
            fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
        xx = x.clone().requires_grad_()
        out = fn(xx, weight)
        out.backward(dy)
        assert weight.grad is not None and weight.grad.dtype == torch.float8_e4m3fn
        return out.detach(), xx.grad, weight.main_grad

    for got, want in zip(run(True), run(False)):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)


CUDA_STEPS = 5
# At 1e-3 Adam on one batch took the loss from 4.24 to about 1 in 5 steps on the H200, and flipped routing
# decisions turned the dense kernels' rounding differences into 9% between the two FP8 runs (each about 4% from a
# run without FP8, on either side): a test of chaos, not of FP8 parameters.
CUDA_LR = 1e-4
CUDA_SEQ = MAX_SEQ  # 16 tokens per micro-batch: the dense layers' FP8 weight-gradient GEMM (torchao) needs a multiple of 16


def _cuda_moe_run(fp8_param: bool, fp8: bool = True) -> dict:
    """Five Adam steps of a bf16 MoE GPT on one batch: FP8 (the experts' weights FP8 parameters with ``fp8_param``),
    or no FP8 at all with ``fp8=False`` (the yardstick)."""
    torch.manual_seed(0)
    precision = {**FP8, "fp8": "hybrid"} if fp8 else {k: v for k, v in FP8.items() if not k.startswith("fp8")}
    model = build("mixtral", fp8_param=fp8_param, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                  num_query_groups=4, bf16=True, params_dtype=torch.bfloat16, **precision).cuda()
    if fp8:
        convert_to_float8(model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=fp8_param), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=CUDA_LR, bf16=True, use_distributed_optimizer=True), [ddp])
    batch = tuple(t.cuda() for t in batches(1, seq=CUDA_SEQ)[0])
    losses = torch.stack([_step(model, ddp, opt, batch)["loss"] for _ in range(CUDA_STEPS)]).cpu()
    expert = [p for n, p in model.named_parameters() if n.endswith(EXPERT_KEYS)]
    return dict(losses=losses, expert_bytes=sum(p.numel() * p.element_size() for p in expert),
                expert_numel=sum(p.numel() for p in expert))


@pytest.mark.gpu
def test_fp8_expert_params_on_hopper_track_fp8_experts_on_bf16_weights(tmp_path):
    """A bf16 MoE GPT on Hopper (``torch._scaled_grouped_mm``), 5 Adam steps under DDP + the distributed optimizer:
    with fp8_param the first loss equals the bf16-weight FP8 run's within 1e-3 (the experts' GEMMs identical, the
    dense ones differing by their kernels: torchao's bf16 weight gradient against ours accumulated in fp32); later
    ones within 1% or within the distance of the bf16-weight FP8 run from a run without FP8, as the dense test
    (tests/fp8/test_fp8_param.py) bounds it, and falling; expert weights take 1 byte per element."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (FP8 grouped GEMMs)")
    with one_rank_nccl_group(tmp_path):
        hp, fp8, bf16 = _cuda_moe_run(False), _cuda_moe_run(True), _cuda_moe_run(False, fp8=False)
    losses = (fp8["losses"], hp["losses"], bf16["losses"])
    assert abs(fp8["losses"][0] - hp["losses"][0]) / hp["losses"][0] < 1e-3, losses
    spread = ((hp["losses"] - bf16["losses"]).abs() / bf16["losses"]).max().item()
    assert ((fp8["losses"] - hp["losses"]).abs() / hp["losses"]).max() < max(1e-2, spread), losses
    assert fp8["losses"][-1] < fp8["losses"][0]
    assert fp8["losses"][-1] < fp8["losses"][0]
    assert fp8["expert_bytes"] == fp8["expert_numel"] and hp["expert_bytes"] == 2 * hp["expert_numel"]


def test_fp8_param_grouped_gemm_dispatches_to_the_hopper_path(monkeypatch):
    """``fp8_param_grouped_gemm`` on the Hopper path (forced here, the kernel replaced by its fp32 statement) equals the
    fp32 emulation on the same FP8 parameter within 1e-5 (as ScaledGroupedMm equals EmulatedFp8GroupedGemm), with
    host counts and with device-style ``ends``; both add the weight gradient to ``main_grad``."""
    from megatron_core.fp8 import scaled_grouped_mm as sgm
    from tests.fp8.test_fp8_scaled_grouped_mm import COUNTS, _reference_kernel

    x, w, dy, ends = _sgm_operands(torch.float32)
    results = []
    for path in ("emulated", "counts", "ends"):
        if path != "emulated":
            monkeypatch.setattr(sgm, "_KERNEL", _reference_kernel)
            monkeypatch.setattr(fpg, "scaled_grouped_mm_supported", lambda _: True)
        weight = make_fp8_param(torch.nn.Parameter(w.clone()), scaling="rowwise")
        weight.main_grad = torch.zeros(w.shape)
        xx = x.clone().requires_grad_()
        groups = dict(ends=ends) if path == "ends" else dict(counts=COUNTS)
        out = fpg.fp8_param_grouped_gemm(xx, weight, **groups)
        out.backward(dy)
        results.append((out.detach(), xx.grad, weight.main_grad))
    emulated = results[0]
    for got in results[1:]:
        for a, b in zip(got, emulated):
            assert b.abs().max() > 0
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
