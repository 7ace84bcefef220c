"""Qwen3-Next's multi-token-prediction layer (``mtp.*`` in Qwen's checkpoints) as GPTModel's MTP depth 0.

A random checkpoint with Qwen's ``mtp.*`` names (its transformer layer the last layer of a larger random
Qwen3-Next saved by transformers, so its expert tensors have the on-disk names) imports with the main logits
equal to transformers'; the MTP depth's hidden states equal transformers' own ``MtpLayer`` (which its conversion
mapping fills from the same names) on those weights; the MTP loss trains; in-process export, on-disk export and
the export of a TP=2 run's re-save give back the files bitwise. Layouts Megatron's MTP block cannot hold are refused by name.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf import dist_checks
from tests.models.hf.hf_models import (
    SEQ,
    assert_same_tensors,
    batch,
    hf_logits,
    make_hf_model,
    megatron_model,
    safetensors_tensors,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core import dist_checkpointing, tensor_parallel  # noqa: E402
from megatron_core.models.hf import AutoBridge, HFConversionError  # noqa: E402
from megatron_core.models.hf.convert import export_mcore_to_hf, import_hf_to_mcore  # noqa: E402

# the last layer gated attention and MoE, as the first: the MTP layer takes the last layer's spec
LAYER_TYPES = ["full_attention", "linear_attention", "full_attention"]
MAIN = dict(layer_types=LAYER_TYPES, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    """``(directory with mtp.* tensors, transformers' main model, transformers' MtpLayer on the same weights)``."""
    from safetensors.torch import save_file
    from transformers.modeling_layers import MtpLayer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    root = tmp_path_factory.mktemp("qwen3_next_mtp")
    path = str(root / "hf")
    main = make_hf_model("qwen3_next", path, **MAIN, mtp_num_hidden_layers=1)
    big = make_hf_model("qwen3_next", root / "big", seed=3, num_hidden_layers=4, layer_types=LAYER_TYPES + [
        "full_attention"], mlp_only_layers=[1])
    tensors = safetensors_tensors(path)
    tensors.update({"mtp.layers.0." + n.removeprefix("model.layers.3."): t
                    for n, t in safetensors_tensors(root / "big").items() if n.startswith("model.layers.3.")})
    oracle = MtpLayer(big.config, type(big.model.layers[3]), Qwen3NextRMSNorm, 3).eval()
    oracle.mtp_block = big.model.layers[3]
    gen = torch.Generator().manual_seed(11)
    hidden = main.config.hidden_size
    with torch.no_grad():
        for module, name in ((oracle.enorm, "pre_fc_norm_embedding"), (oracle.hnorm, "pre_fc_norm_hidden"),
                             (oracle.post_norm, "norm"), (oracle.eh_proj, "fc")):
            module.weight.copy_(0.3 * torch.randn(module.weight.shape, generator=gen))
            tensors[f"mtp.{name}.weight"] = module.weight.detach().clone()
    assert oracle.eh_proj.weight.shape == (hidden, 2 * hidden)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path, main, oracle


def _oracle_mtp_hidden(main: torch.nn.Module, oracle: torch.nn.Module) -> torch.Tensor:
    """transformers' MTP hidden states ``[b, s - 1, h]`` for :func:`batch`: position ``t`` predicts ``t + 2``
    from the main model's (final-norm) hidden state at ``t`` and the embedding of token ``t + 1``."""
    ids, _ = batch()
    with torch.no_grad():
        hidden = main.model(input_ids=ids).last_hidden_state[:, :-1]
        embeds = main.model.embed_tokens(ids[:, 1:])
        pos = torch.arange(SEQ - 1).unsqueeze(0).expand(ids.shape[0], -1)
        causal = torch.full((SEQ - 1, SEQ - 1), float("-inf")).triu(1)[None, None]
        return oracle(embeds, hidden, main.model.rotary_emb(hidden, pos), causal, pos, None)


def test_import_matches_transformers_and_mtp_trains(mtp_model) -> None:
    src, main, oracle = mtp_model
    bridge = AutoBridge.from_hf_pretrained(src)
    assert bridge.family.mtp_num_layers == 1
    model = megatron_model(bridge)
    layer = model.mtp.layers[0].mtp_model_layer
    assert type(layer.mlp).__name__ == "MoELayer" and type(layer.self_attention).__name__ == "SelfAttention"
    ids, pos = batch()
    captured = []
    model.mtp.register_forward_hook(lambda _m, _i, out: captured.append(out[SEQ:].detach()))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, None), hf_logits(src), rtol=1e-5, atol=1e-5)
    got = captured[0].transpose(0, 1)[:, :-1]  # [b, s - 1, h]; the last position sees a rolled-in token
    torch.testing.assert_close(got, _oracle_mtp_hidden(main, oracle), rtol=1e-5, atol=1e-5)
    model.train()
    model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean().backward()
    grad = model.mtp.layers[0].eh_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_in_process_and_on_disk_export_are_bitwise(mtp_model, tmp_path) -> None:
    src, _, _ = mtp_model
    bridge = AutoBridge.from_hf_pretrained(src)
    bridge.save_hf_pretrained(megatron_model(bridge), tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")
    ckpt = import_hf_to_mcore(src, str(tmp_path / "ckpt"), tp=2, make_vocab_size_divisible_by=1, progress=False)
    stored = dist_checkpointing.load_tensors_metadata(ckpt)
    assert "mtp.layers.0.eh_proj.weight" in stored
    assert "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight" in stored
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    (loaded,) = bridge.to_megatron_model(load_weights=False)
    state = dist_checkpointing.load(loaded.sharded_state_dict(), ckpt)
    loaded.load_state_dict({k: v for k, v in state.items() if k in loaded.state_dict()}, strict=True)
    want = megatron_model(bridge).state_dict()
    for name, value in loaded.state_dict().items():
        if name.startswith("mtp.") and not name.endswith("_extra_state"):
            assert torch.equal(value, want[name]), name
    export_mcore_to_hf(ckpt, str(tmp_path / "back"), progress=False)
    assert_same_tensors(src, tmp_path / "back")
    # a TP=2 run loads it (MTP layer included, strict) and re-saves it in the training layout, which exports back
    resave = str(tmp_path / "resaved")
    for logits in run_on_ranks(2, dist_checks.load_converted_checkpoint, str(tmp_path / "ckpt"), src, resave, 2, 1):
        torch.testing.assert_close(logits, hf_logits(src), rtol=1e-5, atol=1e-5)
    assert any(key.startswith("mtp.layers.0.") for key in dist_checkpointing.load_tensors_metadata(
        os.path.join(resave, "iter_0000003")))
    export_mcore_to_hf(resave, str(tmp_path / "from_tp2"), hf_template=src, progress=False)
    assert_same_tensors(src, tmp_path / "from_tp2")


def _with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_layouts_megatron_cannot_hold_are_refused(mtp_model, tmp_path) -> None:
    src, _, _ = mtp_model
    cases = [
        (dict(mtp_num_hidden_layers=2), r"mtp_num_hidden_layers=2: Qwen's layout shares one mtp\.fc"),
        (dict(mtp_num_hidden_layers=0), r"no mtp_num_hidden_layers"),
        (dict(mtp_use_dedicated_embeddings=True), r"mtp_use_dedicated_embeddings=True"),
    ]
    for k, (changes, message) in enumerate(cases):
        path = _with_config(src, tmp_path / f"c{k}", **changes)
        with pytest.raises(HFConversionError, match=r"'mtp\..*multi-token-prediction layers .*" + message):
            AutoBridge.from_hf_pretrained(path)
    # Megatron builds the MTP layer from the last layer's spec: a gated delta net here, softmax attention in Qwen's
    path = _with_config(src, tmp_path / "last_linear", layer_types=["linear_attention", "full_attention",
                                                                     "linear_attention"])
    family = AutoBridge.from_hf_pretrained(path, load_weights=False).family
    assert family.mtp_num_layers == 0 and "last decoder layer is a gated delta net" in family.refused_prefixes["mtp."]
