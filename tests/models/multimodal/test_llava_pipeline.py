"""``LLaVAModel`` split over two pipeline stages (1F1B on gloo) equals one process on the same weights.

Stage 0 holds the vision encoder, the projector, the embedding and the first language layer; stage 1 the
second layer and the output layer. Under pipeline parallelism the combined sequence is padded to
``language_max_sequence_length`` (the fixed p2p shape); the per-microbatch masked mean loss and every
gradient must match ``forward_backward_no_pipelining`` on the whole model.
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.pipeline_parallel import forward_backward_no_pipelining, get_forward_backward_func
from tests.dist_harness import run_on_ranks
from tests.models.multimodal.llava_fixture import IMAGE_TOKEN_ID, MAX_SEQ, build, images, randomize

MICROBATCHES, TEXT_LEN = 2, 9


def _batches() -> list[dict]:
    gen = torch.Generator().manual_seed(21)
    out = []
    for _ in range(MICROBATCHES):
        ids = torch.randint(1, IMAGE_TOKEN_ID, (2, TEXT_LEN), generator=gen)
        ids[0, 2] = ids[1, 5] = IMAGE_TOKEN_ID
        out.append(dict(ids=ids, labels=torch.randint(0, IMAGE_TOKEN_ID, (2, TEXT_LEN), generator=gen),
                        loss_mask=(torch.rand(2, TEXT_LEN, generator=gen) > 0.2).float(),
                        images=torch.randn(2, *images(1).shape[1:], generator=gen)))
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output, mask = model(batch["images"], batch["ids"], None, None, labels=batch["labels"],
                         loss_mask=batch["loss_mask"])

    def loss_func(output_tensor):
        weights = mask.float()
        loss = (output_tensor.float() * weights).sum() / weights.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def _reference() -> tuple[dict, list, dict]:
    torch.manual_seed(1)
    model = build()
    randomize(model, seed=2)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    losses = forward_backward_no_pipelining(
        forward_step_func=_forward_step, data_iterator=iter(_batches()), model=model, num_microbatches=MICROBATCHES,
        seq_length=MAX_SEQ, micro_batch_size=2)
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    return state, [d["lm loss"] for d in losses], grads


def _global(name: str, stage: int) -> str:
    """Stage 1's language layer 0 is the whole model's layer 1."""
    return name.replace("decoder.layers.0.", "decoder.layers.1.") if stage == 1 else name


def _check_pp() -> list[str]:
    state, ref_losses, ref_grads = _reference()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        first, last = stage == 0, stage == 1
        model = build(language=dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32),
                      pre_process=first, post_process=last, add_encoder=first, add_decoder=True)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(state[_global(name, stage)])
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(_batches()), model=model,
            num_microbatches=MICROBATCHES, seq_length=MAX_SEQ, micro_batch_size=2)
        if last:
            torch.testing.assert_close(torch.stack([d["lm loss"] for d in losses]), torch.stack(ref_losses),
                                       rtol=1e-5, atol=1e-5)
        for name, param in model.named_parameters():
            ref = ref_grads[_global(name, stage)]
            torch.testing.assert_close(param.grad, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                       msg=lambda m, n=name: f"stage {stage} {n}: {m}")
        return sorted({name.split(".")[0] for name, _ in model.named_parameters()})
    finally:
        parallel_state.destroy_model_parallel()


def test_pp2_matches_single_process():
    parts = run_on_ranks(2, _check_pp)
    assert parts == [["language_model", "vision_model", "vision_projection"], ["language_model"]]
