"""``inference.utils`` (Megatron-Core 0.19's helpers) and the engines' use of them, plus the deprecated constructor
arguments of the dynamic context, the engine and the wrappers, and ``format_mem_bytes``."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import re
import threading
import time

import pytest
import torch

from megatron_core.inference import utils
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts import DynamicInferenceContext, dynamic_context
from megatron_core.inference.engines import DynamicInferenceEngine, dynamic_engine
from megatron_core.inference.model_inference_wrappers import abstract_model_inference_wrapper
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper, gpt_inference_wrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig


def _config(**overrides) -> TransformerConfig:
    cfg = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, use_cpu_initialization=True,
               add_bias_linear=False)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def _model(**overrides) -> GPTModel:
    spec = get_gpt_layer_local_spec(num_experts=overrides.get("num_moe_experts"))
    return GPTModel(_config(**overrides), spec, 64, 32).eval()


def _context(model: GPTModel) -> DynamicInferenceContext:
    return DynamicInferenceContext(model.config, InferenceConfig(block_size_tokens=8, buffer_size_gb=0.01,
                                                                 max_sequence_length=32, max_requests=4))


def test_counter_hands_out_consecutive_ids():
    counter = utils.Counter(5)
    assert [next(counter) for _ in range(3)] == [5, 6, 7]
    counter.reset()
    assert next(counter) == 0


def test_inference_mode_flag_and_the_engine_sets_it():
    utils.InferenceMode.unset_active()
    with utils.InferenceMode.active():
        assert utils.InferenceMode.is_active()
    assert not utils.InferenceMode.is_active()
    torch.manual_seed(0)
    model = _model()
    context = _context(model)
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), None), context)
    assert utils.InferenceMode.is_active() and isinstance(engine.request_counter, utils.Counter)
    ids = [next(engine.request_counter) for _ in range(2)]
    futures = [engine.add_request(i, [1, 2, 3], SamplingParams(top_k=1, num_tokens_to_generate=2)) for i in ids]
    while not all(f.done() for f in futures):
        engine.step_modern()
    assert ids == [0, 1] and [len(f.result(timeout=60).generated_tokens) for f in futures] == [2, 2]
    utils.InferenceMode.unset_active()


def test_get_attention_mask_masks_the_future():
    mask = utils.get_attention_mask(5)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    expected = torch.ones(5, 5).tril() < 0.5  # True above the diagonal
    assert torch.equal(mask[0, 0].cpu(), expected)


def test_tensor_swap_exchanges_rows():
    x = torch.arange(12.0).reshape(6, 2)
    reference = x.clone()
    src, dst = torch.tensor([0, 4]), torch.tensor([5, 1])
    utils.tensor_swap(x, src, dst)
    expected = reference.clone()
    expected[[5, 1]], expected[[0, 4]] = reference[[0, 4]], reference[[5, 1]]
    assert torch.equal(x, expected)


def test_await_process_call_returns_or_names_the_dead_process():
    ctx = multiprocessing.get_context("fork")
    event = ctx.Event()
    alive = ctx.Process(target=time.sleep, args=(30,), name="sleeper")
    alive.start()
    try:
        threading.Timer(0.2, event.set).start()
        asyncio.run(utils.await_process_call(event.wait, alive, timeout=0.05))
    finally:
        alive.terminate()
        alive.join(timeout=30)
    dead = ctx.Process(target=time.sleep, args=(0,), name="quitter")
    dead.start()
    dead.join(timeout=30)
    with pytest.raises(RuntimeError, match=r"Process quitter \(pid \d+\) has exited unexpectedly"):
        asyncio.run(utils.await_process_call(ctx.Event().wait, dead, timeout=0.05))


@pytest.mark.parametrize(("cuda", "wheel"), [("12.9", "cu129"), ("13.0", "cu130"), (None, None)])
def test_flashinfer_jit_cache_check_without_the_package(monkeypatch, cuda, wheel):
    monkeypatch.setattr(utils, "FLASHINFER_JIT_CACHE_VERSION", None)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    with pytest.raises(RuntimeError, match="'flashinfer-jit-cache' package is required") as info:
        utils.check_flashinfer_jit_cache_installed()
    assert (f"https://flashinfer.ai/whl/{wheel}" in str(info.value)) if wheel else "pip install" not in str(info.value)


def test_flashinfer_jit_cache_check_with_the_package(monkeypatch, caplog):
    monkeypatch.setattr(utils, "FLASHINFER_JIT_CACHE_VERSION", "0.5.0")
    with caplog.at_level(logging.INFO, logger=utils.__name__):
        assert utils.check_flashinfer_jit_cache_installed(log_version=True) is None
    assert "flashinfer-jit-cache 0.5.0" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_device_memory_summary_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        utils.device_memory_summary()


@pytest.mark.gpu
def test_device_memory_summary_on_gpu():
    keep = torch.empty(64 * 1024**2, dtype=torch.uint8, device="cuda")
    line = utils.device_memory_summary()
    fields = dict(re.findall(r"(\S+)=(-?\d+)MiB", line))
    assert set(fields) == {"alloc", "private", "resv-alloc", "resv", "dev_mem"}
    assert int(fields["alloc"]) >= 64 and int(fields["dev_mem"]) >= int(fields["alloc"])
    del keep


def _moe_model(**overrides) -> GPTModel:
    return _model(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
                  **overrides)


def test_set_decode_expert_padding_matches_a_model_built_with_padding():
    torch.manual_seed(0)
    model = _moe_model()
    padded = _moe_model(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    padded.load_state_dict(model.state_dict())
    ids, pos = torch.randint(0, 64, (2, 8)), torch.arange(8).expand(2, 8)
    with torch.no_grad():
        dropless = model(ids, pos, None)
        utils.set_decode_expert_padding(model, set_to=True, capacity_factor=1.0)
        assert len(utils.moe_layer_cache) == 2
        torch.testing.assert_close(model(ids, pos, None), padded(ids, pos, None), rtol=0, atol=0)
        assert not torch.allclose(dropless, padded(ids, pos, None))  # capacity 1.0 drops tokens here
        assert all(layer.token_dispatcher.drop_and_pad for layer in utils.moe_layer_cache)
        utils.set_decode_expert_padding(model, set_to=False)
        torch.testing.assert_close(model(ids, pos, None), dropless, rtol=0, atol=0)
    assert model.config.moe_expert_capacity_factor is None and not model.config.moe_pad_expert_input_to_capacity


def test_set_moe_metadata_sync_marks_only_the_first_layer():
    model = _moe_model()
    layers = [m for m in model.modules() if type(m).__name__ == "MoELayer"]
    for layer in layers:
        layer._inference_token_dispatcher = type("Dispatcher", (), {})()
    utils.set_moe_metadata_sync(model)
    assert [layer._inference_token_dispatcher._runs_metadata_sync for layer in layers] == [True, False]


def test_a_new_model_at_a_freed_models_address_is_set_up_again():
    """The once-per-model checks hold the model weakly: a model built where a freed one lived (same ``id``) is still
    a new model, its MoE layers cached and flagged afresh."""
    layers = [m for m in _moe_model().modules() if type(m).__name__ == "MoELayer"]
    for layer in layers:
        layer._inference_token_dispatcher = type("Dispatcher", (), {})()
    first = torch.nn.ModuleList(layers)
    utils.set_moe_metadata_sync(first)
    freed_id = id(first)
    del first
    for _ in range(100):  # CPython usually hands the freed address to the next object of the same size
        second = torch.nn.ModuleList(layers)
        if id(second) == freed_id:
            break
    for layer in layers:
        layer._inference_token_dispatcher._runs_metadata_sync = None
    utils.set_moe_metadata_sync(second)
    assert [layer._inference_token_dispatcher._runs_metadata_sync for layer in layers] == [True, False]
    assert utils.moe_layer_cache == layers


def test_deprecated_constructor_arguments_raise():
    model = _model()
    context = _context(model)
    with pytest.raises(TypeError, match="Argument `max_requests` has been deprecated. Only pass `model_config`"):
        DynamicInferenceContext(model.config, InferenceConfig(), max_requests=4)
    with pytest.raises(TypeError, match="Argument `random_seed` has been deprecated. Only pass `controller`"):
        DynamicInferenceEngine(None, context, random_seed=3)
    with pytest.raises(TypeError, match="Argument 'inference_wrapper_config' has been deprecated"):
        GPTInferenceWrapper(model, context, inference_wrapper_config=None)
    assert "offload_kv_cache" in dynamic_context.DEPRECATED_ARGS and "pg_collection" in dynamic_engine.DEPRECATED_ARGS
    assert gpt_inference_wrapper.DEPRECATED_ARGS == abstract_model_inference_wrapper.DEPRECATED_ARGS == [
        "inference_wrapper_config", "pg_collection"]
    utils.InferenceMode.unset_active()


@pytest.mark.parametrize(("n", "text"), [(0, "0 bytes"), (512, "512.0 bytes"), (1536, "1.5 kb"),
                                         (3 * 1024**3, "3.0 gb"), (-2048, "-2.0 kb"), (5 * 1024**4, "5.0 tb")])
def test_format_mem_bytes(n, text):
    assert dynamic_engine.format_mem_bytes(n) == text
