"""Functions run on gloo ranks by the HF bridge tests (module level, so the ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.hf import AutoBridge
from megatron_core.training import load_checkpoint, save_checkpoint
from tests.models.hf.hf_models import BATCH, SEQ, batch


def _setup(tp: int, pp: int, ep: int = 1) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(1)


def logits_of(model: torch.nn.Module) -> torch.Tensor | None:
    """Full-vocabulary logits of :func:`batch` through this rank's stage (PP via send/recv); ``None`` off the last stage."""
    ids, pos = batch()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    with torch.no_grad():
        if not first:
            hidden = torch.empty(SEQ, BATCH, model.config.hidden_size, dtype=model.config.params_dtype)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids if first else None, pos, None, runtime_gather_output=True)
        if pp > 1 and not last:
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
    return out.float() if last else None


def import_check_export(hf_dir: str, out_dir: str, tp: int, pp: int, ep: int = 1,
                        grouped_experts: bool = False) -> torch.Tensor | None:
    """Import at (tp, pp, ep) (MoE experts in the grouped layout if asked), return the last stage's logits, export
    to ``out_dir`` (collective)."""
    _setup(tp, pp, ep)
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    config = bridge.transformer_config(perform_initialization=False, moe_grouped_gemm=True) if grouped_experts else None
    (model,) = bridge.to_megatron_model(config=config)
    model.eval()
    logits = logits_of(model)
    bridge.save_hf_pretrained(model, out_dir)
    return logits


def train_then_export(hf_dir: str, out_dir: str, tp: int, steps: int = 3) -> torch.Tensor | None:
    """Import at TP=``tp``, take ``steps`` SGD steps on a fixed batch, export; return the trained logits."""
    _setup(tp, 1)
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    (model,) = bridge.to_megatron_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, pos = batch()
    labels = torch.roll(ids, -1, dims=1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    model.eval()
    logits = logits_of(model)
    bridge.save_hf_pretrained(model, out_dir)
    return logits


def load_converted_checkpoint(ckpt: str, hf_dir: str, resave: str, tp: int, pp: int) -> torch.Tensor | None:
    """Load a ``megatron-convert`` checkpoint at (tp, pp) through ``load_checkpoint``; re-save it in the training layout."""
    _setup(tp, pp)
    bridge = AutoBridge.from_hf_pretrained(hf_dir, load_weights=False)
    chunks = bridge.to_megatron_model(load_weights=False)
    state = load_checkpoint(ckpt, chunks, None, None, load_optimizer=False, load_rng=False, strict=True)
    assert state is not None and state["iteration"] == 0
    chunks[0].eval()
    logits = logits_of(chunks[0])
    save_checkpoint(resave, 3, chunks, None, None)
    return logits


def gradients_as_hf(hf_dir: str, out_dir: str, tp: int) -> float:
    """Import at TP=``tp``, take the mean next-token loss of :func:`batch` and backpropagate; export every
    parameter's gradient in place of its value (so ``out_dir`` holds the gradients under HF names); return the loss."""
    _setup(tp, 1)
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    (model,) = bridge.to_megatron_model()
    model.eval()
    ids, pos = batch()
    loss = model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean()
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.grad)
    bridge.save_hf_pretrained(model, out_dir)
    return loss.item()
