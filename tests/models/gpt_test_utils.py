"""The test suite's shared tiny-GPT helpers: sizes, configs, builders, batches, TP sharding.

``llama_like`` / ``gpt2_like`` describe the two tiny models every GPT test uses; ``build`` makes a
single-process one, ``gpt_provider`` is a ``model_provider_func`` for ``get_model`` (pipeline chunks),
``batch`` a fixed batch. ``shard`` / ``unshard`` move between the TP=1 state dict and TP shards.

Sharding follows the layer layouts: column-parallel weights split along dim 0 (the fused QKV is
grouped per query group, so a contiguous split gives each rank whole groups; the SwiGLU fc1
is ``[gate; up]`` per shard), row-parallel weights along dim 1, vocab tables by rows, and
norms, row biases and position embeddings are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig

VOCAB, SEQ, BATCH, MAX_SEQ = 64, 8, 2, 16

COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
          "word_embeddings.weight", "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def llama_like(**overrides) -> dict:
    """RMSNorm, RoPE, GQA, SwiGLU, no biases, untied."""
    cfg = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
               normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    cfg.update(overrides)
    return dict(config=cfg, model=dict(position_embedding_type="rope"))


def gpt2_like(**overrides) -> dict:
    """LayerNorm, learned positions, GELU, biases, tied embeddings."""
    cfg = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
               use_cpu_initialization=True)
    cfg.update(overrides)
    return dict(config=cfg, model=dict(share_embeddings_and_output_weights=True))


def build(spec: dict, **config_overrides) -> GPTModel:
    """A GPTModel from a ``llama_like``/``gpt2_like`` description."""
    cfg = TransformerConfig(**{**spec["config"], **config_overrides})
    return GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ, **spec["model"])


def gpt_provider(spec: dict, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                 config: TransformerConfig | None = None, pg_collection=None) -> GPTModel:
    """A Megatron-style ``model_provider_func`` (for ``get_model``) building a ``spec`` GPTModel or one chunk of it."""
    config = config if config is not None else TransformerConfig(**spec["config"])
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ, pre_process=pre_process,
                    post_process=post_process, vp_stage=vp_stage, pg_collection=pg_collection, **spec["model"])


def batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, labels)``, each ``[b, s]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ), labels


def _glu_split(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    gate, up = t.chunk(2, dim=0)
    return [torch.cat((g, u), dim=0) for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]


def shard(name: str, full: torch.Tensor, tp: int, rank: int, gated: bool) -> torch.Tensor:
    """This TP rank's piece of the TP=1 tensor ``full``."""
    if gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return _glu_split(full, tp)[rank]
    if name.endswith(COLUMN):
        return full.chunk(tp, dim=0)[rank]
    if name.endswith(ROW):
        return full.chunk(tp, dim=1)[rank]
    return full


def unshard(name: str, pieces: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """Reassemble per-rank pieces into the TP=1 layout (replicated tensors: the first piece)."""
    if gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        gates, ups = zip(*(p.chunk(2, dim=0) for p in pieces))
        return torch.cat((*gates, *ups), dim=0)
    if name.endswith(COLUMN):
        return torch.cat(pieces, dim=0)
    if name.endswith(ROW):
        return torch.cat(pieces, dim=1)
    return pieces[0]


def loss_and_grads(model: GPTModel, seed: int = 3) -> tuple[dict, torch.Tensor, dict]:
    """``(weights, per-token loss, gradients)`` of ``model`` on :func:`batch` (``loss.sum()`` backward)."""
    ids, pos, labels = batch(seed)
    loss = model(ids, pos, None, labels=labels)
    loss.sum().backward()
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    return state, loss.detach(), grads
