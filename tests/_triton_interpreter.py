"""Triton's interpreter without its redundant re-patching of triton.language.

Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel after patching the
builtins of ``triton.language`` with its own (``interpreter._patch_lang``: an
``inspect.getmembers`` scan of four modules), and restores them when the launch
ends. It also calls ``_patch_lang`` at every call of a ``@triton.jit`` helper
from a kernel, and there the builtins are patched already: the scan finds
nothing to replace, yet costs about half a millisecond. The optimizer kernels
call their update helpers in every tile loop, so in some interpreter tests the
scans took close to half of the time.

:func:`install` skips that scan for a helper whose ``triton.language`` modules
the running launch has patched already. A helper that sees a module the launch
did not patch is patched as before; outside a launch nothing changes. Where
this Triton lacks the functions this relies on, :func:`install` changes nothing
and says so (the interpreter is then only slower). It also makes a one-element
tensor usable as an index under NumPy 2.4 where this Triton's interpreter does not
(:func:`_index_one_element_tensors`: Triton 3.6).
"""

from __future__ import annotations

import functools

_scans_skipped = 0


def scans_skipped() -> int:
    """How many helper calls ran without a scan since :func:`install`."""
    return _scans_skipped


def _index_one_element_tensors(interpreter) -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with ``int(handle.data)``,
    which NumPy 2.4 refuses for the 1-element array that a scalar ``tl.load`` gives
    ("only 0-dimensional arrays can be converted to Python scalars"): a loop bound such
    as ``range(tl.cdiv(n, BLOCK))`` with a loaded ``n`` failed. Later Triton releases
    squeeze the array first; this does the same wherever Triton does not."""
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_hfkern_squeezes_index", False):
        return

    @functools.wraps(patch_tensor)
    def patch_lang_tensor(tensor, scope, *args, **kwargs):
        result = patch_tensor(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
        return result

    patch_lang_tensor._hfkern_squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def install() -> str:
    """Patch Triton's interpreter as described above; returns "" or why it did not."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError as e:
        return f"triton's interpreter is not importable: {e}"
    _index_one_element_tensors(interpreter)
    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")
    missing = [name for name in needed if not hasattr(interpreter, name)]
    if missing:
        return f"this triton's interpreter has no {', '.join(missing)}"
    if getattr(interpreter._patch_lang, "_hfkern_skips_helpers", False):
        return ""
    original_patch = interpreter._patch_lang
    original_launch = interpreter.GridExecutor.__call__
    launches: list[set[int]] = []  # per launch in progress: the language modules it patched

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    @functools.wraps(original_patch)
    def patch_lang(fn):
        global _scans_skipped
        langs = languages(fn)
        if launches and launches[-1] and langs <= launches[-1]:
            _scans_skipped += 1
            return interpreter._LangPatchScope()  # nothing to restore: the launch's scope restores
        scope = original_patch(fn)
        if launches:
            launches[-1].update(langs)
        return scope

    @functools.wraps(original_launch)
    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang._hfkern_skips_helpers = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    return ""
