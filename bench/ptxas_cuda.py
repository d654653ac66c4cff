"""Registers, stack, spills and shared memory of every hfkern CUDA kernel, without a GPU.

    python bench/ptxas_cuda.py                       # sm_80 and sm_90, the table on stdout
    python bench/ptxas_cuda.py --arch 90 --out report.txt

Every kernel source of hfkern._C (each ``*.cu`` under csrc/ except the
emulator's own, csrc/emu/) is compiled by nvcc to a cubin for each
architecture, with the device-code flags of the ``_C`` build in CMakeLists.txt
(C++17, -O3 host, -DNDEBUG, -lineinfo, no fast math) plus ``-Xptxas -v``; the
table lists what ptxas reports per kernel: registers per thread, stack frame
bytes per thread, spill stores and loads (bytes), and static shared memory
per block. Non-kernel functions that ptxas compiles on their own (noinline
device functions) appear with their stack and spills, their registers as "-".

Exit status 0 when everything compiled and no function spills; 1 when a
function spills; 2 when a compile failed. tests/test_build.py runs the same
compile and asserts zero spills.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
DEFAULT_ARCHS = (80, 90)
# The device-code flags of the _C target (CMakeLists.txt): CUDA_STANDARD 17,
# CMAKE_BUILD_TYPE=Release (-O3 -DNDEBUG), -lineinfo, the include folders.
BUILD_FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", "-lineinfo", f"-I{CSRC / 'include'}", f"-I{CSRC / 'emu'}"]


@dataclass
class Function:
    """What ptxas reports for one function compiled for one architecture."""

    arch: str  # "sm_90"
    source: str  # relative to the repository root
    mangled: str
    entry: bool  # a __global__ kernel
    registers: int | None = None
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0
    name: str = ""  # demangled, without the parameter list

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


class CompileError(RuntimeError):
    pass


def kernel_sources(csrc: Path = CSRC) -> list[Path]:
    """Every kernel source of hfkern._C: the *.cu files under csrc/, not csrc/emu/ (as CMakeLists.txt globs them)."""
    emu = csrc / "emu"
    return sorted(p for p in csrc.rglob("*.cu") if emu not in p.parents)


def find_nvcc() -> str:
    """nvcc from $CUDACXX, PATH, $CUDA_HOME/bin or $CUDA_PATH/bin (the order setup.py looks in)."""
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    candidates += [str(Path(os.environ[v]) / "bin" / "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("nvcc not found ($CUDACXX, PATH, $CUDA_HOME/bin, $CUDA_PATH/bin)")


def find_demangler(nvcc: str) -> str | None:
    """cu++filt (PATH or beside nvcc) or binutils' c++filt, or None (names stay mangled)."""
    beside = Path(nvcc).resolve().parent / "cu++filt"
    for candidate in (shutil.which("cu++filt"), str(beside) if beside.is_file() else None, shutil.which("c++filt")):
        if candidate:
            return candidate
    return None


_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(sm_\w+)'")
_FUNC = re.compile(r"ptxas info\s*: Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str, arch: str, source: str) -> list[Function]:
    """The functions in ptxas -v output, in its order.

    ptxas prints, per entry function: "Compiling entry function 'X' for 'sm_NN'",
    "Function properties for X" with the stack frame and spill line, then
    "Used N registers, ... N bytes smem, ...". Other functions compiled on
    their own get only the properties block."""
    functions: dict[str, Function] = {}
    entry: Function | None = None  # the kernel being compiled: its "Used N registers" line comes last
    props: Function | None = None  # the function whose stack and spill line comes next
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            entry = functions.setdefault(m.group(1), Function(arch, source, m.group(1), entry=True))
            entry.entry = True
        elif m := _FUNC.search(line):
            props = functions.setdefault(m.group(1), Function(arch, source, m.group(1), entry=False))
        elif (m := _FRAME.search(line)) and props is not None:
            props.stack, props.spill_stores, props.spill_loads = map(int, m.groups())
            props = None
        elif (m := _USED.search(line)) and entry is not None:
            entry.registers = int(m.group(1))
            if s := _SMEM.search(line):
                entry.smem = int(s.group(1))
            entry = None
    return list(functions.values())


def compile_one(nvcc: str, source: Path, arch: int, workdir: Path, extra: list[str] = ()) -> list[Function]:
    """Compile `source` for sm_<arch> (device code only, a cubin) and parse ptxas' report."""
    # Named after the whole relative path: sources of one name in two folders compile side by side.
    cubin = workdir / f"{'__'.join(source.relative_to(ROOT).parts)}.sm_{arch}.cubin"
    cmd = [nvcc, "-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}", *BUILD_FLAGS, *extra,
           "-Xptxas", "-v", "-o", str(cubin), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed on {source.relative_to(ROOT)} for sm_{arch} (exit status "
                           f"{proc.returncode}): {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")
    # A source without kernels (csrc/runtime.cu: host code only) reports no function.
    return parse_ptxas(proc.stdout + proc.stderr, f"sm_{arch}", str(source.relative_to(ROOT)))


def demangle(functions: list[Function], demangler: str | None) -> None:
    """Set each function's name: demangled, parameter list dropped (template arguments kept),
    and so is the `void ` return type a function template's name starts with."""
    mangled = sorted({f.mangled for f in functions})
    names = mangled
    if demangler and mangled:
        out = subprocess.run([demangler], input="\n".join(mangled) + "\n", capture_output=True, text=True, check=True)
        names = out.stdout.splitlines()
        if len(names) != len(mangled):
            raise RuntimeError(f"{demangler} returned {len(names)} names for {len(mangled)} symbols")
    table = {m: _drop_parameters(n).removeprefix("void ").replace("(anonymous namespace)::", "")
             for m, n in zip(mangled, names)}
    for f in functions:
        f.name = table[f.mangled]


def _drop_parameters(name: str) -> str:
    """`ns::k<A, B>(int, float)` -> `ns::k<A, B>`: cut at the '(' that opens the outermost parameter list."""
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not name.startswith("(anonymous namespace)", i):
            return name[:i]
    return name


def compile_all(archs=DEFAULT_ARCHS, sources=None, nvcc: str | None = None, jobs: int | None = None,
                extra: list[str] = ()) -> list[Function]:
    """Every (source, arch) compiled in parallel; the functions sorted by arch, source and name."""
    nvcc = nvcc or find_nvcc()
    sources = list(sources) if sources is not None else kernel_sources()
    if not sources:
        raise FileNotFoundError(f"no kernel sources (*.cu) under {CSRC}")
    jobs = jobs or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="hfkern-ptxas-") as tmp:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(compile_one, nvcc, src, arch, Path(tmp), list(extra))
                       for arch in archs for src in sources]
            functions = [f for fut in futures for f in fut.result()]
    demangle(functions, find_demangler(nvcc))
    return sorted(functions, key=lambda f: (f.arch, f.source, not f.entry, f.name))


@dataclass
class Frame:
    """One function's resources in a built cubin, as ``cuobjdump --dump-resource-usage`` reports them."""

    arch: str  # "sm_90"
    source: str  # relative to csrc/'s parent, as the build named it
    mangled: str
    registers: int
    stack: int  # bytes per thread: local arrays and spills
    local: int


_SECTION = re.compile(r"^Fatbin (elf|ptx) code:")
_ARCH = re.compile(r"^arch = (sm_\w+)")
_IDENT = re.compile(r"^identifier = (.+)$")
_RU_FUNC = re.compile(r"^\s*Function (\S+):$")
_RU_LINE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def _source_name(identifier: str) -> str:
    """``/anywhere/csrc/optim/x.cu`` -> ``csrc/optim/x.cu``: the build may have run in another checkout."""
    parts = Path(identifier).parts
    return str(Path(*parts[len(parts) - 1 - parts[::-1].index("csrc"):])) if "csrc" in parts else identifier


def parse_resource_usage(text: str) -> tuple[list[Frame], dict[str, set[str]]]:
    """(every function's frame, the sources each SASS architecture holds) from the output of
    ``cuobjdump --dump-resource-usage`` on a library; PTX sections carry no SASS and are skipped."""
    frames: list[Frame] = []
    sources: dict[str, set[str]] = {}
    kind = arch = source = mangled = None
    for line in text.splitlines():
        if m := _SECTION.match(line):
            kind, arch, source, mangled = m.group(1), None, None, None
        elif kind != "elf":
            continue
        elif m := _ARCH.match(line):
            arch = m.group(1)
        elif m := _IDENT.match(line):
            source = _source_name(m.group(1).strip())
            sources.setdefault(arch, set()).add(source)
        elif m := _RU_FUNC.match(line):
            mangled = m.group(1)
        elif (m := _RU_LINE.search(line)) and mangled is not None:
            regs, stack, local = map(int, m.groups())
            frames.append(Frame(arch, source, mangled, regs, stack, local))
            mangled = None
    return frames, sources


def built_frames(library: Path, cuobjdump: str) -> tuple[list[Frame], dict[str, set[str]]]:
    """:func:`parse_resource_usage` of a built library (hfkern._C): what ptxas gave the build itself."""
    out = subprocess.run([cuobjdump, "--dump-resource-usage", str(library)], capture_output=True, text=True,
                         check=True).stdout
    return parse_resource_usage(out)


def _first_line(cmd: list[str], pattern: str) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    m = re.search(pattern, out)
    return m.group(1) if m else "unknown"


def header(archs, sources: list[Path], nvcc: str, command: str) -> list[str]:
    archs_text = " and ".join(f"sm_{a}" for a in archs)
    nvcc_version = _first_line([nvcc, "--version"], r"release \S+, V(\S+)")
    host = _first_line(["gcc", "--version"], r"^(.*)")  # nvcc's default host compiler
    demangler = find_demangler(nvcc)
    digests = ", ".join(f"{s.relative_to(ROOT)} {hashlib.sha256(s.read_bytes()).hexdigest()[:12]}" for s in sources)
    return [
        f"# Registers, stack, spills and shared memory of every hfkern CUDA kernel (hfkern._C), {archs_text}",
        "#",
        f"# Measured: {datetime.date.today().isoformat()}, without a GPU: each kernel source under csrc/ (not",
        "# csrc/emu/) compiled by nvcc to a cubin per architecture with the device-code flags of the",
        f"# _C build in CMakeLists.txt ({' '.join(BUILD_FLAGS[:4])}, no fast math) and -Xptxas -v.",
        f"# Versions: nvcc and ptxas {nvcc_version}, host compiler {host}, Python {platform.python_version()},",
        f"# names demangled by {Path(demangler).name if demangler else 'nothing (mangled names)'}; "
        "on a CPU-only machine.",
        f"# Sources (sha256, 12 digits): {digests}",
        f"# Command: {command}",
        "#",
        "# Per function and architecture, as ptxas reports them: registers per thread, stack frame",
        "# bytes per thread (local memory, spills included), spill stores and loads (bytes), static",
        "# shared memory bytes per block (dynamic shared memory is sized at launch and not counted).",
        "# Names are demangled without parameter lists and '(anonymous namespace)::'; kind 'device'",
        "# is a function ptxas compiled on its own (noinline), with no register count of its own.",
        "# Compile-time facts, not speed.",
        "#",
    ]


def table(functions: list[Function]) -> list[str]:
    width = max([len("kernel")] + [len(f.name) for f in functions])
    src_width = max([len("source")] + [len(f.source) for f in functions])
    rows = [f"{'arch':<6} {'source':<{src_width}} {'kernel':<{width}} {'kind':<6} {'regs':>5} {'stack':>6} "
            f"{'spill_st':>8} {'spill_ld':>8} {'smem':>7}"]
    for f in functions:
        regs = "-" if f.registers is None else str(f.registers)
        rows.append(f"{f.arch:<6} {f.source:<{src_width}} {f.name:<{width}} {'kernel' if f.entry else 'device':<6} "
                    f"{regs:>5} {f.stack:>6} {f.spill_stores:>8} {f.spill_loads:>8} {f.smem:>7}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append",
                        help="compute capability as a number (80, 90); repeat for several (default: 80 and 90)")
    parser.add_argument("--out", type=Path, help="write the report here as well as to stdout")
    parser.add_argument("--nvcc", help="the nvcc to use (default: $CUDACXX, PATH, $CUDA_HOME/bin, $CUDA_PATH/bin)")
    parser.add_argument("-j", "--jobs", type=int, help="parallel compiles (default: the CPU count)")
    args = parser.parse_args(argv)
    archs = tuple(dict.fromkeys(args.arch or DEFAULT_ARCHS))
    nvcc = args.nvcc or find_nvcc()
    sources = kernel_sources()
    try:
        functions = compile_all(archs, sources, nvcc, args.jobs)
    except CompileError as e:
        print(e, file=sys.stderr)
        return 2
    command = "python bench/ptxas_cuda.py " + " ".join(
        [*(f"--arch {a}" for a in archs), *([f"--out {args.out}"] if args.out else [])])
    spilling = [f for f in functions if f.spills]
    summary = (f"nvcc: {sum(f.entry for f in functions)} kernels in {len(sources)} sources for "
               f"{', '.join(f'sm_{a}' for a in archs)}; {len(spilling)} functions spill")
    lines = header(archs, sources, nvcc, command.strip()) + [summary] + table(functions)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
