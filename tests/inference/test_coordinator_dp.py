"""Two data-parallel engine replicas (gloo ranks) behind one coordinator, fed by one client."""

from __future__ import annotations

import asyncio

import pytest

from tests.dist_harness import run_on_ranks

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

WAIT_S = 90


def _dp_run():
    import torch.distributed as dist

    from megatron_core import parallel_state
    from megatron_core.inference.engines.dynamic_engine import EngineState
    from megatron_core.inference.inference_client import InferenceClient
    from megatron_core.inference.inference_request import Status
    from tests.inference.coordinator_fixture import GREEDY, PROMPTS, engine

    parallel_state.initialize_model_parallel()  # TP = PP = 1: two data-parallel replicas
    served = engine()
    rank = dist.get_rank()

    async def main():
        address = await served.start_listening_to_data_parallel_coordinator(0, True)
        results = None
        if rank == 0:
            client = InferenceClient(address)
            client.start(connect_timeout_s=WAIT_S)
            try:
                futures = [client.add_request(p, GREEDY) for p in PROMPTS]
                replies = await asyncio.wait_for(asyncio.gather(*futures), WAIT_S)
                results = [(r["status"], r["generated_tokens"]) for r in replies]
                client.pause_engines()
                await asyncio.wait_for(served.wait_until(EngineState.PAUSED), WAIT_S)
                client.stop_engines()
                await asyncio.wait_for(served.wait_until(EngineState.STOPPED), WAIT_S)
                client.shutdown_coordinator()
            finally:
                client.stop()
                handle = served.inference_coordinator_process
                handle.join(WAIT_S)
                handle.terminate()
                handle.join(WAIT_S)
                assert not handle.is_alive()
        else:
            await asyncio.wait_for(served.wait_until(EngineState.STOPPED), WAIT_S)
        return results

    results = asyncio.run(main())
    assert served.state == EngineState.STOPPED
    if results is not None:
        results = [(Status[s].name, tokens) for s, tokens in results]
    return results, served._coordinator_link.received_request_count


def test_two_replicas_serve_eight_requests_like_one_process():
    from tests.inference.coordinator_fixture import PROMPTS, reference

    expected = reference(PROMPTS)
    (results, served0), (none, served1) = run_on_ranks(2, _dp_run)
    assert none is None
    assert results == [("COMPLETED", tokens) for tokens in expected]
    assert served0 > 0 and served1 > 0 and served0 + served1 == len(PROMPTS)


def _tp_run():
    import torch

    from megatron_core import parallel_state
    from megatron_core.inference.engines.dynamic_engine import EngineState
    from megatron_core.inference.inference_client import InferenceClient
    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
    from tests.inference.coordinator_fixture import GREEDY, PROMPTS, engine, tiny_gpt
    from tests.inference.llama_fixture import MAX_POS, VOCAB, mcore_config
    from tests.models.gpt_test_utils import shard

    full = tiny_gpt().state_dict()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)  # one replica over two ranks
    rank = parallel_state.get_tensor_model_parallel_rank()
    model = GPTModel(mcore_config(tensor_model_parallel_size=2), get_gpt_layer_local_spec(), VOCAB, MAX_POS,
                     position_embedding_type="rope", rotary_base=10000).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, full[name], 2, rank, gated=True))
    served = engine(model)

    async def main():
        address = await served.start_listening_to_data_parallel_coordinator(0, True)
        results = None
        if rank == 0:
            client = InferenceClient(address)
            client.start(connect_timeout_s=WAIT_S)
            try:
                futures = [client.add_request(p, GREEDY) for p in PROMPTS[:4]]
                futures.append(client.add_request([1] * 80, GREEDY))  # refused on both ranks, answered once
                replies = await asyncio.wait_for(asyncio.gather(*futures), WAIT_S)
                results = [r["generated_tokens"] for r in replies[:4]] + [replies[4]["error"]]
                client.pause_engines()
                await asyncio.wait_for(served.wait_until(EngineState.PAUSED), WAIT_S)
                client.stop_engines()
                await asyncio.wait_for(served.wait_until(EngineState.STOPPED), WAIT_S)
                client.shutdown_coordinator()
            finally:
                client.stop()
                handle = served.inference_coordinator_process
                handle.join(WAIT_S)
                handle.terminate()
                handle.join(WAIT_S)
        else:
            await asyncio.wait_for(served.wait_until(EngineState.STOPPED), WAIT_S)
        return results

    results = asyncio.run(main())
    return results, served._coordinator_link.received_request_count, served.is_mp_coordinator


def test_tensor_parallel_replica_broadcasts_requests_to_its_peer():
    """TP=2: only rank 0 talks to the coordinator; rank 1 gets every message through the model-parallel group."""
    from tests.inference.coordinator_fixture import PROMPTS, reference

    expected = reference(PROMPTS[:4])
    (results, count0, leader0), (none, count1, leader1) = run_on_ranks(2, _tp_run)
    assert results[:4] == expected and "max_sequence_length" in results[4] and none is None
    assert (count0, count1) == (5, 5) and (leader0, leader1) == (True, False)


def _communicator_run():
    import torch.distributed as dist
    import zmq

    from megatron_core.inference.engines.async_zmq_communicator import AsyncZMQCommunicator

    rank = dist.get_rank()
    context = zmq.Context()
    comm = AsyncZMQCommunicator(context, None)
    try:

        async def reduce():
            first = await asyncio.wait_for(comm.all_reduce_max(rank, 10 - rank, -5), WAIT_S)
            second = await asyncio.wait_for(comm.all_reduce_max(3 * rank, async_op=False), WAIT_S)
            return first, second

        first, second = asyncio.run(reduce())
        third = comm.sync_all_reduce_max(7 - rank)
    finally:
        comm.close()
        context.term()
    return first, second, third


def test_async_zmq_communicator_all_reduce_max():
    """Element-wise max over two ranks, asyncio (polling and blocking) and sync, equal to Python's max."""
    for first, second, third in run_on_ranks(2, _communicator_run):
        assert first == (1, 10, -5) and second == 3 and third == 7
