"""LLaVA generation (VLMInferenceWrapper + VLMTextGenerationController through StaticInferenceEngine, with the
static KV cache) equals a hand-written greedy loop over ``LLaVAModel.forward`` without a cache (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.contexts import StaticInferenceContext
from megatron_core.inference.engines import StaticInferenceEngine
from megatron_core.inference.inference_request import InferenceRequest, VLMInferenceRequest
from megatron_core.inference.model_inference_wrappers.multimodal import VLMInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers.vlm_text_generation_controller import (
    VLMTextGenerationController,
)
from tests.models.multimodal.llava_fixture import IMAGE_TOKEN_ID, IMG_SEQ, MAX_SEQ, build, images, randomize

NEW = 8


class ToyTokenizer:
    """Ids as text; the image token is left out of the vocabulary (so it is never generated)."""

    eod, vocab_size = 0, IMAGE_TOKEN_ID

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


@pytest.fixture(scope="module")
def llava():
    torch.manual_seed(0)
    m = build().eval()
    randomize(m, seed=3)
    return m


def _reference(m, prompt: list[int], pixels: torch.Tensor, num_tiles: list[int], new: int, eod: int) -> list[int]:
    """Greedy over the text vocabulary: the whole sequence through ``forward`` (no cache) at every step."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            logits, _ = m(pixels, torch.tensor([ids]), None, None, num_image_tiles=num_tiles)
            token = int(logits[0, -1, :IMAGE_TOKEN_ID].argmax())
            if token == eod:
                break
            out.append(token)
            ids.append(token)
    return out


def _engine(m) -> StaticInferenceEngine:
    wrapper = VLMInferenceWrapper(m, StaticInferenceContext(1, MAX_SEQ))
    return StaticInferenceEngine(VLMTextGenerationController(wrapper, ToyTokenizer()), max_batch_size=1)


def _request(request_id: int, prompt: list[int], pixels: torch.Tensor, num_tiles: list[int], **params):
    return VLMInferenceRequest(
        request_id=request_id, prompt=" ".join(map(str, prompt)), prompt_tokens=prompt,
        sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=NEW, **params),
        num_img_embeddings_per_tile=IMG_SEQ, imgs=pixels, num_tiles=torch.tensor(num_tiles), decoder_seq_length=MAX_SEQ,
    )


def test_greedy_with_kv_cache_matches_forward_loop(llava):
    gen = torch.Generator().manual_seed(1)
    cases = [  # (prompt, tiles per image): one image, two images (1 + 2 tiles), image first
        ([5, IMAGE_TOKEN_ID, 17, 42, 9], [1]),
        ([3, IMAGE_TOKEN_ID, 8, IMAGE_TOKEN_ID, 11, 12, 13], [1, 2]),
        ([IMAGE_TOKEN_ID] + torch.randint(1, IMAGE_TOKEN_ID, (3,), generator=gen).tolist(), [2]),
    ]
    requests, expected = [], []
    for i, (prompt, tiles) in enumerate(cases):
        pixels = images(sum(tiles), seed=10 + i)
        requests.append(_request(i, prompt, pixels, tiles))
        expected.append(_reference(llava, prompt, pixels, tiles, NEW, ToyTokenizer.eod))
    results = _engine(llava).generate(inference_requests=requests)
    assert [r.generated_tokens for r in results] == expected
    assert all(len(e) == NEW for e in expected)
    assert results[1].generated_text == ToyTokenizer().detokenize(expected[1])


def test_cache_is_used_after_prefill(llava):
    """Decode steps feed one text token: the wrapper's context holds the images and the combined positions."""
    pixels = images(1, seed=4)
    prompt = [7, IMAGE_TOKEN_ID, 20]
    engine = _engine(llava)
    engine.generate(inference_requests=[_request(0, prompt, pixels, [1])])
    context = engine.inference_wrapped_model.inference_context
    assert context.key_value_memory_dict["image_tokens_count"] == IMG_SEQ
    # prefill: 2 text + IMG_SEQ image positions; then one position per decode step (the last token is not fed)
    assert context.sequence_len_offset == 2 + IMG_SEQ + NEW - 1


def test_bad_inputs(llava):
    engine = _engine(llava)
    pixels = images(1, seed=0)
    plain = InferenceRequest(request_id=0, prompt_tokens=[1, IMAGE_TOKEN_ID, 2], sampling_params=SamplingParams(top_k=1))
    with pytest.raises(ValueError, match="request 0 is a InferenceRequest; expected a VLMInferenceRequest"):
        engine.generate(inference_requests=[plain])
    no_images = _request(1, [1, IMAGE_TOKEN_ID, 2], pixels, [1])
    no_images.imgs = None
    with pytest.raises(ValueError, match=r"request 1 has imgs=None and num_tiles=tensor\(\[1\]\); both are required"):
        engine.generate(inference_requests=[no_images])
    with pytest.raises(ValueError, match=r"holds 2 image tokens \(id 127\) but num_tiles lists 1 images \(\[1\]\)"):
        engine.generate(inference_requests=[_request(2, [1, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID], pixels, [1])])
    long_prompt = [1, IMAGE_TOKEN_ID] + [5] * (MAX_SEQ - IMG_SEQ)
    request = _request(3, long_prompt, pixels, [1])
    request.decoder_seq_length = MAX_SEQ // 2
    with pytest.raises(ValueError, match=rf"make {MAX_SEQ - IMG_SEQ + 1 + NEW + IMG_SEQ} positions, more than "
                                         rf"decoder_seq_length \({MAX_SEQ // 2}\)"):
        engine.generate(inference_requests=[request])
    with pytest.raises(ValueError, match=r"return_log_probs \(True\) is not supported"):
        engine.generate(inference_requests=[_request(4, [1, IMAGE_TOKEN_ID], pixels, [1], return_log_probs=True)])
    two = StaticInferenceEngine(VLMTextGenerationController(
        VLMInferenceWrapper(llava, StaticInferenceContext(2, MAX_SEQ)), ToyTokenizer()), max_batch_size=2)
    with pytest.raises(ValueError, match="serves one request at a time, got 2"):
        two.generate(inference_requests=[_request(5, [1, IMAGE_TOKEN_ID], pixels, [1]),
                                         _request(6, [2, IMAGE_TOKEN_ID], pixels, [1])])
