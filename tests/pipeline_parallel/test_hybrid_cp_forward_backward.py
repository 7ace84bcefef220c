"""hybrid_context_parallel_forward_backward in one process (collectives and groups faked), its helpers and errors.

The schedule against 4 real ranks and a model is in ``test_hybrid_cp_training.py``; here: the order of the
forward and backward calls, the CP sizes and ``local_cp_size`` given to each, the barriers between groups,
where gradient reduction is allowed again, the TP broadcast protocol seen from a non-reading TP rank, and the
errors of the schedule, ``get_batch_on_this_cp_rank(is_hybrid_cp=True)``, ``packed_cp_group`` and the configs.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.pipeline_parallel import hybrid_cp_schedule, schedules
from megatron_core.pipeline_parallel.microbatch_step import backward_step
from megatron_core.rerun_state_machine import RerunDataIterator
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.packed_sequences import packed_cp_group
from megatron_core.utils import get_batch_on_this_cp_rank


class _Log:
    """Records the schedule's calls in order: forwards, backwards, barriers and the no-sync context."""

    def __init__(self) -> None:
        self.events: list = []

    @contextlib.contextmanager
    def no_sync(self):
        self.events.append("no_sync enter")
        yield
        self.events.append("no_sync exit")

    def forward_step(self, forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                     forward_data_store, config, cp_group_size, collect_non_loss_data, is_first_microbatch,
                     current_microbatch):
        sample = None if data_iterator is None else next(data_iterator)
        if sample is not None:
            assert isinstance(data_iterator, RerunDataIterator)
            assert sample["local_cp_size"].dtype == torch.int32 and int(sample["local_cp_size"]) == cp_group_size
        self.events.append(("forward", None if sample is None else sample["id"], cp_group_size, current_microbatch,
                            is_first_microbatch))
        return torch.tensor(float(current_microbatch)), torch.tensor(5)

    def backward_step(self, input_tensor, output_tensor, output_tensor_grad, config):
        self.events.append(("backward", int(output_tensor)))


def _fake_groups(monkeypatch, *, hdp_rank: int, tp_rank: int, log: _Log, broadcasts: list | None = None) -> None:
    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda with_context_parallel=False: hdp_rank)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp_rank)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_src_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", lambda: "tp")
    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda with_context_parallel=False: "dp_cp")
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: log.events.append(("barrier", group)))

    def broadcast(tensor, src, group=None):
        assert group == "tp" and src == 0
        if broadcasts is not None:  # a non-reading TP rank receives TP rank 0's values in this order
            tensor.copy_(torch.tensor(broadcasts.pop(0), dtype=tensor.dtype))

    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    monkeypatch.setattr(schedules, "forward_step", log.forward_step)
    monkeypatch.setattr(schedules, "backward_step", log.backward_step)


def _run(data_iterator, log: _Log, forward_only: bool = False, total=None):
    return hybrid_cp_schedule.hybrid_context_parallel_forward_backward(
        None, data_iterator, "model", 7, None, None, [], SimpleNamespace(), False, None, forward_only, log.no_sync,
        torch.zeros([], dtype=torch.int) if total is None else total,
        lambda first_val_step, forward_only, is_first: is_first, None)


# Three groups over 4 DP x CP ranks; rank 2 runs sample 0 (CP 4), then 3 (CP 2), then 5 and 6 (CP 1).
SAMPLES = {i: {"id": i} for i in range(8)}
GROUPS = [[[0], [0], [0], [0]], [[2], [2], [3], [3]], [[4], [7], [5, 6], [1]]]


def test_runs_each_group_with_barriers_and_syncs_only_the_last(monkeypatch):
    log = _Log()
    _fake_groups(monkeypatch, hdp_rank=2, tp_rank=0, log=log)
    total = torch.zeros([], dtype=torch.int)
    store, out_total = _run(iter([(SAMPLES, GROUPS)]), log, total=total)
    assert store == [] and out_total is total and int(total) == 20
    assert log.events == [
        "no_sync enter",
        ("forward", 0, 4, 0, True), ("backward", 0), ("barrier", "dp_cp"),
        ("forward", 3, 2, 1, False), ("backward", 1), ("barrier", "dp_cp"),
        ("forward", 5, 1, 2, False), ("backward", 2),
        "no_sync exit",
        ("forward", 6, 1, 3, False), ("backward", 3),
    ]


def test_forward_only_and_a_python_int_token_count(monkeypatch):
    log = _Log()
    _fake_groups(monkeypatch, hdp_rank=0, tp_rank=0, log=log)
    _, total = _run(iter([(SAMPLES, [[[0], [0]]])]), log, forward_only=True, total=3)
    assert total == 8 and isinstance(total, int)
    assert log.events == ["no_sync enter", "no_sync exit", ("forward", 0, 2, 0, True)]


def test_non_reading_tp_rank_takes_counts_and_sizes_by_broadcast(monkeypatch):
    log = _Log()
    # The number of groups, the per-group counts, then one CP size per sub-sample.
    broadcasts = [[2], [1, 2], [4], [1], [1]]
    _fake_groups(monkeypatch, hdp_rank=1, tp_rank=1, log=log, broadcasts=broadcasts)
    _run(None, log)  # a non-reading rank never touches its data iterator
    assert broadcasts == []
    assert [e for e in log.events if e[0] == "forward"] == [
        ("forward", None, 4, 0, True), ("forward", None, 1, 1, False), ("forward", None, 1, 2, False)]


def test_a_rank_without_sub_samples_is_an_error(monkeypatch):
    log = _Log()
    _fake_groups(monkeypatch, hdp_rank=1, tp_rank=0, log=log)
    with pytest.raises(ValueError, match=r"DP x CP rank 1 got sub-sample counts \[1, 0\]"):
        _run(iter([(SAMPLES, [[[0], [1]], [[2], []]])]), log)
    with pytest.raises(ValueError, match=r"counts \[\]"):
        _run(iter([(SAMPLES, [])]), log)


def test_backward_step_takes_megatron_0_19_and_older_forms():
    grads = []
    for call in (lambda out, cfg: backward_step(None, out, None, cfg),
                 lambda out, cfg: backward_step(None, out, None, None, cfg),
                 lambda out, cfg: backward_step(None, out, None, config=cfg)):
        w = torch.tensor([1.0, 2.0], requires_grad=True)
        call((w * w).sum(), SimpleNamespace(grad_scale_func=lambda t: 3 * t))
        grads.append(w.grad)
    for grad in grads:
        torch.testing.assert_close(grad, torch.tensor([6.0, 12.0]))
    with pytest.raises(TypeError, match="got 3 positional arguments"):
        backward_step(None, torch.ones(()), None)


def _batch(local_cp_size):
    tokens = torch.arange(8)[None]
    return {"tokens": tokens, "labels": tokens + 1, "cu_seqlens": torch.tensor([[0, 8]], dtype=torch.int32),
            "local_cp_size": local_cp_size}


def test_get_batch_on_this_cp_rank_hybrid():
    batch = get_batch_on_this_cp_rank(_batch(torch.tensor([1], dtype=torch.int32)), is_hybrid_cp=True)
    assert batch["tokens"].tolist() == [list(range(8))] and "hybrid_cp_group" not in batch  # CP size 1: unsplit
    with pytest.raises(ValueError, match=r"needs batch\['local_cp_size'\] \(None\)"):
        get_batch_on_this_cp_rank(_batch(None), is_hybrid_cp=True)
    with pytest.raises(ValueError, match=r"local_cp_size'\] \(0\) must be >= 1"):
        get_batch_on_this_cp_rank(_batch(0), is_hybrid_cp=True)
    with pytest.raises(ValueError, match="local_cp_size 2 needs hybrid_cp_group_func"):
        get_batch_on_this_cp_rank(_batch(torch.tensor([2])), is_hybrid_cp=True)
    with pytest.raises(ValueError, match=r"group_size=2\) returned a group of 1 ranks"):
        get_batch_on_this_cp_rank(_batch(2), is_hybrid_cp=True, hybrid_cp_group_func=lambda group_size: None)


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_packed_cp_group_rules():
    layer, call = _Group(2), _Group(4)
    assert packed_cp_group(None, layer) is layer
    assert packed_cp_group(PackedSeqParams(qkv_format="thd"), layer) is layer
    assert packed_cp_group(PackedSeqParams(qkv_format="thd", local_cp_size=1), layer) is None
    assert packed_cp_group(PackedSeqParams(qkv_format="thd", cp_group=call, local_cp_size=4), layer) is call
    assert packed_cp_group(PackedSeqParams(qkv_format="thd", cp_group=call), layer) is call
    with pytest.raises(ValueError, match=r"local_cp_size \(2\) needs PackedSeqParams.cp_group"):
        packed_cp_group(PackedSeqParams(qkv_format="thd", local_cp_size=2), layer)
    with pytest.raises(ValueError, match=r"local_cp_size \(2\) must equal the size of PackedSeqParams.cp_group \(4\)"):
        packed_cp_group(PackedSeqParams(qkv_format="thd", cp_group=call, local_cp_size=2), layer)


_BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=2, hybrid_context_parallel=True,
             max_seqlen_per_dp_cp_rank=8, calculate_per_token_loss=True)


def test_config_accepts_hybrid_context_parallel():
    assert TransformerConfig(**_BASE).hybrid_context_parallel
    assert ModelParallelConfig(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=4).hybrid_context_parallel


@pytest.mark.parametrize("overrides, message", [
    (dict(max_seqlen_per_dp_cp_rank=None), r"needs max_seqlen_per_dp_cp_rank \(None\)"),
    (dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32), r"pipeline_model_parallel_size=2; must be 1"),
    (dict(calculate_per_token_loss=False), r"needs calculate_per_token_loss=True \(got False\)"),
    (dict(cuda_graph_impl="local"), r"CUDA graphs \(enable_cuda_graph=False, cuda_graph_impl='local'\)"),
    (dict(mtp_num_layers=1), r"not supported with mtp_num_layers=1"),
    (dict(cp_comm_type="a2a+p2p"), r"cp_comm_type='a2a\+p2p'"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**_BASE, **overrides})
