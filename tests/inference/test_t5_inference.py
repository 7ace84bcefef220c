"""T5 generation (T5InferenceWrapper + EncoderDecoderTextGenerationController through StaticInferenceEngine)
equals a hand-written greedy loop over ``T5Model.forward`` on the whole decoder prefix (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.contexts import StaticInferenceContext
from megatron_core.inference.engines import StaticInferenceEngine
from megatron_core.inference.inference_request import Status
from megatron_core.inference.model_inference_wrappers.t5 import T5InferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers.encoder_decoder_text_generation_controller import (
    EncoderDecoderTextGenerationController,
)
from tests.models.T5.t5_test_utils import MAX_SEQ, VOCAB, model, randomize

NEW = 7
SENTINELS = [VOCAB - 1, VOCAB - 2, VOCAB - 3]


class ToyTokenizer:
    """Characters to ids 3..82; pad 0, bos 1, eod 2, sentinels at the top of the vocabulary."""

    pad, bos, eod, vocab_size = 0, 1, 2, VOCAB
    additional_special_tokens_ids = SENTINELS

    def tokenize(self, text: str) -> list[int]:
        return [3 + (ord(c) - 32) % 80 for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(32 + i - 3) if 3 <= i < 83 else f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def t5():
    torch.manual_seed(0)
    m = model().eval()
    randomize(m, seed=4)
    return m


def _reference(m, encoder_ids: list[int], decoder_ids: list[int], new: int, eod: int) -> list[int]:
    """Greedy: one request, unpadded encoder, the full decoder prefix each step; stops before ``eod``."""
    enc = torch.tensor([encoder_ids])
    no_mask = torch.zeros(1, 1, enc.shape[1], enc.shape[1], dtype=torch.bool)
    out, dec = [], list(decoder_ids)
    with torch.no_grad():
        for _ in range(new):
            d = torch.tensor([dec])
            causal = torch.ones(d.shape[1], d.shape[1], dtype=torch.bool).triu(1)[None, None]
            cross = torch.zeros(1, 1, d.shape[1], enc.shape[1], dtype=torch.bool)
            token = int(m(enc, d, no_mask, causal, cross)[0, -1].argmax())
            if token == eod:
                break
            out.append(token)
            dec.append(token)
    return out


def _engine(m, batch: int = 4) -> StaticInferenceEngine:
    wrapper = T5InferenceWrapper(m, StaticInferenceContext(batch, MAX_SEQ))
    controller = EncoderDecoderTextGenerationController(wrapper, ToyTokenizer())
    return StaticInferenceEngine(controller, max_batch_size=batch)


def test_greedy_batch_matches_forward_loop(t5):
    tok = ToyTokenizer()
    encoder_prompts = ["translate: hello", "a <mask> b <mask> c", "x", "the quick brown fox jumps"]
    decoder_prompts = ["", "ab", "", "q"]  # with BOS: decoder prompt lengths 1, 3, 1, 2
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW)
    results = _engine(t5).generate(prompts=decoder_prompts, add_BOS=True, encoder_prompts=encoder_prompts,
                                   sampling_params=params)
    assert [r.encoder_prompt for r in results] == encoder_prompts
    for prompt, encoder_prompt, result in zip(decoder_prompts, encoder_prompts, results):
        pieces = encoder_prompt.split("<mask>")
        encoder_ids = []
        for i, piece in enumerate(pieces):
            encoder_ids += tok.tokenize(piece) + ([SENTINELS[i]] if i < len(pieces) - 1 else [])
        expected = _reference(t5, encoder_ids, [tok.bos] + tok.tokenize(prompt), NEW, tok.eod)
        assert result.generated_tokens == expected
        assert result.status == Status.COMPLETED
        assert result.generated_text == tok.detokenize(expected)
    assert sum(len(r.generated_tokens) for r in results) > 2 * NEW  # not all stopped at once


def test_batches_of_two_and_log_probs(t5):
    """max_batch_size 2 splits four requests; the generated log-probs are those of the reference's logits."""
    tok = ToyTokenizer()
    encoder_prompts = ["one", "two two", "three three three", "four"]
    params = SamplingParams(top_k=1, num_tokens_to_generate=4, return_log_probs=True)
    results = _engine(t5, batch=2).generate(prompts=[""] * 4, add_BOS=True, encoder_prompts=encoder_prompts,
                                            sampling_params=params)
    for encoder_prompt, result in zip(encoder_prompts, results):
        enc = torch.tensor([tok.tokenize(encoder_prompt)])
        dec = torch.tensor([[tok.bos] + list(result.generated_tokens)])
        with torch.no_grad():
            logits = t5(enc, dec, None, torch.ones(dec.shape[1], dec.shape[1], dtype=torch.bool).triu(1)[None, None],
                        None)
        log_probs = torch.log_softmax(logits[0, :-1], dim=-1)
        expected = log_probs.gather(1, dec[0, 1:, None]).squeeze(1)
        assert result.generated_tokens == _reference(t5, tok.tokenize(encoder_prompt), [tok.bos], 4, tok.eod)
        torch.testing.assert_close(torch.tensor(result.generated_log_probs), expected, rtol=1e-5, atol=1e-5)
        assert result.prompt_log_probs == []


def test_bad_inputs(t5):
    engine = _engine(t5)
    params = SamplingParams(top_k=1, num_tokens_to_generate=2)
    with pytest.raises(ValueError, match=rf"encoder prompt lengths \{{0: 40\}}.*max_sequence_length \({MAX_SEQ}\)"):
        engine.generate(prompts=[""], add_BOS=True, encoder_prompts=["y" * 40], sampling_params=params)
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        engine.generate(prompts=[""], encoder_prompts=["hi"], sampling_params=SamplingParams(top_k=1))
    with pytest.raises(ValueError, match="2 prompts but 1 encoder_prompts"):
        engine.generate(prompts=["", ""], add_BOS=True, encoder_prompts=["hi"], sampling_params=params)
    with pytest.raises(ValueError, match=r"4 <mask> spans but the tokenizer has 3 sentinel tokens"):
        engine.generate(prompts=[""], add_BOS=True, encoder_prompts=["<mask>a<mask>b<mask>c<mask>"],
                        sampling_params=params)
    with pytest.raises(ValueError, match=r"requests \[.*\] have no encoder_prompt"):
        engine.generate(prompts=["a"], sampling_params=params)
    with pytest.raises(ValueError, match=rf"\({MAX_SEQ + 1}\) exceed the context's max_sequence_length \({MAX_SEQ}\)"):
        engine.generate(prompts=[""], add_BOS=True, encoder_prompts=["hi"],
                        sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=MAX_SEQ))


def test_termination_id_stops_each_row(t5):
    """A termination id that the greedy rows reach at different steps: each row stops right before it."""
    tok = ToyTokenizer()
    encoder_prompts = ["translate: hello", "x"]
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=90)
    results = _engine(t5).generate(prompts=["", ""], add_BOS=True, encoder_prompts=encoder_prompts,
                                   sampling_params=params)
    expected = [_reference(t5, tok.tokenize(p), [tok.bos], NEW, 90) for p in encoder_prompts]
    assert [r.generated_tokens for r in results] == expected
    assert len(expected[0]) < NEW == len(expected[1])
    assert [r.generated_length for r in results] == [len(e) for e in expected]
