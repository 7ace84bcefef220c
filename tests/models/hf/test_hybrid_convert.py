"""``megatron-convert`` for hybrid Mamba models (``NemotronHForCausalLM``, ``Mamba2ForCausalLM``), fp32 on CPU.

The converted checkpoint holds exactly the keys and global shapes of HybridModel's sharded state dict (the Mamba
mixer's ``in_proj`` / ``conv1d`` as TP-independent sections); rebuilt from its ``model_config`` record (as
``megatron-generate`` does) at TP=1, TP=2 and PP=2 it gives transformers' logits within 1e-4; ``mcore-to-hf`` gives back
the original safetensors bitwise; ``megatron-generate`` on it produces transformers' greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf import hybrid_convert_checks
from tests.models.hf.hf_models import VOCAB, assert_same_tensors, hf_logits
from tests.models.hf.hybrid_models import HYBRID_KINDS, make_hybrid_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core import tensor_parallel  # noqa: E402
from megatron_core.dist_checkpointing import apply_factories, load_sharded_metadata  # noqa: E402
from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron_core.dist_checkpointing.serialization import COMMON_STATE_KEY, load_common_state_dict  # noqa: E402
from megatron_core.models.hf import AutoBridge  # noqa: E402
from megatron_core.models.hf.cli import main  # noqa: E402
from megatron_core.models.hf.convert import import_hf_to_mcore  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def _convert(src: str, ckpt: str) -> None:
    assert main(["hf-to-mcore", "--hf", src, "--out", ckpt, "--make-vocab-size-divisible-by", "1",
                 "--no-progress"]) == 0


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_keys_match_and_round_trip_is_bitwise(kind: str, tmp_path) -> None:
    src, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    make_hybrid_model(kind, src)
    path = import_hf_to_mcore(src, ckpt, progress=False)  # default: no vocabulary padding at TP=1
    stored = {k: tuple(v.global_shape) for k, v in load_sharded_metadata(path).items()
              if not k.startswith(f"{COMMON_STATE_KEY}/")}
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    (model,) = AutoBridge.from_hf_pretrained(src).to_megatron_model(load_weights=False)
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
    assert any(key.endswith("mixer.in_proj.weight.dt") for key in stored)
    assert any(key.endswith("mixer.conv1d.weight.B") for key in stored)

    record = json.loads(load_common_state_dict(path)["model_config"])
    assert record["model_class"].endswith(":HybridModel")
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    assert record["model"]["mamba_mixer"] == {"d_conv": cfg["conv_kernel"], "chunk_size": cfg["chunk_size"]}
    assert record["model"]["hybrid_layer_pattern"] == AutoBridge.from_hf_pretrained(src).family.hybrid_pattern

    assert main(["mcore-to-hf", "--mcore", ckpt, "--out", str(tmp_path / "back"), "--no-progress"]) == 0
    assert_same_tensors(src, tmp_path / "back")


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
def test_record_rebuilds_the_model_at_tp1_tp2_and_pp2(kind: str, tmp_path) -> None:
    src, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    make_hybrid_model(kind, src)
    expected = hf_logits(src)
    _convert(src, ckpt)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        results = run_on_ranks(2, hybrid_convert_checks.logits_from_record, ckpt, tp, pp)
        last = [logits for logits in results if logits is not None]
        assert len(last) == 2 // pp
        for logits in last:
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def _hf_greedy(src: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                                       eos_token_id=VOCAB - 1, pad_token_id=0)
        out.append(generated[0, len(ids):].tolist())
    return out


@pytest.mark.timeout(600)
def test_megatron_generate_matches_transformers_generate(tmp_path) -> None:
    """Greedy tokens of ``megatron-generate`` (dynamic engine, Mamba state slots, two prompts longer than the chunk
    size) on the converted NemotronH equal ``NemotronHForCausalLM.generate``; the converted checkpoint names
    ``NullTokenizer`` (no tokenizer.json), whose end-of-document id is the last vocabulary id."""
    src, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    make_hybrid_model("nemotron_h", src)
    _convert(src, ckpt)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 40, 41, 42, 43, 44, 45]]
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    cmd = [sys.executable, "-m", "megatron_core.inference.cli.generate", "--load", ckpt, "--max-tokens", "8",
           "--block-size-tokens", "4", "--buffer-size-gb", "0.01", "--output", str(out),
           *[a for p in prompts for a in ("--prompt", " ".join(map(str, p)))]]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ours = [json.loads(line)["generated_tokens"] for line in out.read_text().splitlines()]
    assert ours == _hf_greedy(src, prompts, 8)
    assert all(len(tokens) >= 2 for tokens in ours)


def test_export_with_a_contradicting_template_names_the_section(tmp_path) -> None:
    """A template whose Mamba heads are wider than the checkpoint's is refused naming the stored section and both
    shapes; nothing is written."""
    from megatron_core.models.hf import HFConversionError
    from megatron_core.models.hf.convert import export_mcore_to_hf

    src, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    make_hybrid_model("nemotron_h", src)
    _convert(src, ckpt)
    make_hybrid_model("nemotron_h", tmp_path / "wider", mamba_head_dim=8)
    with pytest.raises(HFConversionError, match=r"mixer\.in_proj\.weight\.z' has shape \(24, 16\), the HF config "
                                                r"implies \(32, 16\)"):
        export_mcore_to_hf(ckpt, str(tmp_path / "out"), hf_template=str(tmp_path / "wider"), progress=False)
    assert not (tmp_path / "out").exists()
