"""Rank-side checks for the context-parallel tests (module level so the rank pool can import them).

Each check loads the weights of a single-process (CP=1) GPT into a CP model, feeds this rank's
load-balanced part of the batch (``get_batch_on_this_cp_rank``) and compares per-token losses and
every gradient (summed over the CP group, TP shards reassembled) with the CP=1 run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer.packed_sequences import thd_layout, thd_partitioned_indices
from megatron_core.utils import get_batch_on_this_cp_rank
from tests.models.gpt_test_utils import VOCAB, build, llama_like, shard, unshard

S, B = 16, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def zigzag(cp: int, rank: int, s: int = S) -> list[int]:
    """The global positions CP rank ``rank`` holds (chunks r and 2cp-1-r of 2cp)."""
    c = s // (2 * cp)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


def _data(seed: int = 3, b: int = B, s: int = S) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=gen), torch.randint(0, VOCAB, (b, s), generator=gen)


def _reference(spec: dict) -> tuple[dict, torch.Tensor, dict]:
    torch.manual_seed(1234)
    model = build(spec)
    ids, labels = _data()
    loss = model(ids, torch.arange(S).expand(B, S), None, labels=labels)
    loss.sum().backward()
    return ({k: v.detach().clone() for k, v in model.named_parameters()}, loss.detach(),
            {k: v.grad.detach().clone() for k, v in model.named_parameters()})


def _load(model: torch.nn.Module, state: dict, tp: int, gated: bool) -> None:
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, state[name], tp, tp_rank, gated))


def _full_grads(model: torch.nn.Module, tp: int, gated: bool) -> dict:
    """Gradients summed over the CP group, SP grads summed over TP, TP shards reassembled."""
    cp_group = parallel_state.get_context_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=cp_group)
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=tp_group)
        pieces = [torch.empty_like(grad) for _ in range(tp)]
        dist.all_gather(pieces, grad.contiguous(), group=tp_group)
        out[name] = unshard(name, pieces, gated)
    return out


def check_cases(cases: list[dict]) -> list[str]:
    """Run each ``dict(cp=, comm=, tp=1, sp=False, hier=None, window=None, mask=False)`` case."""
    done = []
    for case in cases:
        cp, comm, tp = case["cp"], case["comm"], case.get("tp", 1)
        spec = llama_like(window_size=case.get("window"))
        state, ref_loss, ref_grads = _reference(spec)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, context_parallel_size=cp,
            hierarchical_context_parallel_sizes=case.get("hier"),
        )
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            model = build(spec, tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type=comm,
                          sequence_parallel=case.get("sp", False),
                          hierarchical_context_parallel_sizes=case.get("hier"), **case.get("extra", {}))
            _load(model, state, tp, True)
            ids, labels = _data()
            batch = {"tokens": ids, "labels": labels, "position_ids": torch.arange(S).expand(B, S).contiguous(),
                     "attention_mask": torch.ones(S, S, dtype=torch.bool).triu(1)[None, None] if case.get("mask")
                     else None}
            batch = get_batch_on_this_cp_rank(batch)
            loss = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
            cp_rank = parallel_state.get_context_parallel_rank()
            torch.testing.assert_close(loss, ref_loss[:, zigzag(cp, cp_rank)], **TOL)
            loss.sum().backward()
            for name, grad in _full_grads(model, tp, True).items():
                torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name, c=case: f"{c} {n}: {m}")
            done.append(str(case))
        finally:
            parallel_state.destroy_model_parallel()
    return done


def _packed_batch(pad_to: int) -> tuple[dict, list[int], list[int]]:
    """Three documents of lengths 5, 3, 8 padded to multiples of ``pad_to``, as one ``[1, t]`` batch."""
    gen = torch.Generator().manual_seed(5)
    ids, labels, pos, mask = [], [], [], []
    cu, cu_pad = [0], [0]
    for n in (5, 3, 8):
        p = -(-n // pad_to) * pad_to
        ids.append(torch.randint(0, VOCAB, (n,), generator=gen))
        labels.append(torch.randint(0, VOCAB, (n,), generator=gen))
        ids[-1] = torch.cat([ids[-1], torch.zeros(p - n, dtype=torch.long)])
        labels[-1] = torch.cat([labels[-1], torch.zeros(p - n, dtype=torch.long)])
        pos.append(torch.arange(p))
        mask.append(torch.tensor([1.0] * n + [0.0] * (p - n)))
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + p)
    batch = {"tokens": torch.cat(ids)[None], "labels": torch.cat(labels)[None], "position_ids": torch.cat(pos)[None],
             "loss_mask": torch.cat(mask)[None], "cu_seqlens": torch.tensor(cu, dtype=torch.int32)[None],
             "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32)[None], "max_seqlen": 8}
    return batch, cu, cu_pad


def _params(batch: dict) -> PackedSeqParams:
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch["cu_seqlens"][0], cu_seqlens_kv=batch["cu_seqlens"][0],
                           cu_seqlens_q_padded=batch["cu_seqlens_padded"][0],
                           cu_seqlens_kv_padded=batch["cu_seqlens_padded"][0], max_seqlen_q=8, max_seqlen_kv=8)


def check_packed(cp: int, comm: str) -> str:
    """Packed documents under CP (Megatron's per-document split) equal the packed CP=1 run."""
    spec = llama_like()
    batch, _, _ = _packed_batch(2 * cp)
    torch.manual_seed(1234)
    ref_model = build(spec)
    ref_loss = ref_model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                         packed_seq_params=_params(batch))
    (ref_loss * batch["loss_mask"]).sum().backward()
    state = {k: v.detach().clone() for k, v in ref_model.named_parameters()}
    ref_grads = {k: v.grad.detach().clone() for k, v in ref_model.named_parameters()}
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    try:
        model = build(spec, context_parallel_size=cp, cp_comm_type=comm)
        _load(model, state, 1, True)
        local = get_batch_on_this_cp_rank(dict(batch))
        loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                     packed_seq_params=_params(local))
        layout = thd_layout(_params(batch), batch["tokens"].shape[1])
        index = thd_partitioned_indices(layout, cp, parallel_state.get_context_parallel_rank())
        torch.testing.assert_close(loss, ref_loss.detach()[:, index], **TOL)
        (loss * local["loss_mask"]).sum().backward()
        for name, grad in _full_grads(model, 1, True).items():
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        parallel_state.destroy_model_parallel()
    return f"packed cp={cp} {comm}"


def check_bad_input() -> list[str]:
    """Sequence lengths that do not split into 2 * CP chunks, and dropout with ring attention, are refused."""
    errors = []
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        ids = torch.zeros(1, 6, dtype=torch.long)
        try:
            get_batch_on_this_cp_rank({"tokens": ids, "labels": ids})
        except ValueError as exc:
            errors.append(str(exc))
        model = build(llama_like(), context_parallel_size=2, cp_comm_type="p2p")
        try:
            model(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], None)
        except ValueError as exc:
            errors.append(str(exc))
        try:
            build(llama_like(attention_dropout=0.1), context_parallel_size=2, cp_comm_type="p2p")
        except ValueError as exc:
            errors.append(str(exc))
    finally:
        parallel_state.destroy_model_parallel()
    return errors


def _cp_forward_step(data_iterator, model):
    """Megatron's pretrain_gpt forward step under CP: split the batch, per-token loss sum and token count."""
    batch = get_batch_on_this_cp_rank(dict(next(data_iterator)))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"].reshape(-1).float()
        loss = torch.sum(output_tensor.float().reshape(-1) * mask)
        return loss, mask.sum().to(torch.int), {"lm loss": loss.detach().clone()}

    return output, loss_func


def _cp_mean_forward_step(data_iterator, model):
    """Megatron's older loss convention: the loss is the CP-global token mean of the micro-batch
    (sum and count all-reduced over CP outside autograd); the schedule multiplies it by the CP size."""
    batch = get_batch_on_this_cp_rank(dict(next(data_iterator)))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"].reshape(-1).float()
        loss = torch.cat([torch.sum(output_tensor.float().reshape(-1) * mask).view(1), mask.sum().view(1)])
        dist.all_reduce(loss, group=parallel_state.get_context_parallel_group())
        loss = loss[0] / loss[1]
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def check_training(pp: int, use_distributed_optimizer: bool, per_token: bool = True, num_microbatches: int = 2) -> dict:
    """CP=2 with PP or DP through the schedules, DDP (DP x CP reduction), finalize_model_grads and
    (optionally) the distributed optimizer, against the CP=1 model on the same global batch.

    ``per_token``: ``calculate_per_token_loss`` with a (sum, count) loss; else a per-micro-batch mean."""
    from megatron_core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron_core.pipeline_parallel import get_forward_backward_func
    from megatron_core.transformer import TransformerConfig
    from tests.pipeline_parallel.gpt_stages import MBS, SEQ, StageChunks, make_batches, reference_state

    spec = llama_like(num_layers=2)
    cp = 2
    dp = 4 // (cp * pp)
    batches = make_batches(num_microbatches * dp, seed=11)
    ref_model, state = reference_state(spec)
    sums = [(ref_model(b["tokens"], b["position_ids"], None, labels=b["labels"]) * b["loss_mask"]).sum()
            for b in batches]
    if per_token:
        ref_loss = sum(sums) / sum(b["loss_mask"].sum() for b in batches)
    else:
        ref_loss = sum(s / b["loss_mask"].sum() for s, b in zip(sums, batches)) / len(batches)
    ref_loss.backward()
    ref_grads = {k: v.grad.detach().clone() for k, v in ref_model.named_parameters()}
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-3)
    ref_opt.step()
    ref_params = {k: v.detach().clone() for k, v in ref_model.named_parameters()}

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, context_parallel_size=cp)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        config = TransformerConfig(
            **spec["config"], pipeline_model_parallel_size=pp, context_parallel_size=cp, pipeline_dtype=torch.float32,
            calculate_per_token_loss=per_token, finalize_model_grads_func=finalize_model_grads,
        )
        stages = StageChunks(spec, config, state)
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer), stages.chunks[0]
        )
        config.no_sync_func = ddp.no_sync
        optimizer = get_megatron_optimizer(
            OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=use_distributed_optimizer),
            [ddp],
        )
        dp_rank = parallel_state.get_data_parallel_rank()
        mine = batches[dp_rank * num_microbatches:(dp_rank + 1) * num_microbatches]
        get_forward_backward_func()(
            forward_step_func=_cp_forward_step if per_token else _cp_mean_forward_step, data_iterator=iter(mine),
            model=ddp,
            num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
        )
        checked = 0
        if not use_distributed_optimizer:  # with it, each rank holds only its shard of the reduced gradient
            for name, grad in stages.grads(use_main_grad=True).items():
                torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"grad {n}: {m}")
                checked += 1
        optimizer.step()
        for name, param in stages.params().items():
            torch.testing.assert_close(param, ref_params[name], **TOL, msg=lambda m, n=name: f"param {n}: {m}")
            checked += 1
    finally:
        parallel_state.destroy_model_parallel()
    return {"checked": checked}
