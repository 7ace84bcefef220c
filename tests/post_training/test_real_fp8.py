"""Real FP8 weights (``post_training.modelopt.real_quant_fp8``): an FP8-PTQ'd tiny GPT converted to FP8 storage.

Tolerances. On CPU the converted layers emulate the FP8 GEMM with the very fp32 operations of Model Optimizer's
CPU fake quantization (``x * (448 / amax)`` rounded to E4M3, times ``1 / (448 / amax)``, cast to the activation
dtype, ``matmul``), so the converted model's logits equal the fake-quantized model's exactly (bound 0, in fp32
and bf16). TP=2 against one process runs in float64, as ``test_ptq_parallel`` does: in fp32 the row-parallel
all-reduce's other summation order (about 1e-7) can move an activation across an FP8 rounding midpoint (a whole
FP8 step); in float64 that noise is 1e-16 (bound 1e-9). The GPU tests compare ``torch._scaled_mm`` (fp32
accumulation, bf16 output) with the emulation on the same codes: the difference is the output's bf16 rounding
(2**-8 relative) plus summation order.
"""

from __future__ import annotations

import io

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.post_training.modelopt.real_quant_fp8 import (
    FP8ParallelLinear,
    convert_to_real_fp8,
    fp8_gemm_paths,
    fp8_linear,
    linear_weight_bytes,
)
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import shard
from tests.post_training.quant_test_utils import (
    LINEARS,
    MAX_SEQ,
    batch,
    build,
    load_sharded,
    logits,
    quantize,
)

pytest.importorskip("modelopt")

NEW = 6  # greedy tokens per prompt
PROMPTS = [[5, 17, 99, 3, 64], [120, 7, 7, 42, 1, 88, 13, 2, 77], [31, 9]]


def converted(dtype: torch.dtype = torch.float32, seed: int = 1234, **overrides):
    """``(fake-quantized logits, the same model converted to real FP8, high-precision linear weight bytes)``."""
    model = quantize(build(seed=seed, dtype=dtype, **overrides), "FP8_DEFAULT_CFG")
    fake, quantized_bytes = logits(model), _quantized_linear_bytes(model)
    return fake, convert_to_real_fp8(model), quantized_bytes


def _quantized_linear_bytes(model) -> int:
    return sum(model.get_submodule(f"decoder.layers.{i}.{name}").weight.nbytes
               for i in range(len(model.decoder.layers)) for name in LINEARS)


def _fp8_layers(model) -> list[FP8ParallelLinear]:
    return [m for m in model.modules() if isinstance(m, FP8ParallelLinear)]


@pytest.mark.parametrize("dtype, bias", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_converted_logits_equal_fake_quant_and_weights_are_fp8_bytes(dtype, bias):
    import modelopt.torch.opt as mto

    fake, model, high_bytes = converted(dtype, add_bias_linear=bias)
    assert torch.equal(logits(model), fake)  # bound 0: the same operations (module docstring)
    layers = _fp8_layers(model)
    assert len(layers) == 2 * len(LINEARS)
    for layer in layers:
        assert layer.weight.dtype == torch.float8_e4m3fn and not layer.weight.requires_grad
        assert layer.weight.untyped_storage().nbytes() == layer.weight.numel()  # one byte each, no larger storage
    fp8_bytes = sum(layer.weight.nbytes for layer in layers)
    assert fp8_bytes * torch.empty((), dtype=dtype).element_size() == high_bytes  # bf16: half, fp32: a quarter
    output_bytes = model.output_layer.weight.nbytes  # FP8_DEFAULT_CFG leaves the output layer unquantized
    assert linear_weight_bytes(model) == fp8_bytes + output_bytes
    assert type(model.output_layer) is tensor_parallel.ColumnParallelLinear
    assert not list(model.output_layer.children()) and not mto.ModeloptStateManager.is_converted(model)
    assert set(fp8_gemm_paths(model).values()) == {"emulated (weight on cpu)"}


def test_state_dict_round_trip_dtype_casts_and_sharded_checkpoint():
    fake, model, _ = converted()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    _, other, _ = converted(seed=99)  # other weights and scales: only the loaded state can give the logits
    other.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert torch.equal(logits(other), fake)
    layer = other.decoder.layers[0].self_attention.linear_qkv
    codes, scale = layer.weight.clone(), layer.weight_scale.clone()
    other.to(torch.float64)  # the FP8 codes and fp32 scales survive a cast of the model
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(layer.weight_scale, scale)
    with pytest.raises(NotImplementedError, match=r"linear_qkv.*save the fake-quantized model.*convert_to_real_fp8"):
        model.sharded_state_dict()


def test_bad_input_raises_naming_the_layer():
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt.quant_attention import kv_cache_quant_config

    qkv = r"decoder\.layers\.0\.self_attention\.linear_qkv"
    with pytest.raises(ValueError, match=qkv + r" \(ColumnParallelLinear\) is not FP8-quantized.*FP8_DEFAULT_CFG"):
        convert_to_real_fp8(build())
    uncalibrated = mtq.quantize(build(), mtq.FP8_DEFAULT_CFG)  # no forward_loop: inputs never seen
    with pytest.raises(ValueError, match=qkv + r".*input_quantizer has no amax: it was not calibrated"):
        convert_to_real_fp8(uncalibrated)
    weight_only = quantize(build(), "FP8_DEFAULT_CFG")
    mtq.disable_quantizer(weight_only, "*input_quantizer")  # FP8 weights, unquantized inputs
    with pytest.raises(ValueError, match=qkv + r".*input_quantizer is disabled \(weight-only FP8"):
        convert_to_real_fp8(weight_only)
    int8 = quantize(build(), "INT8_SMOOTHQUANT_CFG")
    with pytest.raises(ValueError, match=qkv + r".*num_bits=8, not FP8"):
        convert_to_real_fp8(int8)
    kv = mtq.quantize(build(), kv_cache_quant_config(mtq.FP8_DEFAULT_CFG, "fp8"), lambda m: m(*batch(0), None))
    with pytest.raises(ValueError, match=r"core_attention \(.*\) has enabled quantizers but is not .* linear layer"):
        convert_to_real_fp8(kv)
    assert not any(_fp8_layers(m) for m in (uncalibrated, weight_only, int8, kv))  # left as they were


def test_layer_forward_traces_whole_under_torch_compile():
    """No graph break (so no host sync or data-dependent Python) in a converted column or row layer's forward."""
    _, model, _ = converted()
    x = torch.randn(4, 2, 128)
    for layer in (model.decoder.layers[0].mlp.linear_fc1, model.decoder.layers[0].self_attention.linear_proj):
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x)[0], layer(x)[0])


def _engine(model, **options):
    from megatron_core.inference.config import InferenceConfig
    from megatron_core.inference.contexts import DynamicInferenceContext
    from megatron_core.inference.engines import DynamicInferenceEngine
    from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
    from megatron_core.inference.text_generation_controllers import TextGenerationController

    config = InferenceConfig(block_size_tokens=4, buffer_size_gb=0.002, max_sequence_length=MAX_SEQ, **options)
    context = DynamicInferenceContext(model.config, config)
    return DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), tokenizer=None),
                                  context)


def _engine_greedy(engine, prompts: list[list[int]], one_at_a_time: bool = False) -> list[list[int]]:
    """Greedy tokens of the dynamic engine: all prompts in flight together, or one after another."""
    from megatron_core.inference.sampling_params import SamplingParams

    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1)
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    return [list(r.merge().generated_tokens) for b in batches for r in engine.generate(b, params)]


def _loop_greedy(model, prompt: list[int]) -> list[int]:
    """Greedy decoding by full forwards of the whole sequence (no KV cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            device = next(model.parameters()).device
            tokens = torch.tensor([ids], device=device)
            ids.append(int(model(tokens, torch.arange(len(ids), device=device)[None], None)[0, -1].argmax()))
    return ids[len(prompt):]


def test_engine_greedy_equals_plain_greedy_loop():
    _, model, _ = converted()
    expected = [_loop_greedy(model, p) for p in PROMPTS]
    assert _engine_greedy(_engine(model), PROMPTS) == expected


def _tp2_against_one_process() -> dict[str, float | bool]:
    dtype = torch.float64
    one = build(dtype=dtype)
    weights = {k: v.detach().clone() for k, v in one.named_parameters()}
    one = convert_to_real_fp8(quantize(one, "FP8_DEFAULT_CFG"))
    ref_logits = logits(one)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        rank = parallel_state.get_tensor_model_parallel_rank()
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(dtype=dtype, tensor_model_parallel_size=2)
        load_sharded(model, weights, 2, rank)
        convert_to_real_fp8(quantize(model, "FP8_DEFAULT_CFG"))
        same_scales, same_codes = True, True
        for i in range(len(model.decoder.layers)):
            for name in LINEARS:
                key = f"decoder.layers.{i}.{name}"
                ours, ref = model.get_submodule(key), one.get_submodule(key)
                same_scales &= all(torch.equal(getattr(ours, s), getattr(ref, s))
                                   for s in ("weight_scale", "input_scale", "input_quant_scale"))
                ref_shard = shard(f"{key}.weight", ref.weight.float(), 2, rank, gated=True)
                same_codes &= torch.equal(ours.weight.float(), ref_shard)
        diff = (logits(model) - ref_logits).abs().max().item()
        skewed = quantize(build(tensor_model_parallel_size=2), "FP8_DEFAULT_CFG")
        if rank == 1:  # ranks that disagree must all raise, not leave the others waiting in a later collective
            skewed.decoder.layers[1].mlp.linear_fc2.input_quantizer.amax *= 2
        with pytest.raises(ValueError, match=r"decoder\.layers\.1\.mlp\.linear_fc2: its TP ranks hold different"):
            convert_to_real_fp8(skewed)
        return {"diff": diff, "same_scales": same_scales, "same_codes": same_codes}
    finally:
        parallel_state.destroy_model_parallel()


def test_tp2_converted_logits_equal_one_process_and_disagreeing_ranks_raise():
    for result in run_on_ranks(2, _tp2_against_one_process, timeout=300):
        assert result["same_scales"], "a TP shard's FP8 scales differ from the one-process layer's"
        assert result["same_codes"], "a TP shard's FP8 codes are not the shard of the one-process codes"
        assert result["diff"] < 1e-9, f"TP=2 converted logits differ from one process by {result['diff']:.3g}"


@pytest.mark.gpu
def test_scaled_mm_matches_cpu_emulation():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores")
    _, model, _ = converted()
    for name in ("decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc2"):
        layer = model.get_submodule(name)
        cpu = {s: getattr(layer, s).clone() for s in ("weight", "weight_scale", "input_scale", "input_quant_scale")}
        layer.cuda()
        assert layer.scaled_mm_unfit is None, layer.scaled_mm_unfit
        for tokens in (1, 37):
            x = (torch.randn(tokens, 1, layer.weight.shape[1], generator=torch.Generator().manual_seed(tokens))
                 .to(torch.bfloat16))
            ours = layer(x.cuda())[0]
            ref = fp8_linear(x.float(), cpu["weight"], cpu["weight_scale"], cpu["input_scale"],
                             cpu["input_quant_scale"], use_scaled_mm=False)
            assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
            torch.testing.assert_close(ours.float().cpu(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())
    narrow = converted(hidden_size=40, ffn_hidden_size=72, kv_channels=10)[1].cuda()  # features not multiples of 16
    assert all(p.startswith("emulated (features (") for p in fp8_gemm_paths(narrow).values()), fp8_gemm_paths(narrow)
    layer = narrow.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(3, 1, 40, device="cuda")
    ref = fp8_linear(x.cpu(), layer.weight.cpu(), layer.weight_scale.cpu(), layer.input_scale.cpu(),
                     layer.input_quant_scale.cpu(), use_scaled_mm=False)
    torch.testing.assert_close(layer(x)[0].cpu(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())  # TF32 or not


@pytest.mark.gpu
def test_engine_cuda_graphs_give_eager_greedy_tokens():
    """One request at a time, so eager and graphed decode steps both multiply one token (the same GEMM shapes).

    fp32: every token must be equal; a rounding difference in attention (the graphed step reads a padded block
    table) rarely moves an fp32 activation across an FP8 rounding midpoint. bf16 rounds 2**16 times coarser, so
    there the first token (from the eager prefill in both engines) must be equal and the graphs must have run.
    """
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores")
    for dtype, compile_decode in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
        model = converted(dtype)[1].cuda()
        assert set(fp8_gemm_paths(model).values()) == {"scaled_mm"}
        eager = _engine_greedy(_engine(model), PROMPTS, one_at_a_time=True)
        engine = _engine(model, num_cuda_graphs=2, compile_decode_graphs=compile_decode)
        graphed = _engine_greedy(engine, PROMPTS, one_at_a_time=True)
        assert engine.controller.inference_wrapped_model.decode_graphs.graphs, "no decode step ran as a CUDA graph"
        if dtype == torch.float32:
            assert graphed == eager, f"compile_decode_graphs={compile_decode}"
        else:
            assert [t[0] for t in graphed] == [t[0] for t in eager]
