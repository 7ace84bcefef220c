"""Schedule-order helpers of Megatron-Core's ``transformer.cuda_graphs`` (the graph capture itself is not provided).

Megatron-Core captures one CUDA graph per layer and micro-batch and replays them in the order the pipeline
schedule runs them. These two pure functions compute that order; this library has no CUDA-graph capture
(``docs/compat.md``), but schedules and tools that plan with the order can use them.

An *order* is a list of model-chunk ids, 1-based: ``c`` is a forward of chunk ``c``, ``-c`` its backward.
"""

from __future__ import annotations

from itertools import zip_longest

__all__ = ["convert_schedule_table_to_order", "get_overlap_moe_expert_parallel_comm_order"]


def convert_schedule_table_to_order(num_warmup_microbatches: int, num_model_chunks: int,
                                    schedule_table: list[tuple[int, int]]) -> list[int]:
    """The forward/backward chunk order of an interleaved schedule.

    ``schedule_table`` lists ``(microbatch_id, model_chunk_id)`` per virtual micro-batch. Forwards are
    ``chunk + 1``; backwards ``chunk - num_model_chunks`` (the last chunk's backward runs first). After
    ``num_warmup_microbatches`` forwards, each further forward is followed by one backward; the remaining
    backwards close the order. E.g. PP2, VP2, 5 micro-batches, 5 warm-up: ``1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1
    -1 -2 -2 -1 -1``.
    """
    chunks = [chunk for _, chunk in schedule_table]
    forwards = [chunk + 1 for chunk in chunks]
    backwards = [chunk - num_model_chunks for chunk in chunks]
    warmup = num_warmup_microbatches
    order = forwards[:warmup]
    for i in range(warmup, len(forwards)):
        order += [forwards[i], backwards[i - warmup]]
    if warmup > 0:
        order += backwards[len(backwards) - warmup:]
    return order


def get_overlap_moe_expert_parallel_comm_order(order: list[int], num_layers_per_chunk: list[int],
                                               capture_wgrad_graph: bool) -> tuple[list[float], list]:
    """Expand a chunk order to a layer order in which a forward layer and a backward layer alternate.

    Layers are numbered globally from 1 across chunks (chunk ``c`` holds the ``num_layers_per_chunk[c - 1]``
    layers after those of earlier chunks); a backward of layer ``l`` is ``-l``, and with
    ``capture_wgrad_graph`` each backward is followed by its weight-gradient entry ``-l - 0.5``. Warm-up
    forwards keep their order; in the steady state each (backward chunk, forward chunk) pair is zipped layer
    by layer, forward first (the wgrad of a pair's last backward layer comes after the pair); cool-down
    backwards close the order. Returns the order and, per entry, ``[chunk index, layer index in the chunk]``
    for forwards and ``None`` for backwards.
    """
    def layers(chunk_id: int) -> list[int]:
        before = sum(num_layers_per_chunk[:abs(chunk_id) - 1])
        span = range(before + 1, before + num_layers_per_chunk[abs(chunk_id) - 1] + 1)
        return list(span) if chunk_id > 0 else [-layer for layer in reversed(span)]

    new_order: list[float] = []
    chunk_ids: list = []

    def add(chunk_id: int, layer: float, index: int | None = None, wgrad: bool = False) -> None:
        new_order.append(layer - 0.5 if wgrad else layer)
        chunk_ids.append([abs(chunk_id) - 1, index] if chunk_id > 0 else None)

    first_backward = next((i for i, c in enumerate(order) if c < 0), len(order))
    last_forward = max((i for i, c in enumerate(order) if c > 0), default=-1)
    for chunk_id in order[:first_backward]:
        for index, layer in enumerate(layers(chunk_id)):
            add(chunk_id, layer, index)
    if first_backward < last_forward:
        steady = order[first_backward:last_forward + 1]
        for backward_id, forward_id in zip(steady[0::2], steady[1::2]):
            backward_layers = layers(backward_id)
            pairs = zip_longest(backward_layers, layers(forward_id), fillvalue=0)
            for index, (layer_b, layer_f) in enumerate(pairs):
                if layer_f:
                    add(forward_id, layer_f, index)
                if layer_b:
                    add(backward_id, layer_b)
                    if capture_wgrad_graph and index < len(backward_layers) - 1:
                        add(backward_id, layer_b, wgrad=True)
            if capture_wgrad_graph and backward_layers:
                add(backward_id, backward_layers[-1], wgrad=True)
    for chunk_id in order[last_forward + 1:]:
        for layer in layers(chunk_id):
            add(chunk_id, layer)
            if capture_wgrad_graph:
                add(chunk_id, layer, wgrad=True)
    return new_order, chunk_ids
