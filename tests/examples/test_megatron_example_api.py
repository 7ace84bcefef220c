"""The API calls of Megatron-LM's ``examples/run_simple_mcore_train_loop.py`` (core_v0.19.0), on 2 gloo ranks.

Our own test making the same calls as that example: ``initialize_model_parallel(2, 1)``, a
``TransformerConfig`` that leaves the parallel sizes at their defaults, ``get_gpt_layer_local_spec``,
``GPTModel``, ``MockGPTDataset`` through ``BlendedMegatronDatasetBuilder`` with a ``null-text``
``MegatronTokenizer``, ``DistributedDataParallel``, ``get_forward_backward_func``,
``finalize_model_grads`` and ``dist_checkpointing.save``/``load`` of ``sharded_state_dict``.
Checks: five iterations run with finite, TP-consistent losses and a finite, nonzero ``main_grad`` for
every parameter; the first loss equals a TP=1 model's on the same initial weights and batch; loaded
weights equal the saved ones. (As with Megatron-Core, the example's plain ``torch.optim.Adam`` leaves
the weights unchanged: DDP keeps gradients in ``main_grad``, and ``param.grad`` stays None.)
"""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch
from torch.utils.data import DataLoader

from megatron_core import dist_checkpointing, parallel_state
from megatron_core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron_core.datasets.utils import compile_helpers
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.distributed.finalize_model_grads import finalize_model_grads
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_core.models.gpt.gpt_model import GPTModel
from megatron_core.pipeline_parallel.schedules import get_forward_backward_func
from megatron_core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron_core.tokenizers import MegatronTokenizer
from megatron_core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_on_ranks

pytestmark = pytest.mark.slow  # subprocess/torchrun training runs

SEQUENCE_LENGTH = 64
MICRO_BATCH = 8


def _gpt() -> GPTModel:
    config = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=100,
        max_sequence_length=SEQUENCE_LENGTH,
    )


def _batches(cache: str):
    compile_helpers()
    config = GPTDatasetConfig(
        random_seed=0, sequence_length=SEQUENCE_LENGTH, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, mid_level_dataset_surplus=0.005, path_to_cache=cache,
        tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=SEQUENCE_LENGTH),
    )
    train = BlendedMegatronDatasetBuilder(MockGPTDataset, [100, None, None], lambda: True, config).build()[0]
    return iter(DataLoader(train, batch_size=MICRO_BATCH, shuffle=False))


def _forward_step(data_iterator, model):
    data = next(data_iterator)

    def loss_func(loss_mask, output_tensor):
        mask = loss_mask.view(-1).float()
        loss = torch.sum(output_tensor.float().view(-1) * mask) / mask.sum()
        return loss, {"lm loss": loss}

    output = model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"])
    return output, partial(loss_func, data["loss_mask"])


def _first_loss_tp1(cache: str) -> float:
    """The loss of the first batch for the same model built at TP=1."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    try:
        model_parallel_cuda_manual_seed(123)
        model = _gpt()
        with torch.no_grad():
            output, loss_func = _forward_step(_batches(cache), model)
            return loss_func(output)[0].item()
    finally:
        parallel_state.destroy_model_parallel()


def _example(root: str) -> dict:
    reference_loss = _first_loss_tp1(os.path.join(root, "cache"))
    parallel_state.initialize_model_parallel(2, 1)
    try:
        model_parallel_cuda_manual_seed(123)
        gpt = _gpt()
        gpt.to(torch.device("cpu"))
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        model = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
        initial = {name: value.detach().clone() for name, value in model.module.named_parameters()}
        optim = torch.optim.Adam(model.parameters())
        data = _batches(os.path.join(root, "cache"))
        forward_backward = get_forward_backward_func()
        losses = []
        for _ in range(5):
            optim.zero_grad()
            reduced = forward_backward(
                forward_step_func=_forward_step, data_iterator=data, model=model, num_microbatches=1,
                seq_length=SEQUENCE_LENGTH, micro_batch_size=MICRO_BATCH, decoder_seq_length=SEQUENCE_LENGTH,
                forward_only=False,
            )
            finalize_model_grads([model])
            optim.step()
            losses.append(reduced[0]["lm loss"].item())
        no_grad = [
            name for name, value in model.module.named_parameters()
            if not (torch.isfinite(value.main_grad).all() and value.main_grad.abs().sum() > 0)
        ]
        # As in Megatron-Core, DDP moves gradients into ``main_grad`` and leaves ``param.grad`` None, so the
        # example's plain torch Adam does not change the weights (Megatron's optimizers read main_grad).
        unchanged = [name for name, value in model.module.named_parameters() if torch.equal(initial[name], value)]

        checkpoint = os.path.join(root, "ckpt")
        os.makedirs(checkpoint, exist_ok=True)
        dist_checkpointing.save(sharded_state_dict=model.module.sharded_state_dict(prefix=""), checkpoint_dir=checkpoint)
        saved = {
            name: value.detach().clone() for name, value in model.module.state_dict().items()
            if isinstance(value, torch.Tensor)
        }
        with torch.no_grad():
            for parameter in model.module.parameters():
                parameter.zero_()
        loaded = dist_checkpointing.load(
            sharded_state_dict=model.module.sharded_state_dict(prefix=""), checkpoint_dir=checkpoint
        )
        model.module.load_state_dict(loaded)
        restored = all(
            torch.equal(saved[name], value) for name, value in model.module.state_dict().items()
            if isinstance(value, torch.Tensor)
        )
        return {"losses": losses, "reference_loss": reference_loss, "unchanged": unchanged, "no_grad": no_grad, "num_params": len(initial), "restored": restored}
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_example_api_calls_train_and_checkpoint(tmp_path):
    results = run_on_ranks(2, _example, str(tmp_path))
    for result in results:
        assert all(math.isfinite(loss) for loss in result["losses"]), result["losses"]
        assert abs(result["losses"][0] - result["reference_loss"]) < 1e-5, (result["losses"][0], result["reference_loss"])
        assert result["no_grad"] == [], f"no finite, nonzero main_grad for {result['no_grad']}"
        assert len(result["unchanged"]) == result["num_params"], "torch Adam changed weights without param.grad"
        assert result["restored"], "loaded weights differ from the saved ones"
    assert results[0]["losses"] == results[1]["losses"]  # TP ranks report the same loss
