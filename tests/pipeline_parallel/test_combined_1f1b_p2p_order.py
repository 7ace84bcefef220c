"""The interleaved schedule's point-to-point traffic with ``overlap_moe_expert_parallel_comm`` replays under NCCL's
ordering rules (4 gloo ranks, the toy pipeline of ``test_p2p_order``).

The combined schedule changes the exchanges of the interleaved schedule in one way: every rank runs one more
warm-up forward. A stand-in for ``combined_1f1b_schedule_for_interleaved_pipelining`` runs each step's forward,
then its backward, through the schedule's own pre- and post-processing (the toy stages have no schedule plan),
so the traffic is exactly what the combined path posts.
"""

from __future__ import annotations

from unittest import mock

import pytest

from megatron_core.pipeline_parallel import interleaved_schedule
from megatron_core.pipeline_parallel.microbatch_step import backward_step, forward_step
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel.test_p2p_order import WORLD, _record, _replay


def _sequential_step(config, forward_step_func, data_iterator, model, num_microbatches, forward_data_store,
                     forward_preprocess, forward_postprocess, backward_preprocess, backward_postprocess,
                     get_microbatch_id_in_model_chunk, get_model_chunk_id, check_first_val_step,
                     is_first_microbatch_for_model_chunk, collect_non_loss_data, f_virtual_microbatch_id=None,
                     b_virtual_microbatch_id=None, is_last_stage=None, cp_size=1, **_):
    output_tensor = input_tensor_grad = None
    if f_virtual_microbatch_id is not None:
        chunk = get_model_chunk_id(f_virtual_microbatch_id, forward=True)
        microbatch = get_microbatch_id_in_model_chunk(f_virtual_microbatch_id, forward=True)
        input_tensor = forward_preprocess(f_virtual_microbatch_id, chunk, microbatch)
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator[chunk], model[chunk], num_microbatches, input_tensor,
            forward_data_store, config, is_last_stage=is_last_stage(chunk), cp_size=cp_size)
        forward_postprocess(chunk, output_tensor, num_tokens)
    if b_virtual_microbatch_id is not None:
        chunk = get_model_chunk_id(b_virtual_microbatch_id, forward=False)
        input_tensor_grad = backward_step(*backward_preprocess(b_virtual_microbatch_id, chunk), None, config)
        backward_postprocess(b_virtual_microbatch_id)
    return output_tensor, input_tensor_grad


def _record_combined(pp: int, vpp: int, num_microbatches: int, options: dict) -> list[tuple]:
    with mock.patch.object(interleaved_schedule, "combined_1f1b_schedule_for_interleaved_pipelining",
                           wraps=_sequential_step) as step:
        log = _record(pp, vpp, num_microbatches, {**options, "overlap_moe_expert_parallel_comm": True})
    # Every forward and every backward went through the combined path (2 per micro-batch and chunk, less the
    # steps that paired one of each).
    assert num_microbatches * vpp <= step.call_count <= 2 * num_microbatches * vpp, step.call_count
    return log


CASES = {
    "pp4": (4, 2, 8, {}),
    "pp4_unbatched": (4, 2, 8, {"batch_p2p_comm": False}),
    "pp4_overlap_p2p": (4, 2, 8, {"overlap_p2p_comm": True, "batch_p2p_comm": False}),
    "pp4_all_warmup": (4, 2, 4, {}),
    "pp4_twelve_microbatches": (4, 2, 12, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_combined_interleaved_traffic_replays_under_nccl_ordering(case: str) -> None:
    logs = run_on_ranks(WORLD, _record_combined, *CASES[case])
    assert all(logs)
    for per_pair in (True, False):
        _replay(logs, per_pair)
