"""``MCoreTensorAwareStateDict`` round trips: state dict -> tensor-aware -> hollow + tensors -> state dict.

A tiny GPT's sharded state dict (with a SwiGLU factory) plus common values, per-rank objects, a
non-persistent entry and a list is wrapped, its tensors popped and serialized (as a local checkpoint
manager does), the model's weights are wiped, and the rebuilt state dict must restore every
parameter bit for bit, on 1 and 2 gloo ranks. With ``fully_parallel`` on 2 data-parallel ranks
every replicated shard is kept by exactly one rank and broadcast back on load.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from megatron_core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks


def _model() -> GPTModel:
    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            normalization="RMSNorm", use_cpu_initialization=True)
    return GPTModel(cfg, get_gpt_layer_local_spec(), 32, 8, position_embedding_type="rope")


def _state(model: GPTModel, extra: torch.Tensor) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        "model": model.sharded_state_dict(),
        "iteration": 7,
        "rng": ShardedObject("rng", {"seed": 100 + rank}, (world,), (rank,)),
        "np": LocalNonpersistentObject("local"),
        "list": [ShardedTensor.from_rank_offsets("extra", extra, replica_id=rank), "tail"],
    }


def _serialize(tensors: list[torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save([t.clone() for t in tensors], buffer)
    return buffer.getvalue()


def _round_trip(algo: str, use_init: bool) -> tuple[int, list]:
    parallel_state.initialize_model_parallel()
    try:
        group = parallel_state.get_data_parallel_group()
        model = _model()
        reference = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        extra = torch.arange(6.0).reshape(2, 3)
        tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_state(model, extra), algo=algo,
                                                            parallelization_group=group)
        kept = [(sh.key, sh.global_offset) for sh in _sharded(tasd) if sh.data is not None]
        assert len(list(tasd.tensors)) == len(kept)
        assert "np" not in tasd.common and tasd.common["iteration"] == 7 and tasd.common["list"] == [None, "tail"]

        tensors = tasd.pop_tensors()
        assert tasd.is_hollow and all(sh.data is None for sh in _sharded(tasd))
        with pytest.raises(CheckpointingException, match="hollow"):
            tasd.pop_tensors()
        hollow = pickle.loads(pickle.dumps(tasd))  # what a local checkpoint manager stores next to the tensors
        saved = torch.load(io.BytesIO(_serialize(tensors)), weights_only=True)
        with torch.no_grad():  # the live model loses its weights
            for p in model.parameters():
                p.zero_()
        if use_init:
            hollow.init_tensors()
            for slot, value in zip(hollow.tensors, saved, strict=True):
                slot.copy_(value)
        else:
            hollow.insert_tensors(saved)
        assert not hollow.is_hollow

        request = _state(model, torch.zeros(2, 3))
        loaded = hollow.to_state_dict(request, algo=algo, parallelization_group=group)
        model.load_state_dict(loaded["model"])
        for name, value in model.state_dict().items():
            if name in reference:
                assert torch.equal(value, reference[name]), name
        assert loaded["iteration"] == 7 and loaded["np"] == "local"
        assert loaded["rng"] == {"seed": 100 + dist.get_rank()}
        assert torch.equal(loaded["list"][0], extra) and loaded["list"][1] == "tail"
        assert isinstance(request["np"], LocalNonpersistentObject)  # the request is left unchanged
        return len(kept), kept
    finally:
        parallel_state.destroy_model_parallel()


def _sharded(tasd: MCoreTensorAwareStateDict) -> list[ShardedTensor]:
    from megatron_core.dist_checkpointing.dict_utils import nested_values

    return [sh for sh in nested_values(tasd.sharded_state_dict) if isinstance(sh, ShardedTensor)]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("algo", "use_init"), [("atomic", False), ("fully_parallel", True)])
def test_round_trip_restores_model_exactly(world, algo, use_init):
    results = run_on_ranks(world, _round_trip, algo, use_init)
    counts = [n for n, _ in results]
    kept = [set(k) for _, k in results]
    if algo == "atomic" or world == 1:
        assert all(n == counts[0] for n in counts)
    else:  # every replicated shard kept by exactly one rank, the work spread over both
        assert not kept[0] & kept[1]
        total = _round_trip_total()
        assert kept[0] | kept[1] == total and all(0 < n < len(total) for n in counts)


def _round_trip_total() -> set:
    return set(run_on_ranks(1, _round_trip, "atomic", False)[0][1])


def _toy() -> dict:
    return {"a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0)),
            "b": ShardedObject("b", [1, 2], (1,), (0,)), "c": 5}


def test_strict_handling_and_errors():
    tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(_toy(), algo="atomic")
    assert distribution is None
    request = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(4)),
               "z": ShardedTensor.from_rank_offsets("z", torch.zeros(1))}
    with pytest.raises(CheckpointingException, match="'z'"):
        tasd.to_state_dict(request)
    state, missing, unexpected = tasd.to_state_dict(request, strict="return_all", return_mismatch_keys=True)
    assert missing == {"z"} and unexpected == {"b"}
    assert torch.equal(state["a"], torch.arange(4.0)) and "z" not in state and state["c"] == 5
    with pytest.raises(CheckpointingException, match="not requested"):
        tasd.to_state_dict({"a": request["a"]}, strict="raise_unexpected")
    assert tasd.to_state_dict({}) == {"c": 5}
    with pytest.raises(NotImplementedError):
        MCoreTensorAwareStateDict.from_state_dict(_toy(), algo="other")
    tasd.pop_tensors()
    with pytest.raises(CheckpointingException, match="shape"):
        tasd.insert_tensors([torch.zeros(3)])
    with pytest.raises(CheckpointingException, match="hollow"):
        tasd.to_state_dict(request)


def test_copy_to_cpu_keeps_originals():
    original = torch.arange(4.0)
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(
        {"a": ShardedTensor.from_rank_offsets("a", original)}, algo="atomic")
    tasd.copy_tensors_to_cpu()
    (copy,) = list(tasd.tensors)
    assert torch.equal(copy, original) and copy.data_ptr() != original.data_ptr()
    tasd.restore_tensor_device()
    assert list(tasd.tensors)[0] is copy  # already on its original (CPU) device
    assert list(tasd.values())[:1] == [tasd.common]
