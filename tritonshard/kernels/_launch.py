"""``BoundLaunch``: one kernel launch, bound once and replayed, for the optimizer's hot path (issue 20).

A Triton launch from Python (``kernel[grid](*args)``) binds and specializes every argument, hashes the
specialization, looks the compiled kernel up, checks the globals it captured and builds launch metadata: about
15-40 us of host time per launch, three launches per bucket per step, while the kernels themselves take a few
microseconds on an H200. The optimizer launches the same kernels on the same tensors every step (its buffers are
allocated once; the per-step values, such as the step counter, lr-derived coefficients, grad_scale and found_inf,
live in device tensors that are rewritten in place). So it binds each launch once, when it first runs it:

* the first call goes through Triton's normal path, with the compiled kernel's launcher wrapped for that one
  launch to record the exact arguments Triton passes it (grid, stream, function handle, metadata, hooks, then the
  kernel's arguments in Triton's own order and convention, whatever the Triton version);
* every later call hands those recorded arguments straight to the compiled launcher, with the current stream
  substituted (the step may run on another stream than the first one did).

Correctness rests on three facts, each checked: the arguments are the same objects every step (a BoundLaunch is
built from, and keyed by, the optimizer's own persistent tensors and the Python scalars of the launch; a changed
scalar, e.g. a new ``betas``, rebinds); a tensor keeps its address, so Triton's specialization (16-byte alignment)
still holds; and nothing Triton would do per launch is skipped where it matters: with a launch hook installed
(``knobs.runtime.launch_enter_hook``, e.g. a profiler) or on a backend without a compiled launcher (the
interpreter, the PyTorch reference) every call takes the normal path. ``tests/optim/test_launch_plans.py`` records
what a whole ShardedAdamW step hands Triton's launcher (through the dry-run driver of ``benchmarks.compile_check``)
with and without bound launches and requires the same calls, argument by argument.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from triton.runtime import driver

try:  # triton.knobs exists from Triton 3.4 on (the GPU machine has 3.6, CI 3.9); older ones never bind
    from triton import knobs
except ImportError:  # pragma: no cover - depends on the installed Triton
    knobs = None

__all__ = ["BoundLaunch", "bound_launches_enabled", "set_bound_launches", "cdiv", "block_schedule"]


def cdiv(n: int, d: int) -> int:
    """``ceil(n / d)`` for grids and block counts on the host. Not ``triton.cdiv``: that is a
    ``ConstexprFunction``, ~10 us per call from Python (it was 4 of the 5 us per tensor of a flatten at new
    addresses, one call per tensor, issue 20.5)."""
    return -(-n // d)

def block_schedule(offsets: tuple, numels: tuple, block: int) -> tuple:
    """The host tables of a launch over several tensors in which every program takes one ``block`` of one tensor
    (the flatten, the optimizer's norm pass over every grad shard): ``(offsets, numels, block -> tensor,
    block -> first element)``, the first two as given (int64), the last two in program order."""
    blocks_per_tensor = [cdiv(n, block) for n in numels]
    block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32),
                                           torch.tensor(blocks_per_tensor, dtype=torch.int64))
    first_block = torch.tensor([0] + blocks_per_tensor[:-1], dtype=torch.int64).cumsum(0)
    block_start = (torch.arange(block_tensor.numel(), dtype=torch.int64) - first_block[block_tensor.long()]) * block
    return (torch.tensor(offsets, dtype=torch.int64), torch.tensor(numels, dtype=torch.int64), block_tensor,
            block_start)


_ENABLED = True
#: launches replayed through a compiled launcher so far (observable: tests and benchmarks check it moves)
replays = 0


def set_bound_launches(enabled: bool) -> bool:
    """Turn bound launches on or off process-wide (tests and benchmarks compare both); returns the old value."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(enabled)
    return previous


def bound_launches_enabled() -> bool:
    return _ENABLED


class BoundLaunch:
    """``kernel[grid](*args, **kwargs)``, launched through the compiled launcher from the second call on.

    ``args``/``kwargs`` must be what every call launches: tensors the caller keeps (their contents may change,
    not their storage) and Python scalars that do not change (the caller rebinds when one does), but for the
    ``live`` arguments and the floats, which a call may hand anew (:func:`launch`).
    """

    __slots__ = ("kernel", "grid", "args", "kwargs", "live", "_taken", "_launcher", "_recorded", "_device",
                 "_unbindable")

    def __init__(self, kernel, grid: tuple, args: tuple, kwargs: dict, live: tuple = ()):
        self.kernel, self.grid, self.args, self.kwargs = kernel, grid, args, kwargs
        self.live = live  # positions in args of ints the kernel does not specialize on, or tensors, new per call
        # (the positions a call's args replace in the recorded ones: the live ones and every float)
        self._taken = tuple(sorted(set(live) | {i for i, a in enumerate(args) if type(a) is float}))
        self._launcher: Optional[Callable] = None
        self._recorded: Optional[tuple] = None
        self._device = None
        self._unbindable = False  # recording failed once (an unknown Triton, the interpreter): never try again

    def __call__(self, args: Optional[tuple] = None) -> None:
        """Launch; ``args``: this call's arguments where the live ones and the floats may differ from the bound
        ones (the rest are the bound ones, which :func:`launch` checked)."""
        if _ENABLED and not self._unbindable and _no_launch_hooks():
            if self._recorded is not None:
                global replays
                replays += 1
                recorded = self._recorded
                if args is not None and self._taken:
                    recorded = list(recorded)
                    for i in self._taken:
                        recorded[_LEADING + i] = args[i]
                stream = driver.active.get_current_stream(self._device)
                self._launcher(recorded[0], recorded[1], recorded[2], stream, *recorded[4:])
            else:
                self._record(args)
            return
        self.kernel[self.grid](*(self.args if args is None else args), **self.kwargs)

    def _record(self, args: Optional[tuple] = None) -> None:
        """The first launch: Triton's normal path, with the compiled kernel's launcher recording its arguments.
        ``args``: this call's (see :meth:`__call__`), launched and recorded; the bound ones by default."""
        args = self.args if args is None else args
        try:
            compiled = self.kernel.warmup(*args, grid=self.grid, **self.kwargs)  # compiles; launches nothing
        except (TypeError, AttributeError):  # a Triton whose warmup() differs, the interpreter: the normal path
            compiled = None
        if compiled is None or not hasattr(compiled, "_run") or not hasattr(compiled, "run"):
            self._unbindable = True
            self.kernel[self.grid](*args, **self.kwargs)  # an unknown Triton: keep the normal path
            return
        launcher = compiled.run  # initializes the handles (loads the module) once
        calls: list[tuple] = []

        def record(*args: Any) -> Any:
            calls.append(args)
            return launcher(*args)

        compiled._run = record
        try:
            self.kernel[self.grid](*args, **self.kwargs)
        finally:
            compiled._run = launcher
        # (grid x3, stream, function, metadata, launch metadata, 2 hooks, then the kernel's arguments in its
        # signature's order: a live argument is substituted there, where it must be what was passed)
        if (len(calls) == 1 and len(calls[0]) >= _LEADING
                and all(len(calls[0]) > _LEADING + i and _same_object(calls[0][_LEADING + i], args[i])
                        for i in self._taken)):
            self._launcher, self._recorded = launcher, calls[0]
            self._device = driver.active.get_current_device()
        else:
            self._unbindable = True


def _no_launch_hooks() -> bool:
    """No launch hook is installed (a profiler such as proton installs one; then every launch takes Triton's path,
    which builds the metadata the hook reads). Triton 3.6 keeps None there, 3.9 an empty HookChain. Without
    ``triton.knobs`` (Triton < 3.4) the hooks cannot be seen: answer False, so nothing is bound."""
    if knobs is None:
        return False
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def launch(cache: dict, key, spec: tuple, first: Callable[[], None], live: tuple = ()) -> None:
    """Launch ``spec`` = (kernel, grid, args, kwargs) through the BoundLaunch in ``cache`` under ``key``.

    When there is none, or its arguments differ from ``spec``'s (tensors compared by identity, the rest by value),
    ``first()`` runs instead, the public launcher with its argument checks (which launches), and a BoundLaunch of
    ``spec`` is stored for the next call: every new binding has been validated once. Arguments that may change
    at every call replay the bound launch with their new values instead: every float (Triton types a float
    argument fp32 whatever its value: the betas that torch's OneCycleLR cycles every step, SGD's momentum; the
    optimizer validates its hyper-parameters at every step, and a value a constexpr derives from is in
    ``kwargs``, which rebinds), and the ``live`` positions, each an integer the kernel does not specialize on
    (``do_not_specialize``: the lr's bits) or a tensor (a new 0-d output per call: the clip's norm), unless
    Triton would specialize the new one otherwise (an int's type, i32 / i64 / u64 by its range; a tensor's dtype,
    device, or 16-byte alignment), which binds anew. (Until session 36 a new float rebound: with OneCycleLR's
    momentum cycling, a checked launch per bucket and a segmented launch's tables built anew at every step,
    ~15 ms of host time per 125M step.)"""
    kernel, grid, args, kwargs = spec
    bound = cache.get(key)
    if bound is not None and bound.grid == grid and bound.kwargs == kwargs and bound.live == live:
        if _same(bound.args, args):
            bound()
            return
        if _same_but_live(bound.args, args, live):
            bound(args)
            return
    first()
    cache[key] = BoundLaunch(kernel, grid, args, kwargs, live)


#: the compiled launcher's leading arguments before the kernel's own (grid x3, stream, function, packed metadata,
#: launch metadata, enter hook, exit hook)
_LEADING = 9


def _same(a: tuple, b: tuple) -> bool:
    """The same launch arguments: the same tensor objects, scalars of the same type and value."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if type(x) is not type(y) or isinstance(x, torch.Tensor) or x != y:
            return False
    return True


def _int_type(x: int) -> str:
    """The type Triton gives an int argument it does not specialize on (triton.runtime.jit.mangle_type's rule)."""
    if -2 ** 31 <= x < 2 ** 31:
        return "i32"
    return "u64" if 2 ** 63 <= x < 2 ** 64 else "i64"


def _same_but_live(a: tuple, b: tuple, live: tuple = ()) -> bool:
    """:func:`_same` but where both are floats (any values), and at the ``live`` positions, where both must be
    ints of the same Triton type, or tensors of the same dtype and device, both 16-byte aligned or both not
    (Triton's specialization of a pointer)."""
    if len(a) != len(b):
        return False
    for i, (x, y) in enumerate(zip(a, b)):
        if x is y or (type(x) is float and type(y) is float):
            continue
        if i in live:
            if type(x) is int and type(y) is int:
                if _int_type(x) != _int_type(y):
                    return False
            elif not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                      and x.device == y.device and (x.data_ptr() % 16 == 0) == (y.data_ptr() % 16 == 0)):
                return False
        elif type(x) is not type(y) or isinstance(x, torch.Tensor) or x != y:
            return False
    return True


def _same_object(recorded, passed) -> bool:
    """Whether the launcher got ``passed`` at a live argument's place: the tensor itself, or the number's value
    (a NaN never is: such a launch stays on Triton's path)."""
    return recorded is passed or (type(recorded) is type(passed) and type(passed) in (int, float)
                                  and recorded == passed)


#: int64 columns per segment in a segmented launch's table (see _update_jit): up to 7 role offsets, then the numel
SEGMENT_FIELDS = 8


def segmented_spec(specs: list, vector: tuple, scalar: tuple, numel: int, tables: int, block: int):
    """One launch spec for all of ``specs``: launches of one update kernel on several buckets' shards, which differ
    only in their per-bucket tensors (the argument positions ``vector`` + ``scalar``) and their numel (position
    ``numel``). The result launches the kernel once with MULTI=True: its arguments are ``specs[0]``'s, with at
    positions ``tables`` and ``tables + 1`` the schedule (segment, first element per program) and the segment table
    (each role's element offset from segment 0's tensor, then the numel; see tritonshard.kernels._update_jit).

    None when the launches cannot be merged: other differences between them, a role whose tensors differ in dtype
    or device, an offset that is not a whole number of elements or (``vector`` roles, which the kernel reads with
    16-byte accesses) not a multiple of 16 elements, or a numel that is not a multiple of 16 (every shard of a
    Buffer with the default ``align`` is one; ``align=1`` layouts need not be). The caller then launches them one
    by one."""
    kernel, _, first_args, kwargs = specs[0]
    roles = tuple(vector) + tuple(scalar)
    if len(roles) >= SEGMENT_FIELDS or kwargs.get("MULTI") is not False:
        return None
    varying = set(roles) | {numel, tables, tables + 1}  # (the tables: placeholders without MULTI)
    for other_kernel, _, args, other_kwargs in specs[1:]:
        if other_kernel is not kernel or other_kwargs != kwargs or len(args) != len(first_args):
            return None
        # (an argument the kernel does not read is a placeholder: the launch's first tensor, different per bucket)
        if not _same(tuple(a for i, a in enumerate(args) if i not in varying and a is not args[0]),
                     tuple(a for i, a in enumerate(first_args) if i not in varying and a is not first_args[0])):
            return None
        if any((a is args[0]) != (b is first_args[0]) for i, (a, b) in enumerate(zip(args, first_args))
               if i not in varying):
            return None
    rows, schedule = [], []
    for s, (_, _, args, _) in enumerate(specs):
        n = int(args[numel])
        if n % 16:  # (the kernel's masks assume it, see _update_jit.segment_numel)
            return None
        row = []
        for j, i in enumerate(roles if n else ()):  # (an empty segment has no programs, and maybe no address)
            t, t0 = args[i], first_args[i]
            if t.dtype != t0.dtype or t.device != t0.device:
                return None
            offset, rest = divmod(t.data_ptr() - t0.data_ptr(), t.element_size())
            if rest or (j < len(vector) and offset % 16):
                return None
            row.append(offset)
        rows.append(row + [0] * (SEGMENT_FIELDS - 1 - len(row)) + [n])
        schedule.extend((s, start) for start in range(0, n, block))
    if not schedule:
        return None
    device = first_args[roles[0]].device
    args = list(first_args)
    # (non_blocking: no host sync, as the flatten's tables; the host tensors are staged before the call returns)
    args[tables] = torch.tensor(schedule, dtype=torch.int64).to(device, non_blocking=True)
    args[tables + 1] = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    return kernel, (len(schedule),), tuple(args), dict(kwargs, MULTI=True)
