"""``models.huggingface``: Hugging Face models wrapped as ``MegatronModule`` s, fp32 on CPU.

Tiny random Qwen2, SigLIP-vision and Parakeet-encoder models are saved to a temporary directory (no downloads)
and loaded through the wrappers' ``hf://<directory>`` paths. Each wrapper's outputs and gradients equal those of
the same Hugging Face model loaded on its own from the same directory; state-dict keys are the wrapped model's
under ``model.``; ``get_hf_model_type`` / ``build_hf_model`` dispatch as Megatron-Core 0.19 does. NeMo cannot be
installed here: its backend runs on a stand-in ``nemo.collections.asr`` built from torch modules.
"""

from __future__ import annotations

import subprocess
import sys
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_core.models.huggingface import _optional, build_hf_model  # noqa: E402
from megatron_core.models.huggingface import fastconformer_model as fcm  # noqa: E402
from megatron_core.models.huggingface.clip_model import SiglipHuggingFaceModel  # noqa: E402
from megatron_core.models.huggingface.fastconformer_model import ParakeetHuggingFaceModel  # noqa: E402
from megatron_core.models.huggingface.module import (  # noqa: E402
    AutoHuggingFaceModel,
    HuggingFaceModule,
    get_hf_model_type,
)
from megatron_core.models.huggingface.qwen_model import QwenHuggingFaceModel  # noqa: E402
from megatron_core.transformer import TransformerConfig  # noqa: E402

TOL = dict(rtol=1e-6, atol=1e-6)
VOCAB, HIDDEN, IMG, PATCH, MELS = 64, 32, 32, 8, 16


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """Directories of tiny random Hugging Face models: ``qwen``, ``siglip``, ``parakeet`` (encoder + feature
    extractor) and ``llama`` (an architecture the wrappers do not support), saved under a ``myparakeet-clone``
    directory (a segment that contains but does not start with ``parakeet``)."""
    root = tmp_path_factory.mktemp("hf_models")
    torch.manual_seed(0)
    dirs = {name: root / name for name in ("qwen", "siglip", "parakeet-tiny")}
    dirs["llama"] = root / "myparakeet-clone" / "llama"
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(dirs["qwen"])
    transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=IMG,
        patch_size=PATCH)).save_pretrained(dirs["siglip"])
    transformers.ParakeetEncoder(transformers.ParakeetEncoderConfig(
        hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        subsampling_conv_channels=8, num_mel_bins=MELS, dropout=0.0, layerdrop=0.0, activation_dropout=0.0,
        attention_dropout=0.0)).save_pretrained(dirs["parakeet-tiny"])
    transformers.ParakeetFeatureExtractor(feature_size=MELS).save_pretrained(dirs["parakeet-tiny"])
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(dirs["llama"])
    return dirs


def _config(**paths: str) -> TransformerConfig:
    """A TransformerConfig carrying the wrappers' path fields, set on it as Megatron-LM does."""
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0)
    for name, value in paths.items():
        setattr(config, name, value)
    return config


def _assert_grads_equal(wrapper: HuggingFaceModule, reference: torch.nn.Module) -> None:
    ref_params = dict(reference.named_parameters())
    assert set(ref_params) == {name.removeprefix("model.") for name, _ in wrapper.named_parameters()}
    checked = 0
    for name, param in wrapper.named_parameters():
        want = ref_params[name.removeprefix("model.")].grad
        if want is None:
            assert param.grad is None, name
            continue
        torch.testing.assert_close(param.grad, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        checked += int(bool(want.abs().sum() > 0))
    assert checked > 0


def _checkpointing(model: torch.nn.Module) -> bool:
    """Activation checkpointing is on (transformers 5 name, else the older one)."""
    new_name = hasattr(type(model), "is_activation_checkpointing")
    return getattr(model, "is_activation_checkpointing" if new_name else "is_gradient_checkpointing")


def test_importing_the_wrappers_does_not_import_transformers():
    code = ("import sys; import megatron_core.models.huggingface.module, megatron_core.models.huggingface.qwen_model,"
            " megatron_core.models.huggingface.clip_model, megatron_core.models.huggingface.fastconformer_model;"
            " assert 'transformers' not in sys.modules and 'nemo' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_wrappers_import_without_transformers_installed():
    code = ("import sys; sys.modules['transformers'] = None\n"  # what Python does for a package that is absent
            "from megatron_core.models.huggingface import module, qwen_model\n"
            "assert not module.HAVE_TRANSFORMERS and qwen_model.QwenHuggingFaceModel._fsdp_modules == []\n"
            "try:\n    module.build_hf_model(None, 'hf://x')\nexcept ImportError as e:\n"
            "    assert 'pip install transformers' in str(e)\nelse:\n    raise AssertionError('no ImportError')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("with_labels", [False, True])
def test_qwen_matches_hf_model(hf_dirs, with_labels):
    wrapper = QwenHuggingFaceModel(_config(language_model_type=f"hf://{hf_dirs['qwen']}"))
    reference = transformers.Qwen2ForCausalLM.from_pretrained(hf_dirs["qwen"])
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    embeddings = wrapper.embedding(ids)
    assert embeddings.shape == (7, 2, HIDDEN) and embeddings.is_contiguous()
    torch.testing.assert_close(embeddings, reference.get_input_embeddings()(ids).transpose(0, 1), **TOL)
    labels = torch.roll(ids, -1, dims=1)
    labels[0, -1] = -100
    logits_ref = reference(input_ids=ids).logits
    if with_labels:
        got = wrapper(None, None, None, decoder_input=embeddings, labels=labels, attention_mask=None)
        want = torch.nn.functional.cross_entropy(logits_ref.reshape(-1, VOCAB), labels.reshape(-1),
                                                 reduction="none").reshape(2, 7)
        assert got.shape == (2, 7) and got[0, -1] == 0
    else:
        got = wrapper(decoder_input=embeddings, labels=None, attention_mask=None)["logits"]
        want = logits_ref
    torch.testing.assert_close(got, want, **TOL)
    weights = torch.rand(got.shape, generator=torch.Generator().manual_seed(2))
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    _assert_grads_equal(wrapper, reference)


def test_qwen_needs_decoder_input(hf_dirs):
    wrapper = QwenHuggingFaceModel(_config(language_model_type=f"hf://{hf_dirs['qwen']}"))
    with pytest.raises(ValueError, match="decoder_input"):
        wrapper(labels=None, attention_mask=None)


def test_siglip_matches_hf_model(hf_dirs):
    wrapper = SiglipHuggingFaceModel(_config(vision_model_type=f"hf://{hf_dirs['siglip']}"))
    reference = transformers.SiglipVisionModel.from_pretrained(hf_dirs["siglip"])
    images = torch.randn(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(3))
    got = wrapper(pixel_values=images)
    want = reference(pixel_values=images).last_hidden_state
    assert got.shape == (3, (IMG // PATCH) ** 2, HIDDEN)
    torch.testing.assert_close(got, want, **TOL)
    got.square().sum().backward()
    want.square().sum().backward()
    _assert_grads_equal(wrapper, reference)


def test_auto_model_matches_hf_model(hf_dirs):
    wrapper = AutoHuggingFaceModel(_config(huggingface_model_name_or_path=str(hf_dirs["siglip"])))
    reference = transformers.SiglipVisionModel.from_pretrained(hf_dirs["siglip"])
    images = torch.randn(2, 3, IMG, IMG, generator=torch.Generator().manual_seed(4))
    out = wrapper(pixel_values=images)
    torch.testing.assert_close(out.last_hidden_state, reference(pixel_values=images).last_hidden_state, **TOL)
    torch.testing.assert_close(out.pooler_output, reference(pixel_values=images).pooler_output, **TOL)


def test_parakeet_hf_backend_matches_hf_model(hf_dirs):
    wrapper = ParakeetHuggingFaceModel(_config(sound_model_type=f"hf://{hf_dirs['parakeet-tiny']}",
                                               recompute_granularity=None))
    assert wrapper.use_nemo is False and not _checkpointing(wrapper.model)
    extractor = transformers.AutoFeatureExtractor.from_pretrained(hf_dirs["parakeet-tiny"])
    reference = transformers.ParakeetEncoder.from_pretrained(hf_dirs["parakeet-tiny"])
    audio = torch.randn(2, 3200, generator=torch.Generator().manual_seed(5))
    hidden, lengths = wrapper(audio, torch.tensor([3200, 3200]))
    features = extractor(audio, return_tensors="pt", sampling_rate=16000, return_attention_mask=True)
    want = reference(features.input_features, features.attention_mask).last_hidden_state
    assert hidden.shape == want.shape and hidden.shape[0] == 2 and hidden.shape[-1] == HIDDEN
    torch.testing.assert_close(hidden, want, **TOL)
    assert lengths.tolist() == features.attention_mask.sum(-1).tolist()  # the feature frames, as in 0.19
    hidden.square().sum().backward()
    want.square().sum().backward()
    _assert_grads_equal(wrapper, reference)


def test_parakeet_hf_backend_recompute_enables_gradient_checkpointing(hf_dirs):
    wrapper = ParakeetHuggingFaceModel(_config(sound_model_type=f"hf://{hf_dirs['parakeet-tiny']}",
                                               recompute_granularity="full"))
    assert _checkpointing(wrapper.model)


def test_parakeet_unknown_scheme_raises():
    with pytest.raises(ValueError, match="Unknown sound model type: file:///tmp/x"):
        ParakeetHuggingFaceModel(_config(sound_model_type="file:///tmp/x", recompute_granularity=None))


def test_state_dict_keys_are_the_hf_models_under_model(hf_dirs):
    wrapper = QwenHuggingFaceModel(_config(language_model_type=f"hf://{hf_dirs['qwen']}"))
    reference = transformers.Qwen2ForCausalLM.from_pretrained(hf_dirs["qwen"])
    keys = set(wrapper.state_dict())
    assert keys == {f"model.{k}" for k in reference.state_dict()}
    assert {"model.model.embed_tokens.weight", "model.lm_head.weight",
            "model.model.layers.1.self_attn.q_proj.weight", "model.model.norm.weight"} <= keys
    sharded = wrapper.sharded_state_dict(prefix="language_model.")
    assert set(sharded) == {f"language_model.{k}" for k in keys}
    for key, tensor in sharded.items():
        assert tensor.key == key and tensor.replica_id == (0, 0, 0)
        assert tensor.global_shape == tensor.data.shape  # replicated, never TP-split
    missing, unexpected = reference.load_state_dict({k.removeprefix("model."): v
                                                     for k, v in wrapper.state_dict().items()})
    assert not missing and not unexpected


def test_parameters_are_marked_for_tp_averaging_and_input_tensor_is_kept(hf_dirs):
    wrapper = SiglipHuggingFaceModel(_config(vision_model_type=f"hf://{hf_dirs['siglip']}"))
    assert all(p.average_gradients_across_tp_domain for p in wrapper.parameters())
    wrapper.extra = torch.nn.Linear(2, 2)
    assert wrapper.extra.weight.average_gradients_across_tp_domain
    marker = torch.ones(1)
    wrapper.set_input_tensor(marker)
    assert wrapper.input_tensor is marker


def test_fsdp_units_are_the_hf_layer_classes():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

    assert QwenHuggingFaceModel._fsdp_modules == [Qwen2DecoderLayer]
    assert SiglipHuggingFaceModel._fsdp_modules == [SiglipEncoderLayer]


def test_get_hf_model_type_reads_the_architecture(hf_dirs):
    assert get_hf_model_type(f"hf://{hf_dirs['qwen']}") == "qwen"
    assert get_hf_model_type(f"hf://{hf_dirs['siglip']}") == "siglip"
    with pytest.raises(NotImplementedError, match="llamaforcausallm"):
        get_hf_model_type(f"hf://{hf_dirs['llama']}")  # its path has a segment 'myparakeet-clone'
    with pytest.raises(IndexError):
        get_hf_model_type(str(hf_dirs["qwen"]))  # no hf:// scheme, as in 0.19


@pytest.mark.parametrize("path", ["nemo://nvidia/parakeet-tdt-0.6b-v2", "hf://nvidia/parakeet-tdt-1.1b-en",
                                  "NEMO://Nvidia/Parakeet-TDT-0.6B-V2"])
def test_parakeet_paths_are_recognised_without_reading_a_config(path):
    assert get_hf_model_type(path) == "parakeet"  # these do not exist locally: no config is read


def test_other_nemo_paths_raise():
    with pytest.raises(NotImplementedError, match="nemo:// scheme"):
        get_hf_model_type("nemo://nvidia/some-future-asr-model")


def test_build_hf_model_dispatches(hf_dirs):
    config = _config(language_model_type=f"hf://{hf_dirs['qwen']}", vision_model_type=f"hf://{hf_dirs['siglip']}",
                     sound_model_type=f"hf://{hf_dirs['parakeet-tiny']}", recompute_granularity=None)
    assert type(build_hf_model(config, config.language_model_type)) is QwenHuggingFaceModel
    assert type(build_hf_model(config, config.vision_model_type)) is SiglipHuggingFaceModel
    assert type(build_hf_model(config, config.sound_model_type)) is ParakeetHuggingFaceModel


def test_build_hf_model_dispatches_nemo_parakeet(monkeypatch):
    built = []
    monkeypatch.setattr(fcm, "ParakeetHuggingFaceModel", lambda config: built.append(config) or "parakeet")
    config = SimpleNamespace(sound_model_type="nemo://nvidia/parakeet-tdt-0.6b-v2")
    assert build_hf_model(config, config.sound_model_type) == "parakeet" and built == [config]


def test_missing_transformers_raises_import_error(monkeypatch):
    monkeypatch.setattr(_optional, "HAVE_TRANSFORMERS", False)
    with pytest.raises(ImportError, match="pip install transformers"):
        get_hf_model_type("hf://x")
    with pytest.raises(ImportError, match="QwenHuggingFaceModel"):
        QwenHuggingFaceModel(_config(language_model_type="hf://x"))
    assert QwenHuggingFaceModel._fsdp_modules == []


def _finalize_on_tp_ranks(siglip_dir: str) -> dict:
    """On TP=2: a SigLIP wrapper (plus one unmarked parameter) gets rank-dependent gradients, then
    ``finalize_model_grads``; returns the gradients before and after."""
    from megatron_core import parallel_state
    from megatron_core.distributed import finalize_model_grads

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = torch.distributed.get_rank()
    wrapper = SiglipHuggingFaceModel(_config(vision_model_type=f"hf://{siglip_dir}"))
    wrapper.scale = torch.nn.Parameter(torch.ones(()))  # not a module: not marked
    images = torch.randn(2, 3, IMG, IMG, generator=torch.Generator().manual_seed(10 + rank))
    (wrapper(pixel_values=images) * wrapper.scale).square().sum().backward()
    with_grads = [(name, p) for name, p in wrapper.named_parameters() if p.grad is not None]  # not the pooling head
    before = {name: p.grad.clone() for name, p in with_grads}
    finalize_model_grads([wrapper])
    return {"before": before, "after": {name: p.grad.clone() for name, p in with_grads}}


def test_finalize_model_grads_averages_the_replicas_over_tp(hf_dirs):
    from tests.dist_harness import run_on_ranks

    results = run_on_ranks(2, _finalize_on_tp_ranks, str(hf_dirs["siglip"]))
    assert len(results[0]["before"]) > 10
    for name, grad0 in results[0]["before"].items():
        grad1 = results[1]["before"][name]
        if name == "scale":  # unmarked: left alone
            for r in results:
                torch.testing.assert_close(r["after"][name], r["before"][name], rtol=0, atol=0)
            continue
        for r in results:
            torch.testing.assert_close(r["after"][name], (grad0 + grad1) / 2, **TOL)
    assert not torch.equal(results[0]["before"]["scale"], results[1]["before"]["scale"])


# NeMo backend, on a stand-in ``nemo.collections.asr`` (NeMo is not installable here).

class _Preprocessor(torch.nn.Module):
    """Audio [b, samples] -> features [b, mels, frames] and frame counts (frames of 100 samples)."""

    def forward(self, input_signal, length):
        frames = input_signal.unflatten(-1, (-1, 100))  # [b, t, 100]
        return frames[..., :MELS].transpose(1, 2), length // 100


class _Encoder(torch.nn.Module):
    """Features [b, mels, t] -> hidden [b, h, t] and lengths, with a dropout and layers NeMo's encoder has."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(MELS, HIDDEN)
        self.drop = torch.nn.Dropout(0.3)
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].self_attn = SimpleNamespace(use_pytorch_sdpa=False)
        self.sync_max_audio_length = True

    def forward(self, audio_signal, length):
        return self.drop(self.proj(audio_signal.transpose(1, 2))).transpose(1, 2), length


@pytest.fixture
def fake_nemo(monkeypatch):
    loaded = []

    class ASRModel:
        @classmethod
        def from_pretrained(cls, model_name):
            loaded.append(model_name)
            torch.manual_seed(len(loaded))
            return SimpleNamespace(preprocessor=_Preprocessor(), encoder=_Encoder())

    modules = {name: types.ModuleType(name) for name in
               ("nemo", "nemo.collections", "nemo.collections.asr", "nemo.collections.asr.models")}
    modules["nemo.collections.asr.models"].ASRModel = ASRModel
    modules["nemo.collections.asr"].models = modules["nemo.collections.asr.models"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fcm, "_NEMO_SOUND_MODEL_CACHE", {})
    return loaded


def test_nemo_models_are_cached_per_model_id(fake_nemo):
    a = fcm.get_nemo_sound_model("nemo://nvidia/parakeet-a")
    b = fcm.get_nemo_sound_model("nemo://nvidia/parakeet-b")
    assert fcm.get_nemo_sound_model("nemo://nvidia/parakeet-a") == a
    assert a[1] is not b[1] and fake_nemo == ["nvidia/parakeet-a", "nvidia/parakeet-b"]
    for _, encoder in (a, b):
        assert encoder.sync_max_audio_length is False and encoder.layers[0].self_attn.use_pytorch_sdpa is True


def test_nemo_backend_forward_and_settings(fake_nemo):
    config = _config(sound_model_type="nemo://nvidia/parakeet-a", recompute_granularity=None, hidden_dropout=0.0)
    wrapper = ParakeetHuggingFaceModel(config)
    preprocessor, encoder = fcm.get_nemo_sound_model("nemo://nvidia/parakeet-a")
    assert wrapper.use_nemo and wrapper.model is encoder and wrapper.feature_extractor is preprocessor
    assert encoder.drop.p == 0.0  # set from config.hidden_dropout
    audio, lengths = torch.randn(2, 500, generator=torch.Generator().manual_seed(6)), torch.tensor([500, 300])
    hidden, out_lengths = wrapper(audio, lengths)
    features = audio.unflatten(-1, (-1, 100))[..., :MELS]  # [b, t, mels]
    torch.testing.assert_close(hidden, encoder.proj(features), **TOL)  # [b, t, h]
    assert out_lengths.tolist() == [5, 3]
    hidden.sum().backward()
    assert encoder.proj.weight.grad is not None and encoder.proj.weight.average_gradients_across_tp_domain

    recomputed = ParakeetHuggingFaceModel(_config(sound_model_type="nemo://nvidia/parakeet-a",
                                                  recompute_granularity="full"))
    assert type(recomputed.model).__name__ == "CheckpointWrapper"
    torch.testing.assert_close(recomputed(audio, lengths)[0], hidden, **TOL)


def test_missing_nemo_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo", None)
    monkeypatch.setattr(fcm, "_NEMO_SOUND_MODEL_CACHE", {})
    with pytest.raises(ImportError, match="nemo_toolkit"):
        ParakeetHuggingFaceModel(_config(sound_model_type="nemo://nvidia/parakeet-a", recompute_granularity=None))


# MIMO with the SigLIP wrapper as its image encoder.

def test_siglip_wrapper_as_mimo_encoder(hf_dirs):
    from megatron_core.models.mimo import MimoModel, MimoModelConfig, VisionModalitySubmodules
    from megatron_core.models.vision import MultimodalProjector
    from megatron_core.transformer.spec_utils import ModuleSpec
    from tests.models.mimo import mimo_fixture as f
    from tests.models.multimodal import llava_fixture as lf

    encoder = ModuleSpec(module=SiglipHuggingFaceModel,
                         params=dict(config=_config(vision_model_type=f"hf://{hf_dirs['siglip']}")))
    projector = ModuleSpec(module=MultimodalProjector, params=dict(
        config=lf.projection_config(), submodules=lf.projection_spec(), projector_type="mlp", input_size=HIDDEN))
    vision = ModuleSpec(module=VisionModalitySubmodules,
                        submodules={"encoders": {"siglip": encoder}, "input_projections": [projector]})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MimoModel(MimoModelConfig(language_model_spec=f.language_spec(),
                                          modality_submodules_spec={"images": vision},
                                          special_token_ids={"images": f.IMAGE_TOKEN_ID}))
    reference = transformers.SiglipVisionModel.from_pretrained(hf_dirs["siglip"])

    per_image = (IMG // PATCH) ** 2
    gen = torch.Generator().manual_seed(7)
    text = torch.randint(0, f.VOCAB - 1, (2, 6), generator=gen)
    image_run = torch.full((per_image,), f.IMAGE_TOKEN_ID)
    ids = torch.stack([torch.cat([text[0, :2], image_run, text[0, 2:]]), torch.cat([text[1], image_run])])
    images = torch.randn(2, 3, IMG, IMG, generator=gen)
    labels = torch.roll(ids, -1, dims=1).clamp(max=f.VOCAB - 2)
    got, _ = model(ids, labels=labels, modality_inputs={"images": {"siglip": {"pixel_values": images}}})

    lm, projection = model.language_model, model.modality_submodules["images"].input_projections[0]
    features = projection(reference(pixel_values=images).last_hidden_state.reshape(-1, HIDDEN))
    embeddings = lm.embedding(ids, None).clone()
    b_idx, s_idx = (ids == f.IMAGE_TOKEN_ID).nonzero(as_tuple=True)
    embeddings[s_idx, b_idx] = features
    want = lm(None, None, None, decoder_input=embeddings, labels=labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    weights = torch.rand(got.shape, generator=gen)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    _assert_grads_equal(model.modality_submodules["images"].encoders["siglip"], reference)
