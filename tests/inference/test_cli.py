"""``megatron-generate`` on a checkpoint that ``examples/pretrain_gpt.py`` just wrote, and on a tiny HybridModel
(Mamba + attention) saved with ``save_checkpoint`` (single CPU process each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_core.inference.cli.generate import build_parser, check_args, read_prompts

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", "32", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--mock-data", "--vocab-size", "60", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--log-interval", "1",
         "--eval-interval", "0", "--eval-iters", "1", "--no-progress", "--seed", "3"]

# A naive reference: reload the checkpoint, then greedy-decode with a full forward per token (no KV cache).
NAIVE = """
import json, sys, torch
from megatron_core.inference.cli.checkpoint import init_distributed_for_inference, load_gpt_from_checkpoint
init_distributed_for_inference()
model, tok, _ = load_gpt_from_checkpoint(sys.argv[1])
out = []
for prompt in sys.argv[2:]:
    ids = tok.tokenize(prompt)
    for _ in range(6):
        with torch.no_grad():
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)
        ids.append(int(logits[0, -1, : tok.vocab_size].argmax()))
    out.append(ids[len(tok.tokenize(prompt)):])
print(json.dumps(out))
"""


# A tiny HybridModel saved the way training saves (its model_config record and the tokenizer's training args).
SAVE_HYBRID = """
import sys
from megatron_core.inference.cli.checkpoint import init_distributed_for_inference
from megatron_core.training.checkpointing import save_checkpoint
from tests.inference.hybrid_fixture import build_hybrid
init_distributed_for_inference()
model = build_hybrid("M*M-", seed=2)
save_checkpoint(sys.argv[1], 1, [model], None, None,
                extra_state={"args": {"tokenizer_type": "NullTokenizer", "vocab_size": 60}})
"""


def _run(cmd: list[str], timeout: float = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_prompts_from_flags_and_jsonl(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1 2"}) + "\n\n" + json.dumps({"text": "3"}) + "\n")
    args = build_parser().parse_args(["--load", "x", "--prompt", "5 6", "--prompts-file", str(path)])
    assert read_prompts(args) == ["5 6", "1 2", "3"]
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(build_parser().parse_args(["--load", "x"]))


@pytest.mark.slow
@pytest.mark.timeout(900)  # three subprocesses (train, generate, reference); about 25 s on an idle machine
def test_generate_from_pretrain_checkpoint_matches_naive_decoding(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    _run([sys.executable, "examples/pretrain_gpt.py", *TRAIN, "--save", str(ckpt)])
    out = tmp_path / "out.jsonl"
    prompts = ["1 2 3 4", "7 8 9 10 11 12 13"]
    _run([sys.executable, "-m", "megatron_core.inference.cli.generate", "--load", str(ckpt), "--max-tokens", "6",
          "--output", str(out), *[a for p in prompts for a in ("--prompt", p)]])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    naive = json.loads(_run([sys.executable, "-c", NAIVE, str(ckpt), *prompts]).strip().splitlines()[-1])
    assert [r["prompt"] for r in records] == prompts
    assert [r["generated_tokens"] for r in records] == naive


@pytest.mark.timeout(600)  # three subprocesses (save, generate, reference)
def test_generate_from_hybrid_checkpoint_matches_naive_decoding(tmp_path: Path):
    """``megatron-generate`` rebuilds the HybridModel from its record, reads its Mamba state config, serves it with
    the dynamic engine (two prompts of different lengths, one request slot: the second waits) and matches the
    plain greedy loop over the reloaded model."""
    ckpt = tmp_path / "ckpt"
    _run([sys.executable, "-c", SAVE_HYBRID, str(ckpt)])
    out = tmp_path / "out.jsonl"
    prompts = ["1 2 3 4", "7 8 9 10 11 12 13 40 41"]
    _run([sys.executable, "-m", "megatron_core.inference.cli.generate", "--load", str(ckpt), "--max-tokens", "6",
          "--max-batch", "1", "--block-size-tokens", "4", "--buffer-size-gb", "0.01", "--output", str(out),
          *[a for p in prompts for a in ("--prompt", p)]])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    naive = json.loads(_run([sys.executable, "-c", NAIVE, str(ckpt), *prompts]).strip().splitlines()[-1])
    assert [r["prompt"] for r in records] == prompts
    assert [r["generated_tokens"] for r in records] == naive
    assert all(len(tokens) == 6 for tokens in naive)


def test_hybrid_model_record_round_trip_and_missing_pattern():
    """A HybridModel's model_config record rebuilds the same model (pattern, parameters); a hybrid record without
    its hybrid_layer_pattern is refused by name."""
    from megatron_core.inference.cli.checkpoint import model_from_record
    from megatron_core.models.hybrid import HybridModel
    from megatron_core.training.model_config import model_config_record, parse_model_config
    from tests.inference.hybrid_fixture import build_hybrid

    model = build_hybrid("M*M-")
    record = parse_model_config(model_config_record([model]), "here")
    rebuilt = model_from_record(record, "here", 1, 1)
    assert type(rebuilt) is HybridModel and rebuilt.hybrid_layer_pattern == "M*M-"
    shapes = [{k: getattr(v, "shape", None) for k, v in m.state_dict().items()} for m in (rebuilt, model)]
    assert shapes[0] == shapes[1]
    record["model"].pop("hybrid_layer_pattern")
    with pytest.raises(ValueError, match="has no hybrid_layer_pattern"):
        model_from_record(record, "here", 1, 1)


def test_num_speculative_tokens_flag():
    args = build_parser().parse_args(["--load", "x", "--prompt", "1", "--num-speculative-tokens", "2"])
    assert args.num_speculative_tokens == 2
    check_args(args)
    args.num_speculative_tokens = -1
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        check_args(args)


@pytest.mark.slow
@pytest.mark.timeout(900)  # four subprocesses (train, two generates, reference)
def test_speculative_generate_from_mtp_pretrain_checkpoint_matches_naive_decoding(tmp_path: Path):
    """``pretrain_gpt.py --mtp-num-layers 1`` then ``megatron-generate --num-speculative-tokens 1``: the MTP layers
    draft, and the tokens equal plain generation and the naive full-forward loop."""
    ckpt = tmp_path / "ckpt"
    _run([sys.executable, "examples/pretrain_gpt.py", *TRAIN, "--mtp-num-layers", "1", "--save", str(ckpt)])
    prompts = ["1 2 3 4", "7 8 9 10 11 12 13"]
    outputs = []
    for k in ("0", "1"):
        out = tmp_path / f"out{k}.jsonl"
        _run([sys.executable, "-m", "megatron_core.inference.cli.generate", "--load", str(ckpt), "--max-tokens", "6",
              "--num-speculative-tokens", k, "--output", str(out), *[a for p in prompts for a in ("--prompt", p)]])
        outputs.append([json.loads(line)["generated_tokens"] for line in out.read_text().splitlines()])
    naive = json.loads(_run([sys.executable, "-c", NAIVE, str(ckpt), *prompts]).strip().splitlines()[-1])
    assert outputs[0] == outputs[1] == naive
