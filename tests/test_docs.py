"""What README.md says about the repository matches the repository."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_layout_section_names_paths_that_exist():
    block = re.search(r"## Layout\n\n```\n(.*?)```", _readme(), re.S)
    assert block, "README.md has no Layout code block"
    paths = re.findall(r"(?:^|[\s(])([\w.]+/(?:[\w.<>]+/?)*|[\w]+\.py)", block.group(1))
    checked = 0
    for p in paths:
        if "<" in p:  # a pattern such as <family>_torch.py, not a path
            continue
        if "/" not in p and not p.endswith(".py"):
            continue
        assert os.path.exists(os.path.join(ROOT, p)) or os.path.exists(os.path.join(ROOT, "hfkern", p)), p
        checked += 1
    assert checked >= 10, paths


def _setup_requirements() -> dict[str, str]:
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords
          if k.arg in ("install_requires", "extras_require")}
    reqs = list(kw["install_requires"]) + [r for v in kw["extras_require"].values() for r in v]
    out = {}
    for r in reqs:
        name, _, spec = re.match(r"([A-Za-z0-9_-]+)(.*)", r).group(1, 0, 2)
        if spec:
            assert out.setdefault(name, spec) == spec, f"{name} has two ranges in setup.py"
    return out


def test_setup_version_ranges_are_the_supported_ones():
    m = re.search(r"supports torch (\d+\.\d+) to (\d+)\.(\d+) and Triton (\d+\.\d+) to (\d+)\.(\d+)", _readme())
    assert m, "README.md no longer states the supported torch and Triton versions"
    torch_lo, torch_major, torch_minor, triton_lo, triton_major, triton_minor = m.groups()
    reqs = _setup_requirements()
    assert reqs["torch"] == f">={torch_lo},<{torch_major}.{int(torch_minor) + 1}", reqs
    assert reqs["triton"] == f">={triton_lo},<{triton_major}.{int(triton_minor) + 1}", reqs
