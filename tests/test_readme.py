"""The README's API tour runs as written."""

import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.long
def test_readme_examples_run():
    # the python blocks run in order in one scope, as a reader would paste them
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2, "README.md lost its python examples"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert scope["logits"].shape == (scope["B"], 32, 10)
    assert scope["losses"].shape == (scope["B"],)
    assert all(p.grad is not None for p in scope["model"].parameters())
    assert torch.isfinite(scope["losses"]).all()
    for block in blocks[1:]:
        if "set_backend" in block:  # the backend block shows calls, not a program
            continue
        exec(compile(block, "README.md", "exec"), scope)
    assert scope["norms"].shape == (scope["B"],)
    assert scope["opt"].last_skipped.shape == (scope["B"],)
    assert scope["out"].shape == (4, 32, 10)  # the hfkern.fuse block
    assert [type(n).__name__ for n in scope["nets"]] == ["Net"] * 4
