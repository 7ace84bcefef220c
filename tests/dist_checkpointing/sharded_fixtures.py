"""Hand-made sharded state dicts with known global values, for any (TP, PP, DP) layout.

Every global tensor is a deterministic function of its key, so a rank can check that what it
loaded equals the matching slice of the global tensor under whatever layout it runs.
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state
from megatron_core.dist_checkpointing import (
    ShardedObject,
    ShardedTensor,
    apply_swiglu_sharded_factory,
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)

NUM_LAYERS = 4
GLOBAL_SHAPES = {"col": (8, 6), "row": (6, 8), "rep": (5,), "layers.w": (NUM_LAYERS, 8, 6), "fc1": (16, 6)}


def global_tensor(key: str) -> torch.Tensor:
    """The reference global value of ``key``."""
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(GLOBAL_SHAPES[key], generator=gen)


def _tp_slice(t: torch.Tensor, axis: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=axis)[rank].clone()


def build_state_dict(empty: bool = False, with_rng: bool = True) -> dict:
    """This rank's sharded state dict under the current parallel_state layout (zeros if ``empty``).

    ``rng`` is a per-(pp, tp) object: it only loads under the layout it was saved with.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()

    def value(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t

    tp_sharded = (pp_rank, 0, dp_rank)  # present on every stage: stage 0 holds the main replica
    sd: dict = {
        "col": make_tp_sharded_tensor_for_checkpoint(
            value(_tp_slice(global_tensor("col"), 0, tp_rank, tp)), "col", 0, replica_id=tp_sharded),
        "row": make_tp_sharded_tensor_for_checkpoint(
            value(_tp_slice(global_tensor("row"), 1, tp_rank, tp)), "row", 1, replica_id=tp_sharded),
        "nested": {"rep": make_sharded_tensor_for_checkpoint(value(global_tensor("rep").clone()), "rep",
                                                             replica_id=(pp_rank, tp_rank, dp_rank)),
                   "lr": 0.5},
        "rng": ShardedObject("rng", None if empty else {"pp": pp_rank, "tp": tp_rank}, (pp, tp), (pp_rank, tp_rank),
                             replica_id=dp_rank),
        "iteration": 3,
    }
    if not with_rng:
        del sd["rng"]
    full_fc1 = global_tensor("fc1")
    gate, up = full_fc1.chunk(2)
    local_fc1 = torch.cat([_tp_slice(gate, 0, tp_rank, tp), _tp_slice(up, 0, tp_rank, tp)])
    sd["fc1"] = apply_swiglu_sharded_factory(
        make_tp_sharded_tensor_for_checkpoint(value(local_fc1), "fc1", 0, replica_id=tp_sharded))
    per_stage = NUM_LAYERS // pp
    layers = global_tensor("layers.w")
    for local in range(per_stage):
        g = pp_rank * per_stage + local
        sd[f"layers.{local}.w"] = make_tp_sharded_tensor_for_checkpoint(
            value(_tp_slice(layers[g], 0, tp_rank, tp)), "layers.w", 0, prepend_offsets=((0, g, NUM_LAYERS),)
        )
    return sd


def expected_state_dict(with_rng: bool = True) -> dict:
    """What :func:`build_state_dict` (non-empty) holds after merging factories: plain values."""
    from megatron_core.dist_checkpointing import ShardedTensorFactory

    out = {}
    for k, v in build_state_dict(with_rng=with_rng).items():
        if isinstance(v, ShardedTensorFactory) or isinstance(v, ShardedTensor):
            out[k] = v.data
        elif isinstance(v, ShardedObject):
            out[k] = v.data
        elif isinstance(v, dict):
            out[k] = {kk: (vv.data if isinstance(vv, ShardedTensor) else vv) for kk, vv in v.items()}
        else:
            out[k] = v
    return out


def assert_same(actual, expected, path: str = "") -> None:
    """Recursive exact equality with a helpful path in the error."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{path}: keys {actual!r} vs {expected!r}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected), f"{path}: tensors differ"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
