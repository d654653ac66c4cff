"""The emulated kernel tests once more, with hfkern._C_emu built under ThreadSanitizer.

Opt-in (HFKERN_TSAN=1; about a minute): the kernels' sources and the binding are
compiled with ``g++ -fsanitize=thread`` into a scratch copy of the package,
and this directory's emulator tests run on it in a subprocess with libtsan
preloaded (the Python interpreter is not instrumented). Any report fails the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("HFKERN_TSAN") != "1", reason="ThreadSanitizer run; set HFKERN_TSAN=1")
def test_emulated_kernels_under_thread_sanitizer(tmp_path):
    pybind11 = pytest.importorskip("pybind11")
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    for name in ("hfkern", "tests"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pytest.ini", tmp_path)
    sources = [ROOT / "csrc" / "bindings.cpp", *sorted(p for p in (ROOT / "csrc").rglob("*.cu")
                                                     if "emu" not in p.relative_to(ROOT / "csrc").parts)]
    module = tmp_path / "hfkern" / ("_C_emu" + sysconfig.get_config_var("EXT_SUFFIX"))
    build = subprocess.run(
        [gxx, "-std=c++20", "-O1", "-g", "-fsanitize=thread", "-pthread", "-shared", "-fPIC",
         f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc' / 'emu'}", f"-I{pybind11.get_include()}",
         f"-I{sysconfig.get_paths()['include']}", "-DHFKERN_MODULE_NAME=_C_emu", "-DHFKERN_EMULATED_BUILD=1",
         str(sources[0]), "-x", "c++", *map(str, sources[1:]), "-o", str(module)],
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stderr
    libtsan = subprocess.run([gxx, "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=libtsan, HFKERN_REQUIRE_EXTENSIONS="1",
               TSAN_OPTIONS="halt_on_error=0 report_signal_unsafe=0")
    env.pop("HFKERN_TSAN")
    where = subprocess.run([sys.executable, "-c", "import hfkern._C_emu as m; print(m.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert where.stdout.strip() == str(module), where.stdout + where.stderr  # the instrumented build
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "emulator", "tests/cuda"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200,
    )
    output = proc.stdout + proc.stderr
    assert "WARNING: ThreadSanitizer" not in output, output[-20000:]
    assert proc.returncode == 0 and " passed" in proc.stdout, output[-20000:]
