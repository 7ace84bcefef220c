"""Knowledge distillation through Model Optimizer's ``mtd.convert`` with this library's TP-aware losses.

* The vocab-parallel KL equals a plain PyTorch KL (``F.kl_div`` of full-vocabulary log-softmaxes), value
  and gradient, forward and reverse, at two temperatures: on one process, and at TP=2 against the
  gathered logits (each rank holds half the vocabulary).
* A student (hidden 32) distilled from a wider, differently initialised frozen teacher (hidden 64) on the
  main job's corpus, with the logit KL and an MSE loss between the final norms' outputs (through the
  projection 32 -> 64): the KL falls over 30 steps (mean of the last 5 below 60 % of the first 5;
  measured 0.0123 -> 0.0027; the MSE 0.995 -> 0.408), the teacher does not change.
* At TP=2 (student and teacher sharded) the KL and the intermediate loss of every step and every student
  gradient (projection included) equal one process's: fp32 at the first step within 1e-5 relative
  (measured 1.4e-6 loss, 1.5e-6 gradients), float64 over 6 steps within 1e-10 (measured 7e-15, 4e-14),
  and float64 with sequence parallelism over 3 steps (measured 1e-15, 8e-14); see :data:`PARITY` for
  why later fp32 steps are not compared.
* At PP=2 (student and teacher each split into two stages; the stages pass ``[student; teacher]``
  activations, the schedule's shapes widened by ``get_tensor_shapes_adjust_fn_for_distillation``; an MSE
  loss on global layer 1, the last stage's local layer 0) the KL of both microbatches and every student
  gradient of every stage equal one process's in float64 (bound 1e-10; measured equal).
* Quantization-aware distillation: an FP8-quantized student's KL (temperature 2) falls over 20 steps
  (measured 0.00308 -> 0.00101, means of 5 steps).
* Bad input: vocab sizes that differ, a temperature <= 0, an unknown intermediate loss: ``ValueError``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("modelopt")

from megatron_core import parallel_state, tensor_parallel  # noqa: E402
from megatron_core.post_training.modelopt.distillation import (  # noqa: E402
    DistillationConfig,
    convert_to_distillation_model,
    distillation_loss,
)
from megatron_core.post_training.modelopt.distillation_losses import (  # noqa: E402
    LogitsKLLoss,
    vocab_parallel_kl_divergence,
)
from megatron_core.post_training.modelopt.qat import token_windows, train_steps  # noqa: E402
from tests.dist_harness import run_on_ranks  # noqa: E402
from tests.models.gpt_test_utils import shard  # noqa: E402
from tests.post_training.test_qat import BATCH, SEQ, build, corpus, optimizer_for  # noqa: E402

PAIRS = [("decoder.final_layernorm", "decoder.final_layernorm", "mse")]


def _plain_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float, reverse: bool) -> torch.Tensor:
    """Per-token KL of full-vocabulary logits with plain PyTorch (teacher || student unless ``reverse``)."""
    log_s = F.log_softmax(student / temperature, dim=-1)
    log_t = F.log_softmax(teacher / temperature, dim=-1)
    if reverse:
        return F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    return F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)


def _kl_cases(tp_group=None, tp: int = 1, rank: int = 0) -> float:
    """Max |difference| of value and student gradient from the plain KL over the cases (this rank's shard)."""
    worst = 0.0
    gen = torch.Generator().manual_seed(3)
    for temperature in (1.0, 2.5):
        for reverse in (False, True):
            student = (3 * torch.randn(5, 2, 64, generator=gen, dtype=torch.float64)).requires_grad_()
            teacher = 3 * torch.randn(5, 2, 64, generator=gen, dtype=torch.float64)
            weight = torch.rand(5, 2, generator=gen, dtype=torch.float64)
            (_plain_kl(student, teacher, temperature, reverse) * weight).sum().backward()
            local = student.detach().chunk(tp, dim=-1)[rank].clone().requires_grad_()
            kl = vocab_parallel_kl_divergence(local, teacher.chunk(tp, dim=-1)[rank], temperature, reverse, tp_group)
            (kl * weight).sum().backward()
            ref = _plain_kl(student.detach(), teacher, temperature, reverse)
            worst = max(worst, (kl - ref).abs().max().item(),
                        (local.grad - student.grad.chunk(tp, dim=-1)[rank]).abs().max().item())
    return worst


def test_kl_equals_plain_pytorch_kl_value_and_gradient():
    assert _kl_cases() < 1e-12
    loss = LogitsKLLoss(build().config, temperature=2.0)
    student, teacher = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    out = loss((student, None), (teacher, None))  # an output layer's (logits, bias)
    torch.testing.assert_close(out, _plain_kl(student, teacher, 2.0, False).T, rtol=1e-6, atol=1e-6)


def _models(dtype: torch.dtype = torch.float32, **overrides):
    """(student hidden 32 seed 1, teacher hidden 64 seed 2), the same on every rank."""
    return build(dtype, seed=1, hidden=32, **overrides), build(dtype, seed=2, hidden=64, **overrides)


def _distil(model, steps: int, snapshot: tuple[int, ...] = ()) -> tuple[list[dict], dict]:
    """Per-step reports (means over tokens) of ``steps`` distillation steps; student gradients at ``snapshot``."""
    reports, grads = [], {}

    def on_step(step: int, info: dict) -> None:
        reports.append(info["report"])
        if step in snapshot:
            grads[step] = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.requires_grad and p.grad is not None}

    train_steps(model, optimizer_for(model), token_windows(corpus(), SEQ, BATCH, steps, seed=0),
                loss_func=distillation_loss, on_step=on_step)
    return reports, grads


def test_student_kl_to_teacher_falls_and_teacher_stays_frozen():
    student, teacher = _models()
    teacher_before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    model = convert_to_distillation_model(student, teacher, DistillationConfig(intermediate_layer_pairs=PAIRS))
    assert not any(k.startswith("_teacher_model") for k in model.state_dict())
    reports, _ = _distil(model, 30)
    kl = [r["logits distillation loss"] for r in reports]
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    print(f"KL to the teacher: steps 1-5 {first:.4f}, steps 26-30 {last:.4f}; "
          f"intermediate MSE {reports[0]['intermediate distillation loss']:.4f} -> "
          f"{reports[-1]['intermediate distillation loss']:.4f}")
    assert last < 0.6 * first, kl
    assert reports[-1]["intermediate distillation loss"] < reports[0]["intermediate distillation loss"]
    for name, param in teacher.named_parameters():
        assert torch.equal(param.detach(), teacher_before[name]), f"teacher's {name} changed"


def test_quantized_student_distils():
    """Quantization-aware distillation: an FP8 fake-quantized student trained against the teacher."""
    from megatron_core.post_training.modelopt.qat import quantize_for_training
    from megatron_core.post_training.modelopt.recipes import get_quant_config
    from tests.post_training.test_qat import calibration_loop

    student, teacher = _models()
    student = quantize_for_training(student, get_quant_config("FP8_DEFAULT_CFG"), calibration_loop)
    model = convert_to_distillation_model(student, teacher, DistillationConfig(logit_kl_temperature=2.0))
    reports, _ = _distil(model, 20)
    kl = [r["logits distillation loss"] for r in reports]
    print(f"quantized student, T=2: KL {sum(kl[:5]) / 5:.5f} -> {sum(kl[-5:]) / 5:.5f}")
    assert sum(kl[-5:]) < 0.6 * sum(kl[:5]), kl
    assert all(r["intermediate distillation loss"] == 0 for r in reports)  # logits only
    assert model.decoder.layers[0].mlp.linear_fc1.weight_quantizer.is_enabled


def _tp2_distillation_against_one_process(dtype: torch.dtype, steps: int, sequence_parallel: bool = False) -> dict:
    """On each rank: the KL check against gathered logits and the TP=2 distillation against one process."""
    snapshot = tuple(sorted({0, steps - 1}))
    student, teacher = _models(dtype)
    full = {"s": dict(student.named_parameters()), "t": dict(teacher.named_parameters())}
    full = {k: {n: p.detach().clone() for n, p in v.items()} for k, v in full.items()}
    one = convert_to_distillation_model(student, teacher, DistillationConfig(intermediate_layer_pairs=PAIRS))
    projection = {n: p.detach().clone() for n, p in one.named_parameters() if n.startswith("_loss_modules")}
    ref_reports, ref_grads = _distil(one, steps, snapshot)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_tensor_model_parallel_rank()
        kl_check = _kl_cases(parallel_state.get_tensor_model_parallel_group(), 2, rank)
        gathered, other = _models(dtype, tensor_model_parallel_size=2)
        gathered.output_layer.gather_output = True  # as parallel_output=False builds it
        with pytest.raises(ValueError, match=r"student's output layer gathers its logits over TP"):
            convert_to_distillation_model(gathered, other)
        student, teacher = _models(dtype, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        with torch.no_grad():
            for key, model in (("s", student), ("t", teacher)):
                for name, param in model.named_parameters():
                    param.copy_(shard(name, full[key][name], 2, rank, gated=True))
        model = convert_to_distillation_model(student, teacher, DistillationConfig(intermediate_layer_pairs=PAIRS))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in projection:
                    param.copy_(projection[name])
        reports, grads = _distil(model, steps, snapshot)
    finally:
        parallel_state.destroy_model_parallel()
    loss_diff = max(abs(r[k] - ref[k]) / abs(ref[k]) for r, ref in zip(reports, ref_reports, strict=True)
                    for k in ("logits distillation loss", "intermediate distillation loss"))
    grad_diff, compared = 0.0, 0
    for step in snapshot:
        assert set(grads[step]) == set(ref_grads[step]), sorted(set(grads[step]) ^ set(ref_grads[step]))
        for name, grad in grads[step].items():
            ref = shard(name, ref_grads[step][name], 2, rank, gated=True)
            grad_diff = max(grad_diff, ((grad - ref).abs().max() / ref.abs().max()).item())
            compared += 1
    kl = [r["logits distillation loss"] for r in reports]
    return {"kl_check": kl_check, "loss": loss_diff, "grad": grad_diff, "compared": compared, "kl": kl}


# (dtype, steps, bound): fp32 for the first step; float64 over 6 steps. Adam's first update is about
# lr * sign(gradient), so fp32 reduction-order noise in a near-zero gradient entry becomes a whole lr-sized
# difference in the weights, and later gradients differ by more (measured 1.5e-5 relative at step 2, 2e-5 at step 6).
# The last case adds sequence parallelism: the final norms' outputs are split over the sequence, the MSE gathers
# its per-token loss, and the norms' and the projection's gradients are summed over TP (finalize_model_grads).
PARITY = [(torch.float32, 1, 1e-5, False), (torch.float64, 6, 1e-10, False), (torch.float64, 3, 1e-10, True)]


@pytest.mark.parametrize(("dtype", "steps", "bound", "sequence_parallel"), PARITY, ids=["fp32", "fp64", "fp64-sp"])
def test_distillation_at_tp2_equals_one_process(dtype, steps, bound, sequence_parallel):
    for result in run_on_ranks(2, _tp2_distillation_against_one_process, dtype, steps, sequence_parallel,
                               timeout=280):
        print(f"TP=2 {dtype} SP={sequence_parallel}: KL vs gathered plain KL {result['kl_check']:.3g}; losses vs one process {result['loss']:.3g}, "
              f"gradients {result['grad']:.3g} ({result['compared']} compared); KL {[round(x, 4) for x in result['kl']]}")
        assert result["kl_check"] < 1e-12
        assert result["compared"] >= 17 * min(steps, 2)  # 15 student parameters + the projection's 2, per snapshot
        assert result["loss"] < bound and result["grad"] < bound, result
        assert steps == 1 or result["kl"][-1] < result["kl"][0]


def test_bad_input_is_refused_with_clear_errors():
    student, teacher = build(seed=1, hidden=32), build(seed=2, hidden=64)
    teacher.vocab_size = 128  # as a teacher of another tokenizer would be
    with pytest.raises(ValueError, match=r"student's vocab_size \(256\) and the teacher's \(128\) must be equal"):
        convert_to_distillation_model(student, teacher)
    for temperature in (0.0, -1.0):
        with pytest.raises(ValueError, match=rf"logit_kl_temperature \({temperature}\) must be > 0"):
            DistillationConfig(logit_kl_temperature=temperature)
        with pytest.raises(ValueError, match=rf"logit_kl_temperature \({temperature}\) must be > 0"):
            LogitsKLLoss(student.config, temperature=temperature)
        with pytest.raises(ValueError, match=rf"temperature \({temperature}\) must be > 0"):
            vocab_parallel_kl_divergence(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), temperature)
    with pytest.raises(ValueError, match=r"student logits \(2, 1, 8\) and teacher logits \(2, 1, 4\)"):
        vocab_parallel_kl_divergence(torch.zeros(2, 1, 8), torch.zeros(2, 1, 4))
    with pytest.raises(ValueError, match=r"unknown loss 'l1'; known: cosine, mse"):
        DistillationConfig(intermediate_layer_pairs=[("decoder", "decoder", "l1")])


PP_PAIRS = [("decoder.layers.1", "decoder.layers.1", "mse")]  # global layer 1: on the last of 2 stages


def _stage(full: dict, hidden: int, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """This pipeline stage (of 2) of the model ``build(dtype, seed, hidden)``, holding ``full``'s weights."""
    from megatron_core.models.gpt import GPTModel
    from megatron_core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec
    from megatron_core.transformer.pipeline_layout import get_transformer_layer_offset

    rank = parallel_state.get_pipeline_model_parallel_rank()
    cfg = build(dtype, seed, hidden).config
    cfg.pipeline_model_parallel_size, cfg.pipeline_dtype = 2, dtype
    model = GPTModel(cfg, get_gpt_modelopt_spec(cfg, local_core_attention=True), 256, SEQ,
                     position_embedding_type="rope", pre_process=rank == 0, post_process=rank == 1).to(dtype)
    offset = get_transformer_layer_offset(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(full[_global(name, offset)])
    return model


def _global(name: str, offset: int) -> str:
    """A stage's parameter name under the one-process model's layer numbers."""
    import re

    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _pp2_distillation_against_one_process() -> dict:
    """On each stage: max relative differences of the per-microbatch KL and of every student gradient (fp64)."""
    from megatron_core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
    from megatron_core.post_training.modelopt.distillation_pipeline import (
        get_tensor_shapes_adjust_fn_for_distillation,
    )
    from megatron_core.transformer.pipeline_layout import get_transformer_layer_offset

    dtype, config = torch.float64, DistillationConfig(intermediate_layer_pairs=PP_PAIRS)
    batches = list(token_windows(corpus(), SEQ, BATCH, 2, seed=5))
    student, teacher = _models(dtype)
    full = {"s": {n: p.detach().clone() for n, p in student.named_parameters()},
            "t": {n: p.detach().clone() for n, p in teacher.named_parameters()}}
    one = convert_to_distillation_model(student, teacher, config)
    full["s"].update({n: p.detach().clone() for n, p in one.named_parameters() if n.startswith("_loss_modules")})
    one.train()
    ref_kl = []
    for b in batches:
        loss, num_tokens, report = distillation_loss(one, one(b["tokens"], b["position_ids"], None, labels=b["labels"]),
                                                     b["loss_mask"])
        (loss / num_tokens / len(batches)).backward()
        ref_kl.append((report["logits distillation loss"][0] / num_tokens).item())
    ref_grads = {n: p.grad for n, p in one.named_parameters() if p.requires_grad}
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        model = convert_to_distillation_model(_stage(full["s"], 32, 1, dtype), _stage(full["t"], 64, 2, dtype),
                                              DistillationConfig(intermediate_layer_pairs=PP_PAIRS))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.startswith("_loss_modules"):
                    param.copy_(full["s"][name])
        model.train()
        kl = []

        def forward_step(data_iterator, chunk):
            b = next(data_iterator)
            output = chunk(b["tokens"], b["position_ids"], None, labels=b["labels"])

            def loss_func(output_tensor):
                loss, num_tokens, report = distillation_loss(chunk, output_tensor, b["loss_mask"])
                kl.append((report["logits distillation loss"][0] / num_tokens).item())
                return loss / num_tokens, {}

            return output, loss_func

        forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model], num_microbatches=len(batches),
            seq_length=SEQ, micro_batch_size=BATCH,
            adjust_tensor_shapes_fn=get_tensor_shapes_adjust_fn_for_distillation(model))
        offset = get_transformer_layer_offset(model.config)
        grads = {_global(n, offset): p.grad for n, p in model.named_parameters() if p.requires_grad}
        last = model.post_process
    finally:
        parallel_state.destroy_model_parallel()
    grad_diff = max(((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item() for n, g in grads.items())
    kl_diff = max(abs(a - b) / b for a, b in zip(kl, ref_kl, strict=True)) if last else 0.0
    return {"kl": kl_diff, "grad": grad_diff, "compared": sorted(grads), "last": last, "kls": kl}


def test_distillation_at_pp2_equals_one_process():
    results = run_on_ranks(2, _pp2_distillation_against_one_process, timeout=280)
    for result in results:
        print(f"PP=2 stage (last={result['last']}): KL {result['kl']:.3g}, gradients {result['grad']:.3g} "
              f"({len(result['compared'])} compared) KL {result['kls']}")
        assert result["kl"] < 1e-10 and result["grad"] < 1e-10, result
    first, last = results
    assert {"embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"} <= set(first["compared"])
    assert "output_layer.weight" in last["compared"] and "decoder.layers.1.mlp.linear_fc1.weight" in last["compared"]
    assert any(n.startswith("_loss_modules") for n in last["compared"]) and len(last["kls"]) == 2
