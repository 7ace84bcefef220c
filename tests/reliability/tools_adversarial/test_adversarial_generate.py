"""``megatron-generate`` and its checkpoint loader against bad flags, prompts and corrupt or mismatched checkpoints.

One tiny checkpoint is trained once (``pretrain_gpt.py`` in this process); each case works on a
copy. A user error must exit with status 2 and one line naming what and where, and the
checkpoint must be left byte for byte as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.inference.cli import checkpoint as loader
from megatron_core.inference.cli.generate import main
from megatron_core.training.model_config import MODEL_CONFIG_KEY
from tests.reliability.tools_adversarial.conftest import EXAMPLES, fingerprint

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint of a tiny GPT (NullTokenizer, vocab 64) after 2 steps."""
    if dist.is_initialized():
        pytest.skip("a process group from another test is still up")
    saved = {k: os.environ.pop(k) for k in ENV if k in os.environ}
    sys.path.insert(0, EXAMPLES)
    try:
        import pretrain_gpt

        save = tmp_path_factory.mktemp("generate") / "ckpt"
        assert pretrain_gpt.main([
            "--model-preset", "tiny", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--position-embedding-type", "rope", "--mock-data", "--vocab-size", "64",
            "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1", "--train-iters", "2",
            "--eval-iters", "0", "--save", str(save), "--no-progress"]) == 0
    finally:
        sys.path.remove(EXAMPLES)
        for k in ENV:
            os.environ.pop(k, None)
        os.environ.update(saved)
    return save


@pytest.fixture
def ckpt(trained, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(trained, copy)
    return copy


def _data_file(ckpt: Path) -> Path:
    return next((ckpt / "iter_0000002").glob("*.distcp"))


def _truncate(ckpt: Path) -> None:
    path = _data_file(ckpt)
    path.write_bytes(path.read_bytes()[:-100])


def _flip(ckpt: Path) -> None:
    path = _data_file(ckpt)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = [
    ("empty-directory", lambda c: [shutil.rmtree(c), c.mkdir()], "holds no checkpoint"),
    ("tracker-garbage", lambda c: (c / "latest_checkpointed_iteration.txt").write_text("two\n"),
     "must hold a non-negative iteration number"),
    ("tracker-empty", lambda c: (c / "latest_checkpointed_iteration.txt").write_text(""),
     "latest_checkpointed_iteration.txt"),
    ("tracker-names-missing-iteration", lambda c: (c / "latest_checkpointed_iteration.txt").write_text("7\n"),
     "iter_0000007"),
    ("iteration-dir-removed", lambda c: shutil.rmtree(c / "iter_0000002"), "iter_0000002"),
    ("metadata-json-removed", lambda c: (c / "iter_0000002" / "metadata.json").unlink(), "iter_0000002"),
    ("dcp-metadata-removed", lambda c: (c / "iter_0000002" / ".metadata").unlink(), ".metadata"),
    ("dcp-metadata-garbage", lambda c: (c / "iter_0000002" / ".metadata").write_bytes(b"\x80\x04garbage"), ".metadata"),
    ("data-file-truncated", _truncate, ".distcp"),
    ("data-file-byte-flipped", _flip, ".distcp"),
    ("data-file-removed", lambda c: _data_file(c).unlink(), ".distcp"),
]


@pytest.mark.parametrize("name, corrupt, fragment", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_checkpoints_are_refused(ckpt, capsys, name, corrupt, fragment) -> None:
    corrupt(ckpt)
    before = fingerprint(ckpt)
    assert main(["--load", str(ckpt), "--prompt", "1 2 3", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatron-generate: error: ") and fragment in err, err
    assert fingerprint(ckpt) == before
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()


def _edit_record(edit):
    """A change of the record's text: parse it, ``edit`` the dict, write it back."""
    def change(text: str) -> str:
        record = json.loads(text)
        edit(record)
        return json.dumps(record)
    return change


RECORDS = [
    ("record-not-json", lambda text: text[:40], "model_config is not JSON"),
    ("record-not-a-string", lambda text: 42, "model_config is not JSON"),
    ("record-future-format", _edit_record(lambda r: r.update(format=99)), "format 99"),
    ("record-without-config", _edit_record(lambda r: r.pop("transformer_config")), "lacks 'transformer_config'"),
    ("record-unknown-field", _edit_record(lambda r: r["transformer_config"].update(bogus_field=1)), "bogus_field"),
    ("record-imports-outside-torch", _edit_record(lambda r: r["transformer_config"].update(
        activation_func={"function": "os:system"})), "refusing to import"),
    ("record-unknown-dtype", _edit_record(lambda r: r["transformer_config"].update(params_dtype={"dtype": "float7"})),
     "unknown dtype"),
    ("record-other-hidden-size", _edit_record(lambda r: r["transformer_config"].update(hidden_size=32)),
     "hidden_size is 16 in the checkpoint and 32"),
    ("record-other-vocab", _edit_record(lambda r: r["model"].update(vocab_size=128)), "vocab_size is 72"),
    ("record-not-a-gpt", _edit_record(lambda r: r.update(model_class="megatron_core.models.bert:BertModel")),
     "only GPTModel"),
    ("record-vocab-smaller-than-tokenizer", _edit_record(lambda r: r["model"].update(vocab_size=8)), "tokenizer has 65"),
]


@pytest.mark.parametrize("name, change, fragment", RECORDS, ids=[r[0] for r in RECORDS])
def test_bad_model_config_records_are_refused(ckpt, monkeypatch, capsys, name, change, fragment) -> None:
    original = loader.read_checkpoint_common

    def corrupted(load_dir: str, **kwargs):
        common, iteration, where = original(load_dir, **kwargs)
        common[MODEL_CONFIG_KEY] = change(common[MODEL_CONFIG_KEY])
        return common, iteration, where

    monkeypatch.setattr(loader, "read_checkpoint_common", corrupted)
    before = fingerprint(ckpt)
    assert main(["--load", str(ckpt), "--prompt", "1 2 3", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    assert fingerprint(ckpt) == before


def test_checkpoint_without_record_or_args(ckpt, monkeypatch, capsys) -> None:
    monkeypatch.setattr(loader, "read_checkpoint_common", lambda d, **_: ({"iteration": 2}, 2, str(d)))
    assert main(["--load", str(ckpt), "--prompt", "1"]) == 2
    assert "records neither the model configuration nor training args" in capsys.readouterr().err


def _prompts(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(data)
    return str(path)


FLAGS = [
    ("load-missing", lambda c, t: ["--load", str(t / "nope"), "--prompt", "1"], "does not exist"),
    ("load-is-a-file", lambda c, t: ["--load", str(c / "latest_checkpointed_iteration.txt"), "--prompt", "1"],
     "is not a directory"),
    ("prompts-file-missing", lambda c, t: ["--load", str(c), "--prompts-file", str(t / "none.jsonl")], "none.jsonl"),
    ("prompts-file-bad-json", lambda c, t: ["--load", str(c), "--prompts-file",
                                            _prompts(t, b'{"prompt": "1"}\n{"prompt": \n')], "prompts.jsonl:2: not JSON"),
    ("prompts-file-not-a-string", lambda c, t: ["--load", str(c), "--prompts-file", _prompts(t, b'{"prompt": 3}\n')],
     "prompts.jsonl:1: expected a 'prompt' string"),
    ("prompts-file-binary", lambda c, t: ["--load", str(c), "--prompts-file", _prompts(t, b"\xff\xd8\xff\xe0\n")],
     "prompts.jsonl:1: not UTF-8"),
    ("prompts-file-is-a-directory", lambda c, t: ["--load", str(c), "--prompts-file", str(t)], str(Path("/"))),
    ("no-prompts", lambda c, t: ["--load", str(c)], "no prompts"),
    ("max-tokens-zero", lambda c, t: ["--load", str(c), "--prompt", "1", "--max-tokens", "0"], "--max-tokens (0)"),
    ("temperature-negative", lambda c, t: ["--load", str(c), "--prompt", "1", "--temperature", "-1"], "--temperature"),
    ("top-p-above-one", lambda c, t: ["--load", str(c), "--prompt", "1", "--top-p", "1.5"], "--top-p (1.5)"),
    ("top-k-negative", lambda c, t: ["--load", str(c), "--prompt", "1", "--top-k", "-2"], "--top-k (-2)"),
    ("tp-zero", lambda c, t: ["--load", str(c), "--prompt", "1", "--tp", "0"], "--tp (0)"),
    ("tp-larger-than-world", lambda c, t: ["--load", str(c), "--prompt", "1", "--tp", "2"], "2"),
    ("buffer-zero", lambda c, t: ["--load", str(c), "--prompt", "1", "--buffer-size-gb", "0"], "--buffer-size-gb (0.0)"),
    ("max-batch-zero", lambda c, t: ["--load", str(c), "--prompt", "1", "--max-batch", "0"], "--max-batch (0)"),
    ("output-dir-missing", lambda c, t: ["--load", str(c), "--prompt", "1", "--output", str(t / "no" / "o.jsonl")],
     "does not exist"),
    ("output-is-a-directory", lambda c, t: ["--load", str(c), "--prompt", "1", "--output", str(t)], "is a directory"),
    ("prompt-not-integers-for-null-tokenizer", lambda c, t: ["--load", str(c), "--prompt", "hello"], "hello"),
]


@pytest.mark.parametrize("name, argv, fragment", FLAGS, ids=[f[0] for f in FLAGS])
def test_bad_flags_and_prompts(ckpt, tmp_path, capsys, name, argv, fragment) -> None:
    before = fingerprint(ckpt)
    assert main(argv(ckpt, tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatron-generate: error: ") and fragment in err, err
    assert fingerprint(ckpt) == before
    assert not dist.is_initialized()


def test_a_good_run_writes_its_output_and_leaves_the_checkpoint(ckpt, tmp_path) -> None:
    before = fingerprint(ckpt)
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    assert main(["--load", str(ckpt), "--prompt", "1 2 3", "--prompt", "4", "--max-tokens", "2",
                 "--buffer-size-gb", "0.01", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["1 2 3", "4"] and all(len(r["generated_tokens"]) == 2 for r in rows)
    assert fingerprint(ckpt) == before and not list(tmp_path.glob("out.jsonl.tmp-*"))


def test_an_older_checkpoint_loads_from_its_flags_with_a_warning(ckpt, monkeypatch) -> None:
    original = loader.read_checkpoint_common

    def without_record(load_dir: str, **kwargs):
        common, iteration, where = original(load_dir, **kwargs)
        return {k: v for k, v in common.items() if k != MODEL_CONFIG_KEY}, iteration, where

    monkeypatch.setattr(loader, "read_checkpoint_common", without_record)
    loader.init_distributed_for_inference()
    try:
        with pytest.warns(UserWarning, match="no model_config record"):
            model, _, _ = loader.load_gpt_from_checkpoint(str(ckpt))
        assert model.vocab_size == 72
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
