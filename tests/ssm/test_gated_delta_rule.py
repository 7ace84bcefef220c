"""The chunked gated delta rule against a per-token recurrence (float64), values and gradients.

The recurrence is written here from the rule's definition: per head, ``S <- exp(g) S``, then
``S <- S + beta k (v - S^T k)^T`` and ``o = S^T q / sqrt(d_k)``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.ssm.gated_delta_net import chunk_gated_delta_rule, l2norm, torch_chunk_gated_delta_rule

B, S, H, DK, DV = 2, 13, 2, 4, 3


def recurrence(q, k, v, g, beta, state=None):
    """Outputs ``[b, s, h, dv]`` and final state, one token at a time (q/k heads repeated over value heads)."""
    b, s, h, dv = v.shape
    rep = h // q.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    state = torch.zeros(b, h, q.shape[-1], dv, dtype=v.dtype) if state is None else state
    outs = []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t][..., None] * (v[:, t] - predicted))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * q.shape[-1] ** -0.5, state))
    return (torch.stack(outs, dim=1) if outs else v.new_zeros(b, 0, h, dv)), state


def inputs(seed: int = 0, key_heads: int = H, length: int = S):
    gen = torch.Generator().manual_seed(seed)
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k = l2norm(rand(B, length, key_heads, DK)), l2norm(rand(B, length, key_heads, DK))
    v = rand(B, length, H, DV)
    g = -torch.rand(B, length, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, length, H, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, rand(B, H, DK, DV)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 64])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_chunked_matches_recurrence(chunk_size: int, with_state: bool) -> None:
    q, k, v, g, beta, state = inputs()
    state = state if with_state else None
    want, want_state = recurrence(q, k, v, g, beta, state)
    got, got_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=state,
                                                  output_final_state=True)
    assert got.dtype == torch.float64 and got.shape == (B, S, H, DV)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_state, want_state, rtol=1e-10, atol=1e-10)
    _, no_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=state)
    assert no_state is None


def test_grouped_keys_l2norm_in_kernel_and_fp32() -> None:
    """One key head per two value heads; ``use_qk_l2norm_in_kernel`` normalises q, k; fp32 inputs give fp32."""
    q, k, v, g, beta, _ = inputs(seed=1, key_heads=1)
    got, _ = torch_chunk_gated_delta_rule(3 * q, 2 * k, v, g, beta, chunk_size=4, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got, recurrence(l2norm(3 * q), l2norm(2 * k), v, g, beta)[0], rtol=1e-10, atol=1e-10)
    want, _ = recurrence(q, k, v, g, beta)
    got32, _ = chunk_gated_delta_rule(*(x.float() for x in (q, k, v, g, beta)))
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-5)


def test_gradients_match_recurrence() -> None:
    leaves = [x.requires_grad_(True) for x in inputs(seed=2)]
    q, k, v, g, beta, state = leaves
    upstream = torch.randn(B, S, H, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    want_out, want_state = recurrence(q, k, v, g, beta, state)
    want = torch.autograd.grad((want_out * upstream).sum() + want_state.sum(), leaves)
    got_out, got_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=state,
                                                      output_final_state=True)
    got = torch.autograd.grad((got_out * upstream).sum() + got_state.sum(), leaves)
    for name, a, b in zip("q k v g beta state".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_packed_sequences_restart_per_document() -> None:
    """With ``cu_seqlens`` each document starts from its own initial state, as separate runs do."""
    q, k, v, g, beta, state = (x[:1] for x in inputs(seed=3))
    bounds = [0, 5, 5, 13]
    states = torch.cat([state, torch.zeros_like(state), 2 * state])
    got, got_states = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=states,
                                                   output_final_state=True, cu_seqlens=torch.tensor(bounds))
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        want, want_state = recurrence(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], states[i:i + 1])
        torch.testing.assert_close(got[:, a:b], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_states[i:i + 1], want_state, rtol=1e-10, atol=1e-10)


def test_bad_inputs_raise() -> None:
    q, k, v, g, beta, _ = inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        torch_chunk_gated_delta_rule(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="batch 1"):
        torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, S]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        torch_chunk_gated_delta_rule(*(x[:1] for x in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 4]))
