"""hfkern build script.

The Python package is pure Python; CMakeLists.txt builds two optional pybind11
modules from csrc/ (raw pointers, no torch ABI, so one build serves every
supported torch):

* ``hfkern._C``: the CUDA kernels, compiled by nvcc, statically linked to the
  CUDA runtime. ``HFKERN_BUILD_CUDA=auto|0|1`` (default ``auto``): ``auto``
  builds it when nvcc is found ($CUDACXX, PATH, $CUDA_HOME/bin, $CUDA_PATH/bin)
  and otherwise installs pure Python with a notice; ``1`` fails when nvcc is
  missing; ``0`` never builds it. No GPU is probed, ever.
* ``hfkern._C_emu``: the same kernels compiled as C++20 host code and run by
  the grid emulator (csrc/emu/README.md). ``HFKERN_BUILD_EMU=auto|0|1``
  (default ``0``; ``auto`` builds it when a C++ compiler is found).

``HFKERN_CUDA_ARCHS`` (default ``80-real;90``) lists the architectures of
``_C`` in CMake's syntax: ``NN`` (SASS and PTX), ``NN-real`` (SASS) or
``NN-virtual`` (PTX), separated by ``;`` or ``,``.

A build that is attempted and fails fails the install: there is no silent
fallback to pure Python. CMake builds in a persistent directory under build/,
one per configuration, so that building again (``pip wheel .`` after
``pip install -e .``) only redoes what changed. The version ranges are the ones
the test suite runs on (README.md, "Versions and compile checks").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "80-real;90"
MIN_CMAKE = (3, 24)
# CMake's CUDA_ARCHITECTURES entries that name one architecture: 80, 86-real,
# 90-virtual (hfkern/cuda/_ext.py reads the same form back from _C). Not
# "native", "all" or "all-major": those depend on the machine that builds (or
# take an hour), and the build never probes a GPU.
_ARCH_ENTRY = re.compile(r"[1-9][0-9]+(?:-real|-virtual)?")
_MODES = ("auto", "0", "1")
# Every module CMakeLists.txt can build.
EXTENSION_MODULES = ("hfkern._C", "hfkern._C_emu")


class BuildConfigError(RuntimeError):
    """An HFKERN_* build setting or a build tool is not what the build needs."""


def build_mode(env, name: str, default: str) -> str:
    """The value of the build switch `name`: "auto", "0" or "1" ("" means `default`)."""
    value = env.get(name, "").strip().lower() or default
    if value not in _MODES:
        raise BuildConfigError(f"{name}={env.get(name)!r}: expected one of auto, 0, 1")
    return value


def cuda_architectures(env=os.environ) -> str:
    """HFKERN_CUDA_ARCHS validated and normalized to CMake's list form ("80-real;90")."""
    raw = env.get("HFKERN_CUDA_ARCHS", "").strip()
    if not raw:
        return DEFAULT_CUDA_ARCHS
    entries = [entry.strip() for entry in re.split(r"[;,]", raw)]
    bad = [entry for entry in entries if not _ARCH_ENTRY.fullmatch(entry)]
    if bad:
        raise BuildConfigError(
            f"HFKERN_CUDA_ARCHS={raw!r}: {', '.join(repr(b) for b in bad)} is not an architecture; expected "
            "entries like 80, 86-real or 90-virtual separated by ';' or ',' (e.g. \"80-real;90\"). "
            "'native', 'all' and 'all-major' are not accepted: the build never probes a GPU."
        )
    return ";".join(dict.fromkeys(entries))  # in order, duplicates dropped


def find_nvcc(env=os.environ) -> str | None:
    """nvcc from $CUDACXX, PATH, $CUDA_HOME/bin or $CUDA_PATH/bin, or None."""
    candidates = [env.get("CUDACXX"), shutil.which("nvcc", path=env.get("PATH"))]
    candidates += [str(Path(env[var]) / "bin" / "nvcc") for var in ("CUDA_HOME", "CUDA_PATH") if env.get(var)]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    return None


def find_cxx(env=os.environ) -> str | None:
    """The C++ compiler CMake would pick ($CXX, else c++, g++ or clang++ on PATH), or None."""
    path = env.get("PATH")
    if env.get("CXX"):
        return shutil.which(shlex.split(env["CXX"])[0], path=path)
    return next((found for name in ("c++", "g++", "clang++") if (found := shutil.which(name, path=path))), None)


class CMakeExtension(Extension):
    """A module that CMakeLists.txt builds: its target is the module's own name
    (``_C``), enabled by the CMake option `option`; `defines` are the cache
    entries it needs (-DNAME=VALUE)."""

    def __init__(self, name: str, option: str, defines: dict[str, str] | None = None):
        super().__init__(name, sources=[])
        self.target = name.rpartition(".")[2]
        self.option = option
        self.defines = dict(defines or {})


def plan_extensions(env=os.environ) -> list[CMakeExtension]:
    """The extensions this build makes, from the HFKERN_BUILD_* switches."""
    cuda = build_mode(env, "HFKERN_BUILD_CUDA", "auto")
    emu = build_mode(env, "HFKERN_BUILD_EMU", "0")
    archs = cuda_architectures(env)  # validated even when unused: a typo should not wait for nvcc
    nvcc = find_nvcc(env) if cuda != "0" else None
    extensions = []
    if cuda == "1" and nvcc is None:
        raise BuildConfigError(
            "HFKERN_BUILD_CUDA=1 but nvcc was not found ($CUDACXX, PATH, $CUDA_HOME/bin, $CUDA_PATH/bin); "
            "install the CUDA toolkit or set HFKERN_BUILD_CUDA=auto or 0 for a pure-Python install"
        )
    if nvcc is not None:
        defines = {"CMAKE_CUDA_COMPILER": nvcc, "HFKERN_CUDA_ARCHITECTURES": archs}
        extensions.append(CMakeExtension("hfkern._C", "HFKERN_BUILD_CUDA", defines))
    elif cuda == "auto":
        print(
            "hfkern: nvcc not found ($CUDACXX, PATH, $CUDA_HOME/bin, $CUDA_PATH/bin): installing without "
            "hfkern._C (pure Python; the 'cuda' backend is unavailable). HFKERN_BUILD_CUDA=1 makes this an error.",
            file=sys.stderr,
        )
    if emu == "1" or (emu == "auto" and find_cxx(env) is not None):
        extensions.append(CMakeExtension("hfkern._C_emu", "HFKERN_BUILD_EMU"))
    elif emu == "auto":
        print("hfkern: no C++ compiler found ($CXX, c++, g++, clang++): not building hfkern._C_emu", file=sys.stderr)
    return extensions


def _tool(module: str, attribute: str, name: str) -> str | None:
    """The executable `name` from the pip package `module` (its bin folder in
    `attribute`), else from PATH. The pip package first: a build run by
    `.venv/bin/python` without an activated venv has no venv bin folder on PATH."""
    try:
        package = __import__(module)
        path = Path(getattr(package, attribute)) / name
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which(name)


class CMakeBuild(build_ext):
    """Builds every CMakeExtension with one CMake configure and one ninja run."""

    def run(self) -> None:
        # A module an earlier build made but this one does not must not be
        # packaged (setuptools keeps build/lib.* between builds) or, in place
        # (editable installs, build_ext --inplace), stay importable.
        built = {ext.name for ext in self.extensions}
        build_py = self.get_finalized_command("build_py")
        for name in EXTENSION_MODULES:
            if name in built:
                continue
            filename = self.get_ext_filename(name)
            stale = [Path(self.build_lib) / filename]
            if self.inplace:
                package = name.rpartition(".")[0]
                stale.append(Path(build_py.get_package_dir(package)) / Path(filename).name)
            for path in stale:
                if path.is_file():
                    print(f"hfkern: removing {path}: {name} is not built this time", file=sys.stderr)
                    path.unlink()
        super().run()

    def build_extensions(self) -> None:
        cmake_exts = [ext for ext in self.extensions if isinstance(ext, CMakeExtension)]
        others = [ext for ext in self.extensions if not isinstance(ext, CMakeExtension)]
        if others:
            raise BuildConfigError(f"only CMake extensions are built here, got {[e.name for e in others]}")
        if not cmake_exts:
            return
        cmake, ninja, pybind11_dir = self._build_tools()
        cmake_version = self._cmake_version(cmake)
        defines = {name: value for ext in cmake_exts for name, value in ext.defines.items()}
        build_dir = self._build_dir(cmake_version, defines)
        out_dir = build_dir / "hfkern"
        enabled = {ext.option for ext in cmake_exts}
        args = [
            "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11_dir}",
            f"-DHFKERN_OUTPUT_DIR={out_dir}",
            f"-DHFKERN_BUILD_CUDA={'ON' if 'HFKERN_BUILD_CUDA' in enabled else 'OFF'}",
            f"-DHFKERN_BUILD_EMU={'ON' if 'HFKERN_BUILD_EMU' in enabled else 'OFF'}",
            *(f"-D{name}={value}" for name, value in sorted(defines.items())),
        ]
        # Configure only when the arguments changed or nothing was generated
        # yet: the generated build re-runs CMake by itself when CMakeLists.txt
        # changes or a kernel source appears (CONFIGURE_DEPENDS).
        stamp = build_dir / "hfkern-configure-args.json"
        stamp_text = json.dumps([cmake, *args], indent=1)
        started = time.monotonic()
        if not (build_dir / "build.ninja").is_file() or not stamp.is_file() or stamp.read_text() != stamp_text:
            stamp.unlink(missing_ok=True)
            self._run([cmake, "-S", str(ROOT), "-B", str(build_dir), *args], "configure")
            stamp.write_text(stamp_text)
        jobs = self.parallel or int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or 0) or os.cpu_count() or 1
        targets = [ext.target for ext in cmake_exts]
        self._run([cmake, "--build", str(build_dir), "--target", *targets, "-j", str(jobs)], "build")
        elapsed = time.monotonic() - started
        print(f"hfkern: built {', '.join(targets)} in {build_dir} ({elapsed:.1f} s)", file=sys.stderr)
        for ext in cmake_exts:
            suffix = sysconfig.get_config_var("EXT_SUFFIX")
            built = out_dir / f"{ext.target}{suffix}"
            if not built.is_file():
                raise BuildConfigError(f"CMake reported success but {built} does not exist")
            dest = Path(self.get_ext_fullpath(ext.name))
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(built), str(dest))

    @staticmethod
    def _build_tools() -> tuple[str, str, str]:
        """cmake, ninja and pybind11's CMake folder, or a BuildConfigError saying what is missing."""
        cmake = _tool("cmake", "CMAKE_BIN_DIR", "cmake")
        ninja = _tool("ninja", "BIN_DIR", "ninja")
        try:
            import pybind11

            pybind11_dir = pybind11.get_cmake_dir()
        except ImportError:
            pybind11_dir = None
        found = {"cmake": cmake, "ninja": ninja, "pybind11": pybind11_dir}
        missing = [name for name, path in found.items() if not path]
        if missing:
            raise BuildConfigError(
                f"building hfkern's extensions needs {', '.join(missing)} (not found for {sys.executable}): "
                "pip install pybind11 cmake ninja, or set HFKERN_BUILD_CUDA=0 HFKERN_BUILD_EMU=0 for a "
                "pure-Python install"
            )
        return cmake, ninja, pybind11_dir

    @staticmethod
    def _cmake_version(cmake: str) -> str:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, check=True).stdout
        match = re.search(r"version (\d+)\.(\d+)\.(\S+)", out)
        if not match:
            raise BuildConfigError(f"cannot read the version of {cmake} from {out!r}")
        if tuple(map(int, match.group(1, 2))) < MIN_CMAKE:
            raise BuildConfigError(
                f"{cmake} is CMake {'.'.join(match.groups())}; hfkern needs {'.'.join(map(str, MIN_CMAKE))} or "
                "newer (pip install cmake)"
            )
        return ".".join(match.groups())

    @staticmethod
    def _build_dir(cmake_version: str, defines: dict[str, str]) -> Path:
        """build/cmake-<Python ABI>-<hash of what makes two builds incompatible>.

        The hash covers the Python ABI, CMake's version, the compiler settings
        of the environment and the extensions' cache entries (nvcc and the CUDA
        architectures of _C), but not whether _C_emu is built: an editable
        install with both modules and a wheel with _C alone share _C's objects."""
        soabi = sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}"
        key = {
            "soabi": soabi,
            "cmake": cmake_version,
            **{var: os.environ.get(var, "") for var in ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CUDAFLAGS", "LDFLAGS")},
            **defines,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
        path = ROOT / "build" / f"cmake-{soabi}-{digest}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "hfkern-build-key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
        return path

    @staticmethod
    def _run(command: list[str], step: str) -> None:
        print("hfkern:", shlex.join(command), file=sys.stderr, flush=True)
        result = subprocess.run(command, cwd=ROOT)
        if result.returncode != 0:
            raise BuildConfigError(
                f"CMake {step} failed (exit status {result.returncode}): {shlex.join(command)}\n"
                "The compiler's messages are above. HFKERN_BUILD_CUDA=0 / HFKERN_BUILD_EMU=0 skip the "
                "extensions for a pure-Python install."
            )


def main() -> None:
    extensions = plan_extensions()
    setup(
        name="hfkern",
        version="0.1.0",
        description="Horizontally fused training: B models as one array model, with array kernels",
        packages=find_packages(include=["hfkern", "hfkern.*"]),
        ext_modules=extensions,
        cmdclass={"build_ext": CMakeBuild},
        python_requires=">=3.10",
        install_requires=["torch>=2.11,<2.14", "numpy"],
        extras_require={
            "triton": ["triton>=3.6,<3.10"],
            "demo": ["scikit-learn", "tqdm", "rich"],
            "bench": ["matplotlib", "tqdm"],
            # hfkern.sweep: Optuna studies on SQLite or PostgreSQL (SQLAlchemy, psycopg2)
            "sweep": ["optuna>=4.0", "sqlalchemy>=2.0", "psycopg2-binary>=2.9", "tqdm", "rich", "matplotlib"],
            # hfkern.elastic: ThroughputModel.fit (scipy's least squares), the simulator's plots
            "elastic": ["scipy", "matplotlib"],
            "test": ["pytest", "pytest-xdist>=3.8", "scikit-learn", "scipy", "tqdm", "rich", "matplotlib", "triton>=3.6,<3.10",
                     "optuna>=4.0", "sqlalchemy>=2.0", "psycopg2-binary>=2.9"],
        },
        zip_safe=False,
    )


# setuptools' PEP 517 backend and `python setup.py ...` both run this file as
# __main__; tests/test_build.py imports it for cuda_architectures().
if __name__ == "__main__":
    main()
