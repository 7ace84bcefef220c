"""AutoBridge on a tiny random ``DeepseekV3ForCausalLM`` saved by transformers (fp32, CPU).

The model has what DeepSeek-V3 computes: multi-latent attention with a q latent (and, DeepSeek-V2-Lite style,
without one), YaRN with ``factor > 1`` and ``mscale_all_dim`` on a sequence longer than
``original_max_position_embeddings``, a first dense layer, then MoE layers with a sigmoid router whose score
correction bias selects, group-limited top-2 of 8 experts, ``routed_scaling_factor`` and shared experts.
Imported in one process (both expert layouts) and under TP=2 / EP=2 on gloo ranks, its logits are within 1e-4
of transformers'; exports load back bitwise-identical tensors, a trained model's export reproduces our logits
in transformers, and an all-MoE model round-trips through the offline converter. The config mapping (YaRN's
scales against transformers' own) and its refusals are checked too.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf.hf_models import assert_same_tensors, safetensors_tensors

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core import parallel_state, tensor_parallel  # noqa: E402
from megatron_core.models.hf import AutoBridge  # noqa: E402
from megatron_core.models.hf.convert import export_mcore_to_hf, import_hf_to_mcore  # noqa: E402
from megatron_core.models.hf.families import family_from_config  # noqa: E402
from megatron_core.models.hf.safetensors_io import HFConversionError  # noqa: E402
from megatron_core.transformer import MLATransformerConfig  # noqa: E402
from megatron_core.transformer.mla_rope import mla_softmax_scale  # noqa: E402
from megatron_core.transformer.rope_utils import yarn_concentration  # noqa: E402

VOCAB, SEQ, BATCH = 64, 20, 2
ROPE = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=8, mscale=1.0,
            mscale_all_dim=0.7, beta_fast=32.0, beta_slow=1.0)


def _hf_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=10,
                qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=True,
                max_position_embeddings=32, rope_parameters=dict(ROPE), tie_word_embeddings=False)
    return transformers.DeepseekV3Config(**{**base, **overrides})


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(SEQ).expand(BATCH, SEQ)


def _hf_logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_batch()[0]).logits.float()


def _hf_logits(path: str) -> torch.Tensor:
    return _hf_logits_of(transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval())


def _make(path: str, seed: int = 0, **overrides) -> torch.Tensor:
    """Save a perturbed random DeepSeek-V3 (score correction biases too) at ``path``; returns its logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(**overrides)).eval()
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=gen))
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return _hf_logits_of(model)


def _ours(bridge: AutoBridge, grouped: bool = False, **overrides) -> torch.nn.Module:
    config = bridge.transformer_config(perform_initialization=False, moe_grouped_gemm=grouped, **overrides)
    (model,) = bridge.to_megatron_model(config=config)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids, pos = _batch()
    with torch.no_grad():
        return model(ids, pos, None, runtime_gather_output=True)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[str, torch.Tensor]:
    path = str(tmp_path_factory.mktemp("deepseek_v3") / "hf")
    return path, _make(path)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_import_matches_transformers_and_export_round_trips(hf_model, grouped: bool, tmp_path) -> None:
    src, expected = hf_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = _ours(bridge, grouped)
    assert isinstance(model.config, MLATransformerConfig) and model.config.moe_layer_freq == [0, 1, 1]
    assert not hasattr(model, "rotary_pos_emb")  # MLA rotates by itself
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MLP", "MoELayer", "MoELayer"]
    torch.testing.assert_close(_logits(model), expected, rtol=1e-4, atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")


def test_without_q_lora_rank(tmp_path) -> None:
    """DeepSeek-V2-Lite style: the query is one projection (``linear_q_proj``), no q latent or norm."""
    src = str(tmp_path / "hf")
    expected = _make(src, seed=1, q_lora_rank=None)
    bridge = AutoBridge.from_hf_pretrained(src)
    model = _ours(bridge)
    attention = model.decoder.layers[1].self_attention
    assert hasattr(attention, "linear_q_proj") and not hasattr(attention, "linear_q_down_proj")
    torch.testing.assert_close(_logits(model), expected, rtol=1e-4, atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")


def test_trained_model_exports_to_the_same_logits(hf_model, tmp_path) -> None:
    src, expected = hf_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = _ours(bridge).train()
    ids, pos = _batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean().backward()
        optimizer.step()
    with torch.no_grad():  # as the router's bias update would
        model.decoder.layers[2].mlp.router.expert_bias.add_(torch.linspace(-0.2, 0.2, 8))
    latent = model.decoder.layers[1].self_attention.linear_kv_down_proj.weight
    assert latent.grad is not None and latent.grad.abs().sum() > 0
    trained = _logits(model.eval())
    assert (trained - expected).abs().max() > 1e-3
    bridge.save_hf_pretrained(model, tmp_path / "trained")
    torch.testing.assert_close(_hf_logits(str(tmp_path / "trained")), trained, rtol=1e-4, atol=1e-4)


def _parallel_check(src: str, out: str, tp: int, ep: int) -> torch.Tensor:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        bridge = AutoBridge.from_hf_pretrained(src)
        model = _ours(bridge, grouped=ep > 1, expert_tensor_parallel_size=1,
                      expert_model_parallel_size=ep)
        logits = _logits(model)
        bridge.save_hf_pretrained(model, out)
        return logits
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_parallel_import_and_export(hf_model, tmp_path, tp: int, ep: int) -> None:
    src, expected = hf_model
    out = str(tmp_path / "export")
    for logits in run_on_ranks(2, _parallel_check, src, out, tp, ep):
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert_same_tensors(src, out)


def test_offline_converter_round_trips_an_all_moe_model(tmp_path) -> None:
    src = str(tmp_path / "hf")
    _make(src, seed=2, first_k_dense_replace=0, num_hidden_layers=2)
    import_hf_to_mcore(src, str(tmp_path / "ckpt"), progress=False)
    export_mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    assert_same_tensors(src, tmp_path / "back")


def test_offline_converter_refuses_mixed_dense_and_moe_layers(hf_model, tmp_path) -> None:
    with pytest.raises(HFConversionError, match="dense and MoE layers"):
        import_hf_to_mcore(hf_model[0], str(tmp_path / "ckpt"), progress=False)
    assert not os.path.exists(tmp_path / "ckpt")


def test_multi_token_prediction_layers_are_skipped(hf_model, tmp_path) -> None:
    from safetensors.torch import save_file

    src, _ = hf_model
    tensors = safetensors_tensors(src)
    for name, extra in (("model.layers.3.eh_proj.weight", True), ("model.layers.0.mlp.unknown.weight", False)):
        target = tmp_path / name
        shutil.copytree(src, target)
        save_file({**tensors, name: torch.zeros(2, 2)}, str(target / "model.safetensors"), metadata={"format": "pt"})
        if extra:
            AutoBridge.from_hf_pretrained(target)  # the MTP layer after the last decoder layer is ignored
        else:
            with pytest.raises(HFConversionError, match="has no place"):
                AutoBridge.from_hf_pretrained(target)


def _family(**overrides):
    cfg = _hf_config(**overrides).to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    return family_from_config(cfg), cfg


def test_config_mapping(hf_model) -> None:
    family, cfg = _family()
    c = family.config_kwargs
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_head_dim"], c["qk_pos_emb_head_dim"], c["v_head_dim"]) == (
        24, 16, 10, 8, 12)
    assert (c["num_moe_experts"], c["moe_router_topk"], c["moe_router_num_groups"], c["moe_router_group_topk"]) == (
        8, 2, 2, 1)
    assert c["moe_layer_freq"] == [0, 1, 1] and c["moe_shared_expert_intermediate_size"] == 32
    assert (c["moe_router_score_function"], c["moe_router_enable_expert_bias"], c["moe_router_topk_scaling_factor"]) \
        == ("sigmoid", True, 2.5)
    assert (c["rope_type"], c["rotary_scaling_factor"], c["original_max_position_embeddings"]) == ("yarn", 4.0, 8)
    assert family.model_kwargs["position_embedding_type"] == "rope" and c["qk_layernorm"]
    assert family_from_config({**cfg, "first_k_dense_replace": 3}).config_kwargs.get("num_moe_experts") is None


@pytest.mark.parametrize("rope", [
    dict(ROPE),
    {**ROPE, "mscale": None},  # transformers: cos/sin factor get_mscale(f) alone, softmax still by mscale_all_dim
    {**ROPE, "mscale_all_dim": None},
    {**ROPE, "attention_factor": 1.25},
    dict(rope_type="default", rope_theta=1000.0),
], ids=["both", "no_mscale", "no_mscale_all_dim", "attention_factor", "default"])
def test_yarn_scales_equal_transformers(rope: dict) -> None:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rope = {k: v for k, v in rope.items() if v is not None}
    hf_cfg = _hf_config(rope_parameters=rope)
    family, _ = _family(rope_parameters=rope)
    config = MLATransformerConfig(**{**family.config_kwargs, "num_layers": 3})
    want_factor = hf.DeepseekV3RotaryEmbedding(hf_cfg).attention_scaling
    got_factor = yarn_concentration(config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) \
        if config.rope_type == "yarn" else 1.0
    assert got_factor == pytest.approx(want_factor, rel=1e-9)
    assert mla_softmax_scale(config) == pytest.approx(hf.DeepseekV3Attention(hf_cfg, 0).scaling, rel=1e-9)
    if config.mscale_all_dim:
        assert mla_softmax_scale(config) != pytest.approx(1 / math.sqrt(18))  # mscale_all_dim matters here


@pytest.mark.parametrize("bad,field", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(n_group=4, topk_group=2), "topk_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={**ROPE, "rope_type": "longrope"}), "longrope"),
    (dict(rope_parameters={**ROPE, "truncate": False}), "truncate"),
])
def test_refusals_name_the_field(bad: dict, field: str) -> None:
    _, cfg = _family()
    with pytest.raises(HFConversionError, match=field):
        family_from_config(json.loads(json.dumps({**cfg, **bad})))
