"""``LLaVAModel``, fp32 on CPU, against Hugging Face's LLaVA and Megatron-Core's own model.

- Hugging Face ``LlavaForConditionalGeneration`` (CLIP tower, GELU MLP projector, Llama; random weights
  mapped in) gives the same logits for a batch whose samples hold 2 and 1 images at different positions
  (HF sees each image token repeated ``IMG_SEQ`` times, as its processor expands it).
- The installed Megatron-Core's ``LLaVAModel`` (local specs) has the same state-dict keys and, on the
  same weights, the same loss, loss mask and gradients.
- Inference: a prefill with images and then one-token decode steps through a KV cache give the logits of
  the full forward.
- ``freeze``, ``shared_embedding_or_output_weight``, the projection's optional checkpoint entries, and
  bad arguments / input (``ValueError`` naming the values).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch

from megatron_core.inference.contexts.static_context import StaticInferenceContext
from megatron_core.models.multimodal.llava_model import IGNORE_INDEX
from tests.dist_harness import run_on_ranks
from tests.megatron_oracle import megatron_on_cpu
from tests.models.multimodal.llava_fixture import (
    IMAGE_TOKEN_ID,
    IMG_SEQ,
    MAX_SEQ,
    VOCAB,
    build,
    from_hf,
    hf_llava,
    images,
    randomize,
)

TEXT_LEN = 10


def _batch(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``labels``, ``loss_mask`` ``[2, TEXT_LEN]``: images at positions 1 and 6, and at 4."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, IMAGE_TOKEN_ID, (2, TEXT_LEN), generator=gen)
    ids[0, 1] = ids[0, 6] = ids[1, 4] = IMAGE_TOKEN_ID
    labels = torch.randint(0, IMAGE_TOKEN_ID, (2, TEXT_LEN), generator=gen)
    loss_mask = (torch.rand(2, TEXT_LEN, generator=gen) > 0.2).float()
    return ids, labels, loss_mask


def _expand_for_hf(ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Each image token repeated ``IMG_SEQ`` times, rows padded at the end to one length; the real lengths."""
    rows = [torch.cat([row[i:i + 1].repeat(IMG_SEQ if row[i] == IMAGE_TOKEN_ID else 1) for i in range(len(row))])
            for row in ids]
    length = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r.new_zeros(length - len(r))]) for r in rows]), [len(r) for r in rows]


def test_matches_hugging_face_llava():
    pytest.importorskip("transformers")
    hf = hf_llava()
    ours = build().eval()
    missing, unexpected = ours.load_state_dict(from_hf(hf.state_dict()), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    ids, _, _ = _batch()
    pixels = images(3, seed=1)
    hf_ids, lengths = _expand_for_hf(ids)
    assert lengths == [TEXT_LEN - 2 + 2 * IMG_SEQ, TEXT_LEN - 1 + IMG_SEQ]
    with torch.no_grad():
        want = hf(input_ids=hf_ids, pixel_values=pixels, attention_mask=torch.ones_like(hf_ids)).logits
        got, mask = ours(pixels, ids, None, None)
    assert mask is None and got.shape == (2, lengths[0], VOCAB)
    for row, length in enumerate(lengths):  # the shorter sample is padded at the end (causal: no effect before)
        torch.testing.assert_close(got[row, :length], want[row, :length], rtol=1e-4, atol=1e-4)


def test_inference_prefill_then_decode_matches_full_forward():
    torch.manual_seed(0)
    model = build().eval()
    randomize(model, seed=3)
    ids = torch.tensor([[5, IMAGE_TOKEN_ID, 7, 9, 11, 13]])
    pixels = images(1, seed=2)
    with torch.no_grad():
        full, _ = model(pixels, ids, None, None)
        context = StaticInferenceContext(max_batch_size=1, max_sequence_length=MAX_SEQ)
        prefix = 3
        first, _ = model(pixels, ids[:, :prefix], None, None, inference_context=context)
        assert context.key_value_memory_dict["image_tokens_count"] == IMG_SEQ
        context.sequence_len_offset += first.shape[1]
        steps = [first]
        for i in range(prefix, ids.shape[1]):
            step, _ = model(pixels, ids[:, i:i + 1], None, None, inference_context=context)
            context.sequence_len_offset += 1
            steps.append(step)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_freeze_and_shared_weight():
    model = build(share_embeddings_and_output_weights=True)
    model.freeze(freeze_language_model=False, freeze_vision_model=True, freeze_vision_projection=False)
    trainable = {name.split(".")[0] for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"language_model", "vision_projection"}
    assert model.shared_embedding_or_output_weight() is model.language_model.embedding.word_embeddings.weight
    assert "language_model.output_layer.weight" not in model.state_dict()


def test_missing_projection_checkpoint_allowed_only_when_asked():
    source = build().state_dict()
    partial = {k: v for k, v in source.items() if not k.startswith("vision_projection.")}
    result = build(allow_missing_vision_projection_checkpoint=True).load_state_dict(partial, strict=False)
    assert not [k for k in result.missing_keys if not k.endswith("_extra_state")]
    with pytest.raises(RuntimeError, match="vision_projection.encoder.linear_fc1.weight"):
        build().load_state_dict(partial)


def test_text_only_batch_and_no_images():
    model = build().eval()
    ids, labels, loss_mask = _batch()
    ids[ids == IMAGE_TOKEN_ID] = 3
    with torch.no_grad():
        loss, mask = model(images(0), ids, None, None, labels=labels, loss_mask=loss_mask)
        plain = model.language_model(ids, None, None, labels=labels)
        loss_none, _ = model(None, ids, None, None, labels=labels, loss_mask=loss_mask)
    torch.testing.assert_close(loss, plain)
    torch.testing.assert_close(loss_none, plain)
    # No image: only the text loss mask, unchanged.
    torch.testing.assert_close(mask, loss_mask)


@pytest.mark.parametrize(("call", "message"), [
    (lambda m, ids: m(images(2), ids, None, None),
     r"input_ids hold 3 image tokens \(image_token_index=127; per sample \[2, 1\]\) but there are 2 images"),
    (lambda m, ids: m(images(3), ids, None, None, num_image_tiles=[1, 1]),
     r"images hold 3 tiles but num_image_tiles \(\[1, 1\]\) sums to 2"),
    (lambda m, ids: m(images(4), ids, None, None, num_image_tiles=[2, 1, 1]),
     None),
    (lambda m, ids: m(torch.randn(3, 3, 32, 24), ids, None, None),
     r"expects images \[b, 3, 32, 32\], got shape \(3, 3, 32, 24\)"),
    (lambda m, ids: m(images(3), ids, None, None, labels=ids),
     r"labels were given without a loss_mask"),
    (lambda m, ids: m(images(3), ids, None, None, labels=ids[:, :-1], loss_mask=torch.ones(2, TEXT_LEN - 1)),
     r"labels \(2, 9\) and loss_mask \(2, 9\) must both have the shape of input_ids \(2, 10\)"),
    (lambda m, ids: m(images(3), ids, None, None, num_image_tiles=[1, 0, 2]),
     r"num_image_tiles \(\[1, 0, 2\]\) must be >= 1"),
    (lambda m, ids: m(images(3), ids, None, None, imgs_sizes=torch.tensor([[32, 32]])),
     r"\['imgs_sizes'\] are not supported"),
])
def test_bad_input_names_the_values(call, message):
    model = build().eval()
    ids, _, _ = _batch()
    if message is None:  # a valid multi-tile call, as a control
        with torch.no_grad():
            out, _ = call(model, ids)
        assert out.shape == (2, TEXT_LEN - 2 + 3 * IMG_SEQ, VOCAB)  # sample 0: 2 + 1 tiles
        return
    with pytest.raises(ValueError, match=message):
        with torch.no_grad():
            call(model, ids)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(vision_model_type="radio-h"), r"vision_model_type \('radio-h'\) is not supported"),
    (dict(vision_model_type=None), r"vision_transformer_config.vision_model_type must be set"),
    (dict(vision_model_type="siglip"), r"'siglip' has no class token: drop_vision_class_token must be False"),
    (dict(sound_model=torch.nn.Linear(1, 1)), r"\['sound_model'\] are not supported"),
    (dict(dynamic_resolution=True, temporal_patch_dim=2), r"\['dynamic_resolution', 'temporal_patch_dim > 1'\]"),
    (dict(language_model_type="nemotron5-hybrid-8b"), r"language_model_type \('nemotron5-hybrid-8b'\) needs the "
                                                      r"hybrid Mamba language model"),
    (dict(tile_tags=[[1, 2, 3, 4, 5]]), r"use_tile_tags needs tokenizer_type"),
])
def test_bad_arguments_name_the_values(kwargs, message, monkeypatch):
    import tests.models.multimodal.llava_fixture as fixture

    vision_type = kwargs.pop("vision_model_type", "clip")
    language_type = kwargs.pop("language_model_type", None)
    make_vision, make_language = fixture.vision_config, fixture.language_config

    def vision(**overrides):
        config = make_vision(**overrides)
        if vision_type is None:
            del config.vision_model_type
        else:
            config.vision_model_type = vision_type
        return config

    def language(**overrides):
        config = make_language(**overrides)
        if language_type is not None:
            config.language_model_type = language_type
        return config

    monkeypatch.setattr(fixture, "vision_config", vision)
    monkeypatch.setattr(fixture, "language_config", language)
    with pytest.raises(ValueError, match=message):
        fixture.build(**kwargs)


# --- Megatron-Core as an oracle ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _cuda_calls_stay_on_cpu():
    """Megatron-Core's vision model moves its position ids with ``.cuda()`` and its softmax builds the default
    causal mask on ``"cuda"``; on a CPU machine keep both on the CPU."""
    from megatron.core.fusions import fused_softmax

    saved = torch.Tensor.cuda, fused_softmax.get_default_causal_mask
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq).triu(diagonal=1).bool()
    try:
        yield
    finally:
        torch.Tensor.cuda, fused_softmax.get_default_causal_mask = saved


def _their_llava():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as their_gpt_spec
    from megatron.core.models.multimodal import llava_model as their_llava
    from megatron.core.models.multimodal.llava_model import LLaVAModel as TheirModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec as their_vit_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear as TheirColumn
    from megatron.core.tensor_parallel import RowParallelLinear as TheirRow
    from megatron.core.transformer.enums import AttnMaskType as TheirMaskType
    from megatron.core.transformer.mlp import MLPSubmodules as TheirMLPSubmodules
    from megatron.core.transformer.torch_norm import WrappedTorchNorm as TheirNorm
    from megatron.core.transformer.transformer_config import TransformerConfig as TheirConfig

    from tests.models.multimodal import llava_fixture as fx

    def config(ours, **extra):
        fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
                  "add_qkv_bias", "hidden_dropout", "attention_dropout", "bias_activation_fusion",
                  "use_cpu_initialization")
        return TheirConfig(**{f: getattr(ours, f) for f in fields}, **extra)

    vision = config(fx.vision_config())
    vision.vision_model_type = "clip"
    vit_spec = their_vit_spec()
    # 0.16's local ViT spec still says causal; 0.19 (the API mirrored here) has no mask.
    vit_spec.submodules.self_attention.params["attn_mask_type"] = TheirMaskType.no_mask
    # Without Transformer Engine their CLIP's default pre-norm cannot be built: use their torch norm.
    saved = their_llava.CLIPViTModel
    their_llava.CLIPViTModel = functools.partial(saved, ln_pre_impl=TheirNorm)
    try:
        return _build_their_llava(TheirModel, config, vision, vit_spec, TheirMLPSubmodules, TheirColumn, TheirRow,
                                  their_gpt_spec)
    finally:
        their_llava.CLIPViTModel = saved


def _build_their_llava(TheirModel, config, vision, vit_spec, TheirMLPSubmodules, TheirColumn, TheirRow,  # noqa: N803
                       their_gpt_spec):
    from tests.models.multimodal import llava_fixture as fx

    return TheirModel(
        config(fx.language_config()), their_gpt_spec(), fx.VOCAB, fx.MAX_SEQ, vision, vit_spec,
        drop_vision_class_token=True, vision_projection_config=config(fx.projection_config()),
        vision_projection_layer_spec=TheirMLPSubmodules(linear_fc1=TheirColumn, linear_fc2=TheirRow),
        language_position_embedding_type="rope", img_h=fx.IMG, img_w=fx.IMG, patch_dim=fx.PATCH,
        image_token_index=fx.IMAGE_TOKEN_ID,
    )


def _compare_with_megatron() -> list[str]:
    with megatron_on_cpu(), _cuda_calls_stay_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(4)
        theirs = _their_llava()
        randomize(theirs, seed=5)
        ours = build()
        assert set(ours.state_dict()) == set(theirs.state_dict())
        ours.load_state_dict(theirs.state_dict())
        ids, labels, loss_mask = _batch()
        pixels = images(3, seed=6)
        want, want_mask = theirs(pixels, ids, None, None, labels=labels, loss_mask=loss_mask)
        got, got_mask = ours(pixels, ids, None, None, labels=labels, loss_mask=loss_mask)
        torch.testing.assert_close(got_mask, want_mask, rtol=0, atol=0)
        # At IGNORE_INDEX labels (all masked out) this library's cross entropy is 0 where Megatron-Core's is the
        # log-sum-exp of the logits; everywhere else the per-token losses agree.
        ignored = got == 0
        assert not (ignored & want_mask.bool()).any()
        torch.testing.assert_close(got[~ignored], want[~ignored], rtol=1e-5, atol=1e-5)
        (want * want_mask).sum().backward()
        (got * got_mask).sum().backward()
        their_params = dict(theirs.named_parameters())
        for name, param in ours.named_parameters():
            ref = their_params[name].grad
            torch.testing.assert_close(param.grad, ref, rtol=1e-4, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                       msg=lambda m, n=name: f"{n}: {m}")
        # Without labels: the logits.
        with torch.no_grad():
            torch.testing.assert_close(ours(pixels, ids, None, None)[0], theirs(pixels, ids, None, None)[0],
                                       rtol=1e-5, atol=1e-5)
        return sorted(ours.state_dict())


def test_matches_megatron_core_llava_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core.models.multimodal.llava_model")
    (keys,) = run_on_ranks(1, _compare_with_megatron)
    prefixes = {k.split(".")[0] for k in keys}
    assert prefixes == {"language_model", "vision_model", "vision_projection"}
    assert "vision_projection.encoder.linear_fc1.weight" in keys and "vision_model.class_token" in keys
    assert IGNORE_INDEX == -100


def test_packed_documents_match_separate_samples():
    """Two documents, each with an image, packed into one row (``qkv_format="thd"`` over the combined
    sequence) give the logits of each document run alone."""
    from megatron_core.packed_seq_params import PackedSeqParams

    torch.manual_seed(0)
    model = build().eval()
    randomize(model, seed=8)
    first = torch.tensor([[3, IMAGE_TOKEN_ID, 4, 5]])
    second = torch.tensor([[IMAGE_TOKEN_ID, 6, 7, 8, 9]])
    pixels = images(2, seed=9)
    lengths = [first.shape[1] - 1 + IMG_SEQ, second.shape[1] - 1 + IMG_SEQ]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    with torch.no_grad():
        packed, _ = model(pixels, torch.cat([first, second], dim=1), None, None, packed_seq_params=params)
        alone = [model(pixels[i:i + 1], ids, None, None)[0] for i, ids in enumerate((first, second))]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)


def test_tile_tags_prefix_every_tile():
    """NVLM tile tags: tiles 1..n-1 get tags 0..n-2, the last tile (thumbnail) the last tag, each tag's token
    embeddings placed before the tile's image embeddings."""
    tags = [[10 + 5 * i + j for j in range(5)] for i in range(4)]  # 5 tokens per tag (llama3p1)
    torch.manual_seed(0)
    model = build(tile_tags=tags, tokenizer_type="llama3p1", max_num_tiles=4).eval()
    assert model.img_seq_len == IMG_SEQ + 5
    ids = torch.tensor([[3, IMAGE_TOKEN_ID, 4]])
    pixels = images(3, seed=4)
    with torch.no_grad():
        encoded = model._encode_images(pixels, ids, torch.tensor([3]), IMAGE_TOKEN_ID, None)
        word = model.language_model.embedding.word_embeddings.weight
        for tile, tag in enumerate([tags[0], tags[1], tags[3]]):
            torch.testing.assert_close(encoded[:5, tile], word[tag], rtol=0, atol=0)
        out, _ = model(pixels, ids, None, None, num_image_tiles=[3])
    assert out.shape == (1, 2 + 3 * (IMG_SEQ + 5), VOCAB)
    with pytest.raises(ValueError, match=r"tile tags support one image per batch, got 2 images"):
        model(images(2), torch.tensor([[IMAGE_TOKEN_ID, IMAGE_TOKEN_ID]]), None, None)
