"""The fused-QKV layout as a plain function (test helper for the MoE parity tests).

The HF <-> GPTModel mapping itself lives in the library, ``megatron_core.models.hf`` (tests in
``tests/models/hf/``). ``linear_qkv`` is grouped per query group: for each KV group, its query
heads' rows, then that group's key rows, then its value rows.
"""

from __future__ import annotations

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """``[nh*hd, ...]``, ``[ng*hd, ...]`` x2 -> Megatron's per-group ``[ng*(nh/ng+2)*hd, ...]``."""
    from megatron_core.models.hf.rules import FusedQKV

    head_dim = k.shape[0] // num_groups
    rule = FusedQKV("qkv", parts=("q", "k", "v"), num_heads=num_heads, num_groups=num_groups, head_dim=head_dim)
    tensors = {"q": q, "k": k, "v": v}
    return rule.from_hf(lambda name, index: tensors[name][tuple(index)], None, 0, 1, lambda name: tensors[name].shape)
