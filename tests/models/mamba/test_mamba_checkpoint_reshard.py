"""A hybrid Mamba model's distributed checkpoint reshards: saved at TP=2 it loads at TP=1 (and back) bit for bit.

The mixer's fused tensors hold each TP rank's own sections (``in_proj``: z, x, B, C, dt; ``conv1d``: x, B, C),
so the checkpoint stores every section as its own TP-independent tensor (Megatron-Core's
``in_proj.weight.{z,x,B,C,dt}`` and ``conv1d.{weight,bias}.{x,B,C}``); stored whole, a TP=2 checkpoint would
reload at TP=1 with the conv channels of the two ranks interleaved.
"""

from __future__ import annotations

import torch

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.models.mamba.mamba_test_utils import build
from tests.models.mamba.test_mamba_tensor_parallel import PATTERN, shard, unshard


def _reference_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    return {k: v.detach().clone() for k, v in build(PATTERN).named_parameters()}


def _tp_model(tp: int, state: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    torch.manual_seed(99)  # other weights than the reference's, so a load that misses a tensor shows
    model = build(PATTERN, tensor_model_parallel_size=tp)
    if state is not None:
        rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], tp, rank))
    return model


def _gathered(model: torch.nn.Module, tp: int) -> dict[str, torch.Tensor]:
    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, param in model.named_parameters():
        pieces = [torch.empty_like(param) for _ in range(tp)]
        torch.distributed.all_gather(pieces, param.detach().contiguous(), group=group)
        out[name] = unshard(name, pieces)
    return out


def _save_then_load(ckpt: str, save_tp: int, load_tp: int) -> list[str]:
    state = _reference_state()
    for tp, action in ((save_tp, "save"), (load_tp, "load")):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            model = _tp_model(tp, state if action == "save" else None)
            if action == "save":
                dist_checkpointing.save(model.sharded_state_dict(), ckpt)
                continue
            loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
            model.load_state_dict(loaded, strict=False)
            for name, value in _gathered(model, tp).items():
                torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        finally:
            parallel_state.destroy_model_parallel()
    return sorted(dist_checkpointing.load_tensors_metadata(ckpt))


def test_tp2_checkpoint_loads_at_tp1(tmp_path):
    keys = run_on_ranks(2, _save_then_load, str(tmp_path / "tp2"), 2, 1)[0]
    mixer = "decoder.layers.0.mixer."
    assert {f"{mixer}conv1d.weight.{p}" for p in "xBC"} | {f"{mixer}conv1d.bias.{p}" for p in "xBC"} <= set(keys)
    assert {f"{mixer}in_proj.weight.{p}" for p in ("z", "x", "B", "C", "dt")} <= set(keys)
    assert f"{mixer}conv1d.weight" not in keys


def test_tp1_checkpoint_loads_at_tp2(tmp_path):
    run_on_ranks(2, _save_then_load, str(tmp_path / "tp1"), 1, 2)
