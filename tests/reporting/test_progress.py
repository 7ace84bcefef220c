"""``megatron_core.progress``: a tqdm bar on a terminal, plain lines without tqdm or off a terminal.

Also its users: the example's training logger and ``megatron-preprocess-data``'s progress. tqdm's
absence is simulated by hiding the module (``sys.modules["tqdm"] = None`` makes the import fail).
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import pytest

from megatron_core.datasets import preprocess_data
from megatron_core.progress import load_tqdm, progress_bar, track

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
pytest.importorskip("tqdm")


class Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _hide_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert load_tqdm() is None


def test_track_draws_a_bar_on_a_terminal() -> None:
    out = Terminal()
    assert list(track(range(4), 4, "convert", unit="tensors", stream=out)) == [0, 1, 2, 3]
    assert "convert: 100%" in out.getvalue() and "4/4" in out.getvalue()


@pytest.mark.parametrize("why", ["not a terminal", "no tqdm"])
def test_track_falls_back_to_plain_lines(why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO() if why == "not a terminal" else Terminal()
    if why == "no tqdm":
        _hide_tqdm(monkeypatch)
    assert list(track(range(20), 20, "convert", unit="tensors", stream=out, lines=4)) == list(range(20))
    assert out.getvalue().splitlines() == [f"convert: {k}/20 tensors" for k in (5, 10, 15, 20)]
    silent = io.StringIO()
    assert list(track(range(3), 3, "x", stream=silent, lines=0)) == [0, 1, 2] and silent.getvalue() == ""


def test_progress_bar_is_none_when_disabled_off_a_terminal_or_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    assert progress_bar(10, "train", stream=Terminal(), enabled=False) is None
    assert progress_bar(10, "train", stream=io.StringIO()) is None
    bar = progress_bar(10, "train", stream=Terminal())
    assert bar is not None
    bar.close()
    _hide_tqdm(monkeypatch)
    assert progress_bar(10, "train", stream=Terminal()) is None


def _logger_args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(train_iters=10, no_progress=False, log_json=str(tmp_path / "log.jsonl"),
                              tensorboard_dir=None, wandb_project=None, wandb_exp_name=None)


@pytest.mark.parametrize("tqdm_installed", [True, False], ids=["tqdm", "no_tqdm"])
def test_training_logger_bar_on_a_terminal_and_plain_lines_otherwise(tqdm_installed: bool, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(EXAMPLES)
    from gpt_training.logger import TrainingLogger

    if not tqdm_installed:
        _hide_tqdm(monkeypatch)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    logger = TrainingLogger(_logger_args(tmp_path), rank=0)
    logger.log(5, {"lm loss": 3.25})
    logger.log(5, {"validation loss": 3.5}, kind="valid")
    logger.info("saved")
    logger.close()
    text = terminal.getvalue()
    assert "[valid] iteration      5/10 | validation loss 3.5" in text and "saved" in text
    if tqdm_installed:
        assert logger.progress and "5/10" in text and "lm loss 3.25" in text and "[train]" not in text
    else:
        assert not logger.progress and "[train] iteration      5/10 | lm loss 3.25" in text
    assert (tmp_path / "log.jsonl").read_text().count("\n") == 2  # the JSON sink is unchanged


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "log_file"])
def test_preprocess_progress_counts_on_a_terminal_and_prints_lines_otherwise(terminal: bool,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    progress = preprocess_data._Progress(interval=2)
    for _ in range(4):
        progress.add(100)
    progress.message("skipping x.jsonl:3: bad record")
    progress.close()
    text = stream.getvalue()
    assert "skipping x.jsonl:3: bad record" in text and progress.documents == 4
    if terminal:
        assert "preprocess:4doc" in text.replace(" ", ""), text
        assert "Processed" not in text
    else:
        assert text.count("Processed") == 2, text
