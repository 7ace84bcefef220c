"""Quantization-aware training: a fake-quantized tiny GPT keeps training on the main job's corpus.

The corpus is ``examples/main_job.py``'s (the Python standard library's sources, collected by its
``collect_corpus``), read as bytes (vocabulary 256), cut into random windows by ``qat.token_windows``.
The model (hidden 32, 2 layers, the Model Optimizer spec) is quantized with a predefined recipe and
calibrated on one batch, then trained with the library's optimizer (Adam, clipping at 1.0).

* On one process, 50 steps lower the loss (mean of the last 10 steps below 75 % of the first 10;
  measured FP8: 5.086 -> 2.921, INT8: 5.087 -> 2.880), the calibrated amax stay as they were, and every
  quantized linear's weight trains (straight-through gradients).
* At TP=2 the loss and every gradient (each rank's shard) equal one process's: in fp32 for the first step
  (bounds 1e-6 relative for the loss, 1e-5 relative to the largest entry for the gradients; measured:
  equal losses, gradients 4.9e-7), and over a 12-step loss curve (gradients at steps 1 and 12) in float64.
  Later fp32 steps are not compared: the row-parallel all-reduce sums in another order than one process
  (1e-7 relative), which can move a fake-quantized value across a rounding midpoint (a whole FP8 step),
  and Adam's first update (about ``lr * sign(gradient)``) turns noise in a near-zero gradient entry into
  a whole ``lr``. In float64 that noise is 1e-16; the cross entropy is computed in fp32 either way
  (Megatron-Core casts the logits), so the bounds stay those of fp32; measured: equal losses (the FP8
  products are exact in fp32 and the input quantizers snap small differences back to the grid),
  gradients 1.6e-7 (the fp32 softmax of the backward).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("modelopt")

from megatron_core import parallel_state, tensor_parallel  # noqa: E402
from megatron_core.models.gpt import GPTModel  # noqa: E402
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec  # noqa: E402
from megatron_core.post_training.modelopt.qat import quantize_for_training, token_windows, train_steps  # noqa: E402
from megatron_core.post_training.modelopt.recipes import get_quant_config  # noqa: E402
from megatron_core.transformer import TransformerConfig  # noqa: E402
from tests.dist_harness import run_on_ranks  # noqa: E402
from tests.models.gpt_test_utils import shard  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, TP_STEPS = 256, 32, 4, 50, 12
LR = 3e-3


@cache
def corpus(max_bytes: int = 200_000) -> torch.Tensor:
    """The main job's corpus (stdlib sources as ``examples/main_job.py`` collects them) as a byte stream."""
    import tempfile

    from examples.main_job import collect_corpus

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stdlib.jsonl"
        collect_corpus(path, max_bytes)
        text = "\n".join(json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines())
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def build(dtype: torch.dtype = torch.float32, seed: int = 1234, hidden: int = 32, **overrides) -> GPTModel:
    """A tiny Llama-like GPT (RMSNorm, GQA, SwiGLU, RoPE) on the Model Optimizer spec, vocab-parallel output."""
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=2 * hidden, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, **overrides)
    model = GPTModel(cfg, get_gpt_modelopt_spec(cfg, local_core_attention=True), VOCAB, SEQ,
                     position_embedding_type="rope")
    return model.to(dtype)


def calibration_loop(model: torch.nn.Module) -> None:
    """Model Optimizer's ``forward_loop``: one corpus batch (seed 99, not a training batch)."""
    batch = next(token_windows(corpus(), SEQ, BATCH, 1, seed=99))
    with torch.no_grad():
        model(batch["tokens"], batch["position_ids"], None)


def optimizer_for(model: torch.nn.Module):
    """The library's optimizer: Adam, no weight decay, gradient clipping at 1.0."""
    return get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=1.0), [model])


def quantized_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every linear layer of the decoder that carries a weight quantizer."""
    return {n: m for n, m in model.named_modules() if n.startswith("decoder") and hasattr(m, "weight_quantizer")}


@pytest.mark.parametrize("recipe", ["FP8_DEFAULT_CFG", "INT8_DEFAULT_CFG"])
def test_qat_loss_decreases_over_50_steps_with_amax_kept(recipe):
    model = quantize_for_training(build(), get_quant_config(recipe), calibration_loop)
    linears = quantized_linears(model)
    assert len(linears) == 8 and all(m.weight_quantizer.is_enabled for m in linears.values())
    amax = {n: m.weight_quantizer.amax.clone() for n, m in linears.items()}
    weights = {n: m.weight.detach().clone() for n, m in linears.items()}
    losses = train_steps(model, optimizer_for(model), token_windows(corpus(), SEQ, BATCH, STEPS, seed=0))
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"{recipe}: mean loss of steps 1-10 {first:.4f}, of steps 41-50 {last:.4f}")
    assert len(losses) == STEPS and last < 0.75 * first, (first, last)
    for name, linear in linears.items():
        torch.testing.assert_close(linear.weight_quantizer.amax, amax[name], rtol=0, atol=0)  # calibration kept
        assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0, name
        assert not torch.equal(linear.weight.detach(), weights[name]), f"{name} did not train"


def _run(model: torch.nn.Module, snapshot_steps: tuple[int, ...], steps: int) -> tuple[list[float], dict]:
    """Losses of ``steps`` QAT steps and every parameter's gradient at ``snapshot_steps``."""
    grads: dict[int, dict[str, torch.Tensor]] = {}

    def on_step(step: int, info: dict) -> None:
        if step in snapshot_steps:
            grads[step] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    losses = train_steps(model, optimizer_for(model), token_windows(corpus(), SEQ, BATCH, steps, seed=0),
                         on_step=on_step)
    return losses, grads


def _tp2_qat_against_one_process(recipe: str, dtype: torch.dtype, num_steps: int) -> dict:
    """On each rank: (max relative loss difference, max relative gradient difference, parameters compared)."""
    steps = tuple(sorted({0, num_steps - 1}))
    one = build(dtype)
    full = {n: p.detach().clone() for n, p in one.named_parameters()}
    ref_losses, ref_grads = _run(quantize_for_training(one, get_quant_config(recipe), calibration_loop), steps,
                                 num_steps)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_tensor_model_parallel_rank()
        model = build(dtype, tensor_model_parallel_size=2)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, full[name], 2, rank, gated=True))
        losses, grads = _run(quantize_for_training(model, get_quant_config(recipe), calibration_loop), steps,
                             num_steps)
    finally:
        parallel_state.destroy_model_parallel()
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    grad_diff, compared = 0.0, 0
    for step in steps:
        assert set(grads[step]) == set(ref_grads[step])
        for name, grad in grads[step].items():
            ref = shard(name, ref_grads[step][name], 2, rank, gated=True)
            grad_diff = max(grad_diff, ((grad - ref).abs().max() / ref.abs().max()).item())
            compared += 1
    return {"loss": loss_diff, "grad": grad_diff, "compared": compared, "losses": losses}


# (dtype, steps, loss bound, gradient bound); see the module docstring.
QAT_PARITY = [(torch.float32, 1, 1e-6, 1e-5), (torch.float64, TP_STEPS, 1e-6, 1e-5)]


@pytest.mark.parametrize(("dtype", "steps", "loss_bound", "grad_bound"), QAT_PARITY, ids=["fp32", "fp64"])
def test_qat_at_tp2_equals_one_process(dtype, steps, loss_bound, grad_bound):
    for result in run_on_ranks(2, _tp2_qat_against_one_process, "FP8_DEFAULT_CFG", dtype, steps, timeout=280):
        print(f"TP=2 {dtype} vs one process: loss {result['loss']:.3g}, gradients {result['grad']:.3g} "
              f"({result['compared']} compared); losses {[round(x, 4) for x in result['losses']]}")
        assert result["compared"] >= 15 * len({0, steps - 1})
        assert result["loss"] < loss_bound and result["grad"] < grad_bound, result
        assert steps == 1 or result["losses"][-1] < result["losses"][0]
