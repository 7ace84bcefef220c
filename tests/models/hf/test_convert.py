"""``megatron-convert``: HF -> distributed checkpoint from one process, loaded by TP=2 / PP=2 runs, and back.

The converted checkpoint holds exactly the keys and global shapes of GPTModel's sharded state
dict; ``load_checkpoint`` under TP=2 and PP=2 reproduces transformers' logits; a checkpoint the
training layout re-saved at TP=2 / PP=2 exports back to bitwise-identical HF tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf import dist_checks, hybrid_convert_checks
from tests.models.hf.hf_models import FAMILIES, MOE_FAMILIES, assert_same_tensors, hf_logits, make_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core import tensor_parallel  # noqa: E402
from megatron_core.dist_checkpointing import apply_factories, load_sharded_metadata, load_tensors_metadata  # noqa: E402
from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron_core.dist_checkpointing.serialization import COMMON_STATE_KEY  # noqa: E402
from megatron_core.models.hf import AutoBridge  # noqa: E402
from megatron_core.models.hf.cli import main  # noqa: E402
from megatron_core.models.hf.convert import export_mcore_to_hf, import_hf_to_mcore  # noqa: E402


@pytest.mark.parametrize("kind", FAMILIES + MOE_FAMILIES)
def test_checkpoint_keys_match_the_models_sharded_state_dict(kind: str, tmp_path) -> None:
    make_hf_model(kind, tmp_path / "hf")
    path = import_hf_to_mcore(str(tmp_path / "hf"), str(tmp_path / "ckpt"), progress=False)
    # The common (non-sharded) state is a ShardedObject of its own in megatron-core 0.19's layout, not a model key.
    stored = {k: tuple(v.global_shape) for k, v in load_sharded_metadata(path).items()
              if not k.startswith(f"{COMMON_STATE_KEY}/")}
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    (model,) = AutoBridge.from_hf_pretrained(tmp_path / "hf").to_megatron_model(load_weights=False)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    expected = {}
    for value in sharded.values():
        for leaf in value if isinstance(value, list) else [value]:
            if isinstance(leaf, ShardedTensor):
                expected[leaf.key] = tuple(leaf.global_shape)
            elif isinstance(leaf, ShardedObject):
                expected[leaf.unique_key] = tuple(leaf.global_shape)
    assert stored == expected


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_converted_checkpoint_loads_at_tp2_and_pp2(kind: str, tmp_path) -> None:
    src = str(tmp_path / "hf")
    make_hf_model(kind, src)
    expected = hf_logits(src)
    ckpt = str(tmp_path / "ckpt")
    assert main(["hf-to-mcore", "--hf", src, "--out", ckpt, "--tp", "2", "--pp", "2",
                 "--make-vocab-size-divisible-by", "1", "--no-progress"]) == 0
    assert sorted(os.listdir(ckpt)) == ["hf", "iter_0000000", "latest_checkpointed_iteration.txt"]
    for tp, pp in ((2, 1), (1, 2)):
        resave = str(tmp_path / f"resaved_tp{tp}pp{pp}")
        results = run_on_ranks(2, dist_checks.load_converted_checkpoint, ckpt, src, resave, tp, pp)
        for logits in (r for r in results if r is not None):
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        out = str(tmp_path / f"back_tp{tp}pp{pp}")
        export_mcore_to_hf(resave, out, hf_template=src, progress=False)
        assert_same_tensors(src, out)
    # The converter's own checkpoint exports back without a template (config and tokenizer travel in <ckpt>/hf).
    assert main(["mcore-to-hf", "--mcore", ckpt, "--out", str(tmp_path / "back"), "--max-shard-size", "30KB",
                 "--no-progress"]) == 0
    assert_same_tensors(src, tmp_path / "back")
    assert os.path.isfile(tmp_path / "back" / "model.safetensors.index.json")


def test_cli_padding_dtype_and_errors(tmp_path, capsys) -> None:
    src = str(tmp_path / "hf")
    make_hf_model("llama", src, vocab_size=99)
    ckpt = str(tmp_path / "ckpt")
    assert main(["hf-to-mcore", "--hf", src, "--out", ckpt, "--tp", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "--load" in printed and "--swiglu" in printed and "llama3 RoPE scaling" in printed
    stored = load_tensors_metadata(os.path.join(ckpt, "iter_0000000"))
    assert stored["embedding.word_embeddings.weight"].global_shape == (256, 48)  # padded to 128 x TP
    assert main(["mcore-to-hf", "--mcore", ckpt, "--out", str(tmp_path / "bf16"), "--dtype", "bf16",
                 "--no-progress"]) == 0
    back = AutoBridge.from_hf_pretrained(tmp_path / "bf16")
    assert back.reader.dtype("model.embed_tokens.weight") == torch.bfloat16
    assert back.reader.shape("model.embed_tokens.weight") == (99, 48)
    # No padding asked for and 99 rows do not split over TP=2: a clear error naming the file, nothing written.
    assert main(["hf-to-mcore", "--hf", src, "--out", str(tmp_path / "bad"), "--tp", "2",
                 "--make-vocab-size-divisible-by", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "config.json: vocab_size 99 is not divisible by tensor_model_parallel_size 2" in err
    assert not os.path.exists(tmp_path / "bad")
    # Exporting over an existing directory needs --overwrite.
    assert main(["mcore-to-hf", "--mcore", ckpt, "--out", str(tmp_path / "bf16"), "--no-progress"]) == 2
    assert "overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral"])
def test_record_rebuilds_the_converted_model_as_megatron_generate_does(kind: str, tmp_path) -> None:
    """The converted checkpoint records its model configuration (Llama 3.1 RoPE frequencies and base included), so
    ``megatron-generate`` / ``megatron-serve`` rebuild it without training flags: at TP=2 it gives transformers'
    logits; the tokenizer falls back to ``NullTokenizer`` (no tokenizer.json here)."""
    from megatron_core.dist_checkpointing.serialization import load_common_state_dict
    from megatron_core.training.model_config import MODEL_CONFIG_KEY

    src, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    make_hf_model(kind, src)
    path = import_hf_to_mcore(src, ckpt, make_vocab_size_divisible_by=1, progress=False)
    common = load_common_state_dict(path)
    assert MODEL_CONFIG_KEY in common and common["extra_state"]["args"]["tokenizer_type"] == "NullTokenizer"
    expected = hf_logits(src)
    for logits in (r for r in run_on_ranks(2, hybrid_convert_checks.logits_from_record, ckpt, 2) if r is not None):
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
