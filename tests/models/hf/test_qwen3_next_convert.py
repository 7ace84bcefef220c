"""``megatron-convert`` for Qwen3-Next (gated delta net and gated attention layers mixed, MoE and dense MLPs).

The converted checkpoint holds exactly GPTModel's sharded keys (per-layer keys; the delta net's ``in_proj`` as the
sections ``.query/.key/.value/.z/.beta/.alpha``); loaded at TP=1 and TP=2 into the bridge-built GPTModel it gives
transformers' logits; re-saved by a TP=2 run and exported, and exported as written, it gives back
the original tensors bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf import dist_checks
from tests.models.hf.hf_models import assert_same_tensors, batch, hf_logits, make_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core import dist_checkpointing, tensor_parallel  # noqa: E402
from megatron_core.dist_checkpointing import apply_factories, load_sharded_metadata  # noqa: E402
from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron_core.dist_checkpointing.serialization import COMMON_STATE_KEY, load_common_state_dict  # noqa: E402
from megatron_core.models.hf import AutoBridge  # noqa: E402
from megatron_core.models.hf.cli import main  # noqa: E402
from megatron_core.models.hf.convert import export_mcore_to_hf  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[str, str]:
    """``(HF directory, its checkpoint converted for TP=2)``."""
    root = tmp_path_factory.mktemp("qwen3_next_convert")
    src, ckpt = str(root / "hf"), str(root / "ckpt")
    make_hf_model("qwen3_next", src)
    assert main(["hf-to-mcore", "--hf", src, "--out", ckpt, "--tp", "2", "--make-vocab-size-divisible-by", "1",
                 "--no-progress"]) == 0
    return src, ckpt


def _sharded_keys(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    keys = {}
    for value in sharded.values():
        for leaf in value if isinstance(value, list) else [value]:
            if isinstance(leaf, ShardedTensor):
                keys[leaf.key] = tuple(leaf.global_shape)
            elif isinstance(leaf, ShardedObject):
                keys[leaf.unique_key] = tuple(leaf.global_shape)
    return keys


def test_one_process_load_gives_transformers_logits(converted) -> None:
    src, ckpt = converted
    path = os.path.join(ckpt, "iter_0000000")
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    (model,) = AutoBridge.from_hf_pretrained(src, load_weights=False).to_megatron_model(load_weights=False)
    stored = {k: tuple(v.global_shape) for k, v in load_sharded_metadata(path).items()
              if not k.startswith(f"{COMMON_STATE_KEY}/")}
    assert stored == _sharded_keys(model)
    assert "model_config" not in load_common_state_dict(path)  # no record megatron-generate would misread
    for section in ("query", "key", "value", "z", "beta", "alpha"):
        assert f"decoder.layers.2.self_attention.in_proj.weight.{section}" in stored
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in stored  # softmax attention layer
    state = dist_checkpointing.load(model.sharded_state_dict(), path)
    result = model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=True)
    assert not result.missing_keys
    model.eval()
    ids, pos = batch()
    with torch.no_grad():
        logits = model(ids, pos, None)
    torch.testing.assert_close(logits, hf_logits(src), rtol=1e-5, atol=1e-5)


def test_tp2_load_resave_and_export_are_exact(converted, tmp_path) -> None:
    src, ckpt = converted
    expected = hf_logits(src)
    resave = str(tmp_path / "resaved")
    results = run_on_ranks(2, dist_checks.load_converted_checkpoint, ckpt, src, resave, 2, 1)
    assert len(results) == 2
    for logits in results:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    export_mcore_to_hf(resave, str(tmp_path / "from_tp2"), hf_template=src, progress=False)
    assert_same_tensors(src, tmp_path / "from_tp2")
    assert main(["mcore-to-hf", "--mcore", ckpt, "--out", str(tmp_path / "back"), "--no-progress"]) == 0
    assert_same_tensors(src, tmp_path / "back")
