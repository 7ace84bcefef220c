"""GPTModel on one CUDA GPU in bf16 (skipped without a GPU).

Checks that a TransformerLayer has no torch.compile graph breaks at TP=1, that the compiled model
gives the eager model's loss and gradients, that the bf16 loss follows the fp32 one, and (with two
GPUs) that TP=2 on NCCL, with and without sequence parallelism, gives the single-GPU loss.
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


def _nccl_rank(rank: int, world_size: int, store_path: str) -> None:
    import torch.distributed as dist

    from megatron_core import parallel_state, tensor_parallel
    from tests.models.gpt_test_utils import shard

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        reference = build(llama_like()).cuda()
        ids, pos, labels = _cuda_batch()
        ref_loss = reference(ids, pos, None, labels=labels).detach()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        for sp in (False, True):
            model = build(llama_like(), tensor_model_parallel_size=world_size, sequence_parallel=sp).cuda()
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(shard(name, reference.state_dict()[name], world_size, rank, True))
            loss = model(ids, pos, None, labels=labels)
            loss.sum().backward()
            torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-4, atol=1e-4)
            assert all(p.grad is not None for p in model.parameters())
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_on_nccl_matches_single_gpu(tmp_path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.multiprocessing.spawn(_nccl_rank, args=(2, str(tmp_path / "store")), nprocs=2)
