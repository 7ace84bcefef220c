"""``megatron-convert`` against bad HF directories, bad checkpoints, existing outputs and faults while exporting.

A user error must exit with status 2 and one line naming what and where; the inputs and any
existing output must be left byte for byte as they were, and no temporary directory may remain.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from megatron_core.models.hf import export as export_module
from megatron_core.models.hf.cli import main
from tests.reliability.tools_adversarial.conftest import fingerprint


def _hf_copy(exported, tmp_path: Path) -> Path:
    hf = tmp_path / "hf"
    shutil.copytree(exported[0], hf)
    return hf


def _config(hf: Path, **changes) -> None:
    path = hf / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


HF_INPUTS = [
    ("hf-missing", lambda hf: shutil.rmtree(hf), "hf"),
    ("hf-is-a-file", lambda hf: [shutil.rmtree(hf), hf.write_text("x")], "hf"),
    ("config-missing", lambda hf: (hf / "config.json").unlink(), "config.json"),
    ("config-not-json", lambda hf: (hf / "config.json").write_text("{oops"), "config.json"),
    ("config-a-list", lambda hf: (hf / "config.json").write_text("[1, 2]"), "config.json"),
    ("unknown-architecture", lambda hf: _config(hf, architectures=["FooForCausalLM"]), "FooForCausalLM"),
    ("hidden-size-missing", lambda hf: _config(hf, hidden_size=None), "hidden_size"),
    ("heads-not-a-number", lambda hf: _config(hf, num_attention_heads="six"), "config.json: LlamaForCausalLM config "
     "holds a value of the wrong type (invalid literal for int() with base 10: 'six')"),
    ("unsupported-rope-scaling", lambda hf: _config(hf, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    ("weights-missing", lambda hf: (hf / "model.safetensors").unlink(), "safetensors"),
    ("weights-truncated", lambda hf: (hf / "model.safetensors").write_bytes(
        (hf / "model.safetensors").read_bytes()[:1000]), "model.safetensors"),
    ("weights-garbage", lambda hf: (hf / "model.safetensors").write_bytes(b"\x00" * 64), "model.safetensors"),
    ("weights-of-another-shape", lambda hf: _config(hf, intermediate_size=96), "config.json implies (96, 48)"),
]


@pytest.mark.parametrize("name, spoil, fragment", HF_INPUTS, ids=[h[0] for h in HF_INPUTS])
def test_bad_hf_directories(exported, tmp_path, capsys, name, spoil, fragment) -> None:
    hf = _hf_copy(exported, tmp_path)
    spoil(hf)
    before = fingerprint(tmp_path)
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "ckpt"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatron-convert: error: ") and fragment in err, err
    assert fingerprint(tmp_path) == before  # nothing created, the input untouched


@pytest.mark.parametrize("name, flags, fragment", [
    ("tp-zero", ["--tp", "0"], "--tp (0)"),
    ("pp-negative", ["--pp", "-1"], "--pp (-1)"),
    ("divisible-by-zero", ["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by (0)"),
    ("tp-not-dividing-heads", ["--tp", "4"], "4"),
    ("pp-above-layers", ["--pp", "3"], "3"),
], ids=lambda v: v if isinstance(v, str) and "-" in v else "")
def test_bad_hf_to_mcore_flags(exported, tmp_path, capsys, name, flags, fragment) -> None:
    assert main(["hf-to-mcore", "--hf", str(exported[0]), "--out", str(tmp_path / "ckpt"), *flags,
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("existing", ["complete-checkpoint", "foreign-files", "a-file"])
def test_hf_to_mcore_never_replaces_an_existing_out(exported, tmp_path, capsys, existing) -> None:
    out = tmp_path / "out"
    if existing == "complete-checkpoint":
        shutil.copytree(exported[1], out)
    elif existing == "foreign-files":
        out.mkdir()
        (out / "iter_0000000").mkdir()
        (out / "iter_0000000" / "notes.txt").write_text("mine")
    else:
        out.write_text("a file")
    before = fingerprint(out)
    assert main(["hf-to-mcore", "--hf", str(exported[0]), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err, err
    assert fingerprint(out) == before


def _ckpt_copy(exported, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported[1], ckpt)
    return ckpt


CHECKPOINTS = [
    ("mcore-missing", lambda c: shutil.rmtree(c), "ckpt"),
    ("no-tracker", lambda c: (c / "latest_checkpointed_iteration.txt").unlink(), "ckpt"),
    ("tracker-garbage", lambda c: (c / "latest_checkpointed_iteration.txt").write_text("zero"), "latest_checkpointed"),
    ("tracker-names-missing-iteration", lambda c: (c / "latest_checkpointed_iteration.txt").write_text("9"),
     "iter_0000009"),
    ("dcp-metadata-removed", lambda c: (c / "iter_0000000" / ".metadata").unlink(), ".metadata"),
    ("data-file-removed", lambda c: next((c / "iter_0000000").glob("*.distcp")).unlink(), ".distcp"),
    ("template-config-garbage", lambda c: (c / "hf" / "config.json").write_text("{"), "config.json"),
]


@pytest.mark.parametrize("name, spoil, fragment", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_bad_checkpoints_for_mcore_to_hf(exported, tmp_path, capsys, name, spoil, fragment) -> None:
    ckpt = _ckpt_copy(exported, tmp_path)
    spoil(ckpt)
    before = fingerprint(tmp_path)
    assert main(["mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "export"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatron-convert: error: ") and fragment in err, err
    assert fingerprint(tmp_path) == before


def _mismatched_template(exported, tmp_path: Path) -> Path:
    from tests.models.hf.hf_models import make_hf_model

    make_hf_model("llama", tmp_path / "other", hidden_size=32, num_attention_heads=4)
    return tmp_path / "other"


@pytest.mark.parametrize("name, flags, fragment", [
    ("iteration-missing", lambda e, t: ["--iteration", "5"], "iter_0000005"),
    ("template-missing", lambda e, t: ["--hf-template", str(t / "none")], "none"),
    ("template-of-another-model", lambda e, t: ["--hf-template", str(_mismatched_template(e, t))], "the HF config implies (128, 32)"),
    ("shard-size-garbage", lambda e, t: ["--max-shard-size", "lots"], "'lots'"),
    ("shard-size-zero", lambda e, t: ["--max-shard-size", "0"], "at least one byte"),
], ids=lambda v: v if isinstance(v, str) and "-" in v else "")
def test_bad_mcore_to_hf_flags(exported, tmp_path, capsys, name, flags, fragment) -> None:
    out = tmp_path / "export"
    extra = flags(exported, tmp_path)
    capsys.readouterr()  # what building a template printed
    assert main(["mcore-to-hf", "--mcore", str(exported[1]), "--out", str(out), *extra, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    assert not out.exists() and not list(tmp_path.glob("export.tmp-*"))


OUTS = [
    ("non-empty-without-overwrite", [], lambda o: (o / "config.json").write_text("{}"), "--overwrite"),
    ("foreign-file-with-overwrite", ["--overwrite"], lambda o: (o / "README.md").write_text("mine"), "'README.md'"),
    ("foreign-folder-with-overwrite", ["--overwrite"], lambda o: (o / "logs").mkdir(), "'logs'"),
    ("symlinked-config-with-overwrite", ["--overwrite"],
     lambda o: [(o / "config.json").unlink(), os.symlink("/etc/hostname", o / "config.json")], "'config.json'"),
    ("out-is-a-file", ["--overwrite"], None, "not a directory"),
]


@pytest.mark.parametrize("name, flags, prepare, fragment", OUTS, ids=[o[0] for o in OUTS])
def test_existing_outputs_are_never_lost(exported, tmp_path, capsys, name, flags, prepare, fragment) -> None:
    out = tmp_path / "out"
    if prepare is None:
        out.write_text("a file")
    else:
        shutil.copytree(exported[2], out)
        prepare(out)
    before = fingerprint(out)
    assert main(["mcore-to-hf", "--mcore", str(exported[1]), "--out", str(out), *flags, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    assert fingerprint(out) == before and not list(tmp_path.glob("out.tmp-*"))


def _fault(monkeypatch, step: str) -> None:
    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, f"No space left on device (simulated: {step})")

    if step == "temporary-directory":
        monkeypatch.setattr(export_module.os, "makedirs", fail)
    elif step == "third-tensor":
        real, count = export_module.HFDirectoryWriter.write, [0]

        def write(self, *args, **kwargs):
            count[0] += 1
            if count[0] == 3:
                fail()
            return real(self, *args, **kwargs)

        monkeypatch.setattr(export_module.HFDirectoryWriter, "write", write)
    elif step == "config-json":
        monkeypatch.setattr(export_module, "_write_json", fail)
    elif step == "tokenizer-copy":
        monkeypatch.setattr(export_module.shutil, "copyfile", fail)
    elif step == "publish-rename":
        real_rename = os.rename

        def rename(src, dst):
            if ".tmp-" in str(src):
                fail()
            return real_rename(src, dst)

        monkeypatch.setattr(export_module.os, "rename", rename)


@pytest.mark.parametrize("step", ["temporary-directory", "third-tensor", "config-json", "publish-rename"])
@pytest.mark.parametrize("over", ["fresh", "earlier-export"])
def test_interrupted_exports_leave_the_output_alone(exported, tmp_path, monkeypatch, capsys, step, over) -> None:
    out = tmp_path / "out"
    if over == "earlier-export":
        shutil.copytree(exported[2], out)
    before = fingerprint(out)
    _fault(monkeypatch, step)
    assert main(["mcore-to-hf", "--mcore", str(exported[1]), "--out", str(out), "--overwrite", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and str(out) in err, err
    assert fingerprint(out) == before
    assert sorted(os.listdir(tmp_path)) == (["out"] if over == "earlier-export" else [])


def test_argparse_errors_exit_2(capsys) -> None:
    for argv in ([], ["frobnicate"], ["mcore-to-hf", "--mcore", "x"], ["mcore-to-hf", "--mcore", "x", "--out", "y",
                                                                       "--dtype", "fp8"]):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 2
    capsys.readouterr()
