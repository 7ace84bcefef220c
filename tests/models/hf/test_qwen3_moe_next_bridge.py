"""AutoBridge on random-weight Qwen3-MoE and Qwen3-Next models saved by transformers (fp32, CPU).

Qwen3-MoE (q/k norms, MoE without shared expert, one dense layer from ``mlp_only_layers``) and Qwen3-Next (gated
delta net and gated attention layers, zero-centred norms, partial RoPE, MoE with a gated shared expert and one dense
layer): import gives transformers' logits within 1e-5, export is bitwise the original and transformers loads it.
Qwen3-Next also imports and exports at TP=2 (gate channels and delta net heads split over the ranks). Config
values the model cannot express, and multi-token-prediction tensors without ``mtp_num_hidden_layers``, are refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf import dist_checks
from tests.models.hf.hf_models import assert_same_tensors, batch, hf_logits, make_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core.models.hf import AutoBridge, HFConversionError  # noqa: E402
from megatron_core.models.hf.convert import export_mcore_to_hf, import_hf_to_mcore  # noqa: E402


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen3_next") / "hf")
    make_hf_model("qwen3_next", path)
    return path


def _import_export(src: str, out) -> tuple[AutoBridge, torch.Tensor]:
    """Import ``src`` in one process (logits equal transformers'), export to ``out`` (bitwise equal, loadable)."""
    expected = hf_logits(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    (model,) = bridge.to_megatron_model()
    model.eval()
    ids, pos = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, None), expected, rtol=1e-5, atol=1e-5)
    bridge.save_hf_pretrained(model, out)
    assert_same_tensors(src, out)
    torch.testing.assert_close(hf_logits(out), expected, rtol=1e-5, atol=1e-5)
    return bridge, expected


def test_qwen3_moe_import_export(tmp_path) -> None:
    src = str(tmp_path / "hf")
    make_hf_model("qwen3_moe", src)
    bridge, _ = _import_export(src, tmp_path / "export")
    ckpt = import_hf_to_mcore(src, str(tmp_path / "ckpt"), progress=False)  # on disk too (per-layer keys)
    export_mcore_to_hf(ckpt, str(tmp_path / "back"), progress=False)
    assert_same_tensors(src, tmp_path / "back")
    config = bridge.transformer_config()
    assert bridge.architecture == "Qwen3MoeForCausalLM" and "Qwen3MoeForCausalLM" in AutoBridge.list_supported_models()
    assert config.qk_layernorm and config.num_moe_experts == 4 and config.moe_layer_freq == [1, 0, 1]
    assert not config.moe_router_pre_softmax and config.moe_shared_expert_intermediate_size is None


def test_qwen3_next_import_export_and_tensor_parallel(qwen3_next_dir: str, tmp_path) -> None:
    bridge, expected = _import_export(qwen3_next_dir, tmp_path / "export")
    config = bridge.transformer_config()
    assert config.experimental_attention_variant == "gated_delta_net" and config.linear_attention_freq == [1, 0, 1]
    assert config.attention_output_gate and config.layernorm_zero_centered_gamma and config.moe_shared_expert_gate
    assert config.moe_layer_freq == [1, 1, 0] and bridge.gpt_model_kwargs()["rotary_percent"] == 0.5
    out = str(tmp_path / "tp2")
    for logits in run_on_ranks(2, dist_checks.import_check_export, qwen3_next_dir, out, 2, 1):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert_same_tensors(qwen3_next_dir, out)


def _edited_config(src: str, dst, **changes) -> str:
    cfg = json.load(open(f"{src}/config.json"))
    cfg.update(changes)
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_refusals_name_the_field(qwen3_next_dir: str, tmp_path) -> None:
    cases = [
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (dict(decoder_sparse_step=0), r"decoder_sparse_step=0 is not supported"),
        (dict(mlp_only_layers=[0, 1, 2]), r"mlp_only_layers=\[0, 1, 2\] leave no MoE layer"),
        (dict(mlp_only_layers=[5]), r"mlp_only_layers=\[5\] is not supported \(layer indices"),
        (dict(layer_types=["linear_attention", "sliding_attention", "full_attention"]), r"layer_types=.* one of"),
    ]
    for k, (changes, message) in enumerate(cases):
        path = _edited_config(qwen3_next_dir, tmp_path / f"c{k}", **changes)
        with pytest.raises(HFConversionError, match=r"config\.json: .*" + message):
            AutoBridge.from_hf_pretrained(path, load_weights=False)


def test_qwen3_next_mtp_tensors_without_mtp_config_are_refused(qwen3_next_dir: str, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "with_mtp"
    shutil.copytree(qwen3_next_dir, path)
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(48, 96)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match=r"'mtp\.fc\.weight' .*multi-token-prediction layers .*not converted: "
                       r"config\.json has no mtp_num_hidden_layers"):
        AutoBridge.from_hf_pretrained(path)
