"""DeepSeek sparse attention under context parallelism (all-gather CP) equals one process (gloo ranks, fp32, 1e-5).

A 2-layer DSA GPT (absorbed MLA + DSA) in training mode, indexer KL loss on, holds the single-process model's
weights; each CP rank feeds its load-balanced part of the batch (``get_batch_on_this_cp_rank``: whole sequences
split into 2 * CP chunks, or each packed document split that way). Per-token losses (this rank's positions), the
indexer loss (CP ranks' means averaged, or per-token sums added) and every gradient (summed over CP, TP shards
reassembled) match the single-process run. Cases: CP=2, with and without packed sequences, dense / sparse /
per-token indexer loss, top-k shared by the second layer; CP=2 x TP=2 with sequence parallelism.

Each rank's indexer loss is its share of the whole sequence's (its rows' KL over all ranks' rows), so the shares
add up to the single-process loss and, at backward scale 1, the summed gradients to its gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper
from megatron_core.transformer.packed_sequences import thd_layout, thd_partitioned_indices
from megatron_core.utils import get_batch_on_this_cp_rank
from tests.dist_harness import run_on_ranks
from tests.transformer.experimental_attention_variant.dsa_common import (
    TOL,
    VOCAB,
    dsa_config,
    dsa_gpt,
    reset_dsa_globals,
    shard_tp,
    unshard_tp,
)

S, B = 16, 2
DOCS = (5, 3, 8)  # packed documents, padded to multiples of 2 * CP * TP


def _plain_batch() -> dict:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    return {"tokens": ids, "labels": torch.randint(0, VOCAB, (B, S), generator=gen),
            "loss_mask": torch.ones(B, S), "position_ids": torch.arange(S).expand(B, S).contiguous()}


def _packed_batch(pad_to: int) -> dict:
    gen = torch.Generator().manual_seed(8)
    ids, labels, pos, mask, cu, cu_pad = [], [], [], [], [0], [0]
    for n in DOCS:
        p = -(-n // pad_to) * pad_to
        ids.append(torch.cat((torch.randint(0, VOCAB, (n,), generator=gen), torch.zeros(p - n, dtype=torch.long))))
        labels.append(torch.cat((torch.randint(0, VOCAB, (n,), generator=gen), torch.zeros(p - n, dtype=torch.long))))
        pos.append(torch.arange(p))
        mask.append(torch.tensor([1.0] * n + [0.0] * (p - n)))
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + p)
    return {"tokens": torch.cat(ids)[None], "labels": torch.cat(labels)[None], "position_ids": torch.cat(pos)[None],
            "loss_mask": torch.cat(mask)[None], "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32), "max_seqlen": max(cu_pad)}


def _params(batch: dict) -> PackedSeqParams | None:
    if "cu_seqlens" not in batch:
        return None
    cu, cu_pad = batch["cu_seqlens"], batch["cu_seqlens_padded"]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                             cu_seqlens_kv_padded=cu_pad, max_seqlen_q=batch["max_seqlen"],
                             max_seqlen_kv=batch["max_seqlen"])
    if batch.get("real_rows"):  # Megatron-Core's optional mask of real (not padding) query rows (packed only)
        params.real_token_mask_q = batch["loss_mask"][0].bool()
    return params


def _run(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per-token loss, indexer losses per layer)`` after the backward of the masked summed loss."""
    DSAIndexerLossLoggingHelper.tracker.clear()
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                 packed_seq_params=_params(batch))
    (loss * batch["loss_mask"]).sum().backward()
    return loss.detach(), DSAIndexerLossLoggingHelper.tracker["values"].clone()


def _local_positions(batch: dict, cp: int, rank: int) -> list[int]:
    if "cu_seqlens" in batch:
        cu = PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch["cu_seqlens_padded"])
        return thd_partitioned_indices(thd_layout(cu, batch["tokens"].shape[1]), cp, rank)
    c = S // (2 * cp)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


def _check(cp: int, tp: int, packed: bool, overrides: dict, real_rows: bool = False) -> str:
    reset_dsa_globals()
    overrides = {"init_method_std": 0.2, **overrides}  # weights large enough for an indexer loss of ~0.01-0.1
    sp = tp > 1
    batch = _packed_batch(2 * cp * tp) if packed else _plain_batch()
    if real_rows:
        batch["real_rows"] = True
    ref = dsa_gpt(dsa_config(**overrides)).train()
    ref_loss, ref_indexer = _run(ref, batch)
    state = {k: v.detach().clone() for k, v in ref.named_parameters()}
    ref_grads = {k: v.grad.detach().clone() for k, v in ref.named_parameters()}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        cfg = dsa_config(context_parallel_size=cp, cp_comm_type="all_gather", tensor_model_parallel_size=tp,
                         sequence_parallel=sp, **overrides)
        model = dsa_gpt(cfg).train()
        tp_rank, tp_group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
        cp_rank, cp_group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard_tp(name, state[name], tp, tp_rank))
        loss, indexer = _run(model, get_batch_on_this_cp_rank(dict(batch)))
        torch.testing.assert_close(loss, ref_loss[:, _local_positions(batch, cp, cp_rank)], **TOL)
        assert indexer[0] > 0
        dist.all_reduce(indexer, group=cp_group)  # each rank's share of the whole sequence's indexer loss
        torch.testing.assert_close(indexer, ref_indexer, rtol=1e-5, atol=1e-8)
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=cp_group)
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=tp_group)
            pieces = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(pieces, grad.contiguous(), group=tp_group)
            want = ref_grads[name]  # 1e-5 relative to the gradient's largest entry (fp32 sums in another order)
            torch.testing.assert_close(unshard_tp(name, pieces), want, rtol=1e-5,
                                       atol=1e-5 * max(1.0, want.abs().max().item()),
                                       msg=lambda m, n=name: f"{n}: {m}")
        return f"cp={cp} tp={tp} packed={packed} {overrides}"
    finally:
        parallel_state.destroy_model_parallel()
        reset_dsa_globals()


# No ReLU in the index scores where top-k is below the visible keys: keys scoring exactly 0 would tie.
_CASES = {
    "dense_loss": dict(dsa_indexer_scoring_relu=False),
    "per_token_loss": dict(dsa_indexer_scoring_relu=False, calculate_per_token_loss=True),
    "sparse_loss_shared_topk": dict(dsa_indexer_scoring_relu=False, dsa_indexer_use_sparse_loss=True,
                                    dsa_indexer_topk_freq=2),
    "relu_topk_above_seq": dict(dsa_indexer_topk=32),
}


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("case", list(_CASES))
def test_cp2_matches_single_process(case: str, packed: bool):
    assert len(run_on_ranks(2, _check, 2, 1, packed, _CASES[case])) == 2


def test_cp2_packed_indexer_loss_over_real_rows_only():
    """With ``real_token_mask_q`` the padding rows leave the indexer loss; the ranks' shares still add up."""
    assert len(run_on_ranks(2, _check, 2, 1, True, _CASES["dense_loss"], True)) == 2


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_cp2_tp2_sequence_parallel_matches_single_process(packed: bool):
    assert len(run_on_ranks(4, _check, 2, 2, packed, _CASES["dense_loss"])) == 4


def _check_refusals() -> list[str]:
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    errors = []
    try:
        for comm in (None, "p2p", ["p2p", "all_gather"]):
            try:
                dsa_gpt(dsa_config(context_parallel_size=2, cp_comm_type=comm))
            except ValueError as exc:
                errors.append(str(exc))
    finally:
        parallel_state.destroy_model_parallel()
    return errors


def test_cp_needs_all_gather_comm_type():
    errors = run_on_ranks(2, _check_refusals)[0]
    assert len(errors) == 3
    assert "cp_comm_type (None) must be 'all_gather'" in errors[0]
    assert "cp_comm_type ('p2p') must be 'all_gather'" in errors[1]
    assert "cp_comm_type ('p2p') must be 'all_gather' for DSAttention" in errors[2]  # layer 1 of the per-layer list
