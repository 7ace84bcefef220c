"""``.nemo`` archives and checkpoint-local configs, on small archives built here: configs and encoder tensors are
read, loaded weights reproduce the source model's outputs, mismatches are named, and unsafe archives are refused
(members escaping the extraction directory, links, pickles holding code) without writing or running anything."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_core.models.audio import (
    CHECKPOINT_NEMO_AUDIO_PREPROCESSOR_CONFIG_NAME,
    NemoAudioFeatureConfig,
    NemoTransformerAudioConfig,
    NemoTransformerAudioModel,
    extract_nemo_archive,
    has_nemo_audio_configs_in_checkpoint_dir,
    load_nemo_transformer_audio_weights,
    nemo_audio_configs_from_archive,
    nemo_audio_configs_from_checkpoint_dir,
    nemo_audio_configs_from_json_paths,
    nemo_audio_configs_from_path,
    read_nemo_config,
    resolve_nemo_audio_configs_from_args,
    write_nemo_audio_configs_from_args_to_checkpoint_dir,
    write_nemo_audio_configs_to_checkpoint_dir,
)

ENCODER = dict(n_mels=6, d_model=16, n_heads=4, n_layers=1, pre_encode="stacking", subsampling_factor=2)
YAML = """\
model:
  sample_rate: 16000
  preprocessor:
    _target_: nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor
    sample_rate: ${model.sample_rate}
    features: 6
    n_fft: 512
  encoder:
    _target_: nemo.collections.asr.modules.transformer_encoder.TransformerEncoder
    n_mels: 6
    d_model: 16
    n_heads: 4
    n_layers: 1
    pre_encode: stacking
    subsampling_factor: 2
    attn_mode: causal
    feat_in: 6
"""


def _source_model() -> NemoTransformerAudioModel:
    torch.manual_seed(3)
    return NemoTransformerAudioModel(NemoTransformerAudioConfig(**ENCODER, causal_mask=True, drop_rate=0.0,
                                                                attn_impl="sdpa")).eval()


def _add(tar: tarfile.TarFile, name: str, data: bytes, kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _weights(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _archive(path: Path, model: NemoTransformerAudioModel, yaml: str = YAML, config_name: str = "./model_config.yaml",
             weights: bytes | None = None) -> Path:
    state = {k: v for k, v in model.state_dict().items()}
    state.update({"decoder.weight": torch.ones(2), "preprocessor.featurizer.fb": torch.ones(1, 6, 257)})
    with tarfile.open(path, "w:") as tar:
        _add(tar, config_name, yaml.encode())
        _add(tar, "./model_weights.ckpt", _weights(state) if weights is None else weights)
    return path


def test_archive_configs_and_weights_round_trip(tmp_path: Path):
    source = _source_model()
    nemo = _archive(tmp_path / "asr.nemo", source)
    encoder_cfg, preproc_cfg, encoder_state = nemo_audio_configs_from_archive(nemo)
    assert encoder_cfg.causal_mask and encoder_cfg.d_model == 16 and encoder_cfg.pre_encode == "stacking"
    assert preproc_cfg.sample_rate == 16000 and preproc_cfg.features == 6  # the ${model.sample_rate} resolved
    assert set(encoder_state) == {k[len("encoder."):] for k in source.state_dict()}
    assert nemo_audio_configs_from_path(nemo) == (encoder_cfg, preproc_cfg)
    assert read_nemo_config(nemo)["encoder"]["feat_in"] == 6
    encoder_cfg.attn_impl, encoder_cfg.drop_rate = "sdpa", 0.0
    target = NemoTransformerAudioModel(encoder_cfg).eval()
    missing, unexpected = load_nemo_transformer_audio_weights(target, nemo, strict=True)
    assert missing == [] and unexpected == []
    features = torch.randn(2, 9, 6)
    with torch.no_grad():
        torch.testing.assert_close(target(features)[0], source(features)[0], rtol=0, atol=0)
    kept = tmp_path / "kept"
    cfg, state = extract_nemo_archive(nemo, out_dir=kept)
    assert (kept / "model_config.yaml").is_file() and (kept / "model_weights.ckpt").is_file()
    assert "decoder.weight" in state and cfg["encoder"]["n_heads"] == 4


def test_load_reports_mismatches(tmp_path: Path):
    nemo = _archive(tmp_path / "asr.nemo", _source_model())
    wrong = NemoTransformerAudioModel(NemoTransformerAudioConfig(**{**ENCODER, "d_model": 8, "n_heads": 2},
                                                                 attn_impl="sdpa"))
    with pytest.raises(ValueError, match="d_model: model=8 ckpt=16"):
        load_nemo_transformer_audio_weights(wrong, nemo)
    with pytest.raises(TypeError, match="NemoTransformerAudioModel"):
        load_nemo_transformer_audio_weights(torch.nn.Linear(2, 2), nemo)
    with_norms = NemoTransformerAudioModel(NemoTransformerAudioConfig(**ENCODER, attn_impl="sdpa"))
    with_norms.encoder.extra = torch.nn.Linear(1, 1)
    missing, _ = load_nemo_transformer_audio_weights(with_norms, nemo)
    assert missing == ["extra.weight", "extra.bias"]
    with pytest.raises(RuntimeError, match="strict load failed"):
        load_nemo_transformer_audio_weights(with_norms, nemo, strict=True)


def test_bad_archives_are_named(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        read_nemo_config(tmp_path / "absent.nemo")
    (tmp_path / "plain.ckpt").write_bytes(b"not a tar")
    with pytest.raises(ValueError, match="tar"):
        read_nemo_config(tmp_path / "plain.ckpt")
    with tarfile.open(tmp_path / "empty.nemo", "w:") as tar:
        _add(tar, "README", b"hi")
    with pytest.raises(ValueError, match="has no model_config.yaml"):
        read_nemo_config(tmp_path / "empty.nemo")
    other = YAML.replace("transformer_encoder.TransformerEncoder", "ConformerEncoder")
    with pytest.raises(ValueError, match="encoder._target_"):
        nemo_audio_configs_from_path(_archive(tmp_path / "conformer.nemo", _source_model(), yaml=other))
    no_encoder_tensors = _weights({"decoder.weight": torch.ones(1)})
    with pytest.raises(ValueError, match="no 'encoder.' tensors"):
        nemo_audio_configs_from_archive(_archive(tmp_path / "dec.nemo", _source_model(), weights=no_encoder_tensors))


@pytest.mark.parametrize("name", ["../model_config.yaml", "/tmp/model_config.yaml", "a/../../model_config.yaml"])
def test_member_escaping_the_directory_is_refused(tmp_path: Path, name: str):
    nemo = _archive(tmp_path / "evil.nemo", _source_model(), config_name=name)
    out = tmp_path / "deep" / "out"
    with pytest.raises(ValueError, match="leaves the extraction directory"):
        extract_nemo_archive(nemo, out_dir=out)
    assert not (tmp_path / "deep" / "model_config.yaml").exists()
    assert not (tmp_path / "model_config.yaml").exists()


def test_link_member_is_refused(tmp_path: Path):
    secret = tmp_path / "secret.yaml"
    secret.write_text(YAML)
    with tarfile.open(tmp_path / "link.nemo", "w:") as tar:
        _add(tar, "./model_config.yaml", b"", kind=tarfile.SYMTYPE, link=str(secret))
    with pytest.raises(ValueError, match="not a regular file"):
        read_nemo_config(tmp_path / "link.nemo")


class _Payload:
    """Unpickling this would create the file named in ``marker``."""

    marker = ""

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_weights_holding_code_are_not_unpickled(tmp_path: Path):
    marker = tmp_path / "pwned"
    payload = _Payload()
    payload.marker = str(marker)
    nemo = _archive(tmp_path / "code.nemo", _source_model(), weights=_weights({"encoder.x": payload}))
    with pytest.raises(ValueError, match="weights_only"):
        extract_nemo_archive(nemo)
    assert not marker.exists()


def test_yaml_without_omegaconf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "omegaconf", None)
    plain = _archive(tmp_path / "plain.nemo", _source_model(), yaml=YAML.replace("${model.sample_rate}", "8000"))
    assert nemo_audio_configs_from_path(plain)[1].sample_rate == 8000
    with pytest.raises(ImportError, match="omegaconf"):
        read_nemo_config(_archive(tmp_path / "interp.nemo", _source_model()))


def test_checkpoint_dir_json_round_trip(tmp_path: Path):
    encoder_cfg = NemoTransformerAudioConfig(**ENCODER, left_context=3, causal_mask=True)
    preproc_cfg = NemoAudioFeatureConfig(features=6, normalize=None)
    assert not has_nemo_audio_configs_in_checkpoint_dir(tmp_path / "iter")
    with pytest.raises(FileNotFoundError, match=CHECKPOINT_NEMO_AUDIO_PREPROCESSOR_CONFIG_NAME):
        nemo_audio_configs_from_checkpoint_dir(tmp_path / "iter")
    encoder_path, preproc_path = write_nemo_audio_configs_to_checkpoint_dir(tmp_path / "iter", encoder_cfg,
                                                                             preproc_cfg)
    assert has_nemo_audio_configs_in_checkpoint_dir(tmp_path / "iter")
    assert json.loads(encoder_path.read_text())["left_context"] == 3
    assert nemo_audio_configs_from_checkpoint_dir(tmp_path / "iter") == (encoder_cfg, preproc_cfg)
    assert nemo_audio_configs_from_json_paths(encoder_path) == (encoder_cfg, NemoAudioFeatureConfig())


def test_resolve_configs_from_args(tmp_path: Path):
    nemo = _archive(tmp_path / "asr.nemo", _source_model())
    args = SimpleNamespace(load_audio_from=str(nemo), nemo_transformer_audio_attn_impl="sdpa",
                           nemo_transformer_audio_left_context=-1, recompute_audio=True,
                           audio_model_type="nemo_transformer")
    encoder_cfg, preproc_cfg = resolve_nemo_audio_configs_from_args(args)
    assert (encoder_cfg.attn_impl, encoder_cfg.left_context, encoder_cfg.recompute_layers) == ("sdpa", None, True)
    assert encoder_cfg.d_model == 16 and preproc_cfg.features == 6
    written = write_nemo_audio_configs_from_args_to_checkpoint_dir(args, tmp_path / "ckpt")
    assert written is not None and nemo_audio_configs_from_checkpoint_dir(tmp_path / "ckpt")[0] == encoder_cfg
    defaults = resolve_nemo_audio_configs_from_args(SimpleNamespace(nemo_transformer_audio_left_context=4))
    assert defaults == (NemoTransformerAudioConfig(left_context=4), NemoAudioFeatureConfig())
    json_args = SimpleNamespace(nemo_transformer_audio_config=str(written[0]))
    assert resolve_nemo_audio_configs_from_args(json_args)[0].d_model == 16
    assert write_nemo_audio_configs_from_args_to_checkpoint_dir(SimpleNamespace(), tmp_path / "none") is None
