"""AutoBridge on a tiny random ``GptOssForCausalLM`` saved by transformers (fp32, CPU).

The model has everything GPT-OSS computes: attention sinks, a sliding window on every other layer, YaRN
with ``factor > 1`` on a sequence longer than ``original_max_position_embeddings``, biased linears and router,
top-2 of 4 stacked experts with the clamped, offset quick-GELU GLU. Imported in one process (both expert
layouts), under TP=2 and under EP=2 on gloo ranks, its logits are within 1e-4 of transformers'; exports
(in process, at TP=2, and through the offline converter) load back bitwise-identical tensors, and a trained
model's export reproduces our logits in transformers. The config mapping and its refusals are checked too.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf.hf_models import assert_same_tensors, eval_logits, megatron_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core import parallel_state, tensor_parallel  # noqa: E402
from megatron_core.activations import quick_gelu  # noqa: E402
from megatron_core.models.hf import AutoBridge  # noqa: E402
from megatron_core.models.hf.convert import export_mcore_to_hf, import_hf_to_mcore  # noqa: E402
from megatron_core.models.hf.families import family_from_config  # noqa: E402
from megatron_core.models.hf.safetensors_io import HFConversionError  # noqa: E402
from megatron_core.transformer import TransformerConfig  # noqa: E402
from megatron_core.transformer.rope_utils import yarn_concentration_factor  # noqa: E402

VOCAB, SEQ, BATCH = 64, 20, 2
ROPE = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=8)


def _hf_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                max_position_embeddings=32, swiglu_limit=1.0, rope_parameters=dict(ROPE), tie_word_embeddings=False)
    return transformers.GptOssConfig(**{**base, **overrides})


def _make(path: str, seed: int = 0):
    """Save a perturbed random GPT-OSS at ``path``; returns its logits on :func:`_batch`."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config()).eval()
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen))
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return _hf_logits_of(model)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(SEQ).expand(BATCH, SEQ)


def _hf_logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_batch()[0]).logits.float()


def _hf_logits(path: str) -> torch.Tensor:
    return _hf_logits_of(transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval())


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[str, torch.Tensor]:
    path = str(tmp_path_factory.mktemp("gpt_oss") / "hf")
    return path, _make(path)


@pytest.mark.parametrize("grouped", [False, True])
def test_import_matches_transformers_and_export_round_trips(hf_model, grouped: bool, tmp_path) -> None:
    src, expected = hf_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = megatron_model(bridge, grouped)
    torch.testing.assert_close(eval_logits(model, *_batch()), expected, rtol=1e-4, atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")


def test_trained_model_exports_to_the_same_logits(hf_model, tmp_path) -> None:
    src, expected = hf_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = megatron_model(bridge).train()
    ids, pos = _batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean().backward()
        optimizer.step()
    sink = model.decoder.layers[0].self_attention.core_attention.softmax_offset
    assert sink.grad is not None and sink.grad.abs().sum() > 0
    trained = eval_logits(model.eval(), *_batch())
    assert (trained - expected).abs().max() > 1e-3
    bridge.save_hf_pretrained(model, tmp_path / "trained")
    torch.testing.assert_close(_hf_logits(str(tmp_path / "trained")), trained, rtol=1e-4, atol=1e-4)


def test_offline_converter_round_trips(hf_model, tmp_path) -> None:
    src, _ = hf_model
    import_hf_to_mcore(src, str(tmp_path / "ckpt"), progress=False)
    export_mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    assert_same_tensors(src, tmp_path / "back")


def test_config_mapping_and_refusals(hf_model) -> None:
    cfg = _hf_config().to_dict()
    cfg["architectures"] = ["GptOssForCausalLM"]
    family = family_from_config(cfg)
    c = family.config_kwargs
    assert (c["window_size"], c["window_attn_skip_freq"]) == ((3, 0), 2)  # layer 1 sliding, layer 2 full
    assert (c["softmax_type"], c["activation_func"], c["glu_linear_offset"], c["activation_func_clamp_value"]) == (
        "learnable", quick_gelu, 1.0, 1.0)
    assert (c["yarn_rotary_scaling_factor"], c["yarn_original_max_position_embeddings"],
            c["yarn_correction_range_round_to_int"]) == (4.0, 8, False)
    assert family.model_kwargs["position_embedding_type"] == "yarn" and c["add_bias_linear"]
    assert family_from_config({**cfg, "layer_types": ["full_attention", "sliding_attention"]}
                              ).config_kwargs["window_attn_skip_freq"] == [0, 1]
    explicit = family_from_config({**cfg, "rope_parameters": {**ROPE, "attention_factor": 1.3}}).config_kwargs
    assert yarn_concentration_factor(TransformerConfig(**explicit)) == pytest.approx(1.3)
    for bad, field in ((dict(swiglu_alpha=1.5), "swiglu_alpha"), (dict(attention_bias=False), "attention_bias"),
                       (dict(rope_parameters={**ROPE, "rope_type": "longrope"}), "longrope"),
                       (dict(quantization_config={"quant_method": "mxfp4"}), "quantization_config")):
        with pytest.raises(HFConversionError, match=field):
            family_from_config({**cfg, **bad})


def _parallel_check(src: str, out: str, tp: int, ep: int) -> tuple[torch.Tensor, str]:
    """Import at (tp, ep) with expert-TP 1 (expert biases need it), return logits and the export's outcome."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        bridge = AutoBridge.from_hf_pretrained(src)
        config = bridge.transformer_config()  # the expert layout comes from parallel_state
        assert (config.expert_tensor_parallel_size, config.expert_model_parallel_size) == (1, ep)
        model = megatron_model(bridge, grouped=ep > 1)
        logits = eval_logits(model, *_batch())
        try:
            bridge.save_hf_pretrained(model, out)
            outcome = "exported"
        except HFConversionError as e:
            outcome = str(e)
        return logits, outcome
    finally:
        parallel_state.destroy_model_parallel()


def test_tensor_and_expert_parallel_import(hf_model, tmp_path) -> None:
    src, expected = hf_model
    out = str(tmp_path / "tp2")
    for logits, outcome in run_on_ranks(2, _parallel_check, src, out, 2, 1):
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert outcome == "exported"
    assert_same_tensors(src, out)
    for logits, outcome in run_on_ranks(2, _parallel_check, src, str(tmp_path / "ep2"), 1, 2):
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert "expert_model_parallel_size 2 is not supported" in outcome
    assert not os.path.exists(tmp_path / "ep2")
