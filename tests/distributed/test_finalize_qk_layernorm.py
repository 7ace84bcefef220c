"""``finalize_model_grads`` keeps the q/k layernorm weights of a tensor-parallel model in step, as in Megatron-Core.

Under TP each rank normalises the heads it holds with the same (replicated) ``q_layernorm`` / ``k_layernorm``
weights, so each rank's gradient is a partial sum over its heads: Megatron-Core 0.19 all-reduces them over TP
(with or without sequence parallelism, whenever ``qk_layernorm``). Checked on 2 gloo ranks against one process
on the same weights and data, fp32.
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import finalize_model_grads
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import MAX_SEQ, VOCAB, llama_like, shard

S, B = 8, 2


def _build(**overrides) -> GPTModel:
    spec = llama_like(num_attention_heads=4, num_query_groups=2, qk_layernorm=True)
    config = TransformerConfig(**{**spec["config"], **overrides})
    return GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True), VOCAB, MAX_SEQ, **spec["model"])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (B, S), generator=gen), torch.randint(0, VOCAB, (B, S), generator=gen)


def _reference() -> tuple[dict, dict]:
    torch.manual_seed(99)
    model = _build()
    ids, labels = _data()
    positions = torch.arange(S).expand(B, S)
    model(ids, positions, None, labels=labels).sum().backward()
    return ({k: v.detach().clone() for k, v in model.named_parameters()},
            {k: v.grad.detach().clone() for k, v in model.named_parameters() if "layernorm" in k})


def _check(sequence_parallel: bool) -> dict:
    state, want = _reference()  # one process: built before the TP groups exist
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = _build(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], 2, tp_rank, gated=True))
        ids, labels = _data()
        positions = torch.arange(S).expand(B, S)
        model(ids, positions, None, labels=labels).sum().backward()
        finalize_model_grads([model])
        got = {k: v.grad.detach().clone() for k, v in model.named_parameters() if "q_layernorm" in k
               or "k_layernorm" in k}
        return {k: (got[k] - want[k]).abs().max().item() for k in got}
    finally:
        parallel_state.destroy_model_parallel()


def _check_tp() -> dict:
    return _check(False)


def _check_tp_sp() -> dict:
    return _check(True)


def test_qk_layernorm_gradients_are_summed_over_tp() -> None:
    for errors in run_on_ranks(2, _check_tp):
        assert errors and max(errors.values()) < 1e-5, errors


def test_qk_layernorm_gradients_are_summed_over_tp_with_sequence_parallel() -> None:
    for errors in run_on_ranks(2, _check_tp_sp):
        assert errors and max(errors.values()) < 1e-5, errors


def _check_mla(sequence_parallel: bool) -> dict:
    """MLA's q/kv layernorms (on the latents) after ``finalize_model_grads`` at TP=2 equal one process."""
    from tests.transformer.test_multi_latent_attention import _batch, _config, _model, _shard

    reference = _model(_config())
    ids, pos, labels = _batch()
    reference(ids, pos, None, labels=labels).sum().backward()
    want = {k: v.grad.detach().clone() for k, v in reference.named_parameters() if "layernorm" in k}
    state = {k: v.detach().clone() for k, v in reference.named_parameters()}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = _model(_config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel))
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_shard(name, state[name], 2, tp_rank))
        model(ids, pos, None, labels=labels).sum().backward()
        finalize_model_grads([model])
        got = {k: v.grad.detach().clone() for k, v in model.named_parameters()
               if "q_layernorm" in k or "kv_layernorm" in k}
        return {k: (got[k] - want[k]).abs().max().item() for k in got}
    finally:
        parallel_state.destroy_model_parallel()


def _check_mla_tp() -> dict:
    return _check_mla(False)


def _check_mla_tp_sp() -> dict:
    return _check_mla(True)


def test_mla_latent_layernorm_gradients_are_not_summed_twice() -> None:
    for check in (_check_mla_tp, _check_mla_tp_sp):
        for errors in run_on_ranks(2, check):
            assert errors and max(errors.values()) < 1e-5, errors
