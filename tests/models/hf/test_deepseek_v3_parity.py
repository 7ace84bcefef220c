"""AutoBridge on a tiny random ``DeepseekV3ForCausalLM`` saved by transformers (fp32, CPU).

The model has what DeepSeek-V3 computes: multi-latent attention with a q latent (and, DeepSeek-V2-Lite style,
without one), YaRN with ``factor > 1`` and ``mscale_all_dim`` on a sequence longer than
``original_max_position_embeddings``, a first dense layer, then MoE layers with a sigmoid router whose score
correction bias selects, group-limited top-2 of 8 experts, ``routed_scaling_factor`` and shared experts.
Imported in one process (both expert layouts) and under TP=2 / EP=2 on gloo ranks, its logits are within 1e-4
of transformers'; exports load back bitwise-identical tensors, a trained model's export reproduces our logits
in transformers, and an all-MoE model round-trips through the offline converter. The config mapping (YaRN's
scales against transformers' own) and its refusals are checked too. A checkpoint with one multi-token-prediction
depth (written by hand in DeepSeek's layout, as transformers does not instantiate MTP layers) imports every MTP
tensor to its place, computes the depth's hidden states as the HF weights define them, trains its MTP loss and
exports back bitwise.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf.hf_models import (
    assert_same_tensors,
    eval_logits,
    megatron_model,
    perturb,
    safetensors_tensors,
)

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
    perturb(model, seed + 7)
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return _hf_logits_of(model)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[str, torch.Tensor]:
    path = str(tmp_path_factory.mktemp("deepseek_v3") / "hf")
    return path, _make(path)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_import_matches_transformers_and_export_round_trips(hf_model, grouped: bool, tmp_path) -> None:
    src, expected = hf_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = megatron_model(bridge, grouped)
    assert isinstance(model.config, MLATransformerConfig) and model.config.moe_layer_freq == [0, 1, 1]
    assert not hasattr(model, "rotary_pos_emb")  # MLA rotates by itself
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MLP", "MoELayer", "MoELayer"]
    torch.testing.assert_close(eval_logits(model, *_batch()), expected, rtol=1e-4, atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")


def test_without_q_lora_rank(tmp_path) -> None:
    """DeepSeek-V2-Lite style: the query is one projection (``linear_q_proj``), no q latent or norm."""
    src = str(tmp_path / "hf")
    expected = _make(src, seed=1, q_lora_rank=None)
    bridge = AutoBridge.from_hf_pretrained(src)
    model = megatron_model(bridge)
    attention = model.decoder.layers[1].self_attention
    assert hasattr(attention, "linear_q_proj") and not hasattr(attention, "linear_q_down_proj")
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
    with torch.no_grad():  # as the router's bias update would
        model.decoder.layers[2].mlp.router.expert_bias.add_(torch.linspace(-0.2, 0.2, 8))
    latent = model.decoder.layers[1].self_attention.linear_kv_down_proj.weight
    assert latent.grad is not None and latent.grad.abs().sum() > 0
    trained = eval_logits(model.eval(), *_batch())
    assert (trained - expected).abs().max() > 1e-3
    bridge.save_hf_pretrained(model, tmp_path / "trained")
    torch.testing.assert_close(_hf_logits(str(tmp_path / "trained")), trained, rtol=1e-4, atol=1e-4)


def _parallel_check(src: str, out: str, tp: int, ep: int) -> torch.Tensor:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        bridge = AutoBridge.from_hf_pretrained(src)
        model = megatron_model(bridge, grouped=ep > 1, expert_tensor_parallel_size=1,
                      expert_model_parallel_size=ep)
        logits = eval_logits(model, *_batch())
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


def test_offline_converter_round_trips_a_mixed_model(hf_model, tmp_path) -> None:
    """Dense and MoE layers (per-layer keys; tests/models/hf/test_convert_mixed_and_mtp.py checks them in detail)."""
    import_hf_to_mcore(hf_model[0], str(tmp_path / "ckpt"), progress=False)
    export_mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    assert_same_tensors(hf_model[0], tmp_path / "back")


def test_partial_or_unknown_layers_are_refused(hf_model, tmp_path) -> None:
    """transformers' files keep num_nextn_predict_layers but hold no MTP layer (imported without MTP); a partial MTP
    layer and a tensor of no known place are refused."""
    from safetensors.torch import save_file

    src, _ = hf_model
    assert _hf_config().num_nextn_predict_layers == 1 and AutoBridge.from_hf_pretrained(src).family.mtp_num_layers == 0
    tensors = safetensors_tensors(src)
    for name, match in (("model.layers.3.eh_proj.weight", "missing"), ("model.layers.0.mlp.unknown.weight",
                                                                       "has no place")):
        target = tmp_path / name
        shutil.copytree(src, target)
        save_file({**tensors, name: torch.zeros(2, 2)}, str(target / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(HFConversionError, match=match):
            AutoBridge.from_hf_pretrained(target)


# --- multi-token prediction ------------------------------------------------------------------------------------------
LAYERS, HIDDEN = 3, 32


def _mtp_tensors(tmp_path, seed: int = 5) -> dict[str, torch.Tensor]:
    """HF-named tensors of one MTP depth (``model.layers.3.*``): a fourth decoder layer of a random 4-layer
    DeepSeek-V3 saved by transformers (a MoE layer), random norms and ``eh_proj``, and the shared copies."""
    big = str(tmp_path / "big")
    _make(big, seed=seed, num_hidden_layers=LAYERS + 1)
    prefix = f"model.layers.{LAYERS}."
    out = {n: t for n, t in safetensors_tensors(big).items() if n.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed + 1)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{prefix}{norm}.weight"] = 1 + 0.3 * torch.randn(HIDDEN, generator=gen)
    out[prefix + "eh_proj.weight"] = 0.2 * torch.randn(HIDDEN, 2 * HIDDEN, generator=gen)
    return out


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> tuple[str, torch.Tensor, dict[str, torch.Tensor]]:
    """A DeepSeek-V3 directory with one MTP depth (as DeepSeek's checkpoints store it), its logits and tensors."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("deepseek_v3_mtp")
    path = str(root / "hf")
    expected = _make(path, num_nextn_predict_layers=1)
    tensors = safetensors_tensors(path)
    mtp = _mtp_tensors(root)
    mtp[f"model.layers.{LAYERS}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[f"model.layers.{LAYERS}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path, expected, mtp


def _hf_mtp_name(name: str) -> list[str]:
    """HF tensor names of an ``mtp.layers.0.`` parameter, written out independently of the bridge's rules."""
    p = f"model.layers.{LAYERS}."
    top = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "final_layernorm.weight": "shared_head.norm.weight"}
    rest = name.removeprefix("mtp.layers.0.")
    if rest in top:
        return [p + top[rest]]
    rest = rest.removeprefix("mtp_model_layer.")
    fixed = {"input_layernorm.weight": "input_layernorm.weight",
             "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
             "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
             "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
             "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
             "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
             "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
             "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
             "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
             "mlp.router.weight": "mlp.gate.weight", "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
             "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight"}
    if rest in fixed:
        return [p + fixed[rest]]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return [p + "mlp.shared_experts.gate_proj.weight", p + "mlp.shared_experts.up_proj.weight"]
    e, tail = rest.removeprefix("mlp.experts.local_experts.").split(".", 1)
    if tail == "linear_fc1.weight":
        return [p + f"mlp.experts.{e}.gate_proj.weight", p + f"mlp.experts.{e}.up_proj.weight"]
    assert tail == "linear_fc2.weight", name
    return [p + f"mlp.experts.{e}.down_proj.weight"]


def test_mtp_import_places_every_tensor_and_trains(mtp_model) -> None:
    src, expected, mtp = mtp_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = megatron_model(bridge)
    assert model.config.mtp_num_layers == 1 and len(model.mtp.layers) == 1
    assert type(model.mtp.layers[0].mtp_model_layer.mlp).__name__ == "MoELayer"
    torch.testing.assert_close(eval_logits(model, *_batch()), expected, rtol=1e-4, atol=1e-4)
    state = {n: t for n, t in model.state_dict().items() if n.startswith("mtp.") and not n.endswith("_extra_state")}
    used = set()
    for name, value in state.items():
        hf = _hf_mtp_name(name)
        used.update(hf)
        assert torch.equal(value, torch.cat([mtp[n] for n in hf], dim=0)), name
    shared = {f"model.layers.{LAYERS}.embed_tokens.weight", f"model.layers.{LAYERS}.shared_head.head.weight"}
    assert used == set(mtp) - shared  # every stored MTP tensor has its place
    model.train()
    ids, pos = _batch()
    model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean().backward()
    grad = model.mtp.layers[0].eh_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_mtp_hidden_states_computed_from_hf_weights(mtp_model) -> None:
    """Depth 1 by hand from the HF-named tensors: ``shared_head.norm(layer(eh_proj([enorm(E[ids shifted left]);
    hnorm(h)])))`` (the transformer layer is the model's own, loaded with the mapped weights)."""
    src, _, mtp = mtp_model
    model = megatron_model(AutoBridge.from_hf_pretrained(src))
    hf = safetensors_tensors(src)
    p = f"model.layers.{LAYERS}."
    ids, pos = _batch()
    with torch.no_grad():
        hidden = model.decoder(hidden_states=model.embedding(input_ids=ids, position_ids=pos), attention_mask=None)
        shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        emb = hf["model.embed_tokens.weight"][shifted].transpose(0, 1)  # [s, b, h]
        x = torch.cat([_rms(emb, mtp[p + "enorm.weight"]), _rms(hidden, mtp[p + "hnorm.weight"])], dim=-1)
        x = x @ mtp[p + "eh_proj.weight"].t()
        x, _ = model.mtp.layers[0].mtp_model_layer(hidden_states=x, attention_mask=None)
        want = _rms(x, mtp[p + "shared_head.norm.weight"])
        got = model.mtp(input_ids=ids, position_ids=pos, hidden_states=hidden, attention_mask=None,
                        embedding=model.embedding)
    assert got.shape[0] == 2 * SEQ
    torch.testing.assert_close(got[SEQ:], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:SEQ], hidden, rtol=0, atol=0)


def test_mtp_export_round_trips_bitwise(mtp_model, tmp_path) -> None:
    src, _, mtp = mtp_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = megatron_model(bridge)
    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")  # the MTP layer's tensors, embed_tokens / shared_head.head too
    back = safetensors_tensors(tmp_path / "export")
    assert all(torch.equal(back[n], t) for n, t in mtp.items())


def test_mtp_can_be_skipped(mtp_model, tmp_path) -> None:
    src, expected, _ = mtp_model
    bridge = AutoBridge.from_hf_pretrained(src)
    (model,) = bridge.to_megatron_model(mtp=False)
    assert not hasattr(model, "mtp") and model.config.mtp_num_layers is None
    torch.testing.assert_close(eval_logits(model.eval(), *_batch()), expected, rtol=1e-4, atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert not any(n.startswith(f"model.layers.{LAYERS}.") for n in safetensors_tensors(tmp_path / "export"))


def test_mtp_shared_copies_must_equal_the_main_tensors(mtp_model, tmp_path) -> None:
    from safetensors.torch import save_file

    src, _, _ = mtp_model
    target = tmp_path / "hf"
    shutil.copytree(src, target)
    tensors = safetensors_tensors(src)
    tensors[f"model.layers.{LAYERS}.shared_head.head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match="differs from 'lm_head.weight'"):
        AutoBridge.from_hf_pretrained(target).to_megatron_model()


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
