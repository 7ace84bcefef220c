"""1F1B and interleaved schedules on a toy Linear stack vs the single-process no-pipelining run.

Every case runs on one pool of 4 gloo ranks (PP=4, or PP=2 x DP=2 with and without two virtual
stages per rank) and checks the loss of every microbatch and every parameter's gradient against
``forward_backward_no_pipelining`` on the whole model with the same weights and data.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.pipeline_parallel import get_forward_backward_func
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel import toy_model
from tests.pipeline_parallel.toy_model import ToyConfig, ToyStage, Wrapper, make_batches, stage_layer_ids

WORLD = 4
STEPS = {
    "mse": toy_model.forward_step,
    "per_token": toy_model.forward_step_per_token,
}


def _finalize_record(model_chunks, num_tokens, **kwargs):
    """A ``finalize_model_grads_func`` that turns summed per-token grads into means, like Megatron's."""
    _finalize_record.calls.append((len(model_chunks), None if num_tokens is None else int(num_tokens)))
    if num_tokens is not None:
        total = num_tokens.clone().float()
        if parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_pipeline_model_parallel_group()
            last = parallel_state.get_pipeline_model_parallel_last_rank()
            torch.distributed.broadcast(total, src=last, group=group)
        for chunk in model_chunks:
            for param in chunk.parameters():
                param.grad /= total


_finalize_record.calls = []


def _run(pp, vpp, counts, step="mse", seq_lengths=None, forward_only=False, wrap=False, options=None):
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    num_chunks = vpp or 1
    results = {}
    for num_microbatches in counts:
        _finalize_record.calls.clear()
        config = ToyConfig(
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32, variable_seq_lengths=seq_lengths is not None,
            calculate_per_token_loss=step == "per_token", finalize_model_grads_func=_finalize_record,
            **(options or {}),
        )
        chunks = [
            ToyStage(config, stage_layer_ids(pp_rank, pp, c, num_chunks), pre_process=pp_rank == 0 and c == 0)
            for c in range(num_chunks)
        ]
        batches = make_batches(num_microbatches, seed=10 * num_microbatches + dp_rank, seq_lengths=seq_lengths)
        iterators = [iter(batches) for _ in chunks]
        models = [Wrapper(c) for c in chunks] if wrap else chunks
        losses = get_forward_backward_func()(
            forward_step_func=STEPS[step],
            data_iterator=iterators if vpp else iterators[0],
            model=models if vpp else models[0],
            num_microbatches=num_microbatches, seq_length=4, micro_batch_size=2, forward_only=forward_only,
        )
        grads = {}
        for chunk in chunks:
            grads.update(chunk.named_grads())
        results[num_microbatches] = {
            "losses": [d["loss"] for d in losses],
            "grads": grads,
            "dp_rank": dp_rank,
            "is_last": parallel_state.is_pipeline_last_stage(),
            "finalize_calls": list(_finalize_record.calls),
            "first_microbatch_calls": [c.first_microbatch_calls for c in chunks],
        }
    return results


@functools.cache
def _reference(num_microbatches, dp_rank, step="mse", seq_lengths=None):
    batches = make_batches(num_microbatches, seed=10 * num_microbatches + dp_rank,
                           seq_lengths=list(seq_lengths) if seq_lengths else None)
    config = ToyConfig(calculate_per_token_loss=step == "per_token",
                       finalize_model_grads_func=_finalize_record)
    _finalize_record.calls.clear()
    return toy_model.reference(batches, STEPS[step], config)


def _check(per_rank, step="mse", seq_lengths=None, forward_only=False):
    covered: dict[tuple[int, int], set] = {}
    for result in per_rank:
        for num_microbatches, r in result.items():
            ref = _reference(num_microbatches, r["dp_rank"], step, tuple(seq_lengths) if seq_lengths else None)
            if r["is_last"]:
                assert len(r["losses"]) == num_microbatches
                for got, want in zip(r["losses"], ref["losses"]):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:
                assert r["losses"] == []
            for name, grad in r["grads"].items():
                if forward_only:
                    assert grad is None, f"forward_only left a gradient on {name}"
                else:
                    torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-5, atol=1e-5, msg=name)
            covered.setdefault((num_microbatches, r["dp_rank"]), set()).update(r["grads"])
            expected_calls = [] if forward_only else [(len(r["first_microbatch_calls"]), r["finalize_calls"][0][1])]
            assert r["finalize_calls"] == expected_calls
            assert all(n == 1 for n in r["first_microbatch_calls"])
    for key, names in covered.items():
        assert names == set(_reference(key[0], key[1], step)["grads"]), key


@pytest.mark.parametrize("pp,vpp,counts", [(4, None, (1, 4, 8)), (2, None, (1, 4, 8)), (2, 2, (2, 4, 8))])
def test_schedule_matches_single_process(pp, vpp, counts):
    _check(run_on_ranks(WORLD, _run, pp, vpp, counts))


@pytest.mark.parametrize("pp,vpp,counts", [(4, None, (3,)), (2, 2, (4,))])
def test_forward_only_same_losses_no_grads(pp, vpp, counts):
    _check(run_on_ranks(WORLD, _run, pp, vpp, counts, forward_only=True), forward_only=True)


# Its finalize function broadcasts over the pipeline group after the schedule's send/recv on it, which
# DETAIL's per-group sequence numbers report as a desync (the other ranks sent or received more).
@pytest.mark.distributed_debug_off
@pytest.mark.parametrize("pp,vpp", [(4, None), (2, 2)])
def test_per_token_loss_passes_num_tokens_to_finalize(pp, vpp):
    per_rank = run_on_ranks(WORLD, _run, pp, vpp, (4,), step="per_token")
    _check(per_rank, step="per_token")
    for result in per_rank:
        r = result[4]
        if r["is_last"]:
            total = int(sum(loss[1] for loss in r["losses"]))
            assert r["finalize_calls"][0][1] == total > 0


@pytest.mark.parametrize("pp,vpp", [(4, None), (2, 2)])
def test_variable_sequence_lengths(pp, vpp):
    seq_lengths = [3, 5, 4, 6]
    _check(run_on_ranks(WORLD, _run, pp, vpp, (4,), seq_lengths=seq_lengths), seq_lengths=seq_lengths)


@pytest.mark.parametrize(
    "options",
    [
        {"deallocate_pipeline_outputs": True},
        {"batch_p2p_comm": False},
        {"microbatch_group_size_per_vp_stage": 4},
    ],
)
def test_interleaved_options_and_wrappers(options):
    _check(run_on_ranks(WORLD, _run, 2, 2, (8,), wrap=True, options=options))


def test_1f1b_deallocated_outputs_through_wrappers():
    _check(run_on_ranks(WORLD, _run, 4, None, (4,), wrap=True, options={"deallocate_pipeline_outputs": True}))


def _interleaved_bad_count(num_microbatches):
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    config = ToyConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                       pipeline_dtype=torch.float32)
    chunks = [ToyStage(config, [0], pre_process=False) for _ in range(2)]
    try:
        get_forward_backward_func()(
            forward_step_func=toy_model.forward_step, data_iterator=[iter([]), iter([])], model=chunks,
            num_microbatches=num_microbatches, seq_length=4, micro_batch_size=2,
        )
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("num_microbatches,numbers", [(1, ("(2)", "(1)")), (5, ("(5)", "(2)"))])
def test_interleaved_rejects_bad_microbatch_counts(num_microbatches, numbers):
    for message in run_on_ranks(WORLD, _interleaved_bad_count, num_microbatches):
        assert message is not None and all(n in message for n in numbers), message


OVERLAP = {"overlap_p2p_comm": True, "batch_p2p_comm": False}  # what Megatron's training sets for interleaving


@pytest.mark.parametrize("pp,counts,options", [
    (2, (2, 4, 8), OVERLAP),
    (4, (4, 8), OVERLAP),
    (4, (8,), {"overlap_p2p_comm": True}),  # batched and overlapped
    (4, (4,), {**OVERLAP, "deallocate_pipeline_outputs": True}),
    (2, (8,), {**OVERLAP, "microbatch_group_size_per_vp_stage": 4}),
])
def test_interleaved_with_overlapped_p2p_matches_single_process(pp, counts, options):
    _check(run_on_ranks(WORLD, _run, pp, 2, counts, wrap=True, options=options))


def test_interleaved_with_overlapped_p2p_forward_only_and_variable_lengths():
    _check(run_on_ranks(WORLD, _run, 4, 2, (4,), forward_only=True, options=OVERLAP), forward_only=True)
    seq_lengths = [3, 5, 4, 6]
    _check(run_on_ranks(WORLD, _run, 2, 2, (4,), seq_lengths=seq_lengths, options=OVERLAP), seq_lengths=seq_lengths)


def _overlap_on_1f1b():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=4)
    config = ToyConfig(pipeline_model_parallel_size=4, pipeline_dtype=torch.float32, **OVERLAP)
    stage = ToyStage(config, stage_layer_ids(parallel_state.get_pipeline_model_parallel_rank(), 4), pre_process=True)
    try:
        get_forward_backward_func()(forward_step_func=toy_model.forward_step, data_iterator=iter(make_batches(4, 1)),
                                    model=stage, num_microbatches=4, seq_length=4, micro_batch_size=2)
    except ValueError as error:
        return str(error)
    return None


def test_overlapped_p2p_is_refused_without_interleaving():
    for message in run_on_ranks(WORLD, _overlap_on_1f1b):
        assert message is not None and "overlap_p2p_comm=True needs the interleaved schedule" in message
