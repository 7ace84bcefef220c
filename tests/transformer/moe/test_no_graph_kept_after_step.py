"""After an MoE model's forward and backward nothing in the library keeps a tensor of that step's autograd graph.

A kept tensor keeps the step's graph nodes alive until the next forward: their memory is small, but each
``AccumulateGrad`` node stays bound to the stream the step ran on, so a CUDA graph captured later on another stream
(``FullCudaGraphWrapper``'s) must wait on that stream, which invalidates the capture (seen on an H100 with the
all-to-all dispatcher's ``probs``). Checked here on CPU by looking for any live tensor with a ``grad_fn``.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from megatron_core import tensor_parallel
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig


def _live_graph_tensors() -> list[torch.Tensor]:
    gc.collect()
    # ``type(o)`` never dereferences, so dead weak proxies left by other tests are skipped rather than raising
    # ReferenceError the way ``isinstance`` does; it also avoids torch's deprecated aliases' instance checks.
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn is not None]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
def test_no_tensor_of_the_step_outlives_its_backward(dispatcher, grouped):
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=grouped,
                               moe_aux_loss_coeff=0.01, moe_token_dispatcher_type=dispatcher)
    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=grouped), 64, 16,
                     position_embedding_type="rope")
    ids = torch.randint(0, 64, (2, 8))
    pos = torch.arange(8).unsqueeze(0).expand(2, -1)
    before = {id(t) for t in _live_graph_tensors()}
    for _ in range(2):
        model(ids, pos, None, labels=ids).mean().backward()
    kept = [t for t in _live_graph_tensors() if id(t) not in before]
    assert not kept, [(tuple(t.shape), type(t.grad_fn).__name__) for t in kept]
