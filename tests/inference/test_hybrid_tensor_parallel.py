"""A HybridModel ("M*M-") under TP=2 or PP=2 (gloo ranks) in the dynamic engine gives the single-process plain
loop's greedy tokens: each rank's Mamba slots hold its heads' states (TP, shapes from its own mixers) or its
stage's Mamba layers (PP), with waiting requests and chunked prefill."""

from __future__ import annotations

import torch

from tests.dist_harness import run_on_ranks

NEW = 6
LENGTHS = (5, 13, 9, 3)


def _reference(seed: int) -> tuple[list[list[int]], list[list[int]], dict[str, torch.Tensor]]:
    """``(prompts, the single-process plain greedy outputs, the reference model's parameters)``."""
    from tests.inference.hybrid_fixture import build_hybrid, plain_greedy, prompts

    ref = build_hybrid("M*M-", chunk_size=4)
    batch = prompts(list(LENGTHS), seed=seed)
    expected = [plain_greedy(ref, p, NEW) for p in batch]
    return batch, expected, {name: param.detach().clone() for name, param in ref.named_parameters()}


def _tp_run() -> tuple[list[list[int]], list[list[int]], tuple]:
    from megatron_core import parallel_state, tensor_parallel
    from megatron_core.inference.config import MambaInferenceStateConfig
    from tests.inference.hybrid_fixture import (
        build_hybrid,
        greedy_params,
        hybrid_engine,
    )
    from tests.models.mamba.test_mamba_tensor_parallel import shard

    batch, expected, full = _reference(21)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build_hybrid("M*M-", chunk_size=4, tensor_model_parallel_size=2)
        rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, full[name], 2, rank))
        engine = hybrid_engine(model, max_requests=2, max_tokens=8, enable_chunked_prefill=True)
        out = [r.merge().generated_tokens for r in engine.generate(batch, greedy_params(NEW))]
        shapes = MambaInferenceStateConfig.from_model(model)
        return out, expected, (shapes.conv_states_shape, shapes.ssm_states_shape)
    finally:
        parallel_state.destroy_model_parallel()


def test_tp2_greedy_equals_single_process_plain_loop():
    for out, expected, shapes in run_on_ranks(2, _tp_run):
        assert out == expected
        assert shapes == ((32, 4), (2, 8, 8))  # half of x, B, C channels and half the heads per rank


def _pp_run() -> tuple[list[list[int]], list[list[int]], list[str]]:
    from megatron_core import parallel_state
    from megatron_core.inference.config import MambaInferenceStateConfig
    from tests.inference.hybrid_fixture import (
        build_hybrid,
        greedy_params,
        hybrid_engine,
    )

    batch, expected, full = _reference(22)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        model = build_hybrid("M*M-", chunk_size=4, pre_process=stage == 0, post_process=stage == 1,
                             pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.startswith("decoder.layers."):
                    index, rest = name[len("decoder.layers."):].split(".", 1)
                    name = f"decoder.layers.{model.decoder.layers[int(index)].layer_number - 1}.{rest}"
                param.copy_(full[name])
        engine = hybrid_engine(model, max_requests=2, max_tokens=8, enable_chunked_prefill=True)
        out = [r.merge().generated_tokens for r in engine.generate(batch, greedy_params(NEW))]
        return out, expected, MambaInferenceStateConfig.from_model(model).layer_type_list
    finally:
        parallel_state.destroy_model_parallel()


def test_pp2_greedy_equals_single_process_plain_loop():
    results = run_on_ranks(2, _pp_run)
    assert [layers for _, _, layers in results] == [["M", "*"], ["M", "-"]]
    for out, expected, _ in results:
        assert out == expected
