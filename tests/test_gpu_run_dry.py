"""bench/gpu_run.sh, dry: every Python command it would run on a GPU machine, checked here.

A device session is short and comes rarely; a stage whose command line no longer parses
(an option renamed in a benchmark) loses that stage's results for the whole session. The
script runs here with ``PYTHON`` set to a stand-in interpreter that, instead of running a
benchmark, parses its command line with the benchmark's own parser and stops; it skips the
CUDA build and the extension check, runs the environment stage's inline code for real, and
collects (does not run) the GPU tests with the options given. The test then asks that every
benchmark command parsed, that the expected ones were reached, and that bash met no unset
variable, syntax error or missing command.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.long,
    pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                       reason="needs bash and coreutils' timeout"),
]

# The stand-in interpreter: argv as bench/gpu_run.sh passes it to "$PY".
_DRIVER = r'''
import argparse, os, runpy, sys

args = sys.argv[1:]
log = open(os.environ["HFKERN_DRY_LOG"], "a")


def note(kind, what):
    log.write(f"{kind}\t{what}\n")
    log.flush()


if args[:1] == ["setup.py"] or (args[:1] == ["-c"] and "hfkern._C" in args[1]):
    note("SKIP", " ".join(args)[:80])  # the CUDA build and its check: a GPU machine's
    sys.exit(0)
if args[:1] == ["-c"]:
    sys.argv = ["-c"]
    exec(compile(args[1], "<-c>", "exec"), {"__name__": "__main__"})
    sys.exit(0)
if args[:1] == ["-"]:
    exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__"})
    sys.exit(0)
if args[:2] == ["-m", "pytest"]:
    import pytest
    rest = args[2:]
    for flag in ("-n",):  # pytest-xdist's workers: collection alone needs none
        while flag in rest:
            i = rest.index(flag)
            del rest[i:i + 2]
    code = pytest.main([*rest, "--collect-only", "-q", "-p", "no:xdist"])
    note("PYTEST", f"exit {int(code)}")
    sys.exit(0 if code in (0, 5) else int(code))
script = args[0]
if not script.endswith(".py"):
    note("UNKNOWN", " ".join(args))
    sys.exit(3)
parse = argparse.ArgumentParser.parse_args


def parse_and_stop(self, *a, **k):
    try:
        parse(self, *a, **k)
    except SystemExit as e:
        note("PARSE-ERROR", f"{script} {' '.join(args[1:])}")
        raise
    note("PARSED", script)
    sys.exit(0)


argparse.ArgumentParser.parse_args = parse_and_stop
sys.argv = args
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
note("NO-PARSER", script)
'''

# The benchmarks each part reaches (the report stages run only on results: not here).
_EXPECTED = {
    "all": {"bench/train_throughput.py", "bench/bandwidth.py", "bench/bench_kernels.py", "bench/bench_optim.py"},
    "kernels": {"bench/bandwidth.py", "bench/bench_kernels.py", "bench/bench_optim.py", "bench/bench_topk.py"},
    "e2e": {"bench/train_throughput.py"},
    "train": {"bench/train_throughput.py", "bench/convergence.py"},
    "plan": {"bench/bench_plan.py"},
}


@pytest.mark.parametrize("part", sorted(_EXPECTED))
def test_every_command_of_the_gpu_run_parses(part, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    shim = tmp_path / "python"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{driver}" "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "commands.log"
    log.touch()
    env = {**os.environ, "PYTHON": str(shim), "OUT": str(tmp_path / "out"), "HFKERN_DRY_LOG": str(log),
           "PYTHONPATH": str(ROOT), "TORCH_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(["bash", "bench/gpu_run.sh", part], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    output = run.stdout + run.stderr
    entries = [line.split("\t", 1) for line in log.read_text().splitlines()]
    problems = [e for e in entries if e[0] in ("PARSE-ERROR", "UNKNOWN", "NO-PARSER")]
    assert not problems, f"{problems}\n{output[-4000:]}"
    parsed = {what for kind, what in entries if kind == "PARSED"}
    assert _EXPECTED[part] <= parsed, f"not reached: {_EXPECTED[part] - parsed}\n{output[-4000:]}"
    if part in ("all", "kernels", "e2e"):
        assert ["PYTEST", "exit 0"] in entries or ["PYTEST", "exit 5"] in entries, output[-4000:]
    bash_errors = [line for line in output.splitlines()
                   if re.search(r"unbound variable|syntax error|command not found|No such file", line)
                   and "nvidia-smi" not in line]
    assert not bash_errors, "\n".join(bash_errors)
