"""Packed sequences (THD): documents packed into one sequence give the same per-token loss and
gradients as the documents run one by one; bad ``cu_seqlens`` are refused with clear errors."""

from __future__ import annotations

import pytest
import torch

from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer.packed_sequences import thd_layout, thd_partitioned_indices, thd_positions
from tests.models.gpt_test_utils import VOCAB, build, gpt2_like, llama_like

LENGTHS = (5, 3, 8)


def _docs(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (1, n), generator=gen), torch.randint(0, VOCAB, (1, n), generator=gen))
            for n in LENGTHS]


def _separately(model, docs) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    losses = []
    for ids, labels in docs:
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        losses.append(model(ids, pos, None, labels=labels))
    loss = torch.cat(losses, dim=1)
    loss.sum().backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _packed(model, docs, pad_to: int | None = None) -> tuple[torch.Tensor, dict, list[int]]:
    """Pack the documents (each padded to a multiple of ``pad_to`` when given); returns real-token losses."""
    model.zero_grad()
    ids, labels, pos, mask, real_idx = [], [], [], [], []
    cu, cu_pad, offset = [0], [0], 0
    for doc_ids, doc_labels in docs:
        n = doc_ids.shape[1]
        p = n if pad_to is None else -(-n // pad_to) * pad_to
        ids.append(torch.cat([doc_ids, torch.zeros(1, p - n, dtype=torch.long)], dim=1))
        labels.append(torch.cat([doc_labels, torch.zeros(1, p - n, dtype=torch.long)], dim=1))
        pos.append(torch.arange(p).unsqueeze(0))
        mask.append(torch.tensor([[1.0] * n + [0.0] * (p - n)]))
        real_idx.extend(range(offset, offset + n))
        offset += p
        cu.append(cu[-1] + n)
        cu_pad.append(offset)
    cu_t, cu_pad_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_pad, dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
        cu_seqlens_q_padded=None if pad_to is None else cu_pad_t,
        cu_seqlens_kv_padded=None if pad_to is None else cu_pad_t,
        max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS),
    )
    loss = model(torch.cat(ids, 1), torch.cat(pos, 1), None, labels=torch.cat(labels, 1), packed_seq_params=params)
    (loss * torch.cat(mask, 1)).sum().backward()
    return loss.detach()[:, real_idx], {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("pad_to", [None, 4])
def test_packed_documents_match_separate_runs(kind: str, pad_to: int | None):
    torch.manual_seed(0)
    model = build(llama_like() if kind == "llama" else gpt2_like())
    docs = _docs()
    ref_loss, ref_grads = _separately(model, docs)
    loss, grads = _packed(model, docs, pad_to)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_packing_matters():
    """Without the document boundaries the packed loss differs (the test above is not vacuous)."""
    torch.manual_seed(0)
    model = build(llama_like())
    docs = _docs()
    ref_loss, _ = _separately(model, docs)
    ids, labels = torch.cat([d[0] for d in docs], 1), torch.cat([d[1] for d in docs], 1)
    loss = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None, labels=labels).detach()
    assert not torch.allclose(loss, ref_loss, atol=1e-3)


def _params(cu: list[int], padded: list[int] | None = None) -> PackedSeqParams:
    t = torch.tensor(cu, dtype=torch.int32)
    p = None if padded is None else torch.tensor(padded, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t, cu_seqlens_q_padded=p,
                           cu_seqlens_kv_padded=p, max_seqlen_q=8, max_seqlen_kv=8)


def test_bad_cu_seqlens_are_refused():
    torch.manual_seed(0)
    model = build(llama_like())
    ids = torch.randint(0, VOCAB, (1, 16))
    pos = torch.arange(16).unsqueeze(0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing.*entry 2 is 3 after 9"):
        model(ids, pos, None, packed_seq_params=_params([0, 9, 3, 16]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must end at the packed token count \(16\), got 12"):
        model(ids, pos, None, packed_seq_params=_params([0, 5, 12]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q_padded must end at the packed token count \(16\), got 20"):
        model(ids, pos, None, packed_seq_params=_params([0, 5, 12], [0, 8, 20]))
    with pytest.raises(ValueError, match=r"must start at 0"):
        model(ids, pos, None, packed_seq_params=_params([1, 5, 16]))
    with pytest.raises(ValueError, match=r"real length 7 .* exceeds its padded length 4"):
        model(ids, pos, None, packed_seq_params=_params([0, 7, 12], [0, 4, 16]))
    with pytest.raises(ValueError, match=r"qkv_format \('sbhd'\) must be 'thd'"):
        params = _params([0, 8, 16])
        params.qkv_format = "sbhd"
        model(ids, pos, None, packed_seq_params=params)


def test_cp_partition_and_positions():
    """Megatron's per-document CP split: rank r holds chunks r and 2cp-1-r of every document."""
    layout = thd_layout(_params([0, 8, 12], [0, 8, 12]), 12)
    assert thd_partitioned_indices(layout, 2, 0) == [0, 1, 6, 7, 8, 11]
    assert thd_partitioned_indices(layout, 2, 1) == [2, 3, 4, 5, 9, 10]
    assert thd_positions(layout, 2, 1).tolist() == [2, 3, 4, 5, 1, 2]
    with pytest.raises(ValueError, match=r"padded length 12, not divisible by 2 \* context_parallel_size \(8\)"):
        thd_partitioned_indices(thd_layout(_params([0, 12]), 12), 4, 0)
