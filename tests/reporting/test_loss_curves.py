"""The main job's loss-curve PNG (``examples/gpt_training/plots.py``): drawn with matplotlib, skipped without.

The PNG must be a valid PNG of the figure's size; with matplotlib hidden (the import fails),
nothing is written and the job prints how to get the picture instead.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
pytest.importorskip("matplotlib")


def _log(path: Path) -> Path:
    records = [{"kind": "train", "iteration": i, "lm loss": 8.0 / i} for i in range(1, 31)]
    records += [{"kind": "valid", "iteration": i, "validation loss": 9.0 / i} for i in (10, 20, 30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    chunks, offset = [], 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kind, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length:offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append((kind, body))
        offset += 12 + length
    return chunks


def _main_job(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import main_job

    return main_job


def test_png_is_written_and_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    main_job = _main_job(monkeypatch)
    png = tmp_path / "logs" / "loss_curves.png"
    assert main_job.report_curves(_log(tmp_path / "train_log.jsonl"), png) == png
    assert f"loss curves: {png}" in capsys.readouterr().out
    chunks = _png_chunks(png.read_bytes())
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert (width, height) == (700, 450)
    pixels = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(set(pixels)) > 10  # something was drawn, not a blank image


def test_without_matplotlib_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    main_job = _main_job(monkeypatch)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "loss_curves.png"
    assert main_job.report_curves(_log(tmp_path / "train_log.jsonl"), png) is None
    assert not png.exists()
    assert "install matplotlib" in capsys.readouterr().out


def test_curves_are_read_from_the_json_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(EXAMPLES)
    from gpt_training.plots import read_curves

    curves = read_curves(_log(tmp_path / "train_log.jsonl"))
    assert len(curves["train"]) == 30 and curves["valid"] == [(10, 0.9), (20, 0.45), (30, 0.3)]
