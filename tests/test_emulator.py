"""The host grid emulator (csrc/emu/hfkern_cuda.h) against its own CUDA-style kernels.

csrc/emu/tests/emu_kernels.cu is compiled as plain C++ and run on the CPU
(every case must report PASS), and compiled by nvcc for sm_90 to show the very
same source is valid CUDA. Neither needs a GPU.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "emu" / "tests" / "emu_kernels.cu"

# Every case the source defines for the emulator; a case that silently
# disappears from the binary must fail this test, not pass it.
EXPECTED_CASES = {
    "block_reduction",
    "shuffles",
    "votes_partial_warp",
    "atomics",
    "dynamic_smem",
    "odd_shapes",
    "barrier",
    "early_exit",
    "template_kernel",
    "invalid_launch",
    "kernel_exception",
}

GXX_FLAGS = ["-std=c++20", "-O1", "-pthread", "-Wall", "-Wextra", "-x", "c++"]


def _compile_host(tmp_path: Path, extra=()) -> Path:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed; the emulator needs a C++20 host compiler")
    exe = tmp_path / "emu_kernels"
    proc = subprocess.run(
        [gxx, *GXX_FLAGS, *extra, str(SOURCE), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"g++ failed:\n{proc.stderr}"
    return exe


def _run_cases(exe: Path, env=None, timeout=120) -> subprocess.CompletedProcess:
    # A broken barrier or warp exchange deadlocks rather than failing, so the
    # timeout is part of the test.
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout, env=env)


def _assert_all_passed(proc: subprocess.CompletedProcess) -> None:
    results = dict(re.findall(r"^CASE (\S+) (PASS|FAIL.*)$", proc.stdout, flags=re.M))
    failed = {name: r for name, r in results.items() if r != "PASS"}
    assert not failed, f"failed cases: {failed}\n{proc.stdout}{proc.stderr}"
    assert set(results) == EXPECTED_CASES, f"cases run: {sorted(results)}, expected {sorted(EXPECTED_CASES)}"
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout}{proc.stderr}"


def test_emulated_kernels_pass(tmp_path):
    exe = _compile_host(tmp_path)
    _assert_all_passed(_run_cases(exe))


def test_same_source_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    obj = tmp_path / "emu_kernels.o"
    proc = subprocess.run(
        [nvcc, "-arch=sm_90", "-c", "-x", "cu", str(SOURCE), "-o", str(obj)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stderr}"
    assert obj.stat().st_size > 0


@pytest.mark.skipif(os.environ.get("HFKERN_TSAN") != "1", reason="ThreadSanitizer run; set HFKERN_TSAN=1")
def test_emulated_kernels_under_thread_sanitizer(tmp_path):
    exe = _compile_host(tmp_path, extra=["-fsanitize=thread", "-g"])
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    proc = _run_cases(exe, env=env, timeout=300)
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr[-20000:]
    _assert_all_passed(proc)
