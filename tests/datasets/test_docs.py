"""The snippets of docs/datasets.md run, in order, in an empty directory."""

from __future__ import annotations

import os
import re

import pytest

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "datasets.md")


def test_user_guide_snippets_run(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    blocks = re.findall(r"```python\n(.*?)```", open(DOC, encoding="utf-8").read(), flags=re.S)
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs_datasets"}
    for number, block in enumerate(blocks):
        exec(compile(block, f"docs/datasets.md block {number}", "exec"), namespace)  # noqa: S102
