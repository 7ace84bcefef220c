"""Rank-side checks for the hybrid context-parallel training tests (module level so the rank pool can import them).

A tiny GPT trains one step on variable-length packed samples through the whole hybrid CP path:
``HybridCPDataLoaderWrapper`` schedules the sub-samples (``max_seqlen_per_dp_cp_rank`` = 8 tokens, so
sub-samples of 9-16 tokens get CP size 2 and of 17-32 tokens CP size 4), ``forward_backward_no_pipelining``
runs ``hybrid_context_parallel_forward_backward``, each sub-sample is split with
``get_batch_on_this_cp_rank(is_hybrid_cp=True)`` and attends over its own CP group
(``PackedSeqParams.cp_group``), and DDP plus ``finalize_model_grads`` reduce the gradients over DP x CP and
divide them by the token count. Loss and gradients are compared with one process running every sub-sample.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core import tensor_parallel
from megatron_core.datasets.data_schedule import HybridCPDataLoaderWrapper
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.transformer import TransformerConfig
from megatron_core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from tests.models.gpt_test_utils import VOCAB, llama_like, shard, unshard

MAX_SEQLEN_PER_RANK = 8
MAX_POSITIONS = 64
TOL = dict(rtol=1e-5, atol=1e-5)

# Packed samples (their cu_seqlens) each DP rank loads; sub-sample ids run over DP ranks, then in order.
LAYOUTS = {
    # DP=2 x CP=2: lengths 16, 6, 5 | 12, 8, 3, 2, 4, 3 (the empty document is dropped).
    2: [[[0, 16, 22, 27]], [[0, 12, 20, 23, 25], [0, 4, 4, 7]]],
    # DP=4 x CP=1: lengths 32, 5 | 16, 4 | 12 | 7, 6.
    4: [[[0, 32, 37]], [[0, 16, 20]], [[0, 12]], [[0, 7, 13]]],
}

_RECORD: list[tuple[int, int, list[int] | None]] = []


def _packed_sample(cu: list[int], seed: int) -> dict[str, torch.Tensor]:
    """One packed sample: random tokens and labels, a loss mask with a few zeros, per-document positions."""
    gen = torch.Generator().manual_seed(seed)
    n = cu[-1]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
    mask = (torch.rand(n, generator=gen) > 0.2).float()
    return {"tokens": torch.randint(0, VOCAB, (n,), generator=gen), "labels": torch.randint(0, VOCAB, (n,), generator=gen),
            "loss_mask": mask, "position_ids": positions, "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


def dp_batches(dp: int) -> list[list[dict[str, torch.Tensor]]]:
    """Every DP rank's list of packed samples."""
    return [[_packed_sample(cu, 100 * rank + i) for i, cu in enumerate(samples)]
            for rank, samples in enumerate(LAYOUTS[dp])]


def sub_samples(dp: int) -> list[dict[str, torch.Tensor]]:
    """The non-empty documents of all DP ranks in global-id order (the wrapper's numbering)."""
    out = []
    for samples in dp_batches(dp):
        for sample in samples:
            cu = sample["cu_seqlens"].tolist()
            out.extend({k: v[a:b] for k, v in sample.items() if k != "cu_seqlens"}
                       for a, b in zip(cu[:-1], cu[1:]) if b > a)
    return out


def _build(config: TransformerConfig, spec: dict) -> GPTModel:
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, MAX_POSITIONS, **spec["model"])


def _reference(dp: int, spec: dict) -> tuple[dict, torch.Tensor, dict]:
    torch.manual_seed(1234)
    model = _build(TransformerConfig(**spec["config"]), spec)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    sums, tokens = [], 0
    for sample in sub_samples(dp):
        loss = model(sample["tokens"][None], sample["position_ids"][None], None, labels=sample["labels"][None])
        sums.append((loss[0] * sample["loss_mask"]).sum())
        tokens += int(sample["loss_mask"].sum())
    loss = sum(sums) / tokens
    loss.backward()
    return state, loss.detach(), {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _forward_step(data_iterator, model):
    """Megatron-LM's ``pretrain_gpt`` forward step under hybrid CP: TP broadcast, CP split, THD attention."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    batch: dict = {}
    sample_id = None
    if tp_rank == 0:
        sample = next(data_iterator)
        n = sample["tokens"].numel()
        sample_id = int(sample["sample_id"][0])
        batch = {key: sample[key][None] for key in ("tokens", "labels", "loss_mask", "position_ids")}
        batch.update(cu_seqlens=torch.tensor([[0, n]], dtype=torch.int32), cu_seqlens_padded=None,
                     max_seqlen=torch.tensor([n], dtype=torch.int32), local_cp_size=sample["local_cp_size"].reshape(1))
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=True, is_hybrid_cp=True, create_attention_mask_in_dataloader=False,
        broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(), broadcast_group=ps.get_tensor_model_parallel_group(),
        cp_size=ps.get_context_parallel_world_size(), tp_rank=tp_rank, micro_batch_size=1, seq_length=0,
        mtp_on_this_rank=False)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=True, cp_group=ps.get_context_parallel_group(),
                                      hybrid_cp_group_func=ps.get_hybrid_data_context_parallel_groups)
    cu = batch["cu_seqlens"].reshape(-1)
    group = batch.get("hybrid_cp_group")
    _RECORD.append((sample_id, int(batch["local_cp_size"].item()),
                    None if group is None else dist.get_process_group_ranks(group)))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(cu[-1]),
                             max_seqlen_kv=int(cu[-1]), local_cp_size=int(batch["local_cp_size"].item()), cp_group=group)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)

    def loss_func(output_tensor):
        mask = batch["loss_mask"].reshape(-1).float()
        loss = torch.sum(output_tensor.float().reshape(-1) * mask)
        return loss, mask.sum().to(torch.int), {"lm loss": torch.stack([loss.detach(), mask.sum()])}

    return output, loss_func


def _with_ids(batches: list[list[dict]]) -> list[list[dict]]:
    """Add a per-token ``sample_id`` key (the global id) so the forward step can record which sub-sample it got."""
    next_id = 0
    out = []
    for samples in batches:
        tagged = []
        for sample in samples:
            cu = sample["cu_seqlens"].tolist()
            ids = torch.zeros(cu[-1], dtype=torch.long)
            for a, b in zip(cu[:-1], cu[1:]):
                if b > a:
                    ids[a:b] = next_id
                    next_id += 1
            tagged.append({**sample, "sample_id": ids})
        out.append(tagged)
    return out


def train_one_step(dp: int, tp: int = 1) -> dict:
    """One hybrid-CP step on ``4 // tp`` DP x CP ranks (static CP = 4 // (dp * tp)); compare with one process."""
    cp = 4 // (dp * tp)
    spec = llama_like()
    state, ref_loss, ref_grads = _reference(dp, spec)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 hybrid_context_parallel=True, distributed_timeout_minutes=1)
    _RECORD.clear()
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        config = TransformerConfig(
            **spec["config"], tensor_model_parallel_size=tp, context_parallel_size=cp, hybrid_context_parallel=True,
            max_seqlen_per_dp_cp_rank=MAX_SEQLEN_PER_RANK, calculate_per_token_loss=True,
            finalize_model_grads_func=finalize_model_grads)
        model = _build(config, spec)
        tp_rank = ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], tp, tp_rank, True))
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.no_sync_func = ddp.no_sync
        batches = _with_ids(dp_batches(dp))
        mine = iter([batches[ps.get_data_parallel_rank()]]) if tp_rank == 0 else None
        wrapper = HybridCPDataLoaderWrapper(mine, config)
        store = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=wrapper, model=ddp,
                                            num_microbatches=1, seq_length=0, micro_batch_size=1)
        totals = torch.stack([report["lm loss"] for report in store]).sum(0) if store else torch.zeros(2)
        dist.all_reduce(totals, group=ps.get_data_parallel_group(with_context_parallel=True))  # (this TP rank's)
        torch.testing.assert_close(totals[0] / totals[1], ref_loss, **TOL)
        checked = 0
        tp_group = ps.get_tensor_model_parallel_group()
        for name, param in model.named_parameters():
            grad = param.main_grad.detach().clone()
            pieces = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(pieces, grad.contiguous(), group=tp_group)
            torch.testing.assert_close(unshard(name, pieces, True), ref_grads[name], **TOL,
                                       msg=lambda m, n=name: f"grad {n}: {m}")
            checked += 1
        return {"hdp_rank": ps.get_data_parallel_rank(with_context_parallel=True), "tp_rank": tp_rank,
                "record": list(_RECORD), "checked": checked}
    finally:
        ps.destroy_model_parallel()
