"""``LLaVAModel`` with a Hugging Face vision tower (``vision_model_type="hf://<directory>"``), fp32 on CPU.

A tiny random ``SiglipVisionModel`` is saved to a temporary directory (no downloads). LLaVA built on it equals a
hand-written composition on the same weights -- that Hugging Face tower loaded on its own, our
``MultimodalProjector``, our ``GPTModel`` fed the spliced sequence -- in logits, per-token loss, loss mask and every
gradient, with and without pixel shuffle; at TP=2 it equals one process. Also: state-dict keys (the tower's under
``vision_model.model.``), ``get_num_image_embeddings`` for ``hf://`` types, and the refusals (non-SigLIP towers
``NotImplementedError`` as in Megatron-Core 0.19; class-token dropping and size mismatches ``ValueError``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_core import parallel_state, tensor_parallel  # noqa: E402
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec  # noqa: E402
from megatron_core.models.multimodal.llava_model import IGNORE_INDEX, LLaVAModel, pixel_shuffle  # noqa: E402
from megatron_core.models.vision import MultimodalProjector, get_num_image_embeddings  # noqa: E402
from megatron_core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec  # noqa: E402
from tests.dist_harness import run_on_ranks  # noqa: E402
from tests.models.gpt_test_utils import shard  # noqa: E402
from tests.models.multimodal import llava_fixture as lf  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
PATCHES = (lf.IMG // lf.PATCH) ** 2  # 16 per tile, no class token
TEXT_LEN = 9


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny random SigLIP vision tower (``siglip``, LLaVA fixture's vision sizes) and a Qwen2 LM (``qwen``)."""
    root = tmp_path_factory.mktemp("hf_vision")
    torch.manual_seed(0)
    dirs = {"siglip": root / "siglip", "qwen": root / "qwen"}
    transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=lf.V_HIDDEN, intermediate_size=lf.V_FFN, num_hidden_layers=lf.V_LAYERS,
        num_attention_heads=lf.V_HEADS, image_size=lf.IMG, patch_size=lf.PATCH)).save_pretrained(dirs["siglip"])
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(dirs["qwen"])
    return dirs


def _build(path: Path | str, tp: int = 1, vision: dict | None = None, **kwargs) -> LLaVAModel:
    """LLaVA (RoPE Llama-like language model, MLP projector) on the Hugging Face tower at ``path``."""
    vision_config = lf.vision_config(tensor_model_parallel_size=tp, **(vision or {}))
    vision_config.vision_model_type = f"hf://{path}"
    args = dict(language_position_embedding_type="rope", img_h=lf.IMG, img_w=lf.IMG, patch_dim=lf.PATCH,
                image_token_index=lf.IMAGE_TOKEN_ID, drop_vision_class_token=False)
    args.update(kwargs)
    return LLaVAModel(
        lf.language_config(tensor_model_parallel_size=tp), get_gpt_layer_local_spec(), lf.VOCAB, lf.MAX_SEQ,
        vision_config, get_vit_layer_with_local_spec(),
        vision_projection_config=lf.projection_config(tensor_model_parallel_size=tp),
        vision_projection_layer_spec=lf.projection_spec(), **args,
    )


def _batch(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``labels``, ``loss_mask`` ``[2, TEXT_LEN]``; each sample opens with its image token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, lf.IMAGE_TOKEN_ID, (2, TEXT_LEN), generator=gen)
    ids[:, 0] = lf.IMAGE_TOKEN_ID
    labels = torch.randint(0, lf.IMAGE_TOKEN_ID, (2, TEXT_LEN), generator=gen)
    loss_mask = (torch.rand(2, TEXT_LEN, generator=gen) > 0.2).float()
    return ids, labels, loss_mask


class _Composition(torch.nn.Module):
    """The same model written out: HF SigLIP tower -> (pixel shuffle) -> our projector -> our GPT."""

    def __init__(self, siglip_dir: Path, llava: LLaVAModel, shuffle: bool) -> None:
        super().__init__()
        self.tower = transformers.SiglipVisionModel.from_pretrained(siglip_dir)
        self.projection = MultimodalProjector(lf.projection_config(), lf.projection_spec(), "mlp",
                                              lf.V_HIDDEN * (4 if shuffle else 1))
        self.gpt = GPTModel(lf.language_config(), get_gpt_layer_local_spec(), lf.VOCAB, lf.MAX_SEQ,
                            position_embedding_type="rope")
        self.shuffle = shuffle
        for part, source in ((self.tower, llava.vision_model.model), (self.projection, llava.vision_projection),
                             (self.gpt, llava.language_model)):
            part.load_state_dict(source.state_dict())

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        tiles = self.tower(pixel_values=pixels).last_hidden_state  # [b, patches, h_vision]: one tile per sample
        if self.shuffle:
            tiles = pixel_shuffle(tiles)
        image_sbh = self.projection(tiles.transpose(0, 1))  # [s_img, b, h]
        text_sbh = self.gpt.embedding(input_ids=ids[:, 1:], position_ids=None)  # the text after the image token
        combined = torch.cat([image_sbh, text_sbh])
        new_labels = new_mask = None
        if labels is not None:
            # The image's last position predicts the first text token; image positions carry no loss.
            s_img = image_sbh.shape[0]
            new_labels = torch.cat([labels.new_full((2, s_img - 1), IGNORE_INDEX), labels], dim=1)
            new_mask = torch.cat([loss_mask.new_zeros(2, s_img), loss_mask[:, 1:]], dim=1)
        out = self.gpt(input_ids=None, position_ids=None, attention_mask=None, decoder_input=combined,
                       labels=new_labels)
        return out, new_mask


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("shuffle", [False, True], ids=["plain", "pixel_shuffle"])
def test_matches_hand_written_composition(hf_dirs, shuffle):
    torch.manual_seed(1)
    model = _build(hf_dirs["siglip"], pixel_shuffle=shuffle)
    lf.randomize(model, seed=3)
    reference = _Composition(hf_dirs["siglip"], model, shuffle)
    assert model.img_seq_len == PATCHES // (4 if shuffle else 1)
    ids, labels, loss_mask = _batch()
    pixels = lf.images(2, seed=5)

    with torch.no_grad():
        logits, no_mask = model(pixels, ids, None, None)
        want_logits, _ = reference(pixels, ids)
    assert no_mask is None and logits.shape == (2, model.img_seq_len + TEXT_LEN - 1, lf.VOCAB)
    torch.testing.assert_close(logits, want_logits, **TOL)

    loss, mask = model(pixels, ids, None, None, labels=labels, loss_mask=loss_mask)
    want_loss, want_mask = reference(pixels, ids, labels, loss_mask)
    torch.testing.assert_close(mask, want_mask, rtol=0, atol=0)
    torch.testing.assert_close(loss, want_loss, **TOL)
    (loss * mask).sum().backward()
    (want_loss * want_mask).sum().backward()

    want = {f"vision_model.model.{k}": g for k, g in _grads(reference.tower).items()}
    want.update({f"vision_projection.{k}": g for k, g in _grads(reference.projection).items()})
    want.update({f"language_model.{k}": g for k, g in _grads(reference.gpt).items()})
    got = _grads(model)
    assert set(got) == set(want)
    nonzero = 0
    for name, grad in got.items():
        if want[name] is None:  # the tower's pooling head: not part of last_hidden_state
            assert grad is None and ".head." in name, name
            continue
        torch.testing.assert_close(grad, want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
        nonzero += int(bool(grad.abs().sum() > 0))
    assert nonzero > len(got) // 2
    assert any(n.startswith("vision_model.") and got[n] is not None and got[n].abs().sum() > 0 for n in got)


def test_state_dict_keys_and_round_trip(hf_dirs):
    torch.manual_seed(2)
    model = _build(hf_dirs["siglip"])
    lf.randomize(model, seed=6)
    tower_keys = transformers.SiglipVisionModel.from_pretrained(hf_dirs["siglip"]).state_dict().keys()
    vision_keys = {k for k in model.state_dict() if k.startswith("vision_model.")}
    assert vision_keys == {f"vision_model.model.{k}" for k in tower_keys}
    # transformers 5 drops the tower's own "vision_model." prefix; the wrapper adds nothing between.
    assert {"vision_model.model.embeddings.patch_embedding.weight",
            "vision_model.model.vision_model.embeddings.patch_embedding.weight"} & vision_keys
    vision_params = [p for n, p in model.named_parameters() if n.startswith("vision_model.")]
    assert vision_params and all(p.average_gradients_across_tp_domain for p in vision_params)
    assert not any(getattr(p, "average_gradients_across_tp_domain", False)
                   for n, p in model.named_parameters() if not n.startswith("vision_model."))

    torch.manual_seed(3)
    other = _build(hf_dirs["siglip"])
    other.load_state_dict(model.state_dict())
    ids, _, _ = _batch()
    pixels = lf.images(2, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(other(pixels, ids, None, None)[0], model(pixels, ids, None, None)[0],
                                   rtol=0, atol=0)
    sharded_keys = set(model.sharded_state_dict().keys())
    assert {k for k in sharded_keys if k.startswith("vision_model.")} == vision_keys


def test_freeze_vision_model(hf_dirs):
    model = _build(hf_dirs["siglip"])
    model.freeze(freeze_language_model=False, freeze_vision_model=True, freeze_vision_projection=False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith("vision_model.")}


def test_num_image_embeddings_for_hf_siglip(hf_dirs):
    path = f"hf://{hf_dirs['siglip']}"
    count = get_num_image_embeddings
    # SigLIP keeps no class token, whatever disable_vision_class_token and class_token_len say.
    assert count(lf.IMG, lf.IMG, lf.PATCH, path, False, 1, False) == PATCHES
    assert count(lf.IMG, lf.IMG, lf.PATCH, path, True, 1, False) == PATCHES
    assert count(lf.IMG, lf.IMG, lf.PATCH, path, False, 1, True) == PATCHES // 4
    assert count(lf.IMG, lf.IMG, lf.PATCH, path, False, 1, False, True, 6, "llama3p1") == PATCHES + 5
    assert count(48, 48, 8, path, False, 1, False) == 36  # the count follows the given geometry


def test_num_image_embeddings_refuses_other_hf_models(hf_dirs):
    args = (lf.IMG, lf.IMG, lf.PATCH)
    with pytest.raises(NotImplementedError, match=r"unsupported huggingface vision model: hf://.*qwen.*'qwen'"):
        get_num_image_embeddings(*args, f"hf://{hf_dirs['qwen']}", False, 1, False)
    # Parakeet is recognised from the path alone: no config is read (and no network is needed).
    with pytest.raises(NotImplementedError, match=r"unsupported huggingface vision model: hf://nvidia/parakeet"):
        get_num_image_embeddings(*args, "hf://nvidia/parakeet-tdt-0.6b-v2", False, 1, False)
    with pytest.raises(ValueError, match=r"vision_model_type \('vit-h'\) must be one of .*'hf://<SigLIP model>'"):
        get_num_image_embeddings(*args, "vit-h", False, 1, False)


def test_transformers_is_needed_only_for_hf_types():
    quiet = ("import sys, megatron_core.models.multimodal.llava_model, megatron_core.models.vision.clip_vit_model; "
             "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", quiet], check=True, timeout=120)
    absent = ("import sys; sys.modules['transformers'] = None\n"  # what Python does for a package that is absent
              "from megatron_core.models.vision import get_num_image_embeddings\n"
              "assert get_num_image_embeddings(32, 32, 8, 'siglip', False, 0, False) == 16\n"
              "try:\n    get_num_image_embeddings(32, 32, 8, 'hf://x', False, 1, False)\n"
              "except ImportError as e:\n    assert 'pip install transformers' in str(e), e\n"
              "else:\n    raise AssertionError('no ImportError')")
    subprocess.run([sys.executable, "-c", absent], check=True, timeout=120)


def test_llava_refuses_non_siglip_hf_towers(hf_dirs):
    with pytest.raises(NotImplementedError, match=r"unsupported huggingface vision model: hf://.*qwen"):
        _build(hf_dirs["qwen"])


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(drop_vision_class_token=True), r"'hf://.*siglip' has no class token: drop_vision_class_token must be False"),
    (dict(vision=dict(hidden_size=32)),
     r"vision_transformer_config.hidden_size \(32\) must equal the Hugging Face vision model's hidden_size \(64\)"),
    (dict(img_h=48, img_w=48), r"img_h \(48\) must equal the Hugging Face vision model's image_size \(32\)"),
    (dict(img_w=16), r"img_w \(16\) must equal the Hugging Face vision model's image_size \(32\)"),
    (dict(patch_dim=4), r"patch_dim \(4\) must equal the Hugging Face vision model's patch_size \(8\)"),
])
def test_llava_refusals_name_the_values(hf_dirs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _build(hf_dirs["siglip"], **kwargs)


def _tp2_against_one_process(siglip_dir: str) -> int:
    """At TP=2 (projector and language model split, tower replicated): loss, mask and every gradient equal one
    process's; returns the number of parameters compared."""
    ids, labels, loss_mask = _batch()
    pixels = lf.images(2, seed=8)

    def run(model: LLaVAModel) -> tuple[torch.Tensor, torch.Tensor, dict]:
        loss, mask = model(pixels, ids, None, None, labels=labels, loss_mask=loss_mask)
        (loss * mask).sum().backward()
        return loss.detach(), mask, {n: p.grad for n, p in model.named_parameters()}

    torch.manual_seed(1)
    single = _build(siglip_dir)
    lf.randomize(single, seed=9)
    ref_loss, ref_mask, ref_grads = run(single)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_tensor_model_parallel_rank()
        model = _build(siglip_dir, tp=2)
        full = dict(single.named_parameters())
        with torch.no_grad():
            for name, param in model.named_parameters():
                gated = name.startswith("language_model.")
                param.copy_(shard(name, full[name].detach(), 2, rank, gated))
        loss, mask, grads = run(model)
        torch.testing.assert_close(mask, ref_mask, rtol=0, atol=0)
        valid = ref_mask > 0  # masked-out IGNORE_INDEX positions differ between TP=1 and TP>1 (see compat.md)
        torch.testing.assert_close(loss[valid], ref_loss[valid], **TOL)
        compared = 0
        for name, grad in grads.items():
            if not name.startswith("vision_model."):
                continue
            # The column-parallel projector all-reduces its input gradient: the replicated tower's gradients
            # are the full ones on every rank.
            if ref_grads[name] is None:
                assert grad is None, name
                continue
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
            compared += 1
        return compared
    finally:
        parallel_state.destroy_model_parallel()


def test_tp2_matches_single_process(hf_dirs):
    counts = run_on_ranks(2, _tp2_against_one_process, str(hf_dirs["siglip"]))
    assert counts[0] > 10 and len(set(counts)) == 1
