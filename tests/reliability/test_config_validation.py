"""Bad values are caught at the config with a named error (section 7, check 12), also under ``python -O``.

No process group or model is needed: every case fails in a config's ``__post_init__`` (or in
``initialize_model_parallel`` before any group exists, or in ``GPTModel`` before any weight is
allocated). ``test_checks_hold_under_python_O`` runs this file and the TransformerConfig tests
(heads/groups vs TP, layers vs PP/VPP, ...) again with ``python -O`` (assert statements stripped)
to show none of the checks is an ``assert``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from megatron_core import parallel_state
from megatron_core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import OptimizerConfig
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks

REPO = Path(__file__).resolve().parents[2]
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)

TRANSFORMER_CASES = {
    "ffn_hidden_size=0": (dict(ffn_hidden_size=0), "TransformerConfig: ffn_hidden_size (0)", "0"),
    "kv_channels<0": (dict(kv_channels=-8), "TransformerConfig: kv_channels (-8)", "-8"),
    "num_layers=True": (dict(num_layers=True), "TransformerConfig: num_layers (True)", "True"),
    "init_method_std<0": (dict(init_method_std=-0.02), "TransformerConfig: init_method_std (-0.02)", "-0.02"),
    "init_method_std=nan": (dict(init_method_std=float("nan")), "TransformerConfig: init_method_std (nan)", "nan"),
    "num_query_groups=0": (dict(num_query_groups=0), "TransformerConfig: num_query_groups (0)", "0"),
    "hidden_dropout=nan": (dict(hidden_dropout=float("nan")), "TransformerConfig: hidden_dropout (nan)", "nan"),
}
OPTIMIZER_CASES = {
    "weight_decay=nan": (dict(weight_decay=float("nan")), "OptimizerConfig: weight_decay (nan)", "nan"),
    "lr=inf": (dict(lr=float("inf")), "OptimizerConfig: lr (inf)", "inf"),
    "clip_grad=nan": (dict(clip_grad=float("nan")), "OptimizerConfig: clip_grad (nan)", "nan"),
    "adam_eps=0": (dict(adam_eps=0.0), "OptimizerConfig: adam_eps (0.0)", "0.0"),
}


@pytest.mark.parametrize("case", list(TRANSFORMER_CASES))
def test_transformer_config_rejects(case: str) -> None:
    overrides, field, value = TRANSFORMER_CASES[case]
    with pytest.raises(ValueError) as info:
        TransformerConfig(**{**BASE, **overrides})
    assert field in str(info.value) and value in str(info.value), str(info.value)


@pytest.mark.parametrize("case", list(OPTIMIZER_CASES))
def test_optimizer_config_rejects(case: str) -> None:
    overrides, field, value = OPTIMIZER_CASES[case]
    with pytest.raises(ValueError) as info:
        OptimizerConfig(**{"lr": 1e-3, **overrides})
    assert field in str(info.value) and value in str(info.value), str(info.value)


@pytest.mark.parametrize("minutes", [0, -5, float("nan")])
def test_non_positive_timeout_is_rejected_before_any_group(minutes: float) -> None:
    with pytest.raises(ValueError, match=rf"distributed_timeout_minutes \({minutes!r}\) must be a positive number"):
        parallel_state.initialize_model_parallel(distributed_timeout_minutes=minutes)


@pytest.mark.parametrize("vocab, max_len, message", [
    (0, 16, "GPTModel: vocab_size (0) must be a positive int (not a bool)"),
    (64, 0, "GPTModel: max_sequence_length (0) must be a positive int (not a bool)"),
])
def test_gpt_model_sizes(vocab: int, max_len: int, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GPTModel(TransformerConfig(**BASE), get_gpt_layer_local_spec(), vocab, max_len,
                 position_embedding_type="rope")


@pytest.mark.parametrize("split", ["90,-10,0", "90,1e1,0", "a,b"])
def test_split_with_a_sign_or_junk_is_rejected(split: str) -> None:
    with pytest.raises(ValueError, match="is not a non-negative number"):
        parse_and_normalize_split(split)
    assert parse_and_normalize_split(" 90, 10 ,0") == pytest.approx([0.9, 0.1, 0.0])


def _long_input() -> str:
    parallel_state.initialize_model_parallel(1, 1)
    try:
        model = GPTModel(TransformerConfig(**BASE, use_cpu_initialization=True), get_gpt_layer_local_spec(), 64, 8,
                         position_embedding_type="rope")
        tokens = torch.zeros(1, 12, dtype=torch.long)
        try:
            model(tokens, torch.arange(12).unsqueeze(0), None)
        except ValueError as e:
            return str(e)
        return "ran"
    finally:
        parallel_state.destroy_model_parallel()


def test_input_longer_than_max_sequence_length_is_rejected_with_rope() -> None:
    message = run_on_ranks(1, _long_input)[0]
    assert "input sequence length 12 exceeds the model's max_sequence_length 8" in message, message


def test_token_ids_beyond_the_vocabulary_are_named(tmp_path: Path) -> None:
    from megatron_core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron_core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron_core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron_core.datasets.tokenizers import NullTokenizer

    prefix = str(tmp_path / "data")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(20):
        builder.add_item(torch.tensor([1, 2, 500, 3, 10]))  # 500 is beyond a 16-token vocabulary
        builder.end_document()
    builder.finalize(prefix + ".idx")
    config = GPTDatasetConfig(random_seed=1, sequence_length=4, split="1", blend=([prefix], None),
                              tokenizer=NullTokenizer(16), path_to_cache=str(tmp_path / "cache"),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [8, None, None], lambda: True, config).build()[0]
    with pytest.raises(ValueError, match=r"token id 500 is outside the tokenizer's vocabulary \(vocab_size 17\)"):
        for i in range(len(train)):
            train[i]


def test_corrupt_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from megatron_core.datasets.tokenizers.huggingface import HuggingFaceTokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "BPE"}})[:-5])
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.")):
        HuggingFaceTokenizer(str(path))


@pytest.mark.skipif(sys.flags.optimize > 0, reason="already running under python -O")
def test_checks_hold_under_python_O() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    files = [__file__, str(REPO / "tests" / "transformer" / "test_transformer_config.py")]
    proc = subprocess.run([sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
                           "-k", "not input_longer"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-2000:]
