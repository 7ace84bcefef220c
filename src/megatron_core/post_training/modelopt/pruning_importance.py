"""Activation-based importance of a GPT's channels, heads, query groups and layers (Minitron's estimation step).

Minitron (arXiv 2407.14679; Model Optimizer's ``mcore_minitron`` mode, which Megatron-LM runs through
``mtp.prune``) ranks what it may remove by how strongly it is activated on a few calibration batches. Forward
hooks collect, for every batch of ``forward_loop``:

* **FFN neurons**: the input of ``linear_fc2`` (the activated output of ``linear_fc1``, one value per neuron;
  ``act(gate) * up`` for a gated MLP), per layer;
* **attention heads and query groups**: the input of ``linear_proj`` (the attention output, ``kv_channels``
  values per head), per layer;
* **embedding channels**: the outputs of ``input_layernorm`` and ``pre_mlp_layernorm`` of every layer;
* **layers** (depth): Block Importance, ``1 - cos(layer input, layer output)`` averaged over tokens.

Each activation ``x`` ``[s, b, c]`` is aggregated as Model Optimizer does: the mean of ``|x|`` over the
sequence, then the L2 norm over the batch, and over batches the L2 norm again (squares summed, square root at
the end). A head scores the L2 norm of its channels' scores, a query group that of its heads' channels, an
embedding channel the sum of its per-norm scores; layer scores are summed over batches. With
``torch.distributed`` initialised the sums are all-reduced over the data-parallel group before the square
root, so every data-parallel rank gets the scores of one process that ran all the ranks' batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_core._ground.groups import get_pg_size
from megatron_core.process_groups_config import resolve_process_group

__all__ = ["MinitronImportance", "estimate_importance"]


@dataclass
class MinitronImportance:
    """Importance scores of one GPT (higher is more important); layer lists are indexed from 0.

    ``hidden`` ``[hidden_size]``; per layer ``ffn`` ``[ffn_hidden_size]``, ``heads`` ``[num_attention_heads]``,
    ``query_groups`` ``[num_query_groups]``; ``layers`` ``[num_layers]`` (Block Importance).
    """

    hidden: torch.Tensor
    ffn: list[torch.Tensor]
    heads: list[torch.Tensor]
    query_groups: list[torch.Tensor]
    layers: torch.Tensor

    def state_dict(self) -> dict[str, object]:
        """The scores as plain tensors and lists (for ``torch.save``)."""
        return {"hidden": self.hidden, "ffn": self.ffn, "heads": self.heads, "query_groups": self.query_groups,
                "layers": self.layers}


def _squared_batch_norms(x: torch.Tensor) -> torch.Tensor:
    """``[c]``: per channel, the sum over the batch of (mean over the sequence of ``|x|``) squared; ``x`` ``[s, b, c]``."""
    x = x.detach().float()
    if x.dim() == 2:  # [tokens, c]: one sequence
        x = x.unsqueeze(1)
    return x.abs().mean(dim=0).pow(2).sum(dim=0)


class _Accumulators:
    """Running sums the hooks add to, keyed by what they measure."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def get(self, key: str) -> torch.Tensor:
        if key not in self.sums:
            raise ValueError(f"Minitron importance: the calibration forward_loop never reached {key} "
                             "(it must run the model forward on at least one batch)")
        return self.sums[key]


def _layer_hooks(layer: torch.nn.Module, index: int, acc: _Accumulators) -> list[torch.utils.hooks.RemovableHandle]:
    handles = []

    def fc2_input(_module, args):
        acc.add(f"ffn.{index}", _squared_batch_norms(args[0]))

    def proj_input(_module, args):
        acc.add(f"attn.{index}", _squared_batch_norms(args[0]))

    def norm_output(name: str):
        def hook(_module, _args, output):
            acc.add(name, _squared_batch_norms(output[0] if isinstance(output, tuple) else output))
        return hook

    def block_importance(_module, args, kwargs, output):
        hidden_in = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach().float()
        hidden_out = (output[0] if isinstance(output, tuple) else output).detach().float()
        score = 1.0 - F.cosine_similarity(hidden_in, hidden_out, dim=-1).mean()
        acc.add(f"layer.{index}", score.reshape(1))

    handles.append(layer.mlp.linear_fc2.register_forward_pre_hook(fc2_input))
    handles.append(layer.self_attention.linear_proj.register_forward_pre_hook(proj_input))
    for norm_name in ("input_layernorm", "pre_mlp_layernorm"):
        handles.append(getattr(layer, norm_name).register_forward_hook(norm_output(f"norm.{index}.{norm_name}")))
    handles.append(layer.register_forward_hook(block_importance, with_kwargs=True))
    return handles


def _reduce_over_data_parallel(acc: _Accumulators, model: torch.nn.Module) -> None:
    """Sum every accumulator over the data-parallel group (no-op on one rank or without torch.distributed)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    group = resolve_process_group("dp", getattr(model, "pg_collection", None))
    if get_pg_size(group) == 1:
        return
    keys = sorted(acc.sums)
    flat = torch.cat([acc.sums[k].reshape(-1) for k in keys])
    torch.distributed.all_reduce(flat, group=group)
    offset = 0
    for k in keys:
        n = acc.sums[k].numel()
        acc.sums[k] = flat[offset:offset + n].view_as(acc.sums[k])
        offset += n


def estimate_importance(model: torch.nn.Module, forward_loop: Callable[[torch.nn.Module], None]) -> MinitronImportance:
    """Run ``forward_loop(model)`` (in eval mode, without gradients) with hooks and return the Minitron scores.

    ``model`` is an unwrapped ``GPTModel`` whose layers have separate ``input_layernorm`` / ``pre_mlp_layernorm``
    modules (the local and the Model Optimizer specs); :func:`~.pruning.prune` checks that first.
    """
    config = model.config
    layers = list(model.decoder.layers)
    acc = _Accumulators()
    handles = [h for i, layer in enumerate(layers) for h in _layer_hooks(layer, i, acc)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            forward_loop(model)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    _reduce_over_data_parallel(acc, model)

    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    head_scores, group_scores = [], []
    for i in range(len(layers)):
        per_channel = acc.get(f"attn.{i}").sqrt().view(heads, config.kv_channels)
        head_scores.append(torch.linalg.vector_norm(per_channel, dim=1))
        group_scores.append(torch.linalg.vector_norm(per_channel.view(groups, -1), dim=1))
    hidden = sum(acc.get(f"norm.{i}.{name}").sqrt() for i in range(len(layers))
                 for name in ("input_layernorm", "pre_mlp_layernorm"))
    return MinitronImportance(
        hidden=hidden,
        ffn=[acc.get(f"ffn.{i}").sqrt() for i in range(len(layers))],
        heads=head_scores,
        query_groups=group_scores,
        layers=torch.cat([acc.get(f"layer.{i}") for i in range(len(layers))]),
    )
