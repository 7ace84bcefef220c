"""KV-cache quantization (post_training.modelopt.quant_attention) on a tiny GPT (hidden 128, 2 layers, fp32, CPU).

``FP8_DEFAULT_CFG`` with ``FP8_KV_CFG`` merged in as Megatron-LM's ``--export-kv-cache-quant fp8`` does. Checked:
every layer's k/v quantizers are calibrated; the core attention's output equals a hand computation of attention
over the key and value fake-quantized with those amax (1e-6); the logits stay close to the weight/activation-only
quantized model's; TP=2 equals one process and its checkpoint reloads at TP=1; the inference engines (static and
dynamic KV caches) give the plain loop's greedy tokens and log-probs on the KV-quantized model; an unregistered
core attention class and the export scales.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("modelopt")

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron_core.models.gpt import GPTModel  # noqa: E402
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron_core.transformer.backends import LocalSpecProvider  # noqa: E402
from tests.dist_harness import run_on_ranks  # noqa: E402
from tests.post_training.quant_test_utils import (  # noqa: E402
    MAX_SEQ,
    VOCAB,
    batch,
    build,
    calibrate,
    config,
    load_sharded,
    logits,
)

# Relative logit change ||kv - wa|| / ||wa|| of adding FP8 KV quantization to FP8_DEFAULT_CFG (measured 3.6 %;
# FP8_DEFAULT_CFG itself moves the unquantized logits by 4.5 %).
KV_LOGIT_BOUND = 0.06
NEW = 6  # generated tokens per prompt in the engine tests


def kv_config() -> dict:
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt.quant_attention import kv_cache_quant_config

    return kv_cache_quant_config(mtq.FP8_DEFAULT_CFG, "fp8")


def quantize_kv(model: GPTModel) -> GPTModel:
    import modelopt.torch.quantization as mtq

    return mtq.quantize(model, kv_config(), calibrate)


def core_attentions(model: GPTModel) -> list:
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


def fake_fp8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP8 E4M3 fake quantization with scale ``448 / amax`` (written here, not Model Optimizer's)."""
    scale = 448.0 / amax.float()
    codes = (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (codes.float() / scale).to(x.dtype)


def hand_attention(core, query, key, value) -> torch.Tensor:
    """Causal attention ``[s, b, np * hn]`` of ``[s, b, heads, hn]`` tensors, by SDPA."""
    s, b, np_, hn = query.shape
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=core.softmax_scale,
                                                           enable_gqa=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


def test_kv_quantizers_calibrated_and_applied_to_keys_and_values():
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt.calibration import check_calibrated
    from megatron_core.post_training.modelopt.quant_attention import check_kv_cache_quantized, kv_cache_scales

    wa = mtq.quantize(build(), mtq.FP8_DEFAULT_CFG, calibrate)
    model = quantize_kv(build())
    check_calibrated(model)
    check_kv_cache_quantized(model)
    for core in core_attentions(model):
        assert type(core).__name__ == "QuantDotProductAttention"
        assert not core.q_bmm_quantizer.is_enabled  # FP8_KV_CFG quantizes keys and values only
        for quantizer in (core.k_bmm_quantizer, core.v_bmm_quantizer):
            assert quantizer.is_enabled and quantizer.num_bits == (4, 3) and quantizer.amax.numel() == 1
            assert quantizer.amax.item() > 0
    # The weight/activation quantizers are the W/A-only model's (same weights, same batch).
    for name, module in model.named_modules():
        if name.endswith(("weight_quantizer", "input_quantizer")) and module.is_enabled:
            assert torch.equal(module.amax, wa.get_submodule(name).amax), name

    core = core_attentions(model)[0]
    seen = {}
    pre = core.register_forward_pre_hook(lambda m, args: seen.update(qkv=[a.detach().clone() for a in args[:3]]))
    post = core.register_forward_hook(lambda m, args, out: seen.update(out=out.detach().clone()))
    kv_logits = logits(model)
    pre.remove()
    post.remove()
    query, key, value = seen["qkv"]
    k_amax, v_amax = core.k_bmm_quantizer.amax, core.v_bmm_quantizer.amax
    expected = hand_attention(core, query, fake_fp8(key, k_amax), fake_fp8(value, v_amax))
    unquantized_kv = hand_attention(core, query, key, value)
    err, kv_effect = ((seen["out"] - ref).abs().max().item() for ref in (expected, unquantized_kv))
    print(f"hand computation: {err:.3g}; K/V quantization moves the output by {kv_effect:.3g}")
    assert err < 1e-6
    assert kv_effect > 1e-3  # the quantization of K and V is visible

    wa_logits = logits(wa)
    rel = ((kv_logits - wa_logits).norm() / wa_logits.norm()).item()
    print(f"relative logit change from KV quantization: {rel:.4%}")
    assert 0 < rel < KV_LOGIT_BOUND, f"KV quantization moved the logits by {rel:.3%}"

    scales = kv_cache_scales(model, clamp_fp8_scales=False)
    assert set(scales) == {f"decoder.layers.{i}.self_attention.core_attention" for i in range(2)}
    torch.testing.assert_close(scales["decoder.layers.0.self_attention.core_attention"][0], k_amax.float() / 448)
    clamped = kv_cache_scales(model)  # Model Optimizer's export default: at least 1.0
    assert all(float(s) == max(float(u), 1.0) for name in scales for s, u in zip(clamped[name], scales[name]))


class _OwnAttention(torch.nn.Module):
    """A core attention class of the user's (causal SDPA): not registered with Model Optimizer."""

    def __init__(self, config, layer_number: int, attn_mask_type, **kwargs) -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.softmax_scale = config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask, **kwargs) -> torch.Tensor:
        return hand_attention(self, query, key, value)


class _OwnAttentionProvider(LocalSpecProvider):
    def core_attention(self) -> type:
        return _OwnAttention


def test_kv_config_on_unregistered_attention_raises():
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt import register_quant_modules
    from megatron_core.post_training.modelopt.quant_attention import check_kv_cache_quantized

    register_quant_modules()
    torch.manual_seed(0)
    model = GPTModel(config(), get_gpt_layer_local_spec(backend=_OwnAttentionProvider()), VOCAB, MAX_SEQ,
                     position_embedding_type="rope").eval()
    mtq.quantize(model, kv_config(), calibrate)
    with pytest.raises(ValueError, match=r"2 core attention modules have none: decoder\.layers\.0\.self_attention\."
                                         r"core_attention \(_OwnAttention\).*not registered"):
        check_kv_cache_quantized(model)
    plain = mtq.quantize(build(), mtq.FP8_DEFAULT_CFG, calibrate)
    check_kv_cache_quantized(plain)  # no KV entries in the config: nothing to find


# ---- the inference engine: the KV cache holds what the core attention would see ----


def _local_spec_kv_model(device: str, kv_cache_quant: str) -> GPTModel:
    """A local-spec GPT on ``device`` quantized with ``FP8_DEFAULT_CFG`` and the KV-cache config ``kv_cache_quant``."""
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt import register_quant_modules
    from megatron_core.post_training.modelopt.quant_attention import kv_cache_quant_config

    register_quant_modules()
    torch.manual_seed(5)
    model = GPTModel(config(), get_gpt_layer_local_spec(), VOCAB, MAX_SEQ, position_embedding_type="rope")
    model = model.to(device).eval()
    ids, pos = batch(0)
    return mtq.quantize(model, kv_cache_quant_config(mtq.FP8_DEFAULT_CFG, kv_cache_quant),
                        lambda m: m(ids.to(device), pos.to(device), None))


def _plain_greedy(model: GPTModel, prompt: list[int], device: str) -> tuple[list[int], list[float]]:
    """Greedy tokens by full forwards (no cache), and the log-probs of the prompt and generated tokens."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.tensor([tokens], device=device)
            tokens.append(int(model(ids, torch.arange(len(tokens), device=device)[None], None)[0, -1].argmax()))
        ids = torch.tensor([tokens], device=device)
        logp = torch.log_softmax(model(ids, torch.arange(len(tokens), device=device)[None], None)[0].float(), dim=-1)
    return tokens[len(prompt):], [float(logp[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]


def _set_kv_quantizers(model: GPTModel, on: bool) -> None:
    for core in core_attentions(model):
        for quantizer in (core.k_bmm_quantizer, core.v_bmm_quantizer):
            quantizer.enable() if on else quantizer.disable()


def _engines_against_plain_loop(device: str, kv_cache_quant: str) -> list[tuple[bool, float, float]]:
    """Per engine (static-batch, dynamic) and prompt: (same greedy tokens as the plain loop, max |log-prob
    difference| from the plain loop, the same from the plain loop without the K/V quantizers)."""
    from megatron_core.inference.config import InferenceConfig
    from megatron_core.inference.contexts import DynamicInferenceContext, StaticInferenceContext
    from megatron_core.inference.engines import DynamicInferenceEngine, StaticInferenceEngine
    from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
    from megatron_core.inference.sampling_params import SamplingParams
    from megatron_core.inference.text_generation_controllers import TextGenerationController

    model = _local_spec_kv_model(device, kv_cache_quant)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 11)]
    expected = [_plain_greedy(model, p, device) for p in prompts]
    _set_kv_quantizers(model, False)
    without_kv = [_plain_greedy(model, p, device)[1] for p in prompts]
    _set_kv_quantizers(model, True)
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1, return_log_probs=True)

    static = GPTInferenceWrapper(model, StaticInferenceContext(max_batch_size=2, max_sequence_length=MAX_SEQ))
    static_engine = StaticInferenceEngine(TextGenerationController(static, tokenizer=None), max_batch_size=2,
                                          legacy=True)
    static_results = static_engine.generate(prompts=prompts, sampling_params=params)
    context = DynamicInferenceContext(model.config, InferenceConfig(block_size_tokens=8, buffer_size_gb=0.01,
                                                                    max_sequence_length=MAX_SEQ))
    dynamic_engine = DynamicInferenceEngine(
        TextGenerationController(GPTInferenceWrapper(model, context), tokenizer=None), context)
    dynamic_results = [r.merge() for r in dynamic_engine.generate(prompts, params)]

    out = []
    for results in (static_results, dynamic_results):
        for r, (tokens, logp), logp_without in zip(results, expected, without_kv):
            ours = torch.tensor(r.prompt_log_probs + r.generated_log_probs)
            diff, kv_effect = ((ours - torch.tensor(ref)).abs().max().item() for ref in (logp, logp_without))
            print(f"engine log-probs: {diff:.3g} from the plain loop, {kv_effect:.3g} from the loop without KV quant")
            out.append((r.generated_tokens == tokens, diff, kv_effect))
    return out


def test_inference_engines_apply_the_kv_quantization():
    for same_tokens, diff, kv_effect in _engines_against_plain_loop("cpu", "fp8"):
        assert same_tokens and diff < 1e-5
        assert kv_effect > 1e-3  # the engine's cache is quantized: without the KV quantizers the log-probs move


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_quant", ["fp8", "nvfp4"])
def test_inference_engines_apply_the_kv_quantization_on_cuda(kv_cache_quant):
    # CUDA kernels (SDPA, the paged decode attention, Model Optimizer's fake-quant kernels) add and round in
    # another order than the full forward: 1e-4 on the log-probs (fp32).
    for same_tokens, diff, kv_effect in _engines_against_plain_loop("cuda", kv_cache_quant):
        assert same_tokens and diff < 1e-4
        assert kv_effect > 1e-3


def test_mla_with_kv_quantizers_refuses_the_engine():
    from megatron_core.inference.contexts import StaticInferenceContext
    from megatron_core.post_training.modelopt import register_quant_modules
    from megatron_core.post_training.modelopt.quant_attention import check_kv_cache_quantized
    from megatron_core.transformer.transformer_config import MLATransformerConfig

    register_quant_modules()
    torch.manual_seed(0)
    cfg = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12,
                               qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, ffn_hidden_size=64,
                               add_bias_linear=False, use_cpu_initialization=True, rope_type="rope")
    model = GPTModel(cfg, get_gpt_layer_local_spec(multi_latent_attention=True), VOCAB, MAX_SEQ,
                     position_embedding_type="rope").eval()
    quantize_kv(model)
    check_kv_cache_quantized(model)  # the core attention (training / full forward) quantizes K and V
    ids, pos = batch(1)
    with pytest.raises(NotImplementedError, match="multi-latent attention in the inference engine"):
        model(ids, pos, None, inference_context=StaticInferenceContext(max_batch_size=2, max_sequence_length=MAX_SEQ))


# ---- tensor parallelism and checkpoints ----


def _kv_amax(model: GPTModel) -> list[tuple[float, float]]:
    return [(core.k_bmm_quantizer.amax.item(), core.v_bmm_quantizer.amax.item()) for core in core_attentions(model)]


def _tp2_and_checkpoint(ckpt: str) -> dict:
    """TP=2 against one process (logits, K/V amax); then its checkpoint loaded at TP=1 (logits, K/V amax)."""
    from megatron_core.post_training.modelopt.checkpointing import load_modelopt_state, save_modelopt_state

    reference = build()
    weights = {k: v.detach().clone() for k, v in reference.named_parameters()}
    quantize_kv(reference)
    out = {"ref_amax": _kv_amax(reference)}
    ref_logits = logits(reference)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(tensor_model_parallel_size=2)
        load_sharded(model, weights, 2, parallel_state.get_tensor_model_parallel_rank())
        quantize_kv(model)
        tp2_logits = logits(model)
        out.update(tp2_amax=_kv_amax(model), tp2_diff=(tp2_logits - ref_logits).abs().max().item())
        sharded = model.sharded_state_dict()
        out["stored"] = sorted(k for k in sharded if "_bmm_quantizer." in k)
        dist_checkpointing.save(sharded, ckpt)
        save_modelopt_state(model, ckpt)
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        fresh = build(seed=99)  # other weights: only the checkpoint can make the logits match
        load_modelopt_state(fresh, ckpt)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
        out.update(tp1_amax=_kv_amax(fresh), reload_diff=(logits(fresh) - tp2_logits).abs().max().item())
    finally:
        parallel_state.destroy_model_parallel()
    return out


def test_tp2_equals_one_process_and_checkpoint_reloads_at_tp1(tmp_path):
    for rank, result in enumerate(run_on_ranks(2, _tp2_and_checkpoint, str(tmp_path / "ckpt"), timeout=280)):
        print(f"rank {rank}: TP=2 vs one process {result['tp2_diff']:.3g}, reload at TP=1 {result['reload_diff']:.3g}")
        # each rank's K/V amax is the one-process (whole-tensor) amax, so every head shard shares one scale
        torch.testing.assert_close(torch.tensor(result["tp2_amax"]), torch.tensor(result["ref_amax"]),
                                   rtol=1e-6, atol=0)
        assert result["tp2_diff"] < 1e-5, f"rank {rank}: TP=2 logits differ from one process by {result['tp2_diff']}"
        assert all(f"self_attention.core_attention.{kv}_bmm_quantizer._amax" in " ".join(result["stored"])
                   for kv in "kv"), result["stored"]
        assert result["tp1_amax"] == result["tp2_amax"]
        assert result["reload_diff"] < 1e-5, f"rank {rank}: reloaded at TP=1, logits differ by {result['reload_diff']}"


def test_hf_export_tensors_name_the_attention_scales(tmp_path):
    pytest.importorskip("transformers")
    import modelopt.torch.quantization as mtq

    from megatron_core.models.hf import AutoBridge
    from megatron_core.post_training.modelopt import register_quant_modules
    from megatron_core.post_training.modelopt.quant_attention import (
        hf_kv_cache_tensors,
        kv_cache_quant_algo,
        kv_cache_scales,
    )
    from tests.models.hf.hf_models import batch as hf_batch
    from tests.models.hf.hf_models import make_hf_model

    make_hf_model("llama", tmp_path)
    register_quant_modules()
    bridge = AutoBridge.from_hf_pretrained(str(tmp_path))
    (model,) = bridge.to_megatron_model()
    ids, pos = hf_batch(3)
    mtq.quantize(model.eval(), kv_config(), lambda m: m(ids, pos, None))
    assert kv_cache_quant_algo(model) == "FP8"
    tensors = hf_kv_cache_tensors(bridge, model, clamp_fp8_scales=False)
    scales = kv_cache_scales(model, clamp_fp8_scales=False)
    layers = len(model.decoder.layers)
    assert sorted(tensors) == sorted(f"model.layers.{i}.self_attn.{kv}_scale" for i in range(layers) for kv in "kv")
    for i in range(layers):
        k_scale, v_scale = scales[f"decoder.layers.{i}.self_attention.core_attention"]
        assert torch.equal(tensors[f"model.layers.{i}.self_attn.k_scale"], k_scale)
        assert torch.equal(tensors[f"model.layers.{i}.self_attn.v_scale"], v_scale)
    assert kv_cache_quant_algo(mtq.quantize(build(), mtq.FP8_DEFAULT_CFG, calibrate)) is None
