"""Tiny models and a single-process reference trainer shared by the DP / optimizer tests.

``TiedNet`` is ``out = ln(l2(gelu(l1(x @ W.T)))) @ W`` with one weight ``W`` used at both ends
(a tied embedding / output layer in miniature). The TP and PP variants hold slices or stages of
the same weights, so every rank's parameters can be compared with the reference after training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_core import parallel_state
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

D_IN, HIDDEN = 8, 16
GLOBAL_BATCH, NUM_MICROBATCHES = 16, 2
LR, WD, CLIP = 0.01, 0.1, 0.05


class TiedNet(torch.nn.Module):
    """The single-process reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Parameter(torch.randn(HIDDEN, D_IN) * 0.3)
        self.l1 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.l2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.ln = torch.nn.LayerNorm(HIDDEN)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.l1(x @ self.embedding.t()))
        return self.ln(self.l2(h)) @ self.embedding


def make_reference(seed: int = 1234) -> TiedNet:
    """The reference model with deterministic weights."""
    torch.manual_seed(seed)
    return TiedNet()


def make_data(steps: int, seed: int = 99) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (x, y) global batch per step."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, D_IN, generator=g), torch.randn(GLOBAL_BATCH, D_IN, generator=g))
            for _ in range(steps)]


def microbatches(x: torch.Tensor, y: torch.Tensor, dp_rank: int, dp_size: int):
    """This DP rank's slice of the global batch, split into microbatches."""
    local = GLOBAL_BATCH // dp_size
    xs, ys = x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local]
    return list(zip(xs.chunk(NUM_MICROBATCHES), ys.chunk(NUM_MICROBATCHES)))


def train_reference(steps: int, clip: float = CLIP, optimizer: str = "adam") -> tuple[dict, list[float]]:
    """Train the reference with torch's optimizer and clip_grad_norm_; return final params and norms."""
    model = make_reference()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() == 1]
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    if optimizer == "adam":
        opt = torch.optim.AdamW(groups, lr=LR)
    else:
        opt = torch.optim.SGD(groups, lr=LR, momentum=0.9)
    norms = []
    for x, y in make_data(steps):
        opt.zero_grad()
        for xm, ym in zip(x.chunk(NUM_MICROBATCHES), y.chunk(NUM_MICROBATCHES)):
            (F.mse_loss(model(xm), ym) / NUM_MICROBATCHES).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


class TiedNetTP(torch.nn.Module):
    """``TiedNet`` with ``l1`` column-parallel and ``l2`` row-parallel (megatron_core.tensor_parallel layers).

    Inputs are ``[s, b, D_IN]``. With ``sequence_parallel`` each TP rank gets its own slice of the
    sequence; the replicated params then see only that slice, so they are tagged
    ``sequence_parallel`` and ``finalize_model_grads`` sums their gradients over TP.
    """

    def __init__(self, ref: TiedNet, sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        self.config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                                          perform_initialization=False)
        self.embedding = torch.nn.Parameter(ref.embedding.detach().clone())
        self.l1 = ColumnParallelLinear(HIDDEN, HIDDEN, config=self.config, init_method=torch.nn.init.zeros_)
        self.l2 = RowParallelLinear(HIDDEN, HIDDEN, config=self.config, init_method=torch.nn.init.zeros_,
                                    bias=True, input_is_parallel=True, skip_bias_add=False)
        self.ln = torch.nn.LayerNorm(HIDDEN)
        with torch.no_grad():
            self.l1.weight.copy_(ref.l1.weight.chunk(tp, dim=0)[rank])
            self.l1.bias.copy_(ref.l1.bias.chunk(tp, dim=0)[rank])
            self.l2.weight.copy_(ref.l2.weight.chunk(tp, dim=1)[rank])
            self.l2.bias.copy_(ref.l2.bias)
        self.ln.load_state_dict(ref.ln.state_dict())
        if sequence_parallel:
            for param in (self.embedding, self.ln.weight, self.ln.bias):
                param.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.l1(x @ self.embedding.t())
        h, _ = self.l2(F.gelu(h))
        return self.ln(h) @ self.embedding

    def reference_view(self) -> dict[str, torch.Tensor]:
        """This rank's params under the reference names (TP shards still sharded)."""
        return {"embedding": self.embedding, "l1.weight": self.l1.weight, "l1.bias": self.l1.bias,
                "l2.weight": self.l2.weight, "l2.bias": self.l2.bias, "ln.weight": self.ln.weight,
                "ln.bias": self.ln.bias}


@dataclass
class StageConfig(ModelParallelConfig):
    """``ModelParallelConfig`` plus the ``TransformerConfig`` fields the pipeline schedules read."""

    hidden_size: int = HIDDEN
    calculate_per_token_loss: bool = False


class TiedNetStage(torch.nn.Module):
    """One of two pipeline stages of ``TiedNet``; the last stage keeps a tied copy of the embedding."""

    def __init__(self, ref: TiedNet, first: bool) -> None:
        super().__init__()
        self.config = StageConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
        self.first = first
        self.input_tensor: torch.Tensor | None = None
        self.share_embeddings_and_output_weights = True
        if first:
            self.embedding = torch.nn.Parameter(ref.embedding.detach().clone())
            self.l1 = torch.nn.Linear(HIDDEN, HIDDEN)
            self.l1.load_state_dict(ref.l1.state_dict())
        else:
            self.l2 = torch.nn.Linear(HIDDEN, HIDDEN)
            self.l2.load_state_dict(ref.l2.state_dict())
            self.ln = torch.nn.LayerNorm(HIDDEN)
            self.ln.load_state_dict(ref.ln.state_dict())
            self.output_weight = torch.nn.Parameter(ref.embedding.detach().clone())
            self.output_weight.shared = True
        self.shared_embedding_or_output_weight().shared_embedding = True

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        """The tied weight held by this stage."""
        return self.embedding if self.first else self.output_weight

    def set_input_tensor(self, input_tensor) -> None:
        """The activation received from the previous stage (called by the schedule)."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            return F.gelu(self.l1(x @ self.embedding.t()))
        return self.ln(self.l2(self.input_tensor)) @ self.output_weight

    def reference_view(self) -> dict[str, torch.Tensor]:
        """This stage's params under the reference names."""
        if self.first:
            return {"embedding": self.embedding, "l1.weight": self.l1.weight, "l1.bias": self.l1.bias}
        return {"embedding": self.output_weight, "l2.weight": self.l2.weight, "l2.bias": self.l2.bias,
                "ln.weight": self.ln.weight, "ln.bias": self.ln.bias}
