"""Every Triton kernel compiles for Hopper with Triton's GPU compiler, on a machine without a GPU.

The interpreter tests run the kernels' Python semantics; this runs the real
compiler (TTIR -> TTGIR -> LLVM -> PTX -> ptxas) on every launch the launchers
make across their code paths, with the first launch config of each autotuner; in
float16 only each kernel's first launch (bfloat16's cover the same code paths).
``python tests/triton/offline_compile.py --arch 90 --arch 80`` checks every
config and Ampere too (slower; see its docstring).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("offline_compile.py")


@pytest.mark.long
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold cache: everything is compiled here
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90", "--first-config", "--float16", "first", "--keep-cache"],
        env=env, capture_output=True, text=True, timeout=1200,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-8000:]
    assert "compiles succeeded" in out and "FAILED" not in out, out[-8000:]
