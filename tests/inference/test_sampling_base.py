"""``inference.sampling.base.Sampling`` and ``TorchSampling`` behind it: the kernels read each request's settings
from a context's ``active_request_metadata`` and sample exactly as the engine's ``sample(logits, params)``;
log-probs are those of the filtered distribution; ``sample_speculative`` maps rows to requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_core.inference.sampling import Sampling, TorchSampling
from megatron_core.inference.sampling_params import SamplingParams

V = 12
SETTINGS = [(1.0, 1, 0.0), (0.7, 3, 0.0), (1.3, 0, 0.9), (0.7, 3, 0.0)]  # (temperature, top_k, top_p) per request


def _context(settings: list[tuple[float, int, float]], paused: int = 0) -> SimpleNamespace:
    """A context exposing what Megatron-Core's sampling kernels read; ``paused`` trailing paused requests."""
    rows = settings + [(1.0, 0, 0.0)] * paused
    return SimpleNamespace(total_request_count=len(rows), paused_request_count=paused, active_request_metadata={
        "temperature": torch.tensor([r[0] for r in rows]), "top_k": torch.tensor([r[1] for r in rows]),
        "top_p": torch.tensor([r[2] for r in rows])})


def _sampler(seed: int = 0, vocab_size: int | None = None) -> TorchSampling:
    return TorchSampling(torch.Generator().manual_seed(seed), vocab_size)


def _params(settings: list[tuple[float, int, float]]) -> list[SamplingParams]:
    return [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in settings]


def test_sampling_is_abstract():
    with pytest.raises(TypeError):
        Sampling()
    assert isinstance(_sampler(), Sampling)


def test_sample_kernel_matches_the_engine_path_on_the_same_seed():
    logits = torch.randn(len(SETTINGS), V, generator=torch.Generator().manual_seed(1))
    context = _context(SETTINGS, paused=2)
    for seed in range(5):
        kernel = _sampler(seed).sample_kernel(logits, len(SETTINGS), context, no_top_k=False, no_top_p=False)
        engine = _sampler(seed).sample(logits, _params(SETTINGS))
        assert torch.equal(kernel, engine)
        assert kernel[0] == logits[0].argmax()  # top_k=1: greedy
        top3 = set(logits[1].topk(3).indices.tolist())
        assert int(kernel[1]) in top3 and int(kernel[3]) in set(logits[3].topk(3).indices.tolist())


def test_sample_kernel_gathers_rows_and_fills_output():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    greedy = [(1.0, 1, 0.0)] * 3
    gather = torch.tensor([5, 0, 3])
    output = torch.full((3,), -1, dtype=torch.long)
    out = _sampler().sample_kernel(logits, 3, _context(greedy), no_top_k=False, no_top_p=True,
                                   gather_indices=gather, output=output)
    assert out is output and torch.equal(out, logits[gather].argmax(dim=-1))
    cut = _sampler(vocab_size=4).sample_kernel(logits, 3, _context(greedy), no_top_k=False, no_top_p=True)
    assert torch.equal(cut, logits[:3, :4].argmax(dim=-1))  # ids beyond the vocabulary are never drawn


def _filtered_log_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Reference: scale, then keep the top-k set or the smallest prefix reaching top_p, renormalised."""
    scaled = row / temperature
    keep = torch.zeros(V, dtype=torch.bool)
    order = scaled.argsort(descending=True)
    if top_k > 0:
        keep[order[:top_k]] = True
    elif top_p > 0:
        cumulative = scaled[order].softmax(-1).cumsum(-1)
        count = int((cumulative < top_p).sum()) + 1
        keep[order[:count]] = True
    else:
        keep[:] = True
    return torch.where(keep, scaled.masked_fill(~keep, float("-inf")).log_softmax(-1), float("-inf"))


def test_log_probs_kernel_is_the_filtered_distribution():
    logits = torch.randn(len(SETTINGS), V, generator=torch.Generator().manual_seed(3))
    got = _sampler().log_probs_kernel(logits, _context(SETTINGS))
    for i, (t, k, p) in enumerate(SETTINGS):
        torch.testing.assert_close(got[i], _filtered_log_probs(logits[i], t, k, p), rtol=1e-5, atol=1e-6)
    # Rows mapped to requests: rows 0 and 2 belong to request 1, row 1 to request 0.
    mapped = _sampler().log_probs_kernel(logits[:3], _context(SETTINGS), token_to_request_index=torch.tensor([1, 0, 1]))
    for row, request in enumerate([1, 0, 1]):
        torch.testing.assert_close(mapped[row], _filtered_log_probs(logits[row], *SETTINGS[request]),
                                   rtol=1e-5, atol=1e-6)


def test_sample_speculative_maps_rows_to_requests():
    # Two decode requests with 2 draft tokens each (3 rows apiece), then one prefill request.
    settings = [(1.0, 1, 0.0), (0.5, 2, 0.0), (1.0, 1, 0.0)]
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(4))
    tokens = _sampler().sample_speculative(logits, num_decode=2, num_prefill=1, num_speculative_tokens=2,
                                           context=_context(settings))
    assert tokens.shape == (7,)
    for row in (0, 1, 2, 6):  # greedy requests
        assert tokens[row] == logits[row].argmax()
    for row in (3, 4, 5):  # the top-2 request
        assert int(tokens[row]) in set(logits[row].topk(2).indices.tolist())
    explicit = _sampler().sample_kernel(logits, 7, _context(settings), no_top_k=False, no_top_p=True,
                                        token_to_request_index=torch.tensor([0, 0, 0, 1, 1, 1, 2]))
    assert torch.equal(tokens, explicit)
