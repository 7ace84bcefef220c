"""AutoBridge on a tiny random ``DeepseekV32ForCausalLM`` saved by transformers (fp32, CPU).

DeepSeek-V3.2 is DeepSeek-V3 with DeepSeek sparse attention: each layer's lightning indexer (``self_attn.indexer.*``)
picks ``index_topk`` (4) of the up to 16 keys per query. The model has a q latent, YaRN whose cosine/sine factor
is not 1 (the indexer's RoPE carries it too), a dense layer and a MoE layer (group-limited sigmoid routing with
score correction bias, shared experts). Imported, its logits equal transformers' to 1e-5 and would not with dense
attention; exports (of the import, of a model whose indexer was trained through its KL loss, of a TP=2 import on
two gloo ranks, of the offline converter's TP=1 and ``megatron-convert``'s TP=2 checkpoints) give back the HF tensors bitwise or
transformers' logits. ``mlp_layer_types`` places MoE layers anywhere, a hand-written multi-token-prediction depth
(a DSA MoE layer) imports and exports, and the settings DSA cannot compute are refused by their HF field.
"""

from __future__ import annotations

import json

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
pytest.importorskip("transformers.models.deepseek_v32")
pytest.importorskip("safetensors")

from megatron_core import parallel_state, tensor_parallel  # noqa: E402
from megatron_core.models.hf import AutoBridge  # noqa: E402
from megatron_core.models.hf.cli import main  # noqa: E402
from megatron_core.models.hf.convert import export_mcore_to_hf, import_hf_to_mcore  # noqa: E402
from megatron_core.models.hf.families import family_from_config  # noqa: E402
from megatron_core.models.hf.safetensors_io import HFConversionError  # noqa: E402

VOCAB, SEQ, BATCH, TOPK, HIDDEN = 64, 16, 2, 4, 32
# fp32; the sparse attention runs on absorbed MLA (the key up projection folded into the query), whose products
# sum in another order than transformers' unabsorbed attention: about 1e-5 after three layers, on any thread count.
TOL = dict(rtol=1e-5, atol=3e-5)
ROPE = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=8, mscale=1.0,
            mscale_all_dim=0.7, beta_fast=32.0, beta_slow=1.0)


def _hf_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                qk_nope_head_dim=10, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                n_group=2, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=2, first_k_dense_replace=1,
                norm_topk_prob=True, max_position_embeddings=32, rope_parameters=dict(ROPE),
                tie_word_embeddings=False, index_n_heads=4, index_head_dim=16, index_topk=TOPK)
    return transformers.DeepseekV32Config(**{**base, **overrides})


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(SEQ).expand(BATCH, SEQ)


def _hf_logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_batch()[0]).logits.float()


def _make(path: str, seed: int = 0, **overrides) -> torch.Tensor:
    """Save a perturbed random DeepSeek-V3.2 at ``path``; returns its logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(**overrides)).eval()
    perturb(model, seed + 7)
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return _hf_logits_of(model)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[str, torch.Tensor]:
    path = str(tmp_path_factory.mktemp("deepseek_v32") / "hf")
    return path, _make(path)


def test_import_matches_transformers_and_export_round_trips(hf_model, tmp_path) -> None:
    src, expected = hf_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = megatron_model(bridge)
    assert model.config.experimental_attention_variant == "dsa" and model.config.moe_layer_freq == [0, 1]
    assert [type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers] == ["DSAttention"] * 2
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MLP", "MoELayer"]
    torch.testing.assert_close(eval_logits(model, *_batch()), expected, **TOL)
    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")


def test_sparsity_matters(hf_model) -> None:
    """With every key selected (top-k = sequence length) the logits move far from transformers'."""
    src, expected = hf_model
    model = megatron_model(AutoBridge.from_hf_pretrained(src), dsa_indexer_topk=SEQ)
    assert (eval_logits(model, *_batch()) - expected).abs().max() > 1e-3


def test_trained_model_exports_to_the_same_logits(hf_model, tmp_path) -> None:
    """Trained with the indexer's KL loss (so the indexer's weights move too), the export computes our logits."""
    src, expected = hf_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = megatron_model(bridge, dsa_indexer_loss_coeff=0.5).train()
    ids, pos = _batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean().backward()
        optimizer.step()
    wq_b = model.decoder.layers[1].self_attention.core_attention.indexer.linear_wq_b.weight
    assert wq_b.grad is not None and wq_b.grad.abs().sum() > 0
    trained = eval_logits(model.eval(), *_batch())
    assert (trained - expected).abs().max() > 1e-3
    bridge.save_hf_pretrained(model, tmp_path / "trained")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), attn_implementation="eager")
    torch.testing.assert_close(_hf_logits_of(hf.eval()), trained, **TOL)


def _tp2_import(src: str, out: str) -> torch.Tensor:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        bridge = AutoBridge.from_hf_pretrained(src)
        model = megatron_model(bridge)
        logits = eval_logits(model, *_batch())
        bridge.save_hf_pretrained(model, out)
        return logits
    finally:
        parallel_state.destroy_model_parallel()


def test_tp2_import_equals_transformers_and_exports_bitwise(hf_model, tmp_path) -> None:
    src, expected = hf_model
    out = str(tmp_path / "export")
    for logits in run_on_ranks(2, _tp2_import, src, out):
        torch.testing.assert_close(logits, expected, **TOL)
    assert_same_tensors(src, out)


def test_offline_converter_round_trips(hf_model, tmp_path) -> None:
    import_hf_to_mcore(hf_model[0], str(tmp_path / "ckpt"), progress=False)
    export_mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    assert_same_tensors(hf_model[0], tmp_path / "back")


def test_cli_round_trips_a_tp2_checkpoint(hf_model, tmp_path, capsys) -> None:
    src, ckpt, back = hf_model[0], str(tmp_path / "ckpt"), str(tmp_path / "back")
    assert main(["hf-to-mcore", "--hf", src, "--out", ckpt, "--tp", "2", "--no-progress"]) == 0
    assert "dsa layers" in capsys.readouterr().out  # pretrain_gpt.py's flags cannot describe it: use --hf-model
    assert main(["mcore-to-hf", "--mcore", ckpt, "--out", back, "--no-progress"]) == 0
    assert_same_tensors(src, back)


def test_mlp_layer_types_place_the_moe_layers(tmp_path) -> None:
    """``mlp_layer_types`` (not ``first_k_dense_replace``) decides: MoE, dense, MoE."""
    src = str(tmp_path / "hf")
    expected = _make(src, seed=3, num_hidden_layers=3, mlp_layer_types=["sparse", "dense", "sparse"])
    model = megatron_model(AutoBridge.from_hf_pretrained(src))
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MoELayer", "MLP", "MoELayer"]
    torch.testing.assert_close(eval_logits(model, *_batch()), expected, **TOL)


def test_mtp_depth_imports_and_exports(tmp_path) -> None:
    """One MTP depth in DeepSeek's layout (``model.layers.2.*``: a DSA MoE layer, the MTP norms and projection, the
    embedding / head copies) lands in ``mtp.layers.0`` (its attention a DSAttention), trains and exports bitwise."""
    from safetensors.torch import save_file

    src, big = str(tmp_path / "hf"), str(tmp_path / "big")
    expected = _make(src, num_nextn_predict_layers=1)
    _make(big, seed=4, num_hidden_layers=3, mlp_layer_types=None)
    tensors, p = safetensors_tensors(src), "model.layers.2."
    mtp = {n: t for n, t in safetensors_tensors(big).items() if n.startswith(p)}
    gen = torch.Generator().manual_seed(5)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{p}{norm}.weight"] = 1 + 0.3 * torch.randn(HIDDEN, generator=gen)
    mtp[p + "eh_proj.weight"] = 0.2 * torch.randn(HIDDEN, 2 * HIDDEN, generator=gen)
    mtp[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, f"{src}/model.safetensors", metadata={"format": "pt"})
    bridge = AutoBridge.from_hf_pretrained(src)
    model = megatron_model(bridge)
    depth = model.mtp.layers[0].mtp_model_layer
    assert type(depth.self_attention.core_attention).__name__ == "DSAttention"
    assert torch.equal(depth.self_attention.core_attention.indexer.linear_wq_b.weight,
                       mtp[p + "self_attn.indexer.wq_b.weight"])
    torch.testing.assert_close(eval_logits(model, *_batch()), expected, **TOL)
    ids, pos = _batch()
    model.train()
    model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean().backward()
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    bridge.save_hf_pretrained(model.eval(), tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")


def _config(**overrides) -> dict:
    cfg = _hf_config(**overrides).to_dict()
    cfg["architectures"] = ["DeepseekV32ForCausalLM"]
    return cfg


def test_config_mapping() -> None:
    c = family_from_config(_config()).config_kwargs
    assert (c["experimental_attention_variant"], c["dsa_indexer_n_heads"], c["dsa_indexer_head_dim"],
            c["dsa_indexer_topk"]) == ("dsa", 4, 16, TOPK)
    assert c["dsa_indexer_k_norm_epsilon"] == 1e-6 and not c["dsa_indexer_rotate_activation"]
    assert c["multi_latent_attention"] and c["q_lora_rank"] == 24 and c["moe_layer_freq"] == [0, 1]
    assert "num_moe_experts" not in family_from_config(_config(mlp_layer_types=["dense", "dense"])).config_kwargs


@pytest.mark.parametrize("bad,field", [
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(layer_types=["indexed_attention", "full_attention"]), "layer_types"),
    (dict(index_head_dim=4), "index_head_dim"),
    (dict(index_topk=0), "index_topk"),
    (dict(mlp_layer_types=["dense", "moe"]), "mlp_layer_types"),
    (dict(mlp_layer_types=["sparse", "dense"], num_nextn_predict_layers=1), "mlp_layer_types"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps"),  # HF's latent norms keep 1e-6 (DeepSeek-V3 too)
])
def test_refusals_name_the_field(bad: dict, field: str) -> None:
    with pytest.raises(HFConversionError, match=field):
        family_from_config(json.loads(json.dumps({**_config(), **bad})))
