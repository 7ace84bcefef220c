"""The dynamic engine under TP=2 and PP=2 (gloo ranks) produces Hugging Face's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_on_ranks

pytest.importorskip("transformers")

NEW = 8
LENGTHS = (5, 13, 9)


def _generate(model, compiled_decode: bool = False) -> list[list[int]]:
    from megatron_core.inference.apis import MegatronLLM
    from megatron_core.inference.config import InferenceConfig
    from megatron_core.inference.sampling_params import SamplingParams
    from tests.inference.llama_fixture import prompts

    # A small cache and step budget, so the run also pauses / evicts and chunks under parallelism.
    # With the graph layout, decode steps also overlap the host's work (async_sched_mode), on every rank.
    graphs = dict(num_cuda_graphs=4, compile_decode_graphs=True, async_sched_mode="async") if compiled_decode else {}
    llm = MegatronLLM(
        model=model, tokenizer=None, use_coordinator=False,
        inference_config=InferenceConfig(block_size_tokens=4, buffer_size_gb=12 * 1024 / 1024**3, max_tokens=16,
                                         max_sequence_length=32, enable_chunked_prefill=True, **graphs),
    )
    if compiled_decode:  # the CUDA-graph layout and its compiled forward, run without graphs on CPU
        llm.engine.context.pad_decode_steps_on_cpu = True
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1)
    tokens = [r.generated_tokens for r in llm.generate(prompts(LENGTHS), params)]
    assert not compiled_decode or llm.engine.overlapped_step_count > 0
    return tokens


def _expected() -> list[list[int]]:
    from tests.inference.llama_fixture import hf_greedy, hf_llama, prompts

    hf = hf_llama()
    return [hf_greedy(hf, p, NEW) for p in prompts(LENGTHS)]


def _tp_run(compiled_decode: bool = False) -> list[list[int]]:
    from megatron_core import parallel_state
    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
    from tests.inference.llama_fixture import (
        GROUPS,
        HEADS,
        LAYERS,
        MAX_POS,
        VOCAB,
        hf_llama,
        llama_to_mcore,
        mcore_config,
    )
    from tests.models.gpt_test_utils import shard

    full = llama_to_mcore(hf_llama().state_dict(), LAYERS, HEADS, GROUPS)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        rank = parallel_state.get_tensor_model_parallel_rank()
        model = GPTModel(mcore_config(tensor_model_parallel_size=2), get_gpt_layer_local_spec(), VOCAB, MAX_POS,
                         position_embedding_type="rope", rotary_base=10000).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, full[name], 2, rank, gated=True))
        return _generate(model, compiled_decode)
    finally:
        parallel_state.destroy_model_parallel()


def _pp_run() -> list[list[int]]:
    from megatron_core import parallel_state
    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
    from tests.inference.llama_fixture import (
        GROUPS,
        HEADS,
        LAYERS,
        MAX_POS,
        VOCAB,
        hf_llama,
        llama_to_mcore,
        mcore_config,
    )

    full = llama_to_mcore(hf_llama().state_dict(), LAYERS, HEADS, GROUPS)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        config = mcore_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
        model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, MAX_POS, position_embedding_type="rope",
                         rotary_base=10000, pre_process=stage == 0, post_process=stage == 1).eval()
        per_stage = LAYERS // 2
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.startswith("decoder.layers."):
                    index, rest = name[len("decoder.layers."):].split(".", 1)
                    name = f"decoder.layers.{int(index) + stage * per_stage}.{rest}"
                param.copy_(full[name])
        return _generate(model)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("run", [_tp_run, _pp_run], ids=["tp2", "pp2"])
def test_parallel_greedy_matches_hf(run):
    expected = _expected()
    results = run_on_ranks(2, run)
    assert results[0] == expected and results[1] == expected


def test_tp2_compiled_decode_layout_matches_hf():
    """``compile_decode_graphs`` under TP=2: the compiled forward (with its TP collectives) in the padded layout."""
    expected = _expected()
    results = run_on_ranks(2, _tp_run, True)
    assert results[0] == expected and results[1] == expected
