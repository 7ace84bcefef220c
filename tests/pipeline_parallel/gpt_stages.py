"""Tiny GPTModel pipeline chunks loaded from a single-process model (helper for PP/optimizer tests).

``StageChunks`` builds (through ``get_model``) this rank's chunks (one per virtual stage) and copies in the TP
shard of the reference weights under their global layer names; the last stage's copy of a tied
word embedding is keyed ``TIED_LAST`` so tests can check it separately from the first stage's.
"""

from __future__ import annotations

import re
from functools import partial

import torch

from megatron_core import parallel_state
from megatron_core.models.gpt import GPTModel
from megatron_core.training.model_builder import get_model
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.pipeline_layout import get_transformer_layer_offset
from tests.models.gpt_test_utils import BATCH as MBS
from tests.models.gpt_test_utils import SEQ, VOCAB, gpt_provider, shard

__all__ = ["EMBEDDING", "MBS", "SEQ", "TIED_LAST", "StageChunks", "gpt_forward_step", "make_batches", "reference_state"]
TIED_LAST = "output_layer.weight@last_stage"
EMBEDDING = "embedding.word_embeddings.weight"


def gpt_forward_step(data_iterator, model):
    """A user's forward step: masked mean of the per-token loss over the microbatch."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"].reshape(-1).float()
        loss = torch.sum(output_tensor.float().reshape(-1) * mask) / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def make_batches(count: int, seed: int) -> list[dict]:
    """``count`` microbatches of ``[MBS, SEQ]`` tokens, labels, loss mask and positions."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        mask = (torch.rand(MBS, SEQ, generator=gen) > 0.25).float()
        mask[0, 0] = 1.0
        out.append({
            "tokens": torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
            "labels": torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
            "loss_mask": mask,
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ),
        })
    return out


def reference_state(spec: dict, seed: int = 1234) -> tuple[GPTModel, dict[str, torch.Tensor]]:
    """The single-process model and a copy of its initial weights."""
    torch.manual_seed(seed)
    model = gpt_provider(spec, config=TransformerConfig(**spec["config"]))
    return model, {k: v.detach().clone() for k, v in model.named_parameters()}


def _global_name(name: str, offset: int) -> str:
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


class StageChunks:
    """This rank's GPT chunks with a map from each parameter to its name in the single-process model."""

    def __init__(self, spec: dict, config: TransformerConfig, ref_state: dict[str, torch.Tensor]) -> None:
        vpp = config.virtual_pipeline_model_parallel_size
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        gated = spec["config"].get("gated_linear_unit", False)
        tied = spec["model"].get("share_embeddings_and_output_weights", False)
        self.chunks: list[GPTModel] = []
        self.names: dict[torch.nn.Parameter, str] = {}
        self.init_tied: dict[str, torch.Tensor] = {}
        chunks = get_model(partial(gpt_provider, spec), wrap_with_ddp=False, config=config)
        for v, chunk in enumerate(chunks):
            first, last = chunk.pre_process, chunk.post_process
            if tied and (first or last):
                self.init_tied["first" if first else "last"] = chunk.shared_embedding_or_output_weight().detach().clone()
            offset = get_transformer_layer_offset(config, vp_stage=v if vpp else None)
            for name, param in chunk.named_parameters():
                key = _global_name(name, offset)
                if name == "output_layer.weight" and tied and not first:
                    key = TIED_LAST
                self.names[param] = key
                ref_key = EMBEDDING if key == TIED_LAST else key
                with torch.no_grad():
                    param.copy_(shard(ref_key, ref_state[ref_key], tp, tp_rank, gated))
            self.chunks.append(chunk)

    def grads(self, use_main_grad: bool) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient (``main_grad`` under DDP) by reference name."""
        out = {}
        for param, key in self.names.items():
            grad = param.main_grad if use_main_grad else param.grad
            out[key] = None if grad is None else grad.detach().clone()
        return out

    def params(self) -> dict[str, torch.Tensor]:
        """Every parameter by reference name."""
        return {key: param.detach().clone() for param, key in self.names.items()}
