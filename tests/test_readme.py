"""The README's API tour runs as written."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_api_tour_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert scope["logits"].shape == (scope["B"], 32, 10)
    assert scope["losses"].shape == (scope["B"],)
    assert all(p.grad is not None for p in scope["model"].parameters())
    assert torch.isfinite(scope["losses"]).all()
