"""A toy pipeline model for the schedule tests: a stack of Linear+tanh layers split over stages.

Stage chunks hold consecutive global layers; the first stage reads the microbatch's ``x``
(``[s, b, h]``), the others the tensor received from the previous stage; the loss (MSE against
``y``) is computed by the forward-step function on the last stage. Weights depend only on the
global layer index, so any split equals the single-process model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_core.model_parallel_config import ModelParallelConfig

HIDDEN = 8
NUM_LAYERS = 8


@dataclass
class ToyConfig(ModelParallelConfig):
    """``ModelParallelConfig`` plus the two fields the schedules read from ``TransformerConfig``."""

    hidden_size: int = HIDDEN
    calculate_per_token_loss: bool = False


def layer_weights(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic weight and bias of global layer ``index``."""
    gen = torch.Generator().manual_seed(1000 + index)
    weight = torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    bias = torch.randn(HIDDEN, generator=gen) * 0.1
    return weight, bias


class ToyStage(torch.nn.Module):
    """Global layers ``layer_ids`` of the stack; ``pre_process`` marks the stage that reads the data."""

    def __init__(self, config: ToyConfig, layer_ids: list[int], pre_process: bool) -> None:
        super().__init__()
        self.config = config
        self.layer_ids = list(layer_ids)
        self.pre_process = pre_process
        self.layers = torch.nn.ModuleList()
        for index in layer_ids:
            layer = torch.nn.Linear(HIDDEN, HIDDEN)
            weight, bias = layer_weights(index)
            with torch.no_grad():
                layer.weight.copy_(weight)
                layer.bias.copy_(bias)
            self.layers.append(layer)
        self.input_tensor: torch.Tensor | None = None
        self.first_microbatch_calls = 0

    def set_input_tensor(self, input_tensor) -> None:
        """Called by the schedule with a one-element list (the activation from the previous stage)."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def set_is_first_microbatch(self) -> None:
        """Counts the schedule's first-microbatch signals."""
        self.first_microbatch_calls += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x if self.pre_process else self.input_tensor
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return hidden

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        """Gradients keyed by global layer: ``"3.weight"``."""
        out = {}
        for index, layer in zip(self.layer_ids, self.layers):
            for name, param in layer.named_parameters():
                out[f"{index}.{name}"] = None if param.grad is None else param.grad.clone()
        return out


class Wrapper(torch.nn.Module):
    """Stands for DDP/Float16Module: keeps the model in ``.module`` and hides its methods."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def make_batches(num_microbatches: int, seed: int, seq_lengths: list[int] | None = None, mbs: int = 2) -> list[dict]:
    """Microbatches ``{"x", "y", "mask"}`` of shape ``[s, b, h]`` (mask ``[s, b]``), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(num_microbatches):
        s = seq_lengths[i % len(seq_lengths)] if seq_lengths else 4
        mask = (torch.rand(s, mbs, generator=gen) > 0.3).float()
        mask[0, 0] = 1.0
        batches.append({
            "x": torch.randn(s, mbs, HIDDEN, generator=gen),
            "y": torch.randn(s, mbs, HIDDEN, generator=gen),
            "mask": mask,
        })
    return batches


def forward_step(data_iterator, model):
    """Mean-squared-error loss, the ``(loss, logs)`` form of ``loss_func``."""
    batch = next(data_iterator)
    output = model(batch["x"])

    def loss_func(output_tensor):
        loss = ((output_tensor - batch["y"]) ** 2).mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def forward_step_per_token(data_iterator, model):
    """Masked sum of squared errors with the token count, the ``(loss, num_tokens, logs)`` form."""
    batch = next(data_iterator)
    output = model(batch["x"])

    def loss_func(output_tensor):
        per_token = ((output_tensor - batch["y"]) ** 2).sum(-1)
        loss = (per_token * batch["mask"]).sum()
        num_tokens = batch["mask"].sum().to(torch.int)
        return loss, num_tokens, {"loss": torch.stack([loss.detach(), num_tokens.float()])}

    return output, loss_func


def forward_step_collect(data_iterator, model):
    """Collects the output's sum as non-loss data when asked (``collect_non_loss_data``)."""
    batch = next(data_iterator)
    output = model(batch["x"])

    def loss_func(output_tensor, non_loss_data=False):
        if non_loss_data:
            return {"sum": output_tensor.detach().sum()}
        loss = ((output_tensor - batch["y"]) ** 2).mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def stage_layer_ids(pp_rank: int, pp_size: int, chunk: int = 0, num_chunks: int = 1) -> list[int]:
    """Global layers of chunk ``chunk`` on rank ``pp_rank``: virtual stage ``chunk * pp_size + pp_rank``."""
    per_stage = NUM_LAYERS // (pp_size * num_chunks)
    stage = chunk * pp_size + pp_rank
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def reference(batches: list[dict], step=forward_step, config: ToyConfig | None = None) -> dict:
    """Single-process run of the whole stack with ``forward_backward_no_pipelining``: losses and grads."""
    from megatron_core.pipeline_parallel import forward_backward_no_pipelining

    config = config or ToyConfig()
    model = ToyStage(config, list(range(NUM_LAYERS)), pre_process=True)
    losses = forward_backward_no_pipelining(
        forward_step_func=step, data_iterator=iter(batches), model=model,
        num_microbatches=len(batches), seq_length=4, micro_batch_size=2,
    )
    return {"losses": [d["loss"] for d in losses], "grads": model.named_grads()}
