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
* Overflow checks whose assert is dropped. The interpreter's options ask for ``sanitize_overflow`` with ``debug``
  off: every integer ``+``, ``-`` and ``*`` on fewer than 64 bits (offsets, our rounding's bit arithmetic) then
  casts both operands to int64, redoes the operation, compares with the type's bounds, and hands the condition to
  ``device_assert``, which returns without looking at it because ``debug`` is off (Triton 3.9 never sets it in the
  interpreter; a compiled kernel adds the check only with ``debug`` on). Measured (session 51): 9,474 such checks,
  1.46 s of a 22 s test in ``test_loop_fuzz`` under cProfile. Here the check is switched off where ``debug`` is, which drops only
  the computation of a condition that nothing reads.
* Block types described again. Every block a kernel makes gets a new ``tl.block_type`` (``with_element_ty``, the
  builder's ``get_block_ty``: ~52,000 in that test, 1.4 s), whose constructor unwraps and validates the shape and
  formats its name. Those depend only on the element type and the dimensions, so they are kept per (element type,
  dimensions); each block type still gets its own shape tuple (Triton's ``_setitem`` writes one). Likewise every
  ``tl.tensor`` (~108,000 there, 1.6 s) wraps its type's dimensions in constexprs and a Triton tuple, whose type is
  derived again each time: kept per dimensions, a new tuple each.

The kernels' results are the same bits: ``tests/kernels/test_interpreter_speed.py`` runs every kernel family with
nested helpers both ways. Applied by ``tests/conftest.py`` and by the processes of ``tests/distributed.py``; a
no-op where the interpreter is off (the GPU check's compiled kernels) or its internals are not the ones described
above (another Triton).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

#: what undoes each shortcut, once installed
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

    undo = []
    original_patch, original_dtype = interpreter._patch_lang, interpreter._get_np_dtype
    # what Triton patches for a function whose globals name both language modules (it reads only __globals__)
    scope = original_patch(types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core}))
    interpreter._patch_lang = lambda fn: interpreter._LangPatchScope()  # patched already: nothing to do or undo
    undo += [scope.restore, lambda: setattr(interpreter, "_patch_lang", original_patch)]

    np_dtypes: dict = {}

    def _get_np_dtype(tt_dtype):
        key = (type(tt_dtype), tt_dtype.name)
        found = np_dtypes.get(key)
        if found is None:
            found = np_dtypes[key] = original_dtype(tt_dtype)
        return found

    interpreter._get_np_dtype = _get_np_dtype
    undo.append(lambda: setattr(interpreter, "_get_np_dtype", original_dtype))

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if (dataclasses.is_dataclass(options) and getattr(options, "debug", True) is False
            and getattr(options, "sanitize_overflow", False) is True):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
        undo.append(lambda: setattr(builder, "options", options))

    block_type, shape_tuple = getattr(tl.core, "block_type", None), getattr(tl.core, "tuple", None)
    probe = block_type(tl.int32, [2]) if block_type is not None and shape_tuple is not None else None
    if (probe is not None and set(vars(probe)) == {"element_ty", "shape", "numel", "name"}
            and type(probe.shape) is shape_tuple and set(vars(probe.shape)) == {"values", "type"}):
        original_init = block_type.__init__
        described: dict = {}

        def __init__(self, element_ty, shape):
            dims = shape.values if type(shape) is shape_tuple else shape
            key = None
            if type(dims) in (list, tuple) and all(type(d) is int for d in dims):
                try:
                    key = (type(element_ty), element_ty, tuple(dims))
                    found = described.get(key)
                except TypeError:  # (an element type that cannot be hashed)
                    key = found = None
                if found is not None:
                    described_shape, self.numel, self.name = found
                    self.element_ty = element_ty
                    self.shape = shape_tuple.__new__(shape_tuple)  # (its own, as Triton's: _setitem writes one)
                    self.shape.values, self.shape.type = list(described_shape.values), described_shape.type
                    return
            original_init(self, element_ty, shape)
            if key is not None:
                described[key] = (self.shape, self.numel, self.name)

        block_type.__init__ = __init__
        undo.append(lambda: setattr(block_type, "__init__", original_init))

    tensor, constexpr = getattr(tl.core, "tensor", None), getattr(tl.core, "constexpr", None)
    if (tensor is not None and constexpr is not None and "__init__" not in vars(tl.core.base_value)
            and set(vars(tensor(None, block_type(tl.int32, [2])))) == {"handle", "shape", "numel", "type", "dtype"}):
        original_tensor_init = tensor.__init__
        shapes: dict = {}

        def tensor_init(self, handle, type):
            dims = type.shape.values if type.__class__ is block_type else () if not type.is_block() else None
            key = tuple(dims) if dims is not None and all(d.__class__ is int for d in dims) else None
            found = None if key is None else shapes.get(key)
            if found is None:
                original_tensor_init(self, handle, type)
                if key is not None:
                    shapes[key] = (self.numel, self.shape)
                return
            numel, shape = found
            self.handle, self.type, self.dtype, self.numel = handle, type, type.scalar, numel
            self.shape = shape_tuple.__new__(shape_tuple)  # (its own, as block types' above)
            self.shape.values, self.shape.type = list(shape.values), shape.type

        tensor.__init__ = tensor_init
        undo.append(lambda: setattr(tensor, "__init__", original_tensor_init))
    _installed = undo


@contextlib.contextmanager
def disabled():
    """Inside: Triton's interpreter as it comes (every shortcut undone: the language modules unpatched between
    launches, its own ``_get_np_dtype``, its options, ``block_type`` and ``tensor``), the equivalence test's other
    side."""
    global _installed
    from triton.runtime import interpreter
    for undo in reversed(_installed):
        undo()
    _installed = None
    try:
        yield
    finally:
        _apply(interpreter)
