"""Standalone multi-token-prediction stages: ``TransformerConfig.mtp_standalone`` from the pipeline layout.

Megatron-Core 0.19 sets ``mtp_standalone`` when a ``pipeline_model_parallel_layout`` puts the MTP layers on a
pipeline rank before the last one. These tests check that rule, the layouts 0.19 refuses (MTP before the last
virtual stage of its rank, MTP split over chunks, decoder layers after MTP), the one this library refuses on top
(MTP on the first rank's last virtual stage), that a contradicting ``mtp_standalone`` raises, that the pipeline
exchange sends the MTP stage's concatenated hidden states ``[(1 + D) s, b, h]`` with their shape, and
``parallel_state.set_embedding_ranks``. Losses and gradients against one process are in
``tests/pipeline_parallel/test_mtp_pipeline.py``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron_core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_core.training.model_builder import get_model
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.mtp_placement import get_mtp_embedding_ranks
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import MAX_SEQ, VOCAB, llama_like


def _config(layout: str | None, pp: int, depths: int = 1, **extra) -> TransformerConfig:
    spec = llama_like(num_layers=4, mtp_num_layers=depths)
    return TransformerConfig(**spec["config"], pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                             pipeline_model_parallel_layout=layout, **extra)


@pytest.mark.parametrize("layout, pp, depths, standalone", [
    ("Ett|ttm|L", 3, 1, True),
    ("Ett|ttmm|L", 3, 2, True),
    ("Ettttm|L", 2, 1, True),              # MTP with the embedding on the first stage, the loss alone after it
    ("Ett|tt|m|L", 4, 1, True),             # MTP alone on its stage; the final norm one stage earlier
    ("Et|t|t|t|m|L", 3, 1, True),           # virtual stages: rank 1's last one
    ("Ett|ttmL", 2, 1, False),
    ("Ett|tt|mL", 3, 1, False),
    ("Et|tt|t|mL", 2, 1, False),            # rank 1's last virtual stage is the last stage
    ("Ett|ttL", 2, 0, False),
])
def test_layout_sets_mtp_standalone(layout: str, pp: int, depths: int, standalone: bool):
    config = _config(layout, pp, depths)
    assert config.mtp_standalone is standalone
    if standalone:  # given explicitly and agreeing with the layout: accepted
        assert _config(layout, pp, depths, mtp_standalone=True).mtp_standalone is True


def test_no_layout_leaves_mtp_standalone_off():
    assert _config(None, 2).mtp_standalone is False


@pytest.mark.parametrize("layout, pp, match", [
    ("Ett|ttmL", 2, r"mtp_standalone=True contradicts pipeline_model_parallel_layout Ett\|ttmL"),
    (None, 2, r"mtp_standalone=True needs a pipeline_model_parallel_layout.*is None"),
])
def test_contradicting_mtp_standalone_raises(layout: str | None, pp: int, match: str):
    with pytest.raises(ValueError, match=match):
        _config(layout, pp, mtp_standalone=True)


@pytest.mark.parametrize("layout, pp, depths, match", [
    # 0.19's rules
    ("Ett|ttm||L", 2, 1, r"last virtual stage of their pipeline rank; rank 1 holds them in virtual stage 0 of 2"),
    ("Ett|ttm|mL", 3, 2, r"all MTP layers must be in one stage"),
    ("Ettm|ttL", 2, 1, r"decoder layers must come before MTP layers"),
    ("Ett|ttm|L", 3, 2, r"places 1 MTP layers but mtp_num_layers is 2"),
    # ours: the first rank would hold the embedding and the MTP copy in two chunks
    ("Et|tt|tm|L", 2, 1, r"first pipeline rank's last virtual stage.*virtual_pipeline_model_parallel_size 2"),
])
def test_refused_mtp_layouts(layout: str, pp: int, depths: int, match: str):
    with pytest.raises(ValueError, match=match):
        _config(layout, pp, depths)


def test_model_parallel_config_accepts_mtp_standalone():
    assert ModelParallelConfig(mtp_standalone=True).mtp_standalone is True


def _build_first_stage_mtp_chunks() -> dict:
    """The two chunks of ``"Ettttm|L"``: where the MTP layers and the final norm are, and the combined-schedule plan."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        config = _config("Ettttm|L", 2)
        layer = get_gpt_layer_local_spec()
        first = parallel_state.is_pipeline_first_stage()
        model = GPTModel(config, layer, VOCAB, MAX_SEQ, pre_process=first, post_process=not first,
                         position_embedding_type="rope", mtp_block_spec=get_gpt_mtp_block_spec(config, layer, False))
        try:
            model.build_schedule_plan(torch.zeros(1, 8, dtype=torch.long), None, None)
            plan_error = None
        except ValueError as error:
            plan_error = str(error)
        return dict(mtp=model.mtp_process, final_norm=model.decoder.final_layernorm is not None,
                    layers=len(model.decoder.layers), plan_error=plan_error)
    finally:
        parallel_state.destroy_model_parallel()


def test_first_stage_mtp_chunks_and_the_schedule_plan_refusal():
    first, last = run_on_ranks(2, _build_first_stage_mtp_chunks)
    # The final norm sits before the MTP layers on the stage of the last decoder layer; the loss stage has none.
    assert (first["mtp"], first["final_norm"], first["layers"]) == (True, True, 4)
    assert (last["mtp"], last["final_norm"], last["layers"]) == (False, False, 0)
    assert "config.mtp_standalone" in first["plan_error"] and "config.mtp_standalone" in last["plan_error"]


def test_mtp_embedding_ranks_follow_the_layout():
    pp_ranks = [4, 5, 6, 7]
    assert get_mtp_embedding_ranks(pp_ranks, _config("Ett|tt|m|L", 4), False) == [4, 6]
    assert get_mtp_embedding_ranks(pp_ranks, _config("Ett|tt|m|L", 4), True) == [4, 6, 7]
    assert get_mtp_embedding_ranks(pp_ranks[:2], _config("Ettttm|L", 2), False) == [4]
    assert get_mtp_embedding_ranks(pp_ranks[:2], _config(None, 2), False) == [4, 5]


# --- the pipeline exchange under mtp_standalone ----------------------------------------------------------------------
def _send_concatenated(depths: int) -> tuple | None:
    """Rank 0 sends ``[(1 + depths) s, b, h]`` where the schedule expects ``[s, b, h]``; rank 1 receives it and
    sends its gradient back."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                     mtp_standalone=True)
        comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
        shape = (4, 2, 8)
        sent = torch.arange((1 + depths) * 4 * 2 * 8, dtype=torch.float32).reshape((1 + depths) * 4, 2, 8)
        if comm.is_pp_first_stage:
            comm.send_forward(sent)
            grad = comm.recv_backward(shape)
            return tuple(grad.shape), torch.equal(grad, -sent)
        received = comm.recv_forward(shape)
        comm.send_backward(-received.detach())
        return tuple(received.shape), torch.equal(received, sent)
    finally:
        parallel_state.destroy_model_parallel()


def test_p2p_exchanges_the_concatenated_shape_when_mtp_standalone():
    assert run_on_ranks(2, _send_concatenated, 2) == [((12, 2, 8), True), ((12, 2, 8), True)]


# --- parallel_state.set_embedding_ranks --------------------------------------------------------------------------------
def _rebuild_embedding_group() -> dict:
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=3)
    try:
        def ranks() -> list[int] | None:
            group = parallel_state.get_embedding_group(check_initialized=False)
            return None if group is None else torch.distributed.get_process_group_ranks(group)

        before = ranks()
        unchanged = parallel_state.set_embedding_ranks(parallel_state.default_embedding_ranks)
        changed = parallel_state.set_embedding_ranks(lambda pp_ranks: pp_ranks[:2])
        after = ranks()
        group = parallel_state.get_embedding_group(check_initialized=False)
        total = None
        if group is not None:
            total = torch.ones(1)
            torch.distributed.all_reduce(total, group=group)
            total = total.item()
        member = parallel_state.is_rank_in_embedding_group(ignore_virtual=False)
        return dict(before=before, unchanged=unchanged, changed=changed, after=after, total=total, member=member)
    finally:
        parallel_state.destroy_model_parallel()


def test_set_embedding_ranks_rebuilds_the_group():
    results = run_on_ranks(3, _rebuild_embedding_group)
    assert [r["before"] for r in results] == [[0, 2], None, [0, 2]]
    assert all(r["unchanged"] is False and r["changed"] is True for r in results)
    assert [r["after"] for r in results] == [[0, 1], [0, 1], None]
    assert [r["total"] for r in results] == [2.0, 2.0, None]
    # The group's last rank is a middle stage here: 0.19's rule counts it on its last virtual stage only, which
    # without virtual stages means "is the last pipeline stage".
    assert [r["member"] for r in results] == [True, False, False]


def _provider(tied: bool, pre_process: bool, post_process: bool, config: TransformerConfig,
              pg_collection=None) -> GPTModel:
    layer = get_gpt_layer_local_spec()
    return GPTModel(config, layer, VOCAB, MAX_SEQ, pre_process=pre_process, post_process=post_process,
                    pg_collection=pg_collection, position_embedding_type="rope",
                    share_embeddings_and_output_weights=tied,
                    mtp_block_spec=get_gpt_mtp_block_spec(config, layer, False))


def _build_with_given_embedding_ranks(tied: bool) -> dict:
    """``initialize_model_parallel(get_embedding_ranks=get_mtp_embedding_ranks...)`` (as Megatron-LM's pretrain_gpt
    does): building the standalone-MTP model keeps that group; with the default ranks the group is made anew."""
    config = _config("Ett|ttm|L", 3)
    rule = partial(get_mtp_embedding_ranks, config=config, share_embeddings_and_output_weights=tied)
    out = {}
    for given in (True, False):
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=3,
                                                 get_embedding_ranks=rule if given else None)
        try:
            before = parallel_state.get_embedding_group(check_initialized=False)
            (chunk,) = get_model(partial(_provider, tied), wrap_with_ddp=False, config=config)
            after = parallel_state.get_embedding_group(check_initialized=False)
            out[given] = dict(kept=after is before, chunk_group_is_current=chunk.pg_collection.embd is after,
                              ranks=None if after is None else torch.distributed.get_process_group_ranks(after))
        finally:
            parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_given_embedding_ranks_are_kept_and_default_ones_replaced(tied: bool):
    results = run_on_ranks(3, _build_with_given_embedding_ranks, tied)
    group = [0, 1, 2] if tied else [0, 1]
    for rank, r in enumerate(results):
        member = rank in group
        assert r[True] == dict(kept=True, chunk_group_is_current=True, ranks=group if member else None)
        # The default group [0, 2] is replaced on every rank (rank 1 joins it; untied, rank 2 leaves it).
        assert r[False]["kept"] is False
        assert r[False]["chunk_group_is_current"] and r[False]["ranks"] == (group if member else None)


def test_set_embedding_ranks_needs_initialized_groups():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        parallel_state.set_embedding_ranks(parallel_state.default_embedding_ranks)
