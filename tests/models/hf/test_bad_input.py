"""Bad Hugging Face input fails early with a message naming the file and tensor; nothing is left half-written."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.models.hf.hf_models import make_hf_model

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from megatron_core.models.hf import (  # noqa: E402
    AutoBridge,
    HFConversionError,
    safetensors_io,  # noqa: E402
)
from megatron_core.models.hf.convert import import_hf_to_mcore  # noqa: E402


@pytest.fixture
def llama_dir(tmp_path) -> str:
    make_hf_model("llama", tmp_path / "llama", vocab_size=99)
    return str(tmp_path / "llama")


def _edit_config(path: str, **fields) -> None:
    file = os.path.join(path, "config.json")
    cfg = json.load(open(file))
    cfg.update(fields)
    json.dump(cfg, open(file, "w"))


def test_unsupported_architectures_and_fields(llama_dir: str) -> None:
    _edit_config(llama_dir, architectures=["GemmaForCausalLM"])
    with pytest.raises(HFConversionError, match=r"config\.json: architecture 'GemmaForCausalLM' is not supported: "
                                                r"GPTModel does not multiply the word embeddings by sqrt"):
        AutoBridge.from_hf_pretrained(llama_dir)
    _edit_config(llama_dir, architectures=["FalconForCausalLM"])
    with pytest.raises(HFConversionError, match=r"'FalconForCausalLM' is not supported; supported: \['LlamaForCausalLM'"):
        AutoBridge.from_hf_pretrained(llama_dir)
    _edit_config(llama_dir, architectures=["LlamaForCausalLM"], mlp_bias=True)
    with pytest.raises(HFConversionError, match=r"config\.json: mlp_bias=True is not supported"):
        AutoBridge.from_hf_pretrained(llama_dir)
    _edit_config(llama_dir, mlp_bias=False, rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(HFConversionError, match="RoPE scaling type 'yarn' is not supported"):
        AutoBridge.from_hf_pretrained(llama_dir)
    os.remove(os.path.join(llama_dir, "config.json"))
    with pytest.raises(HFConversionError, match=r"config\.json does not exist"):
        AutoBridge.from_hf_pretrained(llama_dir)


def test_missing_shard(tmp_path) -> None:
    make_hf_model("llama", tmp_path / "m", max_shard_size="30KB")
    index = json.load(open(tmp_path / "m" / "model.safetensors.index.json"))["weight_map"]
    victim = index["model.layers.1.mlp.up_proj.weight"]
    os.remove(tmp_path / "m" / victim)
    with pytest.raises(HFConversionError, match=rf"model\.safetensors\.index\.json lists shard .*{victim}, which does "
                                                r"not exist \(it should hold \d+ tensors"):
        AutoBridge.from_hf_pretrained(tmp_path / "m")


def test_wrong_shape_and_unexpected_tensor(llama_dir: str) -> None:
    file = os.path.join(llama_dir, "model.safetensors")
    tensors = safetensors_torch.load_file(file)
    good = tensors["model.layers.0.self_attn.k_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = good[:-1].clone()
    safetensors_torch.save_file(tensors, file)
    with pytest.raises(HFConversionError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' "
                                                r"has shape \(15, 48\), but config\.json implies \(16, 48\)"):
        AutoBridge.from_hf_pretrained(llama_dir)
    tensors["model.layers.0.self_attn.k_proj.weight"] = good
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    safetensors_torch.save_file(tensors, file)
    with pytest.raises(HFConversionError, match=r"tensor 'model\.layers\.0\.self_attn\.extra\.weight' .* has no place"):
        AutoBridge.from_hf_pretrained(llama_dir)
    del tensors["model.layers.0.self_attn.extra.weight"], tensors["model.norm.weight"]
    safetensors_torch.save_file(tensors, file)
    with pytest.raises(HFConversionError, match=r"tensor 'model\.norm\.weight' is missing"):
        AutoBridge.from_hf_pretrained(llama_dir)


def test_vocabulary_not_divisible_by_tp(llama_dir: str) -> None:
    bridge = AutoBridge.from_hf_pretrained(llama_dir)
    with pytest.raises(HFConversionError, match=r"config\.json: vocab_size 99 is not divisible by "
                                                r"tensor_model_parallel_size 2; pass make_vocab_size_divisible_by"):
        bridge.padded_vocab_size(2)
    assert bridge.padded_vocab_size(2, make_vocab_size_divisible_by=8) == 112


def test_failed_export_leaves_nothing(llama_dir: str, tmp_path, monkeypatch) -> None:
    bridge = AutoBridge.from_hf_pretrained(llama_dir)
    (model,) = bridge.to_megatron_model()
    calls = []
    original = safetensors_io.SafetensorsShardWriter.write

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 5:
            raise OSError("No space left on device")
        original(self, name, tensor)

    monkeypatch.setattr(safetensors_io.SafetensorsShardWriter, "write", failing_write)
    with pytest.raises(HFConversionError, match="nothing written there.*No space left on device"):
        bridge.save_hf_pretrained(model, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["llama"]


def test_failed_import_leaves_nothing(llama_dir: str, tmp_path) -> None:
    file = os.path.join(llama_dir, "model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size - 64)  # the header is intact; the last tensor's bytes are gone
    with pytest.raises(HFConversionError, match=r"model\.safetensors"):
        import_hf_to_mcore(llama_dir, str(tmp_path / "ckpt"), progress=False)
    assert not os.path.exists(tmp_path / "ckpt")
