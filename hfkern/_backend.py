"""The one registry that decides which implementation serves each hfkern op.

Every op family module (``hfkern/ops/<family>.py``) defines its ops and
registers their torch implementations. Each other backend is a package of
family modules (``hfkern/triton/<family>.py``, ...) that register themselves
with :func:`implements` when imported; the registry imports every module of a
backend's package (listed in :data:`BACKEND_PACKAGES`) the first time that
backend is considered for a call, so the family modules never list backends,
a new backend module needs no entry anywhere, and ``import hfkern`` never pays
for triton. The op's torch.library kernel asks :func:`resolve` for the
implementation at call time, so switching backends never retraces a model and
never touches ``hfkern.nn`` or ``hfkern.optim``.

Selection:

* ``"torch"``, ``"triton"``, ``"cuda"``: that backend serves every op, or the call
  raises. There is no silent fallback. The one fixed rule: CPU tensors always
  take the torch path (``triton`` and ``cuda`` are backends for CUDA tensors).
* ``"auto"`` (the default): per op and device, the first backend in
  :data:`AUTO_PREFERENCE` that registered the op as *auto-eligible*, is
  available, and (for a GPU backend) has a committed training-step result
  showing the whole step faster with it on this device class
  (:mod:`hfkern._evidence`). A backend registers as auto-eligible only if it
  computes what the torch backend computes under the same dtype policy (same
  accumulation dtype, same TF32 flags), so ``auto`` never silently changes
  numerics; a kernel benchmark alone never makes ``auto`` choose it. The choice
  and its reason (the result file, where one decided) are logged once per
  (op, device type, data dtype) at DEBUG level on the ``hfkern`` logger and
  shown by :func:`backend_info`.

Where the selection lives:

* The process default: ``HFKERN_BACKEND`` (read and validated once, when
  ``hfkern`` is imported, by exactly the rules of :func:`set_backend`; unset or
  empty means ``auto``), replaced by :func:`set_backend`.
* Per op: a selection may name a backend for some ops and another for the rest,
  ``set_backend("torch", ops={"sgd_step_": "cuda"})`` or the same as one string,
  ``"torch,sgd_step_=cuda"`` (what ``HFKERN_BACKEND`` and :func:`get_backend`
  hold). An op's backward ops follow the backend its forward ran, so only
  forward ops (not ``*_grad`` / ``*_backward``) can be named. This is how one
  op's kernels are weighed inside a whole training step
  (``bench/train_throughput.py --backends torch,sgd_step_=cuda``), the evidence
  :mod:`hfkern._evidence` asks for.
* :func:`use_backend` overlays it in the current context only (a
  :class:`contextvars.ContextVar`): a thread or an asyncio task that enters
  ``use_backend`` changes nothing that another one sees.
* A backward pass runs the backend its forward ran, whichever thread autograd
  runs it on and whatever the selection is by then: each op's ``setup_context``
  records the backend that served the forward (:func:`current`) and the
  autograd formula runs the backward ops under :func:`pinned` to it.
  Under ``torch.compile`` the pin is traced away: the ops of a compiled graph
  resolve when the graph runs, so a compiled backward resolves under the
  selection in effect when it runs, not necessarily its forward's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import logging
import os
import pkgutil
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from . import _evidence

__all__ = ["BACKENDS", "set_backend", "get_backend", "use_backend", "backend_info", "implements"]

_ENV = "HFKERN_BACKEND"

logger = logging.getLogger("hfkern")

BACKENDS = ("torch", "triton", "cuda")
_GPU_BACKENDS = ("triton", "cuda")
AUTO_PREFERENCE = ("cuda", "triton", "torch")
_CHOICES = ("auto",) + BACKENDS
# backend -> the package whose (non-underscore) modules register its implementations
BACKEND_PACKAGES = {"triton": "hfkern.triton", "cuda": "hfkern.cuda"}


@dataclass
class _Impl:
    fn: Callable | str  # the implementation, or "module:attr" imported on first use
    device_types: tuple[str, ...]
    auto: bool
    dtypes: tuple[torch.dtype, ...] = ()  # data dtypes served; empty: every dtype

    def load(self) -> Callable:
        # Kernel modules (triton, the compiled extension) are imported only when an
        # op first runs on them, so importing hfkern never pays for them.
        if isinstance(self.fn, str):
            module, attr = self.fn.split(":")
            self.fn = getattr(importlib.import_module(module), attr)
        return self.fn


# op name -> backend -> implementation
_registry: dict[str, dict[str, _Impl]] = {}
# backend -> callable returning (available, reason)
_availability: dict[str, Callable[[], tuple[bool, str]]] = {}
# The process default (set_backend, HFKERN_BACKEND) and where it came from.
_default: str = "auto"
_default_source: str = "default"
# use_backend's overlay, and the pin of a backward pass. A ContextVar rather than
# a global so that threads (and tasks) never see each other's use_backend. The
# threads autograd runs CUDA backward passes on do not see the forward's
# context either, which is why backward passes pin the forward's backend
# explicitly instead of reading this.
_context: contextvars.ContextVar[str | None] = contextvars.ContextVar("hfkern_backend", default=None)
_logged_auto: set[tuple[str, str, torch.dtype | None]] = set()
# (op, device type, dtype, requested backend) -> (backend, implementation); cleared by register()
_resolved: dict[tuple[str, str, torch.dtype | None, str], tuple[str, Callable]] = {}
# Counts register() calls: what callers that cache a decision of the registry compare.
generation = 0


def _torch_available() -> tuple[bool, str]:
    return True, f"pure-PyTorch path (torch {torch.__version__}), serves every device"


def _triton_available() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return False, f"triton is not importable ({e})"
    failed = _load_package("triton")
    if failed:
        return False, failed
    if not any(impl for ops in _registry.values() for b, impl in ops.items() if b == "triton"):
        return False, "no hfkern op has a Triton implementation in this build"
    if not torch.cuda.is_available():
        return False, "Triton kernels need a CUDA device and torch.cuda.is_available() is False"
    return True, f"triton {triton.__version__} with CUDA device {torch.cuda.get_device_name()}"


def _cuda_available() -> tuple[bool, str]:
    failed = _load_package("cuda")
    if failed:
        return False, failed
    if not any(impl for ops in _registry.values() for b, impl in ops.items() if b == "cuda"):
        return False, "no hfkern op has a CUDA implementation in this build"
    from hfkern.cuda import _ext  # imported by _load_package above

    return _ext.availability()


_availability.update(torch=_torch_available, triton=_triton_available, cuda=_cuda_available)

# backend -> "" once its package imported, or why it could not be
_packages: dict[str, str] = {}
# Held for the whole of a backend package's import: another thread that asks for the
# backend meanwhile waits for the import to finish (and then sees its result) instead of
# taking the import in progress for a finished one. Re-entrant, for the importing thread's
# own nested calls (a family module's imports asking for the backend).
_load_lock = threading.RLock()


def _load_package(backend: str) -> str:
    """Import every family module of ``backend``'s package (each registers its
    implementations); return "" or the reason it failed. Runs once per backend;
    thread-safe: a call during another thread's import waits for it to finish."""
    with _load_lock:
        if backend not in _packages:
            # A re-entrant call of this thread (a module's own imports) sees it loading.
            _packages[backend] = ""
            name = BACKEND_PACKAGES[backend]
            try:
                # A backend this build does not ship (no package) has nothing to register.
                package = importlib.import_module(name) if importlib.util.find_spec(name) else None
                for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
                    if not info.name.startswith("_"):
                        importlib.import_module(f"{name}.{info.name}")
            except ImportError as e:
                _packages[backend] = f"{name} could not be imported ({e})"
            except Exception as e:  # a broken kernel module must not break the torch path
                _packages[backend] = f"{name} failed to import: {type(e).__name__}: {e}"
                logger.warning("hfkern backend %r disabled: %s", backend, _packages[backend])
        return _packages[backend]


def _load_packages() -> None:
    for backend in BACKEND_PACKAGES:
        _load_package(backend)


def register(
    op: str,
    backend: str,
    fn: Callable | str,
    *,
    device_types: tuple[str, ...] | None = None,
    auto: bool = True,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> None:
    """Register ``fn`` as ``backend``'s implementation of ``op``.

    ``fn`` may be a ``"package.module:function"`` string, imported on first use.
    ``device_types`` lists the device types the implementation serves (None: all).
    ``auto=False`` keeps ``auto`` from ever choosing it (for example a backend
    whose numerics differ from the torch path); ``auto=True`` makes it eligible,
    and ``auto`` chooses it where :mod:`hfkern._evidence` cites a committed
    training-step result showing it faster. ``dtypes`` lists the data dtypes
    it serves (None: all); ``auto`` passes over it for any other dtype, while an
    explicit request for it lets the implementation raise its own TypeError.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    global generation
    _registry.setdefault(op, {})[backend] = _Impl(fn, tuple(device_types or ()), auto, tuple(dtypes or ()))
    _resolved.clear()
    generation += 1


def implements(
    op: str,
    backend: str,
    *,
    device_types: tuple[str, ...] | None = None,
    auto: bool = True,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> Callable[[Callable], Callable]:
    """Decorator form of :func:`register`: a backend module marks each function
    that implements an op, with the same keywords, and returns it unchanged::

        @_backend.implements("array_layer_norm", "triton", device_types=("cuda",))
        def array_layer_norm(x, weight, bias, norm_ndim, eps): ...
    """
    def decorate(fn: Callable) -> Callable:
        register(op, backend, fn, device_types=device_types, auto=auto, dtypes=dtypes)
        return fn

    return decorate


def get_backend() -> str:
    """The backend requested now: ``use_backend``'s in this context, else the process
    default (``set_backend``'s, else ``HFKERN_BACKEND``'s, else ``auto``). With
    per-op choices, their string form: ``"torch,adam_step_=cuda"``."""
    return _context.get() or _default


# Ops that run only inside an op's backward, on the backend pinned by its forward.
_BACKWARD_SUFFIXES = ("_grad", "_backward")


@functools.lru_cache(maxsize=None)
def _parse(requested: str) -> tuple[str, dict[str, str]]:
    """A canonical selection string -> (the backend of every other op, {op: backend})."""
    base, *pairs = requested.split(",")
    return base, dict(pair.split("=") for pair in pairs)


def _requested_for(op: str, requested: str) -> str:
    """The backend name ``requested`` asks for ``op``."""
    if "," not in requested:
        return requested
    base, ops = _parse(requested)
    return ops.get(op, base)


def _check_name(name: object, what: str) -> str:
    """A backend name lower-cased and available (or ``auto``), else the error ``set_backend`` raises."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, one of {_CHOICES}, got {type(name).__name__} {name!r}")
    if name.strip().lower() not in _CHOICES:
        raise ValueError(f"{what} must be one of {_CHOICES}, got {name!r}")
    name = name.strip().lower()
    if name != "auto":
        ok, reason = _availability[name]()
        if not ok:
            origin = "" if what == "backend" else f"{what}={name!r}: "
            raise RuntimeError(f"{origin}hfkern backend {name!r} is not available: {reason}")
    return name


def _check_requestable(name: str, what: str = "backend", ops: object = None) -> str:
    """The canonical selection string of ``name`` (a backend, or the string form with
    per-op choices) and ``ops`` (``{op: backend}``), or the error ``set_backend``
    raises for it; ``what`` names where the value came from."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, one of {_CHOICES}, got {type(name).__name__} {name!r}")
    base, *items = name.split(",")
    base = _check_name(base, what)
    chosen: dict[str, str] = {}
    for item in items:
        op, eq, backend = item.partition("=")
        if not eq:
            raise ValueError(f"{what}: expected per-op choices as op=backend after the backend, "
                             f"got {item!r} in {name!r}")
        chosen[_check_op(op.strip(), what)] = backend
    if ops is not None:
        if not isinstance(ops, Mapping):
            raise TypeError(f"ops must be a mapping of op names to backends, got {type(ops).__name__}")
        for op, backend in ops.items():
            if not isinstance(op, str):
                raise TypeError(f"ops: expected op names as str, got {type(op).__name__} {op!r}")
            chosen[_check_op(op, "ops")] = backend
    for op, backend in chosen.items():
        backend = chosen[op] = _check_name(backend, f"{what} for {op}")
        if backend != "auto" and backend not in _registry[op]:
            raise ValueError(f"{what}: hfkern backend {backend!r} has no implementation of hfkern::{op}; "
                             f"registered: {sorted(_registry[op])}")
    chosen = {op: backend for op, backend in chosen.items() if backend != base}
    return ",".join([base] + [f"{op}={chosen[op]}" for op in sorted(chosen)])


def _check_op(op: str, what: str) -> str:
    """A forward op's name (``hfkern::`` optional), else ValueError."""
    name = op.removeprefix("hfkern::")
    if name not in _registry:
        forward = sorted(o for o in _registry if not o.endswith(_BACKWARD_SUFFIXES))
        raise ValueError(f"{what}: no hfkern op {op!r}; forward ops: {forward}")
    if name.endswith(_BACKWARD_SUFFIXES):
        raise ValueError(f"{what}: hfkern::{name} runs on the backend its forward op ran; "
                         f"choose the backend of the forward op instead")
    return name


def set_backend(name: str, *, ops: Mapping[str, str] | None = None) -> None:
    """Select the default backend of every hfkern op in this process.

    One of ``"auto"``, ``"torch"``, ``"triton"``, ``"cuda"`` (any case). ``ops``
    names another backend for some ops (``{"adam_step_": "cuda"}``, op names as
    :func:`backend_info` lists them, forward ops only: a backward runs where its
    forward ran); the same may be written into ``name``, ``"torch,adam_step_=cuda"``.
    Asking for a backend that is not available raises ``RuntimeError`` with the
    reason; a name not in that list, an unknown op, a backward op or a backend
    without an implementation of the op raises ``ValueError``. Inside a
    :func:`use_backend` block the block's choice still wins in that context.
    """
    global _default, _default_source
    _default, _default_source = _check_requestable(name, ops=ops), "set_backend"


@contextlib.contextmanager
def use_backend(name: str, *, ops: Mapping[str, str] | None = None) -> Iterator[None]:
    """Select ``name`` (and ``ops``, as :func:`set_backend`) in the current context
    (thread, asyncio task) for the block.

    Validated as :func:`set_backend` validates; other threads keep their own
    selection, and the previous one is back on exit. Backward passes of
    forwards run inside the block use the block's backends even when run
    after it.
    """
    token = _context.set(_check_requestable(name, ops=ops))
    try:
        yield
    finally:
        _context.reset(token)


@contextlib.contextmanager
def pinned(backend: str) -> Iterator[None]:
    """Run the block with ``backend`` (a name :func:`current` returned) selected in
    this context, unvalidated: autograd formulas use it to run a backward on
    the backend its forward ran."""
    token = _context.set(backend)
    try:
        yield
    finally:
        _context.reset(token)


def _select_from_environment() -> None:
    """Apply ``HFKERN_BACKEND`` as the process default, validated as ``set_backend``
    validates (called once, by ``import hfkern``, after every op registered)."""
    global _default, _default_source
    value = os.environ.get(_ENV, "")
    if value == "":  # unset, or set to nothing: the default
        return
    _default, _default_source = _check_requestable(value, _ENV), _ENV


def _serves(impl: _Impl, device_type: str) -> bool:
    return not impl.device_types or device_type in impl.device_types


def _choose(op: str, device_type: str, dtype: torch.dtype | None = None) -> tuple[str, str]:
    """Return (backend, reason) for ``op`` on ``device_type`` (and data ``dtype``,
    where given) under the current selection."""
    requested = _requested_for(op, get_backend())
    if device_type != "cpu" or requested not in ("auto", "torch"):
        _load_packages()  # their modules register what they implement
    impls = _registry.get(op)
    if not impls:
        raise RuntimeError(f"hfkern op {op!r} has no registered implementation")
    if requested in _GPU_BACKENDS and device_type == "cpu" and "torch" in impls:
        return "torch", f"CPU tensors always take the torch path ({requested!r} is for CUDA tensors)"
    if requested != "auto":
        impl = impls.get(requested)
        if impl is None:
            raise RuntimeError(
                f"hfkern backend {requested!r} was requested but has no implementation of "
                f"hfkern::{op}; registered: {sorted(impls)}"
            )
        if not _serves(impl, device_type):
            raise RuntimeError(
                f"hfkern backend {requested!r} cannot serve hfkern::{op} on {device_type} "
                f"tensors (it serves {list(impl.device_types)})"
            )
        ok, why = _availability[requested]()
        if not ok:
            raise RuntimeError(f"hfkern backend {requested!r} is not available: {why}")
        return requested, "requested explicitly"
    passed_over, never = [], []
    for name in AUTO_PREFERENCE:
        impl = impls.get(name)
        if impl is None or not _serves(impl, device_type):
            continue
        if not impl.auto:
            never.append(name)
            continue
        if dtype is not None and impl.dtypes and dtype not in impl.dtypes:
            continue
        if not _availability[name]()[0]:
            continue
        served = device_type if dtype is None else f"{device_type} {dtype}"
        if name == "torch":
            why = f"auto: first available of {list(AUTO_PREFERENCE)} serving {served}"
            if never:
                why += f"; {' and '.join(never)} registered with auto=False (chosen only when requested)"
            if passed_over:
                why += (f"; no committed training-step result shows the step faster with "
                        f"{' or '.join(passed_over)} on {_device_name(device_type)!r}")
            return name, why
        record = _evidence.for_op(op, name, _device_name(device_type))
        if record is None:
            passed_over.append(name)
            continue
        return name, f"auto: {record.result} shows the training step faster with it on {record.device} ({record.summary})"
    raise RuntimeError(f"no available hfkern backend serves hfkern::{op} on {device_type}")


def _device_name(device_type: str) -> str:
    """The current device's name, which evidence records are matched against."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return device_type


def _lookup(op: str, device: torch.device, dtype: torch.dtype | None) -> tuple[str, Callable]:
    requested = _context.get() or _default
    key = (op, device.type, dtype, requested)
    hit = _resolved.get(key)
    if hit is None:
        backend, reason = _choose(op, device.type, dtype)
        if _requested_for(op, requested) == "auto" and (op, device.type, dtype) not in _logged_auto:
            _logged_auto.add((op, device.type, dtype))
            logger.debug("hfkern::%s on %s -> %s backend (%s)", op, device.type, backend, reason)
        hit = _resolved[key] = (backend, _registry[op][backend].load())
    return hit


def resolve(op: str, device: torch.device, dtype: torch.dtype | None = None) -> Callable:
    """The implementation of ``op`` that serves tensors on ``device`` (of data
    ``dtype``, where the op passes it) now.

    Decided once per (op, device type, dtype, requested backend) and cached:
    the per-call cost is one dict lookup.
    """
    return _lookup(op, device, dtype)[1]


def eager_torch(op: str, device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Whether a call of ``op`` now would run the torch backend in eager mode (no compiler
    tracing it): where the library's differentiable entry points (what ``hfkern.nn``
    calls) may run the torch implementation under torch's own autograd instead of
    dispatching the op. Same values, same layouts; the backward is then torch's
    C++ graph rather than the op's Python formula and gradient ops, which is most
    of the host time of a training step whose host issues the work
    (``bench/train_throughput.py --modes array array+ops``). Under
    ``torch.compile`` the ops stay opaque, as they always were."""
    return _eager_paths and not torch.compiler.is_compiling() and _lookup(op, device, dtype)[0] == "torch"


_eager_paths = True


@contextlib.contextmanager
def dispatched_ops() -> Iterator[None]:
    """Within the block every differentiable entry point dispatches its op, as under
    ``torch.compile`` (:func:`eager_torch` is False): what tests compare the eager
    paths with, and benchmarks time them against. Process-wide, not per thread."""
    global _eager_paths
    before, _eager_paths = _eager_paths, False
    try:
        yield
    finally:
        _eager_paths = before


def current(op: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The name of the backend :func:`resolve` picks now for the same arguments
    (what an op's ``setup_context`` records for its backward to :func:`pinned`)."""
    return _lookup(op, device, dtype)[0]


def backend_info() -> dict:
    """What is available, what is requested, and what each op resolves to.

    Returns a dict::

        {"requested": "auto",
         "source": "default" | "HFKERN_BACKEND" | "set_backend" | "use_backend",
         "backends": {name: {"available": bool, "reason": str}},
         # and backends["cuda"]["architectures"]: {"sass": [80, 90], "ptx": [90],
         #     "device": "sm_90" or None, "covered_by": "SASS sm_90" or None}, {} unbuilt
         "ops": {op: {"registered": [backends], "cpu": choice, "cuda": choice}},
         "evidence": [{"op", "backend", "device", "result", "summary"}, ...]}

    where a choice is ``"<backend> (<why>)"`` or ``"error: <why>"``; under ``auto``
    the why of a GPU backend names the committed result that justifies it
    (``evidence`` lists every such record), and the torch path's says which
    eligible backends had none.
    """
    source = "use_backend" if _context.get() is not None else _default_source
    _load_packages()
    backends = {}
    for name in BACKENDS:
        ok, reason = _availability[name]()
        backends[name] = {"available": ok, "reason": reason}
    if not _packages.get("cuda"):
        from hfkern.cuda import _ext

        # What hfkern._C was built for and what of it runs on the current device ({} unbuilt).
        backends["cuda"]["architectures"] = _ext.build_info()
    ops = {}
    for op in sorted(_registry):
        row: dict = {"registered": sorted(_registry[op])}
        for device_type in ("cpu", "cuda"):
            try:
                backend, why = _choose(op, device_type)
                served = _registry[op][backend].dtypes
                if served and _requested_for(op, get_backend()) == "auto":
                    names = ", ".join(str(d).replace("torch.", "") for d in served)
                    why += f"; for {names}, other dtypes go to the next eligible backend"
                row[device_type] = f"{backend} ({why})"
            except RuntimeError as e:
                row[device_type] = f"error: {e}"
        ops[op] = row
    evidence = [dict(vars(record)) for record in _evidence.EVIDENCE]
    layout_evidence = [dict(vars(record)) for record in _evidence.LAYOUT_EVIDENCE]
    return {"requested": get_backend(), "source": source, "backends": backends, "ops": ops,
            "evidence": evidence, "layout_evidence": layout_evidence}
