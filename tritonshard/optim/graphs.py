"""The opt-in CUDA-graph step (``cuda_graph=True``; issue 20.6): a steady step's device work captured once and
replayed.

What is captured: two phases of every step, each a graph of its own, because the user's loop runs code between
them (``clip_grad_norm_`` returns the norm, which a loop may log before ``step()``):

* ``reduce``: the reduce-scatter of every bucket, the read-only norm pass, its finalize, the all-reduce of
  ``[sum_sq, non-finite]`` and the fp32 copies ``clip_grad_norm_`` and ``step()`` read;
* ``update``: ``grad_scale`` (clip coefficient x 1/d x the multipliers), the step counters and rounding seeds, the
  update launches with their coefficients, the all-gathers and their wait, the skip bookkeeping and the loss scale.

What stays eager, per step: the flatten at the end of backward (the gradients' addresses are the allocator's,
not ours), the collective handshakes (gloo calls on the host), the host checks (the model still holds our
parameters, the hyper-parameters are valid), ``clip_grad_norm_``'s few ops, and the values the host sets: each
param group's lr is written into its float64 device tensor before the replay (a scheduler changes it every step;
a graph would freeze a ``fill_`` with the number). Every other hyper-parameter (betas, eps, weight decay,
momentum...) is a kernel argument the graph freezes: it is part of the graph's key, with whether the loop clipped
and the dtype of a multiplier torch code folded in (``torch.nn.utils.clip_grad_norm_``, copied into a buffer
before the replay). A key is captured the second time it is seen (the first warms up: launches bound, NCCL
connected), and replayed from then on; a step with a key seen for the first time runs eagerly, so a
hyper-parameter that moves every step (OneCycleLR's momentum cycling) gives eager steps, never a stale value. The
steps that are never captured: ``torch.amp.GradScaler``'s (with ``loss_scale=False``), those with parameters
frozen after construction or without a gradient on every rank, an lr given as a tensor.

Why it can be captured at all: after the first steps a step allocates no device memory and copies nothing from
the host (``tests/optim/test_steady_state.py``), every launch takes the same tensors, and nothing in it waits on
the host (``benchmarks.sync_check``).

On a CPU nothing can be captured; the CPU tests run the same code with :class:`tests.optim.graph_emulation
.EmulatedGraph`, which runs a phase for real when it "captures" it, and on every "replay" runs it again while
checking that every op and kernel launch gets the same tensors (by address) and the same numbers as when it was
captured, and that the optimizer's host state after it is what the replay's bookkeeping alone sets. A host value
that would be frozen inside a real graph fails there.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["StepGraphs", "CudaGraph", "unsupported"]

#: at most this many captured keys per phase; the oldest goes first
MAX_GRAPHS_PER_PHASE = 4
#: keys seen once and not captured yet, remembered at most this many (a hyper-parameter that moves every step
#: makes a new key every step)
MAX_SEEN = 64


class CudaGraph:
    """One phase captured in a ``torch.cuda.CUDAGraph`` (its own memory pool). Capturing runs no kernel."""

    executes_on_capture = False

    def __init__(self, body: Callable[[], None], device: torch.device, owner=None):
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: ProcessGroupNCCL's watchdog thread queries the events of earlier collectives during the
        # capture (as nccl-tests capture, and torch's own NCCL capture tests)
        with torch.cuda.device(device), torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            body()

    def replay(self) -> None:
        self.graph.replay()


def unsupported(device: torch.device, backend: Optional[str]) -> Optional[str]:
    """Why a step on ``device`` whose collectives run on ``backend`` (None: no collective) cannot be captured, or
    None: CUDA graphs need CUDA tensors, the compiled kernels (the PyTorch fallback allocates per launch) and
    collectives that can be captured (NCCL's; gloo's run on the host)."""
    from ..kernels._dispatch import compiled_path
    if device.type != "cuda":
        return f"the parameters must be on a CUDA device to capture the step in a CUDA graph, got {device}"
    if not compiled_path(device):
        return "the compiled Triton kernels are needed (not the interpreter or the PyTorch fallback)"
    if backend is not None and backend != "nccl":
        return f"the collectives must be NCCL's to be captured, got the {backend} backend"
    return None


#: what captures a phase (tests substitute an emulation on the CPU)
make_graph: Callable = CudaGraph


class StepGraphs:
    """The captured phases of one optimizer's step, by (phase, key)."""

    def __init__(self, owner):
        self.owner = owner  # the optimizer (its device, and what its graphs must keep alive)
        self._graphs: dict = {}
        self._seen: dict = {}  # (phase, key) seen once, oldest first
        #: phases captured and replayed so far (observable: tests and benchmarks check the graphs are used)
        self.captures = 0
        self.replays = 0

    def forget(self) -> None:
        """Drop every capture (they cover a set of buckets that changed: ShardedOptimizer.add_param_group)."""
        self._graphs.clear()
        self._seen.clear()

    def run(self, phase: str, key, body: Callable[[], None], after_replay: Callable[[], None]) -> None:
        """``body()`` (the phase's device work) eagerly, or captured, or replayed. ``key`` (hashable) names what the
        capture froze (None: never capture this step). ``after_replay()`` sets the host state ``body`` would have
        left (work handles, flags), since a replay runs no Python."""
        graph = self._graphs.get((phase, key)) if key is not None else None
        if graph is not None:
            graph.replay()
            after_replay()
            self.replays += 1
            return
        if key is None or (phase, key) not in self._seen:  # a first sight: run eagerly, capture the next one
            if key is not None:
                self._seen[(phase, key)] = True
                if len(self._seen) > MAX_SEEN:
                    del self._seen[next(iter(self._seen))]
            body()
            return
        del self._seen[(phase, key)]
        kept = [k for k in self._graphs if k[0] == phase]
        if len(kept) >= MAX_GRAPHS_PER_PHASE:
            del self._graphs[kept[0]]
        # the body's host effects happen here, its device work at the replay
        graph = make_graph(body, self.owner.device, self.owner)
        graph.references = self.owner._graph_references()  # what it reads that the owner might drop later
        self._graphs[(phase, key)] = graph
        self.captures += 1
        if not graph.executes_on_capture:
            graph.replay()
