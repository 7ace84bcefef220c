"""Fine-grained activation offloading on one CUDA GPU: the activation peak drops, the gradients stay.

A 4-layer GPT (hidden 1024, sequence 2048, fp32) trains three iterations of one micro-batch with and without
offloading every dense module. The second and third iterations run the fixed policy (the last layer's groups
stay on the device); their peak memory above the weights and gradients must drop by a quarter or more, and
every loss and gradient must equal the run without offloading (up to the kernels' own run-to-run noise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager
from megatron_core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron_core.transformer import TransformerConfig

pytestmark = pytest.mark.gpu

SEQ, BATCH, VOCAB = 2048, 2, 1024
MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ)
    output = model(tokens, positions, None, labels=labels)
    return output, lambda out: (out.float().mean(), {"lm loss": out.float().mean().detach()})


def _train(offload: bool) -> tuple[list, list, list]:
    PipelineOffloadManager.reset_instance()
    extra = dict(fine_grained_activation_offloading=True, offload_modules=MODULES) if offload else {}
    config = TransformerConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                               ffn_hidden_size=1024, normalization="RMSNorm", activation_func=F.gelu,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, **extra)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope").cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses, grads, peaks = [], [], []
    for _ in range(3):
        model.zero_grad(set_to_none=False)
        data = [(torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=gen),
                 torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=gen))]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = forward_backward_no_pipelining(forward_step_func=_forward_step, data_iterator=iter(data), model=model,
                                             num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        losses.append(out[0]["lm loss"])
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    PipelineOffloadManager.reset_instance()
    return losses, grads, peaks


def test_offloading_lowers_the_activation_peak_and_keeps_gradients():
    plain_losses, plain_grads, plain_peaks = _train(offload=False)
    losses, grads, peaks = _train(offload=True)
    mib = [(p // 2**20, q // 2**20) for p, q in zip(plain_peaks, peaks)]
    print(f"peak MiB above weights (no offload, offload) per iteration: {mib}")  # noqa: T201
    for it in (1, 2):
        assert peaks[it] < 0.75 * plain_peaks[it], mib
    for it in range(3):
        torch.testing.assert_close(losses[it], plain_losses[it])
        for name, grad in grads[it].items():
            torch.testing.assert_close(grad, plain_grads[it][name], msg=lambda m, n=name: f"{n}: {m}")
