"""Run a function on N real processes joined by a gloo process group (no mocks).

``run_on_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on ``world_size`` processes that
share a gloo process group, and returns once every rank has returned. An exception on any rank fails the calling
test with that rank's traceback. ``fn`` must be a module-level function (it is pickled into the processes).

The processes are kept between calls, one set per world size (what torch's own ``MultiProcContinuousTest`` does):
starting them cost ~3.8 s for 2 ranks and ~8 s for 4 on the 2-core CI machine (spawn, import torch and
tritonshard, join gloo, the interpreter's first launches), more than most tests' own work, and the suite made about
a hundred such calls. Each call starts from what a fresh process would see: the RNGs (torch, random, numpy) reset
to their state at start-up, ``os.environ`` and the warning filters restored after the call, grad mode on,
accelerate's singleton state cleared (process groups a call made stay; see ``_reset_after_call``). A call that
fails on any rank, or a rank that dies, ends that set of processes (the others may be blocked in a collective with
it); the next call starts a new one. ``fresh=True`` runs on new processes that end with the call, as every call did before.
``timeout_s`` (kept processes): a call still running after that long fails as a hang, and its processes are ended.
"""

from __future__ import annotations

import atexit
import gc
import os
import random
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    """A rank of :func:`run_on_ranks` raised (its traceback is the message) or died."""


def _start(rank: int, world_size: int, store_path: str):
    os.environ["OMP_NUM_THREADS"] = "1"  # 2 cores shared by up to 4 ranks
    torch.set_num_threads(1)
    from tests import interpreter_speed
    interpreter_speed.install()  # as in the test process (tests/conftest.py)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return store


def _run_one(rank: int, world_size: int, fn, args, warnings_as_errors) -> None:
    with warnings.catch_warnings():
        if warnings_as_errors:
            warnings.simplefilter("error", warnings_as_errors)
        fn(rank, world_size, *args)
    # objects the test left in reference cycles (optimizers hold the process group) go now, while the group and
    # the interpreter are alive, not in the interpreter's shutdown collection
    gc.collect()


def _fresh_entry(rank: int, world_size: int, store_path: str, fn, args, warnings_as_errors):
    store = _start(rank, world_size, store_path)
    try:
        _run_one(rank, world_size, fn, args, warnings_as_errors)
        dist.barrier()
        # Teardown: twice in two full-suite runs (2026-11-29) a rank died of SIGABRT after its test body had
        # passed ("terminate called without an active exception"; never in 30 runs of those tests alone). Two
        # known ways for gloo to do that are guarded against here: a process group destroyed during interpreter
        # shutdown (the gc.collect() in _run_one), and a peer closing its sockets while a transfer is still
        # finishing (no rank destroys the group before every rank has left the barrier: a handshake through the
        # store, which does not use gloo's connections).
        # A third: the group outliving destroy_process_group() into shutdown anyway, held as a default argument by
        # torch.distributed.nn.functional (see tritonshard.comm.destroy_process_group, which releases it).
        store.set(f"tests.distributed.done.{rank}", "1")
        store.wait([f"tests.distributed.done.{r}" for r in range(world_size)])
    finally:
        from tritonshard.comm import destroy_process_group
        destroy_process_group()


def _freeze_what_is_imported() -> None:
    """``gc.freeze()`` once torch, Triton and tritonshard are imported: the collector then leaves those ~200,000
    objects out of every full collection (``_run_one``'s ``gc.collect()`` after each call, and the automatic ones),
    which took ~0.12 s each; the objects a test makes are collected as before. Undone at exit, so that shutdown
    frees them as usual (nanobind reports Triton's objects as leaked otherwise). The suite's own processes do the
    same (tests/conftest.py)."""
    gc.freeze()
    atexit.register(gc.unfreeze)


def _initial_rng_states():
    numpy = sys.modules.get("numpy")
    return torch.random.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy else None


def _restore_rng_states(states) -> None:
    torch_state, python_state, numpy_state = states
    torch.random.set_rng_state(torch_state)
    random.setstate(python_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


def _reset_after_call(environ: dict) -> None:
    """What one call may leave behind that the next one must not see (a fresh process would not)."""
    os.environ.clear()
    os.environ.update(environ)
    torch.set_grad_enabled(True)
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:  # singletons (as accelerate's own tests reset them between tests)
        accelerate_state.AcceleratorState._reset_state(True)
        accelerate_state.GradientState._reset_state()
    # Process groups the call made stay: tritonshard keeps a gloo side group per group it is given, made with
    # use_local_synchronization=True, whose name is a hash of its ranks; destroying it and making a new one over
    # the same ranks in a later call reused the old one's rendezvous keys in the store ("Connection refused").
    # Groups made without local synchronization take their names from a counter that every rank advances alike.
    dist.barrier()


def _worker(rank: int, world_size: int, store_path: str, conn) -> None:
    _start(rank, world_size, store_path)
    rng = _initial_rng_states()
    _freeze_what_is_imported()
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the test session ended
            return
        if job is None:
            return
        fn, args, warnings_as_errors = job
        environ = dict(os.environ)
        _restore_rng_states(rng)
        try:
            _run_one(rank, world_size, fn, args, warnings_as_errors)
            _reset_after_call(environ)
        except BaseException:  # noqa: BLE001 -- reported to the test; this set of processes is then ended
            conn.send(("error", traceback.format_exc()))
            return
        conn.send(("ok", None))


class _Ranks:
    """``world_size`` kept processes with a gloo group, running one call at a time."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory()
        store = os.path.join(self._tmp.name, "store")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, store, child), daemon=True,
                               name=f"tests.distributed rank {rank}/{world_size}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def call(self, fn, args, warnings_as_errors, timeout_s: float | None = None) -> None:
        for conn in self.conns:
            conn.send((fn, args, warnings_as_errors))
        pending, failures = set(range(self.world_size)), {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending and not failures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], timeout=left)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                raise RankFailed(f"ranks {sorted(pending)} of {self.world_size} still running after {timeout_s} s "
                                 "(a hang: ranks waiting in different collectives?)")
            for r in sorted(pending):
                conn, proc = self.conns[r], self.procs[r]
                if conn in ready:
                    try:
                        status, detail = conn.recv()
                    except EOFError:  # the process ended: its exit code says how
                        proc.join()
                        status, detail = "error", f"its process died (exit code {proc.exitcode})"
                    if status == "ok":
                        pending.discard(r)
                    else:
                        failures[r] = detail
                elif proc.sentinel in ready:
                    proc.join()
                    failures[r] = f"its process died (exit code {proc.exitcode})"
        if failures:
            raise RankFailed("\n".join(f"rank {r} of {self.world_size}: {detail}" for r, detail in failures.items()))

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._tmp.cleanup()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        self._tmp.cleanup()


_kept: dict[int, _Ranks] = {}


@atexit.register
def _close_kept() -> None:
    while _kept:
        _kept.popitem()[1].close()


def run_on_ranks(fn, world_size: int, *args, warnings_as_errors: type[Warning] | None = None,
                 fresh: bool = False, timeout_s: float | None = None) -> None:
    if fresh:
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            mp.start_processes(_fresh_entry, args=(world_size, store, fn, args, warnings_as_errors),
                               nprocs=world_size, join=True, start_method="spawn")
        return
    ranks = _kept.get(world_size)
    if ranks is None:
        ranks = _kept[world_size] = _Ranks(world_size)
    try:
        ranks.call(fn, args, warnings_as_errors, timeout_s)
    except BaseException:
        # a failed call may leave ranks blocked in a collective with the one that raised: end them all
        del _kept[world_size]
        ranks.kill()
        raise
