"""Hand-written reference of the NeMo audio encoder, computed from a state dict (loops and formulas, no nn layers).

Convolutions are sums over kernel taps, GELU is ``x / 2 * (1 + erf(x / sqrt 2))``, layer norm and attention are
written out with an explicit visibility matrix (key padding, causal, left context).
"""

from __future__ import annotations

import math

import torch


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: int = 1, padding: int = 0,
           groups: int = 1) -> torch.Tensor:
    """``x`` ``[b, c_in, t]``; ``weight`` ``[c_out, c_in / groups, k]``."""
    batch, c_in, time = x.shape
    c_out, c_in_g, kernel = weight.shape
    padded = torch.cat([x.new_zeros(batch, c_in, padding), x, x.new_zeros(batch, c_in, padding)], dim=-1)
    steps = (time + 2 * padding - kernel) // stride + 1
    w = weight.view(groups, c_out // groups, c_in_g, kernel)
    out = []
    for t in range(steps):
        window = padded[:, :, t * stride:t * stride + kernel].reshape(batch, groups, c_in_g, kernel)
        taps = [torch.einsum("bgi,goi->bgo", window[..., k], w[..., k]) for k in range(kernel)]
        out.append(sum(taps).reshape(batch, c_out))
    return torch.stack(out, dim=-1) + bias[None, :, None]


def pre_encode(kind: str, state: dict, x: torch.Tensor, lengths: torch.Tensor, factor: int = 4):
    """Subsampling of ``x`` ``[b, n_mels, t]`` -> ``([b, t', d], lengths')``."""
    p = "pre_encode."
    if kind in ("conv", "depth_conv"):
        h = gelu(conv1d(x, state[p + "conv1.weight"], state[p + "conv1.bias"], padding=1))
        for n in (2, 3):
            if kind == "conv":
                h = conv1d(h, state[p + f"conv{n}.weight"], state[p + f"conv{n}.bias"], stride=2, padding=1)
            else:
                h = conv1d(h, state[p + f"dw_conv{n}.weight"], state[p + f"dw_conv{n}.bias"], stride=2, padding=1,
                           groups=h.shape[1])
                h = conv1d(h, state[p + f"pw_conv{n}.weight"], state[p + f"pw_conv{n}.bias"])
            h = gelu(h)
        return h.transpose(1, 2), lengths // 4
    frames = x.transpose(1, 2)
    batch, time, feat = frames.shape
    steps = -(-time // factor)
    rows = []
    for b in range(batch):
        stacked = []
        for s in range(steps):
            pieces = []
            for t in range(s * factor, (s + 1) * factor):
                frame = frames[b, t] if t < time else frames.new_zeros(feat)
                pieces.append(state[p + "pad_frame"] if bool((frame == 0).all()) else frame)
            stacked.append(torch.cat(pieces) @ state[p + "proj_out.weight"].T)
        rows.append(torch.stack(stacked))
    return torch.stack(rows), -(-lengths // factor)


def visible(query_pos: int, key_pos: int, key_len: int, causal: bool, left_context: int | None) -> bool:
    if key_pos >= key_len:
        return False
    if causal and key_pos > query_pos:
        return False
    return not (causal and left_context is not None and key_pos < query_pos - left_context)


def attention(x: torch.Tensor, state: dict, p: str, heads: int, lengths: torch.Tensor, causal: bool,
              left_context: int | None, qk_norm: bool) -> torch.Tensor:
    batch, time, d = x.shape
    hd = d // heads

    def proj(name):
        out = x @ state[p + name + ".weight"].T
        return out + state[p + name + ".bias"] if p + name + ".bias" in state else out

    q, k, v = (proj(n).view(batch, time, heads, hd) for n in ("w_query", "w_key", "w_value"))
    if qk_norm:
        q = layer_norm(q, state[p + "q_norm.weight"], state[p + "q_norm.bias"])
        k = layer_norm(k, state[p + "k_norm.weight"], state[p + "k_norm.bias"])
    out = torch.zeros(batch, time, heads, hd, dtype=x.dtype)
    for b in range(batch):
        for i in range(time):
            allowed = torch.tensor([visible(i, j, int(lengths[b]), causal, left_context) for j in range(time)])
            if not allowed.any():  # a padded row that sees no key: zeros, as torch's SDPA gives
                continue
            for h in range(heads):
                scores = (k[b, allowed, h] @ q[b, i, h]) / math.sqrt(hd)
                out[b, i, h] = torch.softmax(scores, dim=0) @ v[b, allowed, h]
    return out.reshape(batch, time, d) @ state[p + "out_proj.weight"].T + state[p + "out_proj.bias"]


def block(x: torch.Tensor, state: dict, p: str, **attn) -> torch.Tensor:
    h = x + attention(layer_norm(x, state[p + "pre_norm.scale"], state[p + "pre_norm.shift"]), state, p + "mha.",
                      **attn)
    normed = layer_norm(h, state[p + "post_norm.scale"], state[p + "post_norm.shift"])
    hidden = gelu(normed @ state[p + "ffn.ffn.0.weight"].T + state[p + "ffn.ffn.0.bias"])
    return h + hidden @ state[p + "ffn.ffn.2.weight"].T + state[p + "ffn.ffn.2.bias"]


def encoder(state: dict, x: torch.Tensor, lengths: torch.Tensor, *, kind: str, n_layers: int, heads: int,
            factor: int = 4, causal: bool = False, left_context: int | None = None, qk_norm: bool = False):
    """``x`` ``[b, n_mels, t]`` -> ``([b, d, t'], lengths')`` of ``TransformerEncoder``."""
    h, out_lengths = pre_encode(kind, state, x, lengths, factor)
    h = layer_norm(h * math.sqrt(h.shape[-1]), state["layer_norm.weight"], state["layer_norm.bias"])
    for i in range(n_layers):
        h = block(h, state, f"layers.{i}.", heads=heads, lengths=out_lengths, causal=causal,
                  left_context=left_context, qk_norm=qk_norm)
    h = layer_norm(h, state["final_norm.weight"], state["final_norm.bias"])
    return h.transpose(1, 2), out_lengths
