"""GPTModel on one CUDA GPU in bf16 (skipped without a GPU).

Checks that a TransformerLayer has no torch.compile graph breaks at TP=1, that the compiled model
gives the eager model's loss and gradients, and that the bf16 loss follows the fp32 one.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.gpt_test_utils import batch, build, llama_like

pytestmark = pytest.mark.gpu


def _cuda_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.cuda() for t in batch())


def test_layer_has_no_graph_breaks() -> None:
    torch.manual_seed(0)
    model = build(llama_like()).cuda()
    ids, pos, _ = _cuda_batch()
    hidden = model.embedding(input_ids=ids, position_ids=pos)
    rope = model.rotary_pos_emb(hidden.size(0))
    explanation = torch._dynamo.explain(model.decoder.layers[0])(hidden, attention_mask=None, rotary_pos_emb=rope)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_compiled_matches_eager_and_bf16_follows_fp32() -> None:
    torch.manual_seed(0)
    fp32 = build(llama_like()).cuda()
    ids, pos, labels = _cuda_batch()
    loss = fp32(ids, pos, None, labels=labels)
    loss.sum().backward()
    grads = {k: p.grad.clone() for k, p in fp32.named_parameters()}
    fp32.zero_grad(set_to_none=True)

    compiled = torch.compile(fp32)
    loss_c = compiled(ids, pos, None, labels=labels)
    loss_c.sum().backward()
    torch.testing.assert_close(loss_c, loss, rtol=1e-4, atol=1e-4)
    for name, param in fp32.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    bf16 = build(llama_like(), bf16=True, params_dtype=torch.bfloat16).cuda()
    bf16.load_state_dict(fp32.state_dict())
    loss_bf16 = bf16(ids, pos, None, labels=labels)
    assert loss_bf16.dtype == torch.float32
    torch.testing.assert_close(loss_bf16, loss.detach(), rtol=0.03, atol=0.03)
