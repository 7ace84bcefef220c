"""GPTModel under pipeline parallelism (1F1B, interleaved, x TP, x DP with DDP) vs one process.

Each case builds the model's chunks on 4 gloo ranks, loads the weights of a single-process GPT
(TP=1, PP=1, same seed), runs ``get_forward_backward_func()`` with ``finalize_model_grads`` and
compares every microbatch's loss and every gradient (TP shards reassembled; the last stage's copy
of a tied embedding separately) with ``forward_backward_no_pipelining`` on the whole model. The
first microbatch count of each case also runs ``forward_only=True`` first: same losses, no
gradient written. Layer placement (even, uneven first/last stage, explicit layout) is exercised
along the way, and placements that cannot work raise.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.pipeline_parallel import forward_backward_no_pipelining, get_forward_backward_func
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import gpt2_like, llama_like, unshard
from tests.pipeline_parallel.gpt_stages import (
    EMBEDDING,
    MBS,
    SEQ,
    TIED_LAST,
    StageChunks,
    gpt_forward_step,
    make_batches,
    reference_state,
)

WORLD = 4

CASES = {
    "pp4_1f1b": dict(pp=4, kind="gpt2", counts=(1, 4, 8), num_layers=4),
    "pp4_uneven": dict(pp=4, kind="llama", counts=(4,), num_layers=6,
                       extra=dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1)),
    "pp2_dp2_ddp": dict(pp=2, kind="gpt2", counts=(1, 4, 8), num_layers=4, ddp=True),
    "pp2_vpp2_dp2_ddp": dict(pp=2, vpp=2, kind="gpt2", counts=(2, 4, 8), num_layers=4, ddp=True),
    # Megatron's training default for interleaving: each exchange overlapped with the other half of the step.
    "pp2_vpp2_dp2_ddp_overlap_p2p": dict(pp=2, vpp=2, kind="gpt2", counts=(4,), num_layers=4, ddp=True,
                                         extra=dict(overlap_p2p_comm=True, batch_p2p_comm=False)),
    "pp2_vpp2_layout": dict(pp=2, vpp=2, kind="llama", counts=(4,), num_layers=5, ddp=True,
                            extra=dict(pipeline_model_parallel_layout="Et|t|tt|tL")),
    "pp2_tp2": dict(pp=2, tp=2, kind="llama", counts=(4,), num_layers=4),
    "pp2_tp2_sp_tied": dict(pp=2, tp=2, kind="gpt2", counts=(4,), num_layers=4, extra=dict(sequence_parallel=True)),
    "pp2_tp2_vpp2_tied": dict(pp=2, tp=2, vpp=2, kind="gpt2", counts=(4,), num_layers=4),
    # The config leaves tensor/pipeline sizes at their defaults: the parallel_state groups size everything.
    "pp2_tp2_sizes_from_groups": dict(pp=2, tp=2, kind="llama", counts=(4,), num_layers=4, sizes_from_groups=True),
}


def _spec(kind: str, num_layers: int) -> dict:
    return (llama_like if kind == "llama" else gpt2_like)(num_layers=num_layers)


@functools.cache
def _reference(case: str, num_microbatches: int):
    """Weights, per-microbatch losses and grads of the whole model on all DP replicas' microbatches."""
    c = CASES[case]
    model, state = reference_state(_spec(c["kind"], c["num_layers"]))
    dp = WORLD // (c["pp"] * c.get("tp", 1))
    batches = make_batches(num_microbatches * dp, seed=num_microbatches)
    losses = forward_backward_no_pipelining(
        forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=model,
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS,
    )
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    return state, [d["lm loss"] for d in losses], grads


def _run_case(case: str, ref_states: dict):
    c = CASES[case]
    pp, tp, vpp = c["pp"], c.get("tp", 1), c.get("vpp")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    spec = _spec(c["kind"], c["num_layers"])
    results = {}
    for num_microbatches in c["counts"]:
        seed = 1234 + 100 * pp_rank
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        sizes = {} if c.get("sizes_from_groups") else dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        config = TransformerConfig(
            **spec["config"], **sizes, virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32,
            finalize_model_grads_func=finalize_model_grads, **c.get("extra", {}),
        )
        stages = StageChunks(spec, config, ref_states[num_microbatches])
        models = stages.chunks
        if c.get("ddp"):
            models = [DistributedDataParallel(config, DistributedDataParallelConfig(), chunk) for chunk in models]
            config.no_sync_func = [m.no_sync for m in models] if vpp else models[0].no_sync
        batches = make_batches(num_microbatches * parallel_state.get_data_parallel_world_size(), seed=num_microbatches)
        mine = batches[dp_rank * num_microbatches:(dp_rank + 1) * num_microbatches]

        def run(forward_only: bool, models=models, mine=mine, num_microbatches=num_microbatches):
            iterators = [iter(mine) for _ in models]
            losses = get_forward_backward_func()(
                forward_step_func=gpt_forward_step, data_iterator=iterators if vpp else iterators[0],
                model=models if vpp else models[0], num_microbatches=num_microbatches,
                seq_length=SEQ, micro_batch_size=MBS, forward_only=forward_only,
            )
            return [d["lm loss"] for d in losses]

        result = {}
        if num_microbatches == c["counts"][0]:
            result["forward_only_losses"] = run(forward_only=True)
            result["forward_only_grads"] = [k for k, g in stages.grads(c.get("ddp", False)).items()
                                            if g is not None and bool(g.any())]
        result["losses"] = run(forward_only=False)
        result["grads"] = stages.grads(c.get("ddp", False))
        results[num_microbatches] = result
    return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "dp_rank": dp_rank, "results": results,
            "is_last": parallel_state.is_pipeline_last_stage(), "init_tied": stages.init_tied}


def _check_case(case: str, per_rank: list, refs: dict) -> None:
    c = CASES[case]
    gated = _spec(c["kind"], c["num_layers"])["config"].get("gated_linear_unit", False)
    for num_microbatches, (_, ref_losses, ref_grads) in refs.items():
        pieces: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        for r in per_rank:
            res = r["results"][num_microbatches]
            dp_slice = slice(r["dp_rank"] * num_microbatches, (r["dp_rank"] + 1) * num_microbatches)
            for key in ("losses", "forward_only_losses"):
                if key not in res:
                    continue
                if r["is_last"]:
                    torch.testing.assert_close(torch.stack(res[key]), torch.stack(ref_losses[dp_slice]),
                                               rtol=1e-5, atol=1e-5)
                else:
                    assert res[key] == []
            assert res.get("forward_only_grads", []) == [], f"forward_only wrote gradients: {res['forward_only_grads']}"
            for name, grad in res["grads"].items():
                pieces.setdefault((name, r["dp_rank"]), {})[r["tp_rank"]] = grad
        names = set()
        for (name, _), by_tp in pieces.items():
            ref_name = EMBEDDING if name == TIED_LAST else name
            full = unshard(ref_name, [by_tp[t] for t in sorted(by_tp)], gated)
            label = f"{case} M={num_microbatches} {name}"
            torch.testing.assert_close(full, ref_grads[ref_name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, label=label: f"{label}: {m}")
            names.add(ref_name)
        assert names == set(ref_grads), sorted(set(ref_grads) ^ names)


@pytest.mark.parametrize("case", list(CASES))
def test_gpt_pipeline_matches_single_process(case):
    refs = {m: _reference(case, m) for m in CASES[case]["counts"]}
    per_rank = run_on_ranks(WORLD, _run_case, case, {m: ref[0] for m, ref in refs.items()})
    _check_case(case, per_rank, refs)
    tied_inits: dict[int, dict[str, torch.Tensor]] = {}
    for r in per_rank:
        for where, weight in r["init_tied"].items():
            tied_inits.setdefault(r["tp_rank"], {})[where] = weight
    if _spec(CASES[case]["kind"], 1)["model"].get("share_embeddings_and_output_weights"):
        assert tied_inits, "no tied embedding was built"
    for by_stage in tied_inits.values():
        torch.testing.assert_close(by_stage["first"], by_stage["last"], rtol=0, atol=0)


@pytest.mark.parametrize("placement,message", [
    (dict(num_layers=5, pipeline_model_parallel_size=2), r"num_layers \(5\).*pipeline_model_parallel_size \(2\)"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4), r"= 8"),
    (dict(num_layers=4, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=3), r"middle"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|L"), r"3 stages"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tL"), r"num_layers is 4"),
])
def test_layer_count_that_cannot_be_placed_raises(placement, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(hidden_size=16, num_attention_heads=2, pipeline_dtype=torch.float32, **placement)
