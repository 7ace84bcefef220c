"""The order in which the combined 1F1B schedule runs its nodes, and the nodes themselves.

Recorded on 2 gloo ranks (EP=2, two MoE layers, three micro-batches, no pipelining) and compared with
Megatron-Core 0.19's documented order: forward 0 alone; then each step pairs forward layer ``i`` of
micro-batch ``m + 1`` with backward layer ``L - 1 - i`` of micro-batch ``m``, slot by slot (combine
backward, attention forward, experts backward, dispatch forward, dispatch backward, experts forward,
combine forward, attention backward); then backward ``M - 1`` alone.
"""

from __future__ import annotations

from unittest import mock

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.pipeline_parallel.schedule_node import ScheduleNode
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel.combined_1f1b_utils import EP, forward_step, micro_batches
from tests.transformer.moe.moe_parallel_utils import SEQ, build

MICRO, LAYERS = 3, 2
SLOTS = ("pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine")


def _layer_forward(mb: int, layer: int) -> list[tuple]:
    return [(mb, layer, slot, "F") for slot in SLOTS]


def _layer_backward(mb: int, layer: int) -> list[tuple]:
    return [(mb, layer, slot, "B") for slot in reversed(SLOTS)]


def _pair(f_mb: int, f_layer: int, b_mb: int, b_layer: int, early_attn_release: bool = False) -> list[tuple]:
    """One forward layer interleaved with one backward layer, as 0.19's ``TransformerLayerSchedulePlan.run``."""
    order = [(b_mb, b_layer, "moe_combine", "B"), (f_mb, f_layer, "pre_dispatch_computation", "F"),
             (b_mb, b_layer, "mlp", "B"), (f_mb, f_layer, "moe_dispatch", "F"), (b_mb, b_layer, "moe_dispatch", "B")]
    attn_backward = [(b_mb, b_layer, "pre_dispatch_computation", "B")]
    rest = [(f_mb, f_layer, "mlp", "F"), (f_mb, f_layer, "moe_combine", "F")]
    return order + (attn_backward + rest if early_attn_release else rest + attn_backward)


def expected_order(early_attn_release: bool) -> list[tuple]:
    """0.19's node order for ``MICRO`` micro-batches of a ``LAYERS``-layer MoE model without pipelining."""
    order = [(0, None, "pre_process", "F")]
    for layer in range(LAYERS):
        order += _layer_forward(0, layer)
    order += [(0, None, "post_process", "F"), (0, None, "loss_func", "F")]
    for mb in range(1, MICRO):
        # The loss is backpropagated by autograd before the step (the loss node only hands over its input's
        # gradient), so the loss node's backward never runs as a node.
        order += [(mb, None, "pre_process", "F"), (mb - 1, None, "post_process", "B")]
        for i in range(LAYERS):
            order += _pair(mb, i, mb - 1, LAYERS - 1 - i, early_attn_release)
        order += [(mb, None, "post_process", "F"), (mb - 1, None, "pre_process", "B"), (mb, None, "loss_func", "F")]
    order += [(MICRO - 1, None, "post_process", "B")]
    for layer in reversed(range(LAYERS)):
        order += _layer_backward(MICRO - 1, layer)
    return order + [(MICRO - 1, None, "pre_process", "B")]


def _record(early_attn_release: bool) -> list[tuple]:
    """Run the schedule, recording ``(micro-batch, layer, node, F/B)`` for every node run."""
    log: list[tuple] = []
    ids: dict[int, int] = {}  # id of a micro-batch's chunk state -> micro-batch index (in order of first forward)
    loss_nodes: dict[int, int] = {}
    alive: list = []  # keeps the recorded objects alive so that their ids are not reused
    real_forward, real_backward = ScheduleNode._forward, ScheduleNode._backward

    def where(node: ScheduleNode, forward: bool) -> tuple:
        state = getattr(node, "chunk_state", None)
        alive.append(state if state is not None else node)
        if state is None:  # the loss node: micro-batch by order of creation
            mb = loss_nodes.setdefault(id(node), len(loss_nodes)) if forward else loss_nodes[id(node)]
            return mb, None
        mb = ids.setdefault(id(state), len(ids))
        layer = None if node.name in ("pre_process", "post_process") else (0 if node.is_first_layer else 1)
        return mb, layer

    def forward(node, *inputs):
        mb, layer = where(node, True)
        log.append((mb, layer, node.name, "F"))
        return real_forward(node, *inputs)

    def backward(node, *grads):
        mb, layer = where(node, False)
        log.append((mb, layer, node.name, "B"))
        return real_backward(node, *grads)

    model = build("mixtral", expert_model_parallel_size=EP, moe_token_dispatcher_type="alltoall", bf16=True,
                  overlap_moe_expert_parallel_comm=True, ep_overlap_early_attn_memory_release=early_attn_release)
    with mock.patch.object(ScheduleNode, "_forward", forward), mock.patch.object(ScheduleNode, "_backward", backward):
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches(parallel_state.get_data_parallel_rank(), MICRO)), model=[model],
            num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    return log


def _check_order() -> str:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        for early in (False, True):
            got, want = _record(early), expected_order(early)
            if got != want:
                at = next(i for i, (a, b) in enumerate(zip(got + [None] * len(want), want + [None] * len(got)))
                          if a != b)
                raise AssertionError(f"early_attn_release={early}: node {at} is {got[at:at + 3]}, "
                                     f"expected {want[at:at + 3]}")
        return "ok"
    finally:
        parallel_state.destroy_model_parallel()


def test_node_order_interleaves_forward_and_backward_as_megatron():
    assert run_on_ranks(2, _check_order) == ["ok", "ok"]


def test_schedule_node_chain_matches_autograd():
    """Two nodes chained by detached inputs give the gradients of one autograd graph, views included."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    first = ScheduleNode(lambda t: (t @ w1).t(), None, None, name="first")  # a view as output
    # free_input: the second node's autograd keeps only tensors it made, never its input.
    second = ScheduleNode(lambda t: (t.t().tanh() @ w2).sigmoid(), None, None, name="second", free_input=True)
    out = second.forward(first.forward(x))
    grad_out = torch.randn_like(out)
    grad_x = first.backward(second.backward(grad_out))
    got = (grad_x.clone(), w1.grad.clone(), w2.grad.clone())

    x2 = x.detach().clone().requires_grad_()
    w1.grad = w2.grad = None
    ((x2 @ w1).tanh() @ w2).sigmoid().backward(grad_out)
    for a, b in zip(got, (x2.grad, w1.grad, w2.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert first.output is None and second.inputs is None  # state released after the backward
