"""Checkpoints of another architecture do not load silently (section 7, check 13).

A GPT saved by ``save_checkpoint`` records its architecture. Loading it into a model with a
different head count at the same hidden size (identical ``linear_qkv`` shape), a different
vocabulary with tied embeddings, or biases added fails naming the field and both values. Missing
and unexpected keys raise by default and are only logged with ``strict=False``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.dist_checkpointing import CheckpointingException, sharded_state_dict_default
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.training import load_checkpoint, save_checkpoint
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks


def _gpt(heads: int = 4, vocab: int = 64, bias: bool = False) -> GPTModel:
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=heads, ffn_hidden_size=64,
                               add_bias_linear=bias, use_cpu_initialization=True)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab, 16, share_embeddings_and_output_weights=True)


CASES = {
    "heads": (dict(heads=8), "num_attention_heads is 4 in the checkpoint and 8 in the current model"),
    "vocab": (dict(vocab=72), "vocab_size is 64 in the checkpoint and 72 in the current model"),
    "bias": (dict(bias=True), "add_bias_linear is False in the checkpoint and True in the current model"),
}


def _mismatches(save_dir: str) -> dict[str, str]:
    parallel_state.initialize_model_parallel(1, 1)
    try:
        save_checkpoint(save_dir, 1, _gpt(), None, None)
        errors = {}
        for name, (kwargs, _) in CASES.items():
            model = _gpt(**kwargs)
            before = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
            try:
                load_checkpoint(save_dir, model, None, None)
                errors[name] = "loaded"
            except CheckpointingException as e:
                errors[name] = str(e)
            after = model.state_dict()
            assert all(torch.equal(v, after[k]) for k, v in before.items()), f"{name}: model was changed"
        model = _gpt()
        errors["same"] = str(load_checkpoint(save_dir, model, None, None)["iteration"])
        return errors
    finally:
        parallel_state.destroy_model_parallel()


def test_architecture_mismatch_names_field_and_both_values(tmp_path: Path) -> None:
    errors = run_on_ranks(1, _mismatches, str(tmp_path / "run"))[0]
    for name, (_, message) in CASES.items():
        assert message in errors[name], (name, errors[name])
    assert errors["same"] == "1"


class _Net(torch.nn.Module):
    """A config-less module: only the keys protect it."""

    def __init__(self, extra: bool = False, drop_b: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        if not drop_b:
            self.b = torch.nn.Linear(4, 2)
        if extra:
            self.c = torch.nn.Linear(2, 2)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        return sharded_state_dict_default(self, prefix, sharded_offsets, metadata)


def test_missing_and_unexpected_keys_raise_by_default(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _Net(), None, None)
    with pytest.raises(CheckpointingException, match=r"missing from the checkpoint: \['c.bias', 'c.weight'\]"):
        load_checkpoint(tmp_path, _Net(extra=True), None, None)
    with pytest.raises(CheckpointingException, match=r"not in the model: \['b.bias', 'b.weight'\]"):
        load_checkpoint(tmp_path, _Net(drop_b=True), None, None)
    assert load_checkpoint(tmp_path, _Net(drop_b=True), None, None, strict=False)["iteration"] == 1
