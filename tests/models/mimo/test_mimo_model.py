"""``MimoModel`` (colocated), fp32 on CPU: a CLIP vision modality and a GPT language model.

- Same logits, per-token loss and gradients as a hand-written composition of the same modules (image
  features scattered onto the image-token positions of the language model's input embeddings).
- Same logits as our ``LLaVAModel`` on the same weights (LLaVA expands one image token per image).
- Several images per sample and text-only samples; state-dict keys; bad input (``ValueError`` naming values).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_core.models.mimo import AudioModalitySubmodules, MimoModel, MimoModelConfig
from megatron_core.transformer.spec_utils import ModuleSpec
from tests.models.mimo import mimo_fixture as f
from tests.models.multimodal import llava_fixture as lf

TOL = dict(rtol=1e-5, atol=1e-5)


def _model(seed: int = 3) -> MimoModel:
    torch.manual_seed(0)
    model = f.build()
    lf.randomize(model, seed)
    return model


def _inputs(images: torch.Tensor) -> dict:
    return {"images": {"clip_encoder": {"x": images}}}


def _by_hand(model: MimoModel, ids: torch.Tensor, images: torch.Tensor, labels: torch.Tensor | None):
    """CLIP -> projector -> overwrite the image-token rows of the LM's input embeddings -> LM."""
    vision = model.modality_submodules["images"]
    lm = model.language_model
    embeddings = lm.embedding(ids, None).clone()  # [s, b, h]
    if images.shape[0]:
        feats = vision.encoders["clip_encoder"](images)  # [n, 17, vh]
        feats = vision.input_projections[0](feats.reshape(-1, feats.shape[-1]))
        b_idx, s_idx = (ids == f.IMAGE_TOKEN_ID).nonzero(as_tuple=True)  # row-major: sample, then position
        embeddings[s_idx, b_idx] = feats
    return lm(None, None, None, decoder_input=embeddings, labels=labels)


@pytest.mark.parametrize("per_sample", [[2, 0, 1], [0, 0], [1]])
def test_matches_hand_written_composition(per_sample):
    model = _model()
    ids, images = f.batch(per_sample)
    labels = torch.roll(ids, -1, dims=1).clamp(max=f.VOCAB - 2)
    loss_mask = torch.ones_like(ids, dtype=torch.float)
    got, mask = model(ids, labels=labels, loss_mask=loss_mask, modality_inputs=_inputs(images))
    assert mask is loss_mask
    want = _by_hand(model, ids, images, labels)
    torch.testing.assert_close(got, want, **TOL)
    weights = torch.rand(got.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((got * weights).sum(), list(model.parameters()), allow_unused=True)
    want_grads = torch.autograd.grad((want * weights).sum(), list(model.parameters()), allow_unused=True)
    for (name, _), g, w in zip(model.named_parameters(), grads, want_grads):
        if w is None:
            assert g is None or not g.any(), name
        else:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    logits, _ = model(ids, modality_inputs=_inputs(images))
    torch.testing.assert_close(logits, _by_hand(model, ids, images, None), **TOL)
    assert logits.shape == (*ids.shape, f.VOCAB)


def _collapse(ids: torch.Tensor) -> torch.Tensor:
    """LLaVA's input: each run of ``TOKENS_PER_IMAGE`` image tokens becomes one image token."""
    rows = []
    for row in ids.tolist():
        out, i = [], 0
        while i < len(row):
            out.append(row[i])
            i += f.TOKENS_PER_IMAGE if row[i] == f.IMAGE_TOKEN_ID else 1
        rows.append(out)
    assert len({len(r) for r in rows}) == 1
    return torch.tensor(rows)


def test_matches_llava_model_on_same_weights():
    model = _model().eval()
    llava = lf.build(drop_vision_class_token=False).eval()
    renames = {"modality_submodules.images.encoders.clip_encoder.": "vision_model.",
               "modality_submodules.images.input_projections.0.": "vision_projection.",
               "language_model.": "language_model."}
    state = {}
    for key, value in model.state_dict().items():
        prefix = next(p for p in renames if key.startswith(p))
        state[renames[prefix] + key[len(prefix):]] = value
    assert set(state) == set(llava.state_dict())
    llava.load_state_dict(state)
    ids, images = f.batch([1, 1], seed=5)  # same number of image tokens per sample: equal collapsed lengths
    with torch.no_grad():
        got, _ = model(ids, modality_inputs=_inputs(images))
        want, _ = llava(images, _collapse(ids), None, None)
    torch.testing.assert_close(got, want[:, :ids.shape[1]], **TOL)


def test_text_only_batch_without_modality_inputs_is_the_language_model():
    model = _model().eval()
    ids, _ = f.batch([0, 0])
    with torch.no_grad():
        got, _ = model(ids)
        want = model.language_model(ids, None, None)
    torch.testing.assert_close(got, want, **TOL)


def test_state_dict_keys_and_structure():
    model = _model()
    keys = set(model.state_dict())
    assert {k.split(".")[0] for k in keys} == {"modality_submodules", "language_model"}
    assert "modality_submodules.images.encoders.clip_encoder.conv1.weight" in keys
    assert "modality_submodules.images.input_projections.0.encoder.linear_fc1.weight" in keys
    assert "language_model.embedding.word_embeddings.weight" in keys
    sharded = model.sharded_state_dict()
    assert {k for k in sharded if not k.endswith("_extra_state")} >= {
        k for k in keys if not k.endswith("_extra_state") and ".layers." not in k}
    assert model.role.has_language_module and model.role.modality_module_names == ["images"]


def test_align_embeddings_places_rows_in_order():
    model = _model()
    ids = torch.tensor([[5, 9, 9, 6], [9, 7, 8, 9]])
    text = torch.arange(4 * 3, dtype=torch.float).reshape(4, 3)
    image = -torch.arange(4 * 3, dtype=torch.float).reshape(4, 3) - 1
    out = model.align_embeddings_by_token_positions({"text": text, "images": image}, ids, {"images": 9})
    assert out.shape == (4, 2, 3)
    want = torch.stack([torch.stack([text[0], image[0], image[1], text[1]]),
                        torch.stack([image[2], text[2], text[3], image[3]])]).transpose(0, 1)
    torch.testing.assert_close(out, want)


def test_bad_input_names_the_values():
    model = _model()
    ids, images = f.batch([2])
    with pytest.raises(ValueError, match=r"number of 'images' tokens in input_ids \(34\) does not match the number "
                                         r"of 'images' embeddings \(17\)"):
        model(ids, modality_inputs=_inputs(images[:1]))
    with pytest.raises(ValueError, match=r"modality_inputs has unknown modalities \['audio'\]; the model's "
                                         r"modalities are \['images'\]"):
        model(ids, modality_inputs={**_inputs(images), "audio": {}})
    with pytest.raises(ValueError, match=r"input_ids hold 34 'images' tokens \(id 127\) but no 'images' embeddings"):
        model(ids)
    with pytest.raises(ValueError, match=r"inputs given for unknown encoders \['vit'\]"):
        model(ids, modality_inputs={"images": {"clip_encoder": {"x": images}, "vit": {}}})
    with pytest.raises(ValueError, match=r"no special token id for modality 'audio'"):
        model.align_embeddings_by_token_positions({"audio": torch.zeros(1, 4)}, ids, {"images": 127})
    with pytest.raises(ValueError, match=r"kv_format must be one of \('sbhd', 'thd'\), got 'bshd'"):
        MimoModelConfig(kv_format="bshd")


def test_submodule_validation():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proj = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        with pytest.raises(ValueError, match=r"at most one input projection, got 2"):
            AudioModalitySubmodules(input_projections=proj)
        audio = AudioModalitySubmodules(encoders={"enc": torch.nn.Identity()}, is_last_stage=False)
        x = torch.randn(2, 3, 4)
        torch.testing.assert_close(audio(encoder_inputs={"enc": {"input": x}}), x.reshape(6, 4))
        with pytest.raises(ValueError, match="not both"):
            audio(encoder_inputs={}, hidden_states=x)
        with pytest.raises(NotImplementedError):
            audio.decode(x, {})
        spec = ModuleSpec(module=AudioModalitySubmodules, submodules={
            "encoders": {"enc": ModuleSpec(module=torch.nn.Identity)},
            "input_projections": [ModuleSpec(module=torch.nn.Linear, params={"in_features": 4, "out_features": 2})]})
        assert len(AudioModalitySubmodules.from_spec(spec, is_last_stage=False).input_projections) == 0
        assert len(AudioModalitySubmodules.from_spec(spec).input_projections) == 1
