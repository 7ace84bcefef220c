"""Multi-token prediction under pipeline parallelism against one process.

The MTP layers live on the last pipeline stage, or (``pipeline_model_parallel_layout``, ``mtp_standalone``) on a
stage before it that sends the decoder's and the depths' hidden states on concatenated while the last stage only
computes the losses; the MTP stage holds a copy of the first stage's word embedding (it embeds the shifted tokens). Each case builds the model's chunks on gloo ranks, loads the weights of a
single-process MTP model (same seed), runs ``get_forward_backward_func()`` with ``finalize_model_grads`` and
compares every micro-batch's loss and every gradient with ``forward_backward_no_pipelining`` on the whole
model. Both copies of the embedding must carry the whole model's embedding gradient (decoder input, MTP
inputs and, when tied, the output layer) and must start equal. A checkpoint saved at PP=2 loads into one
process with identical weights, also from a standalone layout (PP=3, tied).
"""

from __future__ import annotations

import functools
import re
from functools import partial

import pytest
import torch

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron_core.pipeline_parallel import forward_backward_no_pipelining, get_forward_backward_func
from megatron_core.training.model_builder import get_model
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
from megatron_core.transformer.pipeline_layout import get_transformer_layer_offset
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import MAX_SEQ, VOCAB, llama_like
from tests.pipeline_parallel.gpt_stages import EMBEDDING, MBS, SEQ, make_batches

EMBEDDING_COPY = "embedding.word_embeddings.weight@mtp_stage"
OUTPUT_COPY = "output_layer.weight@tied_last_stage"  # a standalone layout's loss-only last stage, tied weights
COPIES = (EMBEDDING_COPY, OUTPUT_COPY)

CASES = {
    "pp2_untied": dict(world=2, pp=2, depths=2, tied=False, microbatches=4),
    "pp2_tied": dict(world=2, pp=2, depths=1, tied=True, microbatches=4),
    "pp2_vpp2": dict(world=2, pp=2, vpp=2, depths=1, tied=False, microbatches=4),
    "pp2_dp2_ddp": dict(world=4, pp=2, depths=1, tied=False, microbatches=2, ddp=True),
    # Standalone MTP stages: the last stage holds only the loss.
    "pp3_standalone_untied": dict(world=3, pp=3, layout="Ett|ttmm|L", depths=2, tied=False, microbatches=4),
    "pp3_standalone_tied": dict(world=3, pp=3, layout="Ett|ttm|L", depths=1, tied=True, microbatches=4),
    "pp2_first_stage_mtp_tied": dict(world=2, pp=2, layout="Ettttm|L", depths=1, tied=True, microbatches=4),
    # The MTP chunk alone on rank 1's last virtual stage; the final norm on rank 0's last virtual stage.
    "pp3_vpp2_standalone": dict(world=3, pp=3, vpp=2, layout="Et|t|t|t|m|L", depths=1, tied=True, microbatches=6),
    "pp3_dp2_standalone_ddp": dict(world=6, pp=3, layout="Ett|ttm|L", depths=1, tied=False, microbatches=2,
                                   ddp=True),
}


def _config(case: dict, **sizes) -> TransformerConfig:
    spec = llama_like(num_layers=4, mtp_num_layers=case["depths"])
    return TransformerConfig(**spec["config"], **sizes)


def _copy_key(chunk: GPTModel, pname: str) -> str | None:
    """The key of a copy of the word embedding on a stage other than the first (None for other parameters)."""
    if pname == EMBEDDING and not chunk.pre_process:
        return EMBEDDING_COPY
    if pname == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        return OUTPUT_COPY
    return None


def _provider(case: dict, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
              config: TransformerConfig | None = None, pg_collection=None) -> GPTModel:
    """A ``model_provider_func`` for ``get_model``: the MTP model of ``case`` or one pipeline chunk of it."""
    layer = get_gpt_layer_local_spec()
    return GPTModel(config, layer, VOCAB, MAX_SEQ, pre_process=pre_process, post_process=post_process,
                    vp_stage=vp_stage, pg_collection=pg_collection, position_embedding_type="rope",
                    share_embeddings_and_output_weights=case["tied"],
                    mtp_block_spec=get_gpt_mtp_block_spec(config, layer, False, vp_stage=vp_stage))


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])

    def loss_func(per_token):
        mask = batch["loss_mask"].reshape(-1).float()
        loss = torch.sum(per_token.float().reshape(-1) * mask) / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


@functools.cache
def _reference(name: str):
    """Weights, per-micro-batch losses and gradients of the whole model over every replica's micro-batches."""
    case = CASES[name]
    torch.manual_seed(1234)
    model = _provider(case, config=_config(case))
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    dp = case["world"] // case["pp"]
    batches = make_batches(case["microbatches"] * dp, seed=7)
    losses = forward_backward_no_pipelining(forward_step_func=_forward_step, data_iterator=iter(batches), model=model,
                                            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS)
    _reset_mtp_state()
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    return state, [d["lm loss"] for d in losses], grads


def _reset_mtp_state() -> None:
    """The schedules leave the MTP loss scale at 1/micro-batches and the tracker filled: reset both (processes are
    reused by later tests)."""
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def _global_name(name: str, offset: int) -> str:
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _embedding_ranks() -> list[int] | None:
    """The global ranks of this rank's embedding group (None when it is in none)."""
    group = parallel_state.get_embedding_group(check_initialized=False)
    return None if group is None else torch.distributed.get_process_group_ranks(group)


def _run_case(name: str, reference: tuple) -> dict:
    case = CASES[name]
    state, _, _ = reference
    pp, vpp = case["pp"], case.get("vpp")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    try:
        seed = 99 + parallel_state.get_pipeline_model_parallel_rank()
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        config = _config(case, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                         pipeline_model_parallel_layout=case.get("layout"), pipeline_dtype=torch.float32,
                         finalize_model_grads_func=finalize_model_grads)
        chunks = get_model(partial(_provider, case), wrap_with_ddp=False, config=config)
        names, init_copies = {}, {}
        for v, chunk in enumerate(chunks):
            offset = get_transformer_layer_offset(config, vp_stage=v if vpp else None)
            for pname, param in chunk.named_parameters():
                key = _copy_key(chunk, pname) or _global_name(pname, offset)
                if key in COPIES:
                    init_copies[key] = param.detach().clone()
                elif pname == EMBEDDING:
                    init_copies["first"] = param.detach().clone()
                names[param] = key
                with torch.no_grad():
                    param.copy_(state[EMBEDDING if key in COPIES else key])
        models = chunks
        if case.get("ddp"):
            models = [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]
            config.no_sync_func = [m.no_sync for m in models] if vpp else models[0].no_sync
        dp_rank = parallel_state.get_data_parallel_rank()
        count = case["microbatches"]
        mine = make_batches(count * parallel_state.get_data_parallel_world_size(), seed=7)
        mine = mine[dp_rank * count:(dp_rank + 1) * count]
        iterators = [iter(mine) for _ in models]
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iterators if vpp else iterators[0],
            model=models if vpp else models[0], num_microbatches=count, seq_length=SEQ, micro_batch_size=MBS)
        grads = {}
        for param, key in names.items():
            grad = param.main_grad if case.get("ddp") else param.grad
            grads[key] = None if grad is None else grad.detach().clone()
        return {"dp_rank": dp_rank, "is_last": parallel_state.is_pipeline_last_stage(),
                "losses": [d["lm loss"] for d in losses], "grads": grads, "init_copies": init_copies,
                "embedding_ranks": _embedding_ranks(), "standalone": config.mtp_standalone}
    finally:
        _reset_mtp_state()
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("name", list(CASES))
def test_mtp_under_pipeline_parallelism_matches_one_process(name: str):
    case = CASES[name]
    reference = _reference(name)
    _, ref_losses, ref_grads = reference
    per_rank = run_on_ranks(case["world"], _run_case, name, reference)
    count = case["microbatches"]
    seen = set()
    for r in per_rank:
        if r["is_last"]:
            mine = ref_losses[r["dp_rank"] * count:(r["dp_rank"] + 1) * count]
            torch.testing.assert_close(torch.stack(r["losses"]), torch.stack(mine), rtol=1e-5, atol=1e-5)
        else:
            assert r["losses"] == []
        firsts = [q["init_copies"]["first"] for q in per_rank if "first" in q["init_copies"]]
        for key in COPIES:
            if key in r["init_copies"]:
                # A later stage's copy of the embedding started equal to the first stage's (synchronised at build).
                torch.testing.assert_close(r["init_copies"][key], firsts[0], rtol=0, atol=0)
        for key, grad in r["grads"].items():
            want = ref_grads[EMBEDDING if key in COPIES else key]
            # Under DP the replicas' gradients are averaged over their micro-batches: the reference ran all of them.
            assert grad is not None, key
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{name} {k}: {m}")
            seen.add(key)
    assert EMBEDDING in seen and (EMBEDDING_COPY in seen or case.get("layout", "").startswith("Ettttm"))
    if case["tied"] and case.get("layout"):
        assert OUTPUT_COPY in seen
    assert seen - set(COPIES) == set(ref_grads), set(ref_grads) ^ (seen - set(COPIES))
    assert all(r["standalone"] == bool(case.get("layout")) for r in per_rank)
    if case.get("layout"):
        # The embedding groups hold exactly the stages with a copy: first, MTP, and the last one when tied.
        stages = {"Ett|ttm|L": [0, 1], "Ett|ttmm|L": [0, 1], "Ettttm|L": [0], "Et|t|t|t|m|L": [0, 1]}[case["layout"]]
        stages = stages + [case["pp"] - 1] * case["tied"]
        dp = case["world"] // case["pp"]
        for rank, r in enumerate(per_rank):
            stage, dp_rank = divmod(rank, dp)
            group = [p * dp + dp_rank for p in sorted(set(stages))]
            assert r["embedding_ranks"] == (group if stage in stages else None), (rank, r["embedding_ranks"])


def _save_pipelined(name: str, directory: str, reference: tuple) -> bool:
    case = CASES[name]
    state, _, _ = reference
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=case["pp"])
    try:
        config = _config(case, pipeline_model_parallel_size=case["pp"], pipeline_dtype=torch.float32,
                         pipeline_model_parallel_layout=case.get("layout"))
        (chunk,) = get_model(partial(_provider, case), wrap_with_ddp=False, config=config)
        offset = get_transformer_layer_offset(config)
        with torch.no_grad():
            for pname, param in chunk.named_parameters():
                key = _copy_key(chunk, pname) or _global_name(pname, offset)
                param.copy_(state[EMBEDDING if key in COPIES else key])
        dist_checkpointing.save(chunk.sharded_state_dict(), directory)
        return True
    finally:
        parallel_state.destroy_model_parallel()


def _load_at_pp1(name: str, directory: str) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        case = CASES[name]
        torch.manual_seed(5)
        model = _provider(case, config=_config(case))
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
        return {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("name", ["pp2_untied", "pp3_standalone_tied"])
def test_mtp_checkpoint_saved_pipelined_loads_into_one_process(tmp_path, name: str):
    """The embedding copies (MTP stage, tied last stage) are replicas: one process loads the first stage's."""
    reference = _reference(name)
    world = CASES[name]["pp"]
    assert run_on_ranks(world, _save_pipelined, name, str(tmp_path / "ckpt"), reference) == [True] * world
    (loaded,) = run_on_ranks(1, _load_at_pp1, name, str(tmp_path / "ckpt"))
    assert set(loaded) == set(reference[0])
    for key, value in reference[0].items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


def test_mtp_before_the_last_stage_without_mtp_standalone_is_refused():
    case = CASES["pp2_untied"]
    config = _config(case)
    with pytest.raises(ValueError, match="post_process=False.*mtp_standalone is False"):
        _provider(case, pre_process=False, post_process=False, config=config)


# --- a training step of the distributed optimizer keeps the embedding copies equal ---------------------------------
STEP_CASE = CASES["pp2_untied"]


def _train_steps(pp: int, reference: tuple, steps: int = 2) -> dict:
    """Parameters after ``steps`` Adam steps (distributed optimizer over DP = 4 / pp) from the reference weights."""
    from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer

    state = reference[0]
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    try:
        torch.manual_seed(3)
        config = _config(STEP_CASE, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                         finalize_model_grads_func=finalize_model_grads)
        (chunk,) = get_model(partial(_provider, STEP_CASE), wrap_with_ddp=False, config=config)
        offset = get_transformer_layer_offset(config)
        names = {}
        for pname, param in chunk.named_parameters():
            key = _global_name(pname, offset)
            names[param] = EMBEDDING_COPY if pname == EMBEDDING and not chunk.pre_process else key
            with torch.no_grad():
                param.copy_(state[key])
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), chunk)
        config.no_sync_func = ddp.no_sync
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0,
                                                           use_distributed_optimizer=True), [ddp])
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        per_replica = 4 // dp
        for step in range(steps):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            batches = make_batches(4, seed=20 + step)[dp_rank * per_replica:(dp_rank + 1) * per_replica]
            get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(batches), model=[ddp],
                                        num_microbatches=per_replica, seq_length=SEQ, micro_batch_size=MBS)
            assert optimizer.step()[0]
        return {key: param.detach().clone() for param, key in names.items()}
    finally:
        _reset_mtp_state()
        parallel_state.destroy_model_parallel()


def test_distributed_optimizer_steps_keep_the_embedding_copies_equal():
    reference = _reference("pp2_untied")
    (single,) = run_on_ranks(1, _train_steps, 1, reference)
    per_rank = run_on_ranks(4, _train_steps, 2, reference)  # PP=2 x DP=2
    copies = [r[EMBEDDING_COPY] for r in per_rank if EMBEDDING_COPY in r]
    firsts = [r[EMBEDDING] for r in per_rank if EMBEDDING in r]
    assert len(copies) == 2 and len(firsts) == 2
    for copy in copies:
        torch.testing.assert_close(copy, firsts[0], rtol=0, atol=0)
    for params in per_rank:
        for key, value in params.items():
            want = single[EMBEDDING if key == EMBEDDING_COPY else key]
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    assert not torch.equal(single[EMBEDDING], reference[0][EMBEDDING])  # the steps moved the embedding
