"""Multi-token prediction of a hybrid model (``HybridModel`` with ``hybrid_layer_pattern="M*M-/*M/*M"``).

- The loss and every gradient equal the objective computed directly from the model's modules (main loss plus
  ``mtp_loss_scaling_factor`` times the mean of the depths' masked losses on the shifted labels), and every MTP
  parameter gets a gradient; the logged depth losses are those of the direct computation.
- A hybrid depth of pattern ``"*"`` computes what a GPT MTP layer around the same attention layer computes.
- State-dict and sharded checkpoint keys follow Megatron-Core 0.19 (hybrid depths keep ``mtp_model_layer.``).
- Repeated layers, evaluation, and the configuration errors.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from megatron_core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron_core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.transformer.backends import LocalSpecProvider
from megatron_core.transformer.multi_token_prediction import (
    MTPLossLoggingHelper,
    MultiTokenPredictionBlock,
    MultiTokenPredictionLayer,
    get_mtp_layer_spec_for_backend,
)
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from tests.models.hybrid.hybrid_mtp_utils import MAX_SEQ, build, direct_objective, make_batch
from tests.models.mamba.mamba_test_utils import VOCAB, config


@pytest.fixture(autouse=True)
def _clean_tracker():
    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossLoggingHelper.tracker.clear()


def _keys(model: torch.nn.Module) -> set[str]:
    return {sh.key for sh in model.sharded_state_dict().values() if hasattr(sh, "key")}


def test_structure_and_checkpoint_keys_follow_megatron_core():
    model = build()
    assert model.mtp_pattern == "*M" and model.mtp_num_depths == 2 and model.mtp_process
    assert len(model.mtp.layers) == 2 and len(model.decoder.layers) == 4
    stack = model.mtp.layers[1].mtp_model_layer
    assert stack.layer_type_list == ["*", "M"] and [layer.layer_number for layer in stack.layers] == [1, 2]
    assert not hasattr(stack, "final_norm")  # the depth's final_layernorm is its last norm
    depth = "mtp.layers.1."
    assert f"{depth}mtp_model_layer.layers.1.mixer.in_proj.weight" in model.state_dict()
    keys = _keys(model)
    assert {f"{depth}{k}" for k in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight",
        "mtp_model_layer.layers.0.self_attention.linear_qkv.weight",
        "mtp_model_layer.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "mtp_model_layer.layers.1.mixer.in_proj.layer_norm_weight",
        "mtp_model_layer.layers.1.mixer.A_log",
    )} <= keys
    assert not any("transformer_layer" in k for k in keys)
    assert "decoder.layers.3.mlp.linear_fc1.weight" in keys and "output_layer.weight" in keys


@pytest.mark.parametrize("repeated", [False, True])
def test_loss_and_gradients_equal_the_direct_objective(repeated: bool):
    model = build(mtp_use_repeated_layer=repeated)
    assert len(model.mtp.layers) == (1 if repeated else 2)
    ids, pos, labels, mask = make_batch()
    loss = model(ids, pos, None, labels=labels, loss_mask=mask)
    loss.mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    logged = MTPLossLoggingHelper.tracker["loss_values"].clone()
    model.zero_grad()
    main, total, depth_losses = direct_objective(model, ids, pos, labels, mask)
    total.backward()
    torch.testing.assert_close(loss, main, rtol=1e-6, atol=1e-6)  # the reported loss is the main one
    torch.testing.assert_close(logged, torch.stack(depth_losses).detach(), rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        if name.startswith("mtp."):
            assert got[name].abs().sum() > 0, name


def test_without_mtp_the_loss_is_the_decoders():
    ids, pos, labels, mask = make_batch()
    plain = build("M*M-", seed=0)
    with_mtp = build(seed=0)
    with_mtp.load_state_dict(plain.state_dict(), strict=False)
    torch.testing.assert_close(with_mtp(ids, pos, None, labels=labels), plain(ids, pos, None, labels=labels))


def test_eval_returns_logits_and_logs_nothing():
    model = build().eval()
    ids, pos, _, _ = make_batch()
    with torch.no_grad():
        logits = model(ids, pos, None)
    assert logits.shape == (2, 12, VOCAB)
    assert "loss_values" not in MTPLossLoggingHelper.tracker


def test_attention_depth_equals_the_gpt_mtp_layer():
    """Pattern ``"*"``: a hybrid stack of one attention layer equals a GPT MTP layer around that layer."""
    torch.manual_seed(0)
    cfg = config("M", mtp_num_layers=1)
    mtp_spec = hybrid_stack_spec.submodules.mtp_block_spec.submodules.layer_specs[0]
    hybrid = build_module(mtp_spec, config=cfg, layer_number=1, mtp_layer_pattern="*",
                          hybrid_submodules=hybrid_stack_spec.submodules)
    gpt_spec = get_mtp_layer_spec_for_backend(hybrid_stack_spec.submodules.attention_layer, LocalSpecProvider())
    gpt = build_module(gpt_spec, config=cfg, layer_number=1)
    gpt.load_state_dict({k.replace("mtp_model_layer.layers.0.", "mtp_model_layer."): v
                         for k, v in hybrid.state_dict().items()})
    embedding = LanguageModelEmbedding(cfg, VOCAB, MAX_SEQ, position_embedding_type="rope")
    rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)(12).cpu()
    ids, pos, _, mask = make_batch()
    hidden = torch.randn(12, 2, cfg.hidden_size)
    outs = []
    for layer in (hybrid, gpt):
        out = layer(input_ids=ids, position_ids=pos, hidden_states=hidden, attention_mask=None, padding_mask=mask,
                    rotary_pos_emb=rope, embedding=embedding)
        out[0].square().sum().backward()
        outs.append((out, {n.replace("mtp_model_layer.layers.0.", "mtp_model_layer."): p.grad
                           for n, p in layer.named_parameters()}))
    (h_out, h_grads), (g_out, g_grads) = outs
    for a, b in zip(h_out, g_out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert h_grads.keys() == g_grads.keys()
    for name, grad in h_grads.items():
        torch.testing.assert_close(grad, g_grads[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    hybrid_keys, gpt_keys = _keys(hybrid), _keys(gpt)
    assert {k.replace("mtp_model_layer.layers.0.", "transformer_layer.") for k in hybrid_keys} == gpt_keys


def test_deprecated_mamba_submodules_name():
    cfg = config("M", mtp_num_layers=1)
    spec = hybrid_stack_spec.submodules.mtp_block_spec
    with pytest.warns(DeprecationWarning, match="mamba_submodules"):
        block = MultiTokenPredictionBlock(cfg, spec, mtp_layer_pattern="M", mtp_num_depths=1,
                                          mamba_submodules=hybrid_stack_spec.submodules)
    assert block.layers[0].mtp_model_layer.layer_type_list == ["M"]
    with pytest.raises(ValueError, match="hybrid_submodules and mamba_submodules cannot both be set"):
        MultiTokenPredictionBlock(cfg, spec, mtp_layer_pattern="M", mtp_num_depths=1,
                                  hybrid_submodules=hybrid_stack_spec.submodules,
                                  mamba_submodules=hybrid_stack_spec.submodules)


def test_configuration_errors_name_the_fields():
    with pytest.raises(ValueError, match=r"has 2 MTP depths but config.mtp_num_layers is 1"):
        build(mtp_num_layers=1)
    with pytest.raises(ValueError, match=r"has 2 MTP depths but config.mtp_num_layers is None"):
        build(mtp_num_layers=None)
    with pytest.raises(ValueError, match=r"config.mtp_num_layers is 2 but hybrid_layer_pattern 'M\*M-' has no MTP"):
        build("M*M-", mtp_num_layers=2)
    with pytest.raises(ValueError, match="every MTP depth must use the same pattern"):
        build("M*M-/*M/M*", mtp_num_layers=2)
    no_mtp_spec = ModuleSpec(module=hybrid_stack_spec.module,
                             submodules=dataclasses.replace(hybrid_stack_spec.submodules, mtp_block_spec=None))
    with pytest.raises(ValueError, match="mtp_block_spec is None"):
        HybridModel(config("M*M-", mtp_num_layers=2), no_mtp_spec, VOCAB, MAX_SEQ, hybrid_layer_pattern="M*M-/*M/*M")
    with pytest.raises(ValueError, match="post_process=True"):
        HybridModel(config("M*M-", mtp_num_layers=2), hybrid_stack_spec, VOCAB, MAX_SEQ,
                    hybrid_layer_pattern="M*M-/*M/*M", post_process=False)
    cfg = config("M", mtp_num_layers=2)
    with pytest.raises(ValueError, match=r"has 3 depths \(mtp_num_depths\) but config.mtp_num_layers is 2"):
        MultiTokenPredictionBlock(cfg, hybrid_stack_spec.submodules.mtp_block_spec, mtp_layer_pattern="M",
                                  mtp_num_depths=3, hybrid_submodules=hybrid_stack_spec.submodules)
    layer_spec = hybrid_stack_spec.submodules.mtp_block_spec.submodules.layer_specs[0]
    with pytest.raises(ValueError, match=r"mtp_layer_pattern \('M'\) needs hybrid_submodules"):
        MultiTokenPredictionLayer(cfg, layer_spec.submodules, mtp_layer_pattern="M")
    with pytest.raises(ValueError, match="'X' at position 1 is not a valid layer symbol"):
        MultiTokenPredictionLayer(cfg, layer_spec.submodules, mtp_layer_pattern="MX",
                                  hybrid_submodules=hybrid_stack_spec.submodules)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_in_fp32():
    cpu_model = build()
    batch = make_batch(seq=64)
    results = []
    for model, device in ((cpu_model, "cpu"), (copy.deepcopy(cpu_model).cuda(), "cuda")):
        ids, pos, labels, mask = (t.to(device) for t in batch)
        loss = model(ids, pos, None, labels=labels, loss_mask=mask)
        loss.mean().backward()
        results.append((loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}))
    (want_loss, want_grads), (loss, grads) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
