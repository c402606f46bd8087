"""Make the Triton interpreter skip work it repeats at every launch, without changing what a kernel computes.

Measured on this project's suite (Triton 3.9.0): the interpreter spent much of its time on bookkeeping that gives
the same result every time.

* Patching ``triton.language``. A launch (``GridExecutor.__call__``) patches the language modules the kernel's
  globals name (``_patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.core``, ``tl.tensor``, ``tl.math``...,
  every builtin replaced by a wrapper that calls it with the interpreter's semantic) and restores them at its end,
  and every call of a ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__``: our rounding,
  seed and coefficient helpers, ``tl.standard``'s reductions) patches them again, never restoring that scope.
  Session 12 measured 8,068 patches for 186 launches in ``test_idioms``' reads-after-step test, 12.3 s of 23.5 s,
  and skipped the helpers' patches; session 15 still found ~6 ms per launch, 17 % of the interpreter's time in
  ``test_param_steps``. The patch depends on nothing but the modules (the wrappers call the builtins with
  Triton's one ``interpreter_semantic``), and nothing outside a kernel calls a builtin (outside a launch they
  raise), so here the modules are patched once, when this is installed, and stay patched: every launch's and
  helper's patch is then an empty scope. (Triton itself leaves ``tl.core`` patched after the first helper from
  ``tl.standard`` runs; this does the same for ``tl`` from the start.)
* ``_get_np_dtype`` builds a dict of 19 ``tl`` dtypes (hashing each) at every call, ~35,000 calls in that test
  (1.2 s). Its answer depends only on the dtype's class and name (a block type's name holds its element type's),
  so it is looked up once per (class, name).

The kernels' results are the same bits: ``tests/kernels/test_interpreter_speed.py`` runs every kernel family with
nested helpers both ways. Applied by ``tests/conftest.py`` and by the processes of ``tests/distributed.py``; a
no-op where the interpreter is off (the GPU check's compiled kernels) or its internals are not the ones described
above (another Triton).
"""

from __future__ import annotations

import contextlib
import types

#: (Triton's _patch_lang, Triton's _get_np_dtype, the standing patch scope), once installed
_installed = None


def install() -> bool:
    """Install the shortcuts once per process; False (doing nothing) where they do not apply."""
    if _installed is not None:
        return True
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    from tritonshard.kernels._dispatch import interpreter_enabled
    needed = ("_patch_lang", "_LangPatchScope", "_get_np_dtype")
    if not interpreter_enabled() or not all(hasattr(interpreter, name) for name in needed):
        return False
    _apply(interpreter)
    return True


def _apply(interpreter) -> None:
    global _installed
    import triton.language as tl

    original_patch, original_dtype = interpreter._patch_lang, interpreter._get_np_dtype
    # what Triton patches for a function whose globals name both language modules (it reads only __globals__)
    scope = original_patch(types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core}))
    interpreter._patch_lang = lambda fn: interpreter._LangPatchScope()  # patched already: nothing to do or undo

    np_dtypes: dict = {}

    def _get_np_dtype(tt_dtype):
        key = (type(tt_dtype), tt_dtype.name)
        found = np_dtypes.get(key)
        if found is None:
            found = np_dtypes[key] = original_dtype(tt_dtype)
        return found

    interpreter._get_np_dtype = _get_np_dtype
    _installed = (original_patch, original_dtype, scope)


@contextlib.contextmanager
def disabled():
    """Inside: Triton's own ``_patch_lang`` and ``_get_np_dtype``, the language modules unpatched between launches
    (the equivalence test's other side)."""
    global _installed
    from triton.runtime import interpreter
    original_patch, original_dtype, scope = _installed
    scope.restore()
    interpreter._patch_lang, interpreter._get_np_dtype = original_patch, original_dtype
    _installed = None
    try:
        yield
    finally:
        _apply(interpreter)
