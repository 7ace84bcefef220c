"""Loss curves of a run as a PNG (train and validation loss by iteration), when matplotlib is installed.

matplotlib is optional (in the ``dev`` extra) and imported here only; without it nothing is drawn
and the caller keeps printing the numbers.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_curves(log_json: Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train": [(iteration, lm loss)], "valid": [(iteration, validation loss)]}`` from a ``--log-json`` file."""
    curves: dict[str, list[tuple[int, float]]] = {"train": [], "valid": []}
    for line in Path(log_json).read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train" and "lm loss" in record:
            curves["train"].append((record["iteration"], record["lm loss"]))
        elif record["kind"] == "valid" and "validation loss" in record:
            curves["valid"].append((record["iteration"], record["validation loss"]))
    return curves


def plot_loss_curves(log_json: Path, png_path: Path, title: str = "loss") -> Path | None:
    """Draw the train and validation loss of ``log_json`` into ``png_path``; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    curves = read_curves(log_json)
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
    try:
        for kind, style, label in (("train", "-", "train loss"), ("valid", "o-", "validation loss")):
            if curves[kind]:
                iterations, losses = zip(*curves[kind])
                axes.plot(iterations, losses, style, label=label, markersize=4)
        axes.set_xlabel("iteration")
        axes.set_ylabel("loss")
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        png_path = Path(png_path)
        png_path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(png_path, format="png")
    finally:
        plt.close(figure)
    return png_path
