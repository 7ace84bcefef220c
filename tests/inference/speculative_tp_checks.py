"""Rank functions of the speculative-decoding TP test (module level, for ``tests.dist_harness.run_on_ranks``)."""

from __future__ import annotations

import torch


def tp_speculative_run(full: dict[str, torch.Tensor], batch: list[list[int]], k: int, new: int) -> tuple:
    """Greedy tokens and (drafted, accepted) counts of the TP=2 :func:`mtp_gpt` holding the TP=1 weights ``full``."""
    from megatron_core import parallel_state
    from megatron_core.inference.sampling_params import SamplingParams
    from tests.inference.mtp_fixture import engine, mtp_gpt
    from tests.models.gpt_test_utils import shard

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        rank = parallel_state.get_tensor_model_parallel_rank()
        model = mtp_gpt(depths=3, tensor_model_parallel_size=2)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("eh_proj.weight"):  # column-parallel, gathered after the projection
                    param.copy_(full[name].chunk(2, dim=0)[rank])
                else:
                    param.copy_(shard(name, full[name], 2, rank, gated=True))
        eng = engine(model, num_speculative_tokens=k)
        params = SamplingParams(top_k=1, num_tokens_to_generate=new, termination_id=-1)
        tokens = [r.merge().generated_tokens for r in eng.generate(batch, params)]
        return tokens, eng.speculative_drafted_count, eng.speculative_accepted_count
    finally:
        parallel_state.destroy_model_parallel()
