"""A heterogeneous GPTModel split over two pipeline stages (2 + 3 layers): each stage builds its own blocks
with the per-layer configs of their global numbers, and the two stages together give the single-process loss."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from tests.dist_harness import run_on_ranks
from tests.transformer.heterogeneous.hetero_test_utils import MAX_SEQ, VOCAB, batch, build, config


def _check_stages() -> list[int]:
    reference = build(config())
    ids, pos, labels = batch()
    want = reference(ids, pos, None, labels=labels).detach()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        rank = parallel_state.get_pipeline_model_parallel_rank()
        cfg = config(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2, pipeline_dtype=torch.float32)
        stage = GPTModel(cfg, get_gpt_heterogeneous_layer_spec(cfg), VOCAB, MAX_SEQ, position_embedding_type="rope",
                         pre_process=rank == 0, post_process=rank == 1)
        offset = 0 if rank == 0 else 2
        numbers = [layer.layer_number for layer in stage.decoder.layers]
        assert numbers == [offset + i + 1 for i in range(len(numbers))]
        for layer in stage.decoder.layers:
            ref_layer = reference.decoder.layers[layer.layer_number - 1]
            assert type(layer.self_attention) is type(ref_layer.self_attention)
            assert (layer.config.num_query_groups, layer.config.ffn_hidden_size) == (
                ref_layer.config.num_query_groups, ref_layer.config.ffn_hidden_size)
        ref_state = reference.state_dict()
        stage.load_state_dict({
            key: ref_state[_global_key(key, offset)] for key in stage.state_dict()
        })
        hidden_shape = (ids.shape[1], ids.shape[0], cfg.hidden_size)
        if rank == 0:
            dist.send(stage(ids, pos, None).detach().contiguous(), dst=1)
        else:
            received = torch.empty(hidden_shape)
            dist.recv(received, src=0)
            stage.set_input_tensor(received)
            torch.testing.assert_close(stage(ids, pos, None, labels=labels), want, rtol=1e-5, atol=1e-5)
        return numbers
    finally:
        parallel_state.destroy_model_parallel()


def _global_key(key: str, offset: int) -> str:
    if not key.startswith("decoder.layers."):
        return key
    index, rest = key[len("decoder.layers."):].split(".", 1)
    return f"decoder.layers.{int(index) + offset}.{rest}"


def test_pipeline_stages_build_their_blocks_and_match_one_process():
    assert run_on_ranks(2, _check_stages) == [[1, 2], [3, 4, 5]]
