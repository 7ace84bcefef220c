"""Quantization-aware training under pipeline parallelism equals one process.

The tiny GPT of ``test_qat.py`` (hidden 32, 2 layers, vocabulary 256, untied output layer) on the main
job's corpus, quantized with FP8_DEFAULT_CFG. On 2 gloo ranks at PP=2 each rank builds its stage (one
layer; the embedding on the first, the final norm and the output layer on the last) holding the
one-process model's weights, calibrates it with the calibration batch run through the library's pipeline
schedule (forward only, so each stage calibrates on the activations the previous one sends), and trains
``STEPS`` steps with the schedule (``get_forward_backward_func``: 1F1B over 2 microbatches of 2 windows,
``finalize_model_grads`` as the config's finalizer) and the library's optimizer (Adam, clipping at 1.0:
the gradient norm is taken over both stages). The one-process reference is ``qat.train_steps`` on the
whole batch of 4 windows.

Compared, in float64 (as ``test_qat.py``'s multi-step TP case, so that other summation orders cannot move
a fake-quantized value across a rounding midpoint; the cross entropy stays fp32): each step's loss
(relative 1e-6), every final weight (1e-6 relative to the tensor's largest entry) and every quantizer's
amax (equal: calibration saw the same values and training keeps it). Measured: losses 9.0e-8, weights
2.7e-8, amax equal. The differences come from the fp32 cross entropy, whose per-token gradients are summed
per microbatch here and over the whole batch in one process (1e-7 relative), which Adam carries into the
weights.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("modelopt")

import tests.post_training.test_qat as qat_test  # noqa: E402  (a module import: its tests are not collected twice)
from megatron_core import parallel_state  # noqa: E402
from megatron_core.distributed import finalize_model_grads  # noqa: E402
from megatron_core.models.gpt import GPTModel  # noqa: E402
from megatron_core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron_core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec  # noqa: E402
from megatron_core.post_training.modelopt.qat import (  # noqa: E402
    lm_loss,
    quantize_for_training,
    token_windows,
    train_steps,
)
from megatron_core.post_training.modelopt.recipes import get_quant_config  # noqa: E402
from megatron_core.transformer import TransformerConfig  # noqa: E402
from tests.dist_harness import run_on_ranks  # noqa: E402
from tests.post_training.quant_test_utils import pipeline_forward  # noqa: E402

RECIPE, STEPS, MICROBATCHES = "FP8_DEFAULT_CFG", 6, 2
DTYPE = torch.float64
LOSS_BOUND, WEIGHT_BOUND = 1e-6, 1e-6


def _windows() -> list[dict[str, torch.Tensor]]:
    return list(token_windows(qat_test.corpus(), qat_test.SEQ, qat_test.BATCH, STEPS, seed=0))


def _calibration_batch() -> dict[str, torch.Tensor]:
    return next(token_windows(qat_test.corpus(), qat_test.SEQ, qat_test.BATCH, 1, seed=99))


def _amax(model: torch.nn.Module, rename=lambda n: n) -> dict[str, torch.Tensor]:
    return {rename(n): b.detach().clone() for n, b in model.named_buffers() if n.endswith("_amax")}


def _stage() -> GPTModel:
    """This pipeline rank's stage of ``test_qat.build``'s GPT (the same config), in ``DTYPE``."""
    hidden = 32
    cfg = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=2 * hidden, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, pipeline_model_parallel_size=2, pipeline_dtype=DTYPE,
                            finalize_model_grads_func=finalize_model_grads)
    model = GPTModel(cfg, get_gpt_modelopt_spec(cfg, local_core_attention=True), qat_test.VOCAB, qat_test.SEQ,
                     position_embedding_type="rope", pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    return model.to(DTYPE)


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, lambda output_tensor: lm_loss(model, output_tensor, batch["loss_mask"])


def _pp2_qat_against_one_process() -> dict:
    """On each rank: max differences of this stage's final weights and amax, and (last stage) the losses."""
    one = qat_test.build(DTYPE)
    full = {n: p.detach().clone() for n, p in one.named_parameters()}
    one = quantize_for_training(one, get_quant_config(RECIPE), qat_test.calibration_loop)
    ref_losses = train_steps(one, qat_test.optimizer_for(one), _windows())
    ref_weights = {n: p.detach().clone() for n, p in one.named_parameters()}
    ref_amax = _amax(one)

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        stage = _stage()
        offset = stage.decoder.layer_offset

        def global_name(name: str) -> str:
            return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)

        with torch.no_grad():
            for name, param in stage.named_parameters():
                param.copy_(full[global_name(name)])
        calib = _calibration_batch()
        stage = quantize_for_training(stage, get_quant_config(RECIPE),
                                      lambda m: pipeline_forward(m, calib["tokens"], calib["position_ids"]))
        optimizer = qat_test.optimizer_for(stage)
        stage.train()
        losses = []
        for batch in _windows():
            size = qat_test.BATCH // MICROBATCHES
            micro = [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(MICROBATCHES)]
            optimizer.zero_grad()
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iter(micro), model=stage,
                num_microbatches=MICROBATCHES, seq_length=qat_test.SEQ, micro_batch_size=size)
            success, _, _ = optimizer.step()
            assert success, "the optimizer skipped a step"
            if parallel_state.is_pipeline_last_stage():
                total = torch.stack([r["lm loss"] for r in reports]).sum(0)
                losses.append((total[0] / total[1]).item())
        weights = {global_name(n): p.detach().clone() for n, p in stage.named_parameters()}
        amax = _amax(stage, global_name)
    finally:
        parallel_state.destroy_model_parallel()
    weight_diffs = {n: ((w - ref_weights[n]).abs().max() / ref_weights[n].abs().max()).item() for n, w in weights.items()}
    amax_diff = max((a - ref_amax[n]).abs().max().item() for n, a in amax.items())
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)) if losses else None
    return {"weights": sorted(weights), "weight": max(weight_diffs.values()), "weight_diffs": weight_diffs, "amax": amax_diff, "amax_count": len(amax),
            "loss": loss_diff, "losses": losses, "ref_losses": ref_losses, "moved": max(
                ((ref_weights[n] - full[n]).abs().max() / full[n].abs().max()).item() for n in weights)}


def test_qat_at_pp2_equals_one_process():
    first, last = run_on_ranks(2, _pp2_qat_against_one_process, timeout=280)
    for rank, result in enumerate((first, last)):
        print(f"PP=2 rank {rank} vs one process ({STEPS} steps, float64): weights {result['weight']:.3g}, "
              f"amax {result['amax']:.3g} ({result['amax_count']} buffers), losses {result['loss']}; "
              f"ours {[round(x, 4) for x in result['losses']]}, one process {[round(x, 4) for x in result['ref_losses']]}")
    for result in (first, last):
        assert result["weight"] < WEIGHT_BOUND and result["amax"] == 0, result
        assert result["moved"] > 1e-3  # the weights trained: the comparison is not of the initial ones
    assert first["loss"] is None and first["losses"] == []  # the first stage has no loss
    assert len(last["losses"]) == STEPS and last["loss"] < LOSS_BOUND, last
    assert last["losses"][-1] < last["losses"][0]
    # the stages together hold every weight of the one-process model, each once
    names = set(first["weights"]) | set(last["weights"])
    assert not set(first["weights"]) & set(last["weights"])
    assert names == set(dict(qat_test.build().named_parameters())), names
    assert first["amax_count"] > 0 and last["amax_count"] > 0
