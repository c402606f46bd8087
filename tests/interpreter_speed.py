"""Make the Triton interpreter skip work it repeats inside a launch, without changing what a kernel computes.

Measured on this project's suite (Triton 3.9.0, 2026-12-01): half of the interpreter's time went to re-patching
``triton.language``. A launch (``GridExecutor.__call__``) patches the language modules the kernel's globals name
(``_patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math``...) and restores them at its end.
Every call of a ``@triton.jit`` helper *inside* the kernel (``InterpretedFunction.__call__``: our rounding, seed
and coefficient helpers, once per program) patches them again, ~1.5 ms a time, and never restores that scope. In
``test_idioms``' reads-after-step test that was 8,068 patches for 186 launches, 12.3 s of 23.5 s.

While a launch is running, the modules it patched stay patched until it ends: a helper whose language modules are
among them finds every builtin already replaced (a replaced one is no longer a builtin, so a second patch skips it,
and the other attributes are set to the same replacements), so its patch changes nothing, and it is skipped here. A
helper naming a module the launch did not patch goes through Triton's own code, as before. The kernels' results
are the same bits: ``tests/kernels/test_interpreter_speed.py`` runs kernels with nested helpers both ways.

Applied by ``tests/conftest.py`` and by the processes of ``tests/distributed.py``; a no-op where the interpreter is
off (the GPU check's compiled kernels) or its internals are not the ones described above (another Triton).
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()
_original = None  # Triton's _patch_lang, once installed


def install() -> bool:
    """Install the shortcut once per process; False (doing nothing) where it does not apply."""
    global _original
    if _original is not None:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    from tritonshard.kernels._dispatch import interpreter_enabled
    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")
    if not interpreter_enabled() or not all(hasattr(interpreter, name) for name in needed):
        return False
    original = _original = interpreter._patch_lang

    langs_of: dict = {}  # a function's language modules, by the function (its globals' modules do not change)

    def _patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        active = getattr(_state, "langs", None)
        if active is None:  # a launch (GridExecutor.__call__), which restores the scope when it ends
            scope = original(fn)
            _state.langs = langs
            return _LaunchScope(scope)
        if langs <= active:  # a helper called inside the launch: its modules are patched already
            return interpreter._LangPatchScope()
        return original(fn)  # (Triton's own behaviour: patched, never restored)

    interpreter._patch_lang = _patch_lang
    return True


@contextlib.contextmanager
def disabled():
    """Inside: Triton's own ``_patch_lang`` (the equivalence test's other side)."""
    from triton.runtime import interpreter
    installed = interpreter._patch_lang
    interpreter._patch_lang = _original
    try:
        yield
    finally:
        interpreter._patch_lang = installed


class _LaunchScope:
    """The launch's patch scope; restoring it also ends the launch for :func:`install`'s check."""

    def __init__(self, scope):
        self._scope = scope

    def restore(self) -> None:
        _state.langs = None
        self._scope.restore()

    def __getattr__(self, name):
        return getattr(self._scope, name)
