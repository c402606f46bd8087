"""A CUDA graph's rules, checked on the CPU: what ``cuda_graph=True`` relies on, without a GPU (issue 20.6).

A captured CUDA graph replays the kernels and copies its capture recorded, with the same pointers and the same
scalar arguments, and runs no Python. :class:`EmulatedGraph` stands in for :class:`tritonshard.optim.graphs
.CudaGraph` on the CPU (``emulated_graphs`` in the tests): its "capture" runs the phase for real and records every
aten op and Triton (interpreter) launch it makes, each with its tensors' addresses, shapes, strides and dtypes and
its other arguments' values; each "replay" runs the phase again and requires the same record, op by op. So a value
the host changes between steps but a graph would freeze (the lr passed to a ``fill_`` as a number, a tensor
allocated anew each step and read by address) fails the replay here, where a real graph would silently reuse the
captured one. After the replay the optimizer's host state (its attributes and its buckets', containers by content)
is put back to what it was before, because a real replay runs no Python: what the step needs from the host after a
replay must come from the phase's ``after_replay``, and the tests' results show whether it does.

Not emulated: the capture's own constraints (no host sync, no allocation outside the graph's pool, collectives
that can be captured), which only a GPU checks (``benchmarks/sync_check.py``'s ``graph_check``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from triton.runtime import interpreter

from tritonshard.optim import graphs

__all__ = ["EmulatedGraph", "install"]

_Work = dist.distributed_c10d.Work


def _frozen(x):
    """What a graph node freezes of an argument: a tensor by its address and layout, a number by type and value."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), x.dtype, tuple(x.shape), tuple(x.stride()))
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    if isinstance(x, (bool, int, float, str, type(None))):
        return (type(x).__name__, repr(x))
    if isinstance(x, torch.ScriptObject):  # (a collective's process group and options: made per call)
        return ("script object", x._type().qualified_name())
    if callable(x):  # (a launch grid given as a function of the meta-parameters)
        return "callable"
    return repr(x)


class _Recorder(TorchDispatchMode):
    """Records every aten op and interpreter launch while active."""

    def __init__(self):
        super().__init__()
        self.trace: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.trace.append((str(func), _frozen(args), _frozen(kwargs)))
        return func(*args, **kwargs)

    def __enter__(self):
        recorder, original, original_wait = self, interpreter.GridExecutor.__call__, _Work.wait

        def launch(executor, *args, **kwargs):
            recorder.trace.append(("launch " + executor.fn.__name__, _frozen(executor.grid), _frozen(args),
                                   _frozen(kwargs)))
            with _disable_current_modes():  # (the interpreter's own copies are not the kernel's arguments)
                return original(executor, *args, **kwargs)

        def wait(work, *args, **kwargs):
            recorder.trace.append(("wait",))
            with _disable_current_modes():  # (gloo finishes a collective on the host in wait(), with temporaries
                return original_wait(work, *args, **kwargs)  # of its own; NCCL's wait is one stream dependency)
        self._originals = original, original_wait
        interpreter.GridExecutor.__call__, _Work.wait = launch, wait
        return super().__enter__()

    def __exit__(self, *exc):
        interpreter.GridExecutor.__call__, _Work.wait = self._originals
        return super().__exit__(*exc)


_CONTAINERS = (dict, list, set)  # (exactly these types: their contents are restored in place)


def _host_state(objects: list) -> list:
    """Each object's attributes, the plain containers among them copied one level."""
    return [(obj, {name: (value, type(value)(value) if type(value) in _CONTAINERS else None)
                   for name, value in vars(obj).items()}) for obj in objects]


def _restore(saved: list) -> None:
    """Put back what :func:`_host_state` saved: the attributes, and each container's contents in place (other
    objects may hold the same container)."""
    for obj, attrs in saved:
        for name in [n for n in vars(obj) if n not in attrs]:
            delattr(obj, name)
        for name, (value, kept) in attrs.items():
            setattr(obj, name, value)
            if kept is None:
                continue
            value.clear()
            if isinstance(value, list):
                value.extend(kept)
            else:
                value.update(kept)


class EmulatedGraph:
    """:class:`tritonshard.optim.graphs.CudaGraph` on the CPU: see the module's docstring."""

    executes_on_capture = True  # the "capture" ran the phase: StepGraphs does not replay it at once

    def __init__(self, body, device, owner):
        self.body, self.owner = body, owner
        with _Recorder() as recorder:
            body()
        self.trace = recorder.trace
        self.replays = 0

    def replay(self) -> None:
        saved = _host_state([self.owner, *self.owner.buckets])
        with _Recorder() as recorder:
            self.body()
        _restore(saved)
        self.replays += 1
        for i, (captured, now) in enumerate(zip(self.trace, recorder.trace)):
            if captured != now:
                context = "\n".join(f"  {j}: {op[0]}" for j, op in enumerate(self.trace[max(0, i - 8):i + 2],
                                                                                 max(0, i - 8)))
                raise AssertionError(f"a CUDA graph would replay op {i} differently from its capture: captured "
                                     f"{captured}, this step runs {now}; the captured ops before it:\n{context}")
        if len(self.trace) != len(recorder.trace):
            raise AssertionError(f"a CUDA graph replays {len(self.trace)} ops; this step runs {len(recorder.trace)}")


def install(monkeypatch) -> None:
    """Capture with :class:`EmulatedGraph`, and let CPU parameters and gloo collectives be "captured"."""
    monkeypatch.setattr(graphs, "make_graph", EmulatedGraph)
    monkeypatch.setattr(graphs, "unsupported", lambda device, backend: None)
