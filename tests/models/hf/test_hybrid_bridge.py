"""AutoBridge on random-weight ``NemotronHForCausalLM`` / ``Mamba2ForCausalLM`` models saved by transformers (fp32, CPU).

For each: import at TP=1 (in process), TP=2 and PP=2 (gloo ranks) gives HybridModel logits within 1e-4 of
transformers; every export loads back bitwise-identical tensors; import -> 3 training steps -> export ->
transformers reproduces our logits (also from TP=2). Unsupported config fields are refused naming the field
and its value.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf import dist_checks
from tests.models.hf.hf_models import assert_same_tensors, batch, hf_logits, our_logits, safetensors_tensors
from tests.models.hf.hybrid_models import HYBRID_KINDS, make_hybrid_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core.models.hf import AutoBridge, HFConversionError  # noqa: E402
from megatron_core.models.hybrid import HybridModel  # noqa: E402


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """One saved model per kind."""
    root = tmp_path_factory.mktemp("hybrid_models")
    out = {}
    for kind in HYBRID_KINDS:
        make_hybrid_model(kind, root / kind)
        out[kind] = str(root / kind)
    return out


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_import_tp1_export_and_train(kind: str, hf_dirs: dict, tmp_path) -> None:
    src = hf_dirs[kind]
    expected = hf_logits(src)
    assert expected.abs().max() > 1.0  # the layers do real work at this scale
    bridge = AutoBridge.from_hf_pretrained(src)
    (model,) = bridge.to_megatron_model()
    assert isinstance(model, HybridModel)
    assert model.hybrid_layer_pattern == bridge.family.hybrid_pattern
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    for layer in model.decoder.layers:
        if hasattr(layer, "mixer"):
            assert (layer.mixer.d_conv, layer.mixer.chunk_size) == (cfg["conv_kernel"], cfg["chunk_size"])
    model.eval()
    torch.testing.assert_close(our_logits(model), expected, rtol=1e-4, atol=1e-4)

    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")
    torch.testing.assert_close(hf_logits(tmp_path / "export"), expected, rtol=0, atol=0)

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, pos = batch()
    for _ in range(3):
        optimizer.zero_grad()
        model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean().backward()
        optimizer.step()
    model.eval()
    trained = our_logits(model)
    assert (trained - expected).abs().max() > 1e-3  # training changed the model
    bridge.save_hf_pretrained(model, tmp_path / "trained")
    torch.testing.assert_close(hf_logits(tmp_path / "trained"), trained, rtol=1e-4, atol=1e-4)
    # and back: the trained export imports to the trained state, bitwise
    (again,) = AutoBridge.from_hf_pretrained(tmp_path / "trained").to_megatron_model()
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
def test_import_tp2_pp2_logits_and_export(kind: str, hf_dirs: dict, tmp_path) -> None:
    src = hf_dirs[kind]
    expected = hf_logits(src)
    for tp, pp in ((2, 1), (1, 2)):
        out = str(tmp_path / f"tp{tp}pp{pp}")
        results = run_on_ranks(2, dist_checks.import_check_export, src, out, tp, pp)
        last = [r for r in results if r is not None]
        assert len(last) == (2 if tp == 2 else 1)
        for logits in last:
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert_same_tensors(src, out)


def test_train_at_tp2_then_transformers_reproduces(hf_dirs: dict, tmp_path) -> None:
    out = str(tmp_path / "trained")
    results = run_on_ranks(2, dist_checks.train_then_export, hf_dirs["nemotron_h"], out, 2)
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(hf_logits(out), results[0], rtol=1e-4, atol=1e-4)


def test_in_memory_model_prefix_round_trips(hf_dirs: dict, tmp_path) -> None:
    """NemotronH files named like transformers' modules (``model.``) import alike and export under ``model.``."""
    from safetensors.torch import save_file

    src = tmp_path / "model_prefix"
    src.mkdir()
    tensors = {name.replace("backbone.", "model.", 1): t for name, t in safetensors_tensors(hf_dirs["nemotron_h"]).items()}
    assert any(name.startswith("model.layers.") for name in tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(open(os.path.join(hf_dirs["nemotron_h"], "config.json")).read())
    bridge = AutoBridge.from_hf_pretrained(src)
    (model,) = bridge.to_megatron_model()
    torch.testing.assert_close(our_logits(model.eval()), hf_logits(hf_dirs["nemotron_h"]), rtol=1e-4, atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "out")
    assert_same_tensors(src, tmp_path / "out")


_REFUSED = [
    ("nemotron_h", {"layers_block_type": ["linear_attention", "moe"]}, "layers_block_type"),
    ("nemotron_h", {"mlp_hidden_act": "gelu"}, "mlp_hidden_act='gelu'"),
    ("nemotron_h", {"mamba_hidden_act": "relu"}, "mamba_hidden_act='relu'"),
    ("nemotron_h", {"use_conv_bias": False}, "use_conv_bias=False"),
    ("nemotron_h", {"use_bias": True}, "use_bias=True"),
    ("nemotron_h", {"mamba_proj_bias": True}, "mamba_proj_bias=True"),
    ("nemotron_h", {"attention_bias": True}, "attention_bias=True"),
    ("nemotron_h", {"mlp_bias": True}, "mlp_bias=True"),
    ("nemotron_h", {"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
    ("nemotron_h", {"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ("nemotron_h", {"layers_block_type": None, "hybrid_override_pattern": "M*X"}, "hybrid_override_pattern='M*X'"),
    ("mamba2", {"time_step_limit": [0.01, 10.0]}, "time_step_limit=[0.01, 10.0]"),
    ("mamba2", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("mamba2", {"num_heads": 3}, "num_heads * head_dim (3 * 8)"),
    ("mamba2", {"n_groups": 3}, "n_groups (3)"),
]


@pytest.mark.parametrize(("kind", "edit", "needle"), _REFUSED)
def test_unsupported_config_fields_are_refused(kind: str, edit: dict, needle: str, hf_dirs: dict, tmp_path) -> None:
    cfg = json.loads(open(os.path.join(hf_dirs[kind], "config.json")).read())
    cfg.update(edit)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json") as info:
        AutoBridge.from_hf_pretrained(tmp_path, load_weights=False)
    assert isinstance(info.value, HFConversionError)
    assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize("param", ["mixer.in_proj.weight", "mixer.conv1d_weight", "mixer.conv1d_bias"])
def test_mixer_tp_shards_hold_a_slice_of_every_section(param: str, hf_dirs: dict) -> None:
    """TP rank r's in_proj is [z_r; x_r; B_r; C_r; dt_r] (conv1d: [x_r; B_r; C_r]); the shards convert back exactly."""
    bridge = AutoBridge.from_hf_pretrained(hf_dirs["nemotron_h"])
    rule = bridge.rules_by_name()[f"decoder.layers.{{i}}.{param}"]
    reader = bridge.reader
    full = reader.read(rule.hf_names(0)[0])
    d_inner, bc, heads = 4 * 6, 2 * 8, 4
    sections = [d_inner, d_inner, bc, bc, heads] if "in_proj" in param else [d_inner, bc, bc]
    assert sum(sections) == full.shape[0]
    shards = [rule.from_hf(reader.read, 0, rank, 2, reader.shape) for rank in range(2)]
    for rank, shard in enumerate(shards):
        want = torch.cat([part.chunk(2)[rank] for part in full.split(sections)])
        assert torch.equal(shard, want)
    assert not torch.equal(shards[0], full[: full.shape[0] // 2])  # not one contiguous block
    (back,) = rule.to_hf(shards, 0).values()
    assert torch.equal(back, full)


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
def test_tp2_loss_and_every_gradient_match_transformers(kind: str, hf_dirs: dict, tmp_path) -> None:
    """At TP=2 the imported model's loss equals transformers', and every gradient, gathered back to the HF layout
    through the bridge, equals the gradient transformers computes for that tensor."""
    import transformers

    from tests.models.hf.hf_models import safetensors_tensors

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[kind]).eval()
    ids, _ = batch()
    labels = torch.roll(ids, -1, dims=1)
    logits = hf(input_ids=ids).logits
    want_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    want_loss.backward()
    out = str(tmp_path / "grads")
    losses = run_on_ranks(2, dist_checks.gradients_as_hf, hf_dirs[kind], out, 2)
    for loss in losses:
        assert abs(loss - want_loss.item()) < 1e-5
    got = safetensors_tensors(out)
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    assert len(got) == len(hf_grads)
    for name, grad in got.items():
        # transformers names NemotronH's modules model.*, its files backbone.*
        want = hf_grads[name.replace("backbone.", "model.", 1) if kind == "nemotron_h" else name]
        assert want.abs().max() > 0, name
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-5, msg=name)


def test_legacy_nemotron_h_config_fields(hf_dirs: dict, tmp_path) -> None:
    """An older config.json (``hybrid_override_pattern``, ``num_hidden_layers``, ``mamba_*`` aliases) converts alike."""
    import shutil

    src = hf_dirs["nemotron_h"]
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    del cfg["layers_block_type"]
    cfg.update(hybrid_override_pattern="M*M-", num_hidden_layers=4, mamba_n_groups=cfg.pop("n_groups"),
               mamba_d_conv=cfg.pop("conv_kernel"), mamba_chunk_size=cfg.pop("chunk_size"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copyfile(os.path.join(src, "model.safetensors"), tmp_path / "model.safetensors")
    bridge = AutoBridge.from_hf_pretrained(tmp_path)
    assert bridge.family.hybrid_pattern == "M*M-"
    (model,) = bridge.to_megatron_model()
    torch.testing.assert_close(our_logits(model.eval()), hf_logits(src), rtol=1e-4, atol=1e-4)


def test_bf16_round_trip_keeps_every_dtype(tmp_path) -> None:
    """A bf16 checkpoint: A_log and D live in fp32 in the mixer (as in Megatron-Core) and are written back in bf16,
    so the export is bitwise the source, dtypes included."""
    src = tmp_path / "bf16"
    make_hybrid_model("nemotron_h", src).to(torch.bfloat16).save_pretrained(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    (model,) = bridge.to_megatron_model()
    params = dict(model.named_parameters())
    assert params["decoder.layers.0.mixer.A_log"].dtype == torch.float32
    assert params["decoder.layers.0.mixer.in_proj.weight"].dtype == torch.bfloat16
    bridge.save_hf_pretrained(model, tmp_path / "out")
    assert_same_tensors(src, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
