"""Multi-token prediction of a hybrid model ("M*M-/*M/*M") under model parallelism, against one process.

- TP=2, with and without sequence parallelism: per-token loss and every gradient (MTP depths included).
- PP=2 through the pipeline schedule: the MTP depths and a copy of the embedding live on the last stage; every
  micro-batch's loss and every gradient (both embedding copies carry the whole model's embedding gradient).
- A distributed checkpoint saved at TP=2 loads at TP=1 bit for bit.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from megatron_core.distributed import finalize_model_grads
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.pipeline_parallel import forward_backward_no_pipelining, get_forward_backward_func
from megatron_core.training.model_builder import get_model
from megatron_core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
from tests.dist_harness import run_on_ranks
from tests.models.hybrid.hybrid_mtp_utils import MAX_SEQ, PATTERN, build, make_batch
from tests.models.mamba import test_mamba_tensor_parallel as mamba_tp
from tests.models.mamba.mamba_test_utils import VOCAB, config

_REPLICATED = ("enorm.weight", "hnorm.weight")  # the MTP norms (the rest follows the Mamba TP test's layout)
EMBEDDING = "embedding.word_embeddings.weight"


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return full if name.endswith(_REPLICATED) else mamba_tp.shard(name, full, tp, rank)


def unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if name.endswith(_REPLICATED) else mamba_tp.unshard(name, pieces)


def _reset_mtp_state() -> None:
    """Rank-pool processes are reused: leave the MTP loss scale and tracker as a fresh process has them."""
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def _loaded_tp_model(state: dict[str, torch.Tensor] | None, tp: int, **overrides) -> HybridModel:
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    model = build(seed=99, tensor_model_parallel_size=tp, **overrides)
    if state is not None:
        rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], tp, rank))
    return model


def _gather(name: str, tensor: torch.Tensor, tp: int, group) -> torch.Tensor:
    pieces = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return unshard(name, pieces)


# --- tensor parallelism ---------------------------------------------------------------------------------------------
def _check_tp(sequence_parallel: bool) -> str:
    ref = build(seed=1234)
    ids, pos, labels, mask = make_batch()
    ref_loss = ref(ids, pos, None, labels=labels, loss_mask=mask)
    ref_loss.sum().backward()
    state = {k: v.detach() for k, v in ref.named_parameters()}
    ref_grads = {k: v.grad for k, v in ref.named_parameters()}
    _reset_mtp_state()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        model = _loaded_tp_model(state, 2, sequence_parallel=sequence_parallel)
        group = parallel_state.get_tensor_model_parallel_group()
        loss = model(ids, pos, None, labels=labels, loss_mask=mask)
        loss.sum().backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            torch.testing.assert_close(_gather(name, grad, 2, group), ref_grads[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
    finally:
        _reset_mtp_state()
        parallel_state.destroy_model_parallel()
    return "ok"


def test_tp2_matches_single_process():
    assert run_on_ranks(2, _check_tp, False) == ["ok", "ok"]


def test_tp2_sequence_parallel_matches_single_process():
    assert run_on_ranks(2, _check_tp, True) == ["ok", "ok"]


# --- checkpoint resharding ------------------------------------------------------------------------------------------
def _save_then_load(ckpt: str) -> list[str]:
    state = {k: v.detach().clone() for k, v in build(seed=1234).named_parameters()}
    for tp, action in ((2, "save"), (1, "load")):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            model = _loaded_tp_model(state if action == "save" else None, tp)
            if action == "save":
                dist_checkpointing.save(model.sharded_state_dict(), ckpt)
                continue
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt), strict=False)
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.detach(), state[name], rtol=0, atol=0,
                                           msg=lambda m, n=name: f"{n}: {m}")
        finally:
            parallel_state.destroy_model_parallel()
    return sorted(dist_checkpointing.load_tensors_metadata(ckpt))


def test_tp2_checkpoint_loads_at_tp1(tmp_path):
    keys = set(run_on_ranks(2, _save_then_load, str(tmp_path / "tp2"))[0])
    depth = "mtp.layers.1."
    assert {f"{depth}eh_proj.weight", f"{depth}mtp_model_layer.layers.0.self_attention.linear_qkv.weight",
            f"{depth}mtp_model_layer.layers.1.mixer.in_proj.weight.z"} <= keys


# --- pipeline parallelism -------------------------------------------------------------------------------------------
MICRO, MBS, SEQ = 2, 2, 12


def _provider(tied: bool, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
              config=None, pg_collection=None) -> HybridModel:
    return HybridModel(config, hybrid_stack_spec, VOCAB, MAX_SEQ, hybrid_layer_pattern=PATTERN,
                       position_embedding_type="rope", pre_process=pre_process, post_process=post_process,
                       share_embeddings_and_output_weights=tied, vp_stage=vp_stage, pg_collection=pg_collection)


def _batches() -> list[dict]:
    out = []
    for i in range(MICRO):
        ids, pos, labels, mask = make_batch(seed=10 + i, batch=MBS, seq=SEQ)
        out.append(dict(tokens=ids, position_ids=pos, labels=labels, loss_mask=mask))
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])

    def loss_func(per_token):
        mask = batch["loss_mask"].reshape(-1)
        loss = (per_token.reshape(-1) * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def _run_pp(tied: bool) -> dict:
    torch.manual_seed(1234)
    ref = _provider(tied, config=config("M*M-", mtp_num_layers=2))
    state = {k: v.detach().clone() for k, v in ref.named_parameters()}
    ref_losses = forward_backward_no_pipelining(forward_step_func=_forward_step, data_iterator=iter(_batches()),
                                                model=ref, num_microbatches=MICRO, seq_length=SEQ,
                                                micro_batch_size=MBS)
    ref_grads = {k: v.grad.detach().clone() for k, v in ref.named_parameters()}
    _reset_mtp_state()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        torch.manual_seed(99)
        cfg = config("M*M-", mtp_num_layers=2, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                     finalize_model_grads_func=finalize_model_grads)
        (chunk,) = get_model(partial(_provider, tied), wrap_with_ddp=False, config=cfg)
        offset = chunk.decoder.layers[0].layer_number - 1
        names = {}
        for pname, param in chunk.named_parameters():
            key = pname
            if pname.startswith("decoder.layers."):
                local, rest = pname[len("decoder.layers."):].split(".", 1)
                key = f"decoder.layers.{int(local) + offset}.{rest}"
            names[param] = key
            with torch.no_grad():
                param.copy_(state[key])
        losses = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(_batches()),
                                             model=chunk, num_microbatches=MICRO, seq_length=SEQ,
                                             micro_batch_size=MBS)
        last = parallel_state.is_pipeline_last_stage()
        if last:
            torch.testing.assert_close(torch.stack([d["lm loss"] for d in losses]),
                                       torch.stack([d["lm loss"] for d in ref_losses]), rtol=1e-5, atol=1e-5)
        for param, key in names.items():
            torch.testing.assert_close(param.grad, ref_grads[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key: f"stage {int(last)} {k}: {m}")
        return {"last": last, "mtp": chunk.mtp_process, "names": sorted(names.values())}
    finally:
        _reset_mtp_state()
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tied", [False, True])
def test_pp2_mtp_on_the_last_stage_matches_single_process(tied: bool):
    first, last = sorted(run_on_ranks(2, _run_pp, tied), key=lambda r: r["last"])
    assert not first["mtp"] and last["mtp"]
    assert EMBEDDING in first["names"] and EMBEDDING in last["names"]  # the last stage embeds the shifted tokens
    assert any(n.startswith("mtp.layers.1.") for n in last["names"])
    assert ("output_layer.weight" in last["names"]) != tied  # tied: the last stage's embedding copy is the head
