import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# The repository root: tests import the benchmark workloads (bench.models).
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Under pytest-xdist the workers share the cores: torch's intra-op threads (and those of
# the processes a test starts) get a share each, unless OMP_NUM_THREADS says otherwise.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It
# must be chosen before triton is first imported (hfkern imports it lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The interpreter re-scans triton.language at every helper call of a kernel; skipped
# where the launch has patched it already (tests/_triton_interpreter.py).
_interpreter_unpatched = ""
if triton_interpreting():
    import _triton_interpreter

    _interpreter_unpatched = _triton_interpreter.install()


def pytest_report_header(config):
    if _interpreter_unpatched:
        return f"Triton's interpreter runs unpatched (slower): {_interpreter_unpatched}"
    return None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _emulator_missing() -> str:
    """Why hfkern._C_emu cannot be used, or "" (with HFKERN_REQUIRE_EXTENSIONS=1 never
    skipped: the tests then fail on the missing build)."""
    if os.environ.get("HFKERN_REQUIRE_EXTENSIONS") == "1":
        return ""
    try:
        from hfkern.cuda import _ext

        _ext.load(emulated=True)
    except (ImportError, RuntimeError) as e:
        return str(e)
    return ""


_failure_log = None


def pytest_configure(config):
    global _failure_log
    # Not in pytest-xdist's workers: their reports reach the controller, which logs them once.
    if os.environ.get("HFKERN_FAILURE_LOG") and not hasattr(config, "workerinput"):
        _failure_log = os.environ["HFKERN_FAILURE_LOG"]


def pytest_runtest_logreport(report):
    """With ``HFKERN_FAILURE_LOG=FILE``, each failure's traceback is appended to FILE as it happens:
    pytest prints them at the end, which a run stopped at its time cap never reaches."""
    if _failure_log and report.failed:
        with open(_failure_log, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def pytest_collection_modifyitems(config, items):
    # Modules with a long test first (stable otherwise): pytest-xdist hands out work in
    # collection order, and a long module handed out last would leave the other workers idle.
    # Every worker collects the same order, as xdist requires.
    long_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("long")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in long_modules)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    if any("emulator" in item.keywords for item in items):
        missing = _emulator_missing()
        if missing:
            skip_emu = pytest.mark.skip(reason=missing)
            for item in items:
                if "emulator" in item.keywords:
                    item.add_marker(skip_emu)
    skip_interp = pytest.mark.skip(reason="runs in Triton's interpreter (TRITON_INTERPRET=1)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not triton_interpreting():
            item.add_marker(skip_interp)


@pytest.fixture
def deterministic():
    """Deterministic cuDNN and torch kernels, for the GPU tests that compare two runs bit for
    bit: by default cuDNN may pick convolution backward algorithms that add with atomics, so
    two eager runs differ in the last bits (seen on an H200) and the comparison would say
    nothing about what differs between the runs."""
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[:2]
        torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])


@pytest.fixture(scope="module")
def bench():
    """bench_kernels, report and the families as modules (bench/ is a script folder, not a
    package), for the kernel benchmark's smoke tests."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    added = [p for p in (os.path.join(root, "bench"), root) if p not in sys.path]
    sys.path[:0] = added
    try:
        yield {name: importlib.import_module(name) for name in ("bench_kernels", "report", "families")}
    finally:
        for p in added:
            sys.path.remove(p)
        for name in ("bench_kernels", "report", "bandwidth"):
            sys.modules.pop(name, None)


@pytest.fixture
def executor(tmp_path):
    """An hfkern.elastic TorchrunExecutor in a temporary directory (at most three workers a job),
    shut down at the end; no launcher or worker may outlive it (tests/_elastic.py)."""
    from _elastic import processes_of
    from hfkern.elastic import TorchrunExecutor

    ex = TorchrunExecutor(tmp_path / "jobs", nproc_cap=3)
    try:
        yield ex
    finally:
        ex.shutdown()
    assert processes_of(ex.workdir) == []
