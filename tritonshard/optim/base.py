"""``ShardedOptimizer``: the bucketed, sharded mixed-precision pipeline that every tritonshard optimizer shares.

Where its parts live (one job per file):

* ``base.py`` (here): the communication pipeline: buckets built, gradients flattened at the end of backward,
  reduce-scatters launched (overlapped or not), norms, clipping and loss scaling, ``step()`` ordering the updates
  and the parameter all-gathers, ``attach()``;
* ``bucket.py``: one bucket's storage (param and grad Buffers, fp32 master and state shards);
* ``model_view.py``: keeping the user's model and the master consistent (outside writes, ``param.grad`` as seen by
  torch code, frozen parameters, ``opt.state``); ``model_sync.py``: the hooks and placeholder it relies on;
* ``state_io.py``: ``state_dict()`` / ``load_state_dict()`` in torch.optim's format;
* the update rules: ``adamw.py``, ``sgd.py`` (SGD, Lion), ``muon.py``: hyper-parameters, per-group layout hooks and
  ``_update(bucket, group, grad_scale, found_inf)``, which launches the fused kernels on one bucket's shards.

Ownership and aliasing (world size d, this rank r):

* every trainable parameter is a ``param_dtype`` view into one bucket's param :class:`~tritonshard.Buffer`; the
  model reads its weights from there, and the all-gather at the end of ``step()`` writes them;
* every bucket has a grad Buffer with the same layout; gradients are flattened into it at the end of each
  backward (one launch per source dtype for all buckets; see :meth:`ShardedOptimizer._flush_buckets`), and
  ``param.grad`` is released;
* rank r keeps, per bucket, fp32 shards of ``shard_numel`` elements: the master weights and the optimizer
  state. Master shard element i belongs to buffer element ``r * shard_numel + i``; padding positions hold zero
  and stay zero (zero grad, zero decay target);
* the bf16 grad shard is the grad Buffer's local shard (reduce-scatter output); the bf16 param shard is the param
  Buffer's local shard (the update kernel's ``param_out``, then the all-gather input).

One step (no host-device synchronization anywhere in it)::

    flatten (end of backward) -> reduce-scatter(SUM) -> read-only pass: sum of squares of the average (1/d in
    fp32) + non-finite flag -> one all-reduce of [sum_sq, nonfinite] -> clip coefficient on device -> fused
    update with grad_scale = 1/d x clip x 1/loss scale (skips itself when the flag is set) -> param all-gather

Without ``overlap_comm`` no launch or collective is per bucket: every bucket's gradients are flattened by one
launch (per source dtype and accumulate mode), reduced in one coalesced reduce-scatter call, read by one norm-pass
launch, each param group's buckets are updated by one segmented launch (the update kernels' MULTI mode), and every
bucket is gathered in one coalesced all-gather call. With it, what the overlap needs is per bucket and the rest is
not: each bucket's flatten and reduce-scatter as backward completes it, its all-gather in the next forward's order;
the norm pass and the updates are the same launches as without it.
After the first steps a step allocates no device memory (but the norm it returns to the user) and copies nothing
from the host: every per-step value lives in a tensor made once, written in place. So with ``cuda_graph=True`` the
device work of a step's two phases (:meth:`ShardedOptimizer._reduce_phase`, :meth:`ShardedOptimizer._update_phase`)
is captured once and replayed, the host-side checks, handshakes and the lr written around them (``graphs.py``).

The grad shard keeps the SUM over ranks after the reduce-scatter: the average is applied in fp32 inside the update,
so a gradient is rounded to bf16 once (by the flatten, plus the reduction's own adds) and never again.

Communication overlap (``overlap_comm=True``): each parameter's post-accumulate-grad hook marks it ready; when the
last gradient of a bucket arrives in the last backward of an accumulation (outside ``no_sync()``), the bucket is
flattened and its reduce-scatter launched asynchronously, while backward goes on computing earlier layers.
Launches follow bucket order on every rank (a bucket that is ready early waits for the ones before it), and a bucket
whose parameters got no gradient is still reduced at the end of backward, so all ranks issue the same collectives
in the same order. ``step()`` waits for each reduce-scatter only when it scales that bucket. After the update, the
param all-gathers are launched asynchronously too; with :meth:`ShardedOptimizer.attach` a forward pre-hook on each
module waits only for the buckets holding that module's parameters. Where a completed bucket launches nothing (the
backwards inside ``no_sync()``), the completed buckets are flushed ``FLUSH_TOGETHER`` at a time
(:meth:`ShardedOptimizer._flush_completed`).

A shard group of one rank (one GPU, or no process group) issues no collective: its reduce-scatter and all-gather are
the identity (the local shard is the whole buffer); each bucket's handle is a completed one, so everything that waits
for a gather behaves as on more ranks. There ``overlap_comm`` has nothing to overlap, and its machinery (the hooks
per parameter and per module, the flushes per bucket, the gathers left in flight) is left out: the backward
flattens every bucket at its end, under ``overlap_comm``'s rules (``_overlap_machinery``).

Streams (CUDA), the rules:

1. The flatten, norm and update kernels run on the current stream. A collective launched with ``async_op=True``
   is enqueued by ProcessGroupNCCL on its own communication stream behind an event recorded on the current stream,
   so it sees the finished flatten (or update); ``work.wait()`` makes the current stream wait for it without
   blocking the host.
2. A bucket's grad buffer belongs to the communication stream from its reduce-scatter launch until the wait in
   ``step()``; its param buffer from the all-gather launch until the wait in the forward pre-hook (or in
   ``step()``, ``state_dict()``, checkpoint saves). The buffers are allocated once and never freed.
3. ``step()`` records an event on its stream after the last kernel that reads the grad shards; the first flatten
   of the next backward makes its own stream wait for it, so a backward on another stream (autograd runs a node on
   the stream its forward op used) cannot overwrite a shard an update is still reading.
4. A gradient is taken to belong to the stream current where autograd handed it over, in its post-accumulate-grad
   hook (the stream of the parameter's AccumulateGrad node, which the forward's use of the parameter chose), as
   DDP's reducer and FSDP2 take it; a gradient set by hand, to the stream of the call that flushes it, as
   torch.optim takes it. The hook notes that stream (one C call per gradient; the Stream object only when it is
   new). A flush on the same stream needs nothing: the caching allocator reuses the memory of a gradient freed
   after the flatten was enqueued only for work enqueued after it on that stream. A flush on another stream (the
   end-of-backward flush runs on the stream that called backward(); overlap_comm's on the last gradient's) first
   waits for every noted stream, then makes each of them wait for an event recorded after the flatten, before
   ``param.grad`` lets the gradients go: one action per stream and flush, not a ``record_stream`` per gradient
   (issue 20.4).

On a CPU none of this applies (every op completes in order); the rules are exercised by ``benchmarks.sync_check``
and ``gpu_check.sh`` on a GPU.

Buckets: filled in reverse registration order (the order backward produces gradients), at most
``bucket_cap_mb`` of ``param_dtype`` each, never mixing param groups. Frozen parameters (requires_grad=False)
are left out entirely: they keep their storage and dtype and are never updated.
"""

from __future__ import annotations

import ast
import collections.abc
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import math
import operator
import sys
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.optim.optimizer as _optim_hooks  # (the global step hooks: profile_hook_step)

from .. import comm
from ..buffer import COMPLETED, DEFAULT_ALIGN
from .. import kernels as _eager_kernels
from ..kernels import _launch
from ..kernels import ops as _op_kernels
from ..kernels import scalars as _scalars
from ..kernels._dispatch import compiled_path, triton_kernels_run
from ..kernels.flatten import launch_unchecked as _flatten_unchecked
from ..kernels.scale import (finalize_launch_spec, fold_rows_launch_spec, partials_launch_spec,
                             partials_multi_launch_spec, shared_sum_sq_workspace)
from ._hparams import check_flag
from . import graphs as _graphs
from . import model_sync
from .bucket import HELD_FROZEN, HOLDERS_GONE, POST_HOOKED, _Bucket, set_grad, split_into_buckets, trace as _trace
from .bucket import plain_attrs as _PLAIN_ATTRS
from .model_sync import ShardedGrad, SpentGrad
from .model_view import ModelViewMixin, _names
from .param_steps import ParamStepsMixin
from .state_io import StateDictMixin
from .state_view import StateViewMixin

__all__ = ["ShardedOptimizer", "LossScaleConfig", "split_into_buckets"]

#: every ShardedOptimizer alive: a parameter lives in one optimizer's buffers, so one built later over parameters
#: another still holds takes them over (ShardedOptimizer._take_over)
_LIVE: "weakref.WeakSet[ShardedOptimizer]" = weakref.WeakSet()


@dataclasses.dataclass(kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 parameters, with torch.amp.GradScaler's rules, kept on the device."""

    #: the scale the first backward runs with
    init_scale: float = 2.0 ** 16
    #: multiplies the scale after ``growth_interval`` consecutive steps without inf/NaN
    growth_factor: float = 2.0
    #: multiplies the scale after a step with inf/NaN (that step is skipped)
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    #: the scale never backs off below this (DeepSpeed's and Megatron's default, 1.0). Without a floor, 50
    #: overflowing steps in a row took the scale to 3.6e-12, and every gradient of the clean steps after them
    #: underflowed to zero in fp16: the loss rose while nothing was reported (issue 23)
    min_scale: float = 1.0
    #: step() raises FloatingPointError once this many consecutive steps overflowed with the scale at
    #: ``min_scale``: lowering the scale no longer helps (the model diverged, or the data holds inf/NaN), and a
    #: run that keeps skipping every step must stop loudly, as DeepSpeed's does
    max_overflows_at_min_scale: int = 10

    def __post_init__(self):
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"LossScaleConfig.{name} must be a finite number > 0, got {value!r}")
        # (GradScaler refuses both as well: a backoff factor above 1 grew the scale at every overflow, so every
        # step was skipped, silently, and the floor's check never fired; a growth factor below 1 shrank it on clean
        # steps. 1 for both is a static scale, Megatron's constant loss scale)
        if not self.growth_factor >= 1:
            raise ValueError(f"LossScaleConfig.growth_factor must be >= 1 (the scale grows after clean steps), got "
                             f"{self.growth_factor!r}")
        if not self.backoff_factor <= 1:
            raise ValueError(f"LossScaleConfig.backoff_factor must be <= 1 (the scale backs off after an overflow), "
                             f"got {self.backoff_factor!r}")
        if not self.min_scale <= self.init_scale:
            raise ValueError(f"LossScaleConfig.min_scale ({self.min_scale}) must be <= init_scale ({self.init_scale})")
        for name in ("growth_interval", "max_overflows_at_min_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LossScaleConfig.{name} must be an int >= 1, got {value!r}")


def _shape(p) -> str:
    return f"(shape {tuple(p.shape)})"


def param_name(group: dict, gi: int, j: int, p) -> str:
    """How errors name parameter ``j`` of param group ``gi``: its ``param_names`` entry when the group has one
    (``attach()`` later names parameters by their names in the model)."""
    names = group.get("param_names")
    given = names[j] if names is not None else None
    return repr(given) if given else f"param_groups[{gi}]['params'][{j}] {_shape(p)}"


_UNORDERED = ("a set's order differs between processes, and the order lays out the flat buffers, which must be "
              "the same on every rank and in the run a checkpoint resumes; pass a list (model.parameters(), or "
              "sorted by name)")


def param_list(params) -> list:
    """``params`` as every ShardedOptimizer's constructor takes it (parameters, (name, parameter) pairs or param
    groups), as a list, with torch.optim's checks made before anything iterates it (a subclass that reads the
    groups before ShardedOptimizer does calls this first: until session 49 ShardedSGD and ShardedMuon iterated a
    tensor's rows, a string's letters, and took a set, whose order differs between processes)."""
    if isinstance(params, torch.Tensor):  # (list() would iterate its rows, and fail as "non-leaf" tensors)
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but "
                        f"got a {torch.typename(params)} (pass [param] for one parameter)")
    if isinstance(params, (str, bytes, dict)):  # (list() would iterate its letters, or a dict's keys)
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but "
                        f"got a {type(params).__name__}" + (" (pass [group] for one param group)"
                                                             if isinstance(params, dict) else ""))
    if isinstance(params, (set, frozenset)):  # (torch.optim takes one here and orders it per process)
        raise TypeError(f"params is a set: {_UNORDERED}")
    return list(params)


def group_param_list(params, gi: int) -> list:
    """A param group's ``params`` as a list (a tensor: a list of it), a set refused as in :func:`param_list`."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (set, frozenset)):  # (torch.optim refuses one too, but after a list() made it a list)
        raise TypeError(f"param_groups[{gi}]['params'] is a set: {_UNORDERED}")
    return list(params)


def _reject_duplicates(params: list) -> None:
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    for gi, group in enumerate(groups):  # as torch.optim does, in place: a generator ({"params":
        # model.parameters()}) becomes a list once, here, before anything reads it (reading it here first left
        # torch.optim an empty group)
        if isinstance(group, dict) and "params" in group and not isinstance(group["params"], torch.Tensor):
            group["params"] = group_param_list(group["params"], gi)
    seen = set()
    for gi, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            continue  # (torch.optim names it)
        ps = group["params"]
        for p in ([ps] if isinstance(ps, torch.Tensor) else list(ps)):
            if isinstance(p, tuple) and len(p) == 2:  # (named parameters: torch.optim takes (name, tensor) pairs)
                p = p[1]
            if not isinstance(p, torch.Tensor):  # (torch.optim's message; until session 49 a repeated one, the
                # letters of params="weights" among them, raised an AttributeError here)
                raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)} "
                                f"(param_groups[{gi}])")
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is passed twice (param_groups[{gi}])")
            seen.add(id(p))


_LAYOUT_HINT = {"parameters": "every rank must pass the same parameters in the same order (shapes, dtypes, names "
                              "where given, which train): the order lays out the buffers, and a rank whose order "
                              "differs would sum one parameter's gradients into another's"}


def _layout_digest(groups: list) -> str:
    """The parameters in the order the buffers lay them out, compared across ranks at construction: per group,
    each one's name where the group has ``param_names``, shape, dtype and whether it trains, as a count and a
    digest. (Parameters of one shape in another order, without names, look the same: a set is refused for that.)"""
    items = []
    for gi, g in enumerate(groups):
        names = g.get("param_names") or [None] * len(g["params"])
        items += [(gi, name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in zip(names, g["params"])]
    return f"{len(items)} tensors, {hashlib.blake2b(repr(items).encode(), digest_size=8).hexdigest()}"


def _scale_in_place(grad_scale, factor, buf: torch.Tensor, op):
    """``grad_scale * factor`` or ``grad_scale / factor`` (``op``: torch.mul or torch.div) with the ops Python's
    operators run, into ``buf`` when the result is a tensor: ``grad_scale`` is ``buf`` already, or a number and
    ``factor`` a tensor (``number / t`` is ``t.reciprocal() * number`` in torch, ``number * t`` is
    ``t.mul(number)``), or both numbers (Python arithmetic, as before)."""
    if isinstance(grad_scale, torch.Tensor):
        return op(grad_scale, factor, out=buf)
    if isinstance(factor, torch.Tensor):
        if op is torch.div:
            return torch.reciprocal(factor, out=buf).mul_(grad_scale)
        return torch.mul(factor, grad_scale, out=buf)
    return grad_scale / factor if op is torch.div else grad_scale * factor


def _same_spec_but_floats(a: tuple, b: tuple) -> bool:
    """Two launch specs (kernel, grid, args, kwargs) launch the same kernel on the same tensors with the same other
    scalars: tensors by identity, the rest by value, but floats, which may differ (a bound launch takes them anew:
    kernels/_launch.py)."""
    return a[0] is b[0] and a[1] == b[1] and a[3] == b[3] and _launch._same_but_live(a[2], b[2])


def kernels():
    """The kernel entry points for this call: the launchers in eager mode; under ``torch.compile`` the same kernels
    as ``torch.library`` custom ops, which dynamo records as single nodes instead of tracing the launchers."""
    return _op_kernels if torch.compiler.is_compiling() else _eager_kernels


_GRAD = operator.attrgetter("grad")
#: torch.is_grad_enabled without the module attribute look-up (~30 ns less; read per parameter in a backward's
#: pre-hooks: a backward with create_graph=True runs them in grad mode)
_grad_enabled = torch._C.is_grad_enabled
_FLAT_SOURCES = (torch.bfloat16, torch.float16, torch.float32)  # what kernels.flatten_into reads


def _nothing() -> None:
    """What a replay of step()'s update phase leaves to set on the host: nothing (its all-gathers are waited for
    inside it)."""


class _StepFlags:
    """What a step traced by torch.compile reads and sets of the optimizer's Python state, held outside it: dynamo
    replays a traced step's attribute writes on plain objects after the graph, but drops those on the optimizer
    itself (torch 2.13, a torch.optim.Optimizer subclass; measured: each write was lost). The optimizer's other
    attributes a traced step resets are reset again by the next eager call (zero_grad(); see _finish_compiled_step)."""

    def __init__(self):
        # whether a step now needs the host's look at the parameters (one could be skipped, or the gradients were
        # reduced before step()), as of the last look (ShardedOptimizer._note_eager_step): a compiled step then runs
        # eagerly (step())
        self.eager_step_needed = True
        # a step traced by torch.compile left its gradients' markers to place (_finish_compiled_step)
        self.compiled_unfinished = False
        # a reduction (a clip, a norm) traced by torch.compile: what it set on the optimizer, which dynamo drops
        # where the step is not in the same graph (ShardedOptimizer._adopt_traced_reduction): (reduced,
        # _next_launch, _reduce_entered, _reduction_started), and the clip's coefficient (None without a clip)
        self.traced_reduction = False
        self.traced_state: Optional[tuple] = None
        self.traced_clip_coef: Optional[torch.Tensor] = None
        # fp32 values noted for the weights, or in-place calls on them to run on their fp32 values (_Bucket.precise,
        # _Bucket.calls), wait for a step's look: the looks until then look at the buckets holding them
        self.precise_notes = False


def _step_eagerly(opt, closure):
    """A step that torch.compile reached, run eagerly (see ShardedOptimizer._note_eager_step); called as the
    ``torch.compiler.disable`` of it in :data:`_EAGERLY`."""
    with torch.no_grad():
        return opt._run_step(closure)


def _clip_eagerly(opt, max_norm, norm_type):
    """opt.clip_grad_norm_ reached by torch.compile where the step will run eagerly: eagerly too, or its results
    (the optimizer's attributes, which dynamo drops) would not reach that step."""
    return opt._clip_grad_norm(max_norm, norm_type)


def _zero_grad_eagerly(opt, set_to_none):
    """opt.zero_grad() reached by torch.compile (torch.compile of a function that steps and zeroes): eagerly. Until
    session 24 dynamo failed on it (InternalTorchDynamoError: it wrapped the placeholder gradients)."""
    return opt._zero_grad(set_to_none)


def _norm_eagerly(opt):
    """opt.grad_norm() reached by torch.compile where the step will run eagerly: eagerly too (see _clip_eagerly)."""
    return opt._grad_norm()


#: {(name, why): fn under torch.compiler.disable} for name "step", "clip", "norm", "zero_grad" (_step_eagerly, ...),
#: why a key of _EAGER_REASONS (dynamo's error under fullgraph=True says it), made by the first optimizer's
#: construction (which imports torch._dynamo anyway, through torch.optim's add_param_group); made at import it would
#: import torch._dynamo before the loop's init_process_group (tests/test_teardown.py)
_EAGERLY: dict = {}
_EAGER_REASONS = {
    "here": "tritonshard: this optimizer step looks at the parameters on the host and runs eagerly: some have no "
            "gradient (torch.optim skips them; so does this step), gradients were set or cleared by hand, the "
            "weights or opt.state were written, or the gradients were reduced before step() (torch's or the "
            "optimizer's clip, GradScaler.unscale_). Under fullgraph=True give every parameter a gradient (loss + "
            "0 * p.sum()), clip inside the compiled function (opt.clip_grad_norm_), or call step() outside it",
    "ranks": "tritonshard: on more than one rank an optimizer step (and opt.clip_grad_norm_, opt.grad_norm()) runs "
             "eagerly under torch.compile: its handshakes (which parameters have a gradient on some rank, the ranks' "
             "hyper-parameters, the collectives' order) and its collectives are host code. Under fullgraph=True "
             "call step() outside the compiled function",
    "grads": "tritonshard: opt.zero_grad() runs eagerly under torch.compile: it looks at each param.grad, which "
             "holds tritonshard's placeholder (dynamo cannot wrap it). Under fullgraph=True call it outside the "
             "compiled function",
    "forward": "tritonshard: an attached model's forward pre-hook runs eagerly under torch.compile where it "
               "broadcasts rank 0's buffers (a collective, as DDP's own runs outside the graph) or looks at a "
               "DistributedDataParallel wrapper's parameters (whose placeholder gradients dynamo cannot wrap)",
}


def _run_backward_hooks_eagerly() -> None:
    """Never let dynamo compile the code autograd calls back into during a backward (the gradient hooks, the
    end-of-backward flush), nor anything it calls: a function compiled with torch.compile that calls
    ``loss.backward()`` (the whole iteration compiled) breaks its graph there and runs the backward eagerly, but
    dynamo's frame callback stays on, so on the CPU (where autograd runs the hooks on the calling thread) it
    compiled each hook as a frame of its own, which then took the paths meant for a traced step (the flush left
    no placeholders): that iteration gave other weights than eager, silently, until session 24. The code objects
    are marked to be skipped, recursively (dynamo's frame-execution strategy; no cost per call, where a
    ``torch.compiler.disable`` wrapper costs ~0.3 us per hook). Under compiled autograd the hooks are traced by
    other means, untouched by this. Without that API (an older torch) the hooks are compiled as before."""
    try:  # (a private API, as in torch 2.13; another torch without it: the hooks are compiled as before)
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
        for fn in (model_sync.GradReadyHook.__call__, model_sync.ClearPlaceholderHook.__call__,
                   model_sync.OutputGradHook.__call__, ShardedOptimizer._end_of_backward):
            set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except (ImportError, AttributeError, TypeError):
        return


def _let_dynamo_write_our_attributes() -> None:
    """Let a step traced by torch.compile set attributes on a ShardedOptimizer, as torch 2.12 and later let it for
    any ``torch.optim.Optimizer``. Dynamo wraps an optimizer it meets as an ``OptimizerVariable``; torch 2.11 builds
    that without a mutation type, so the first attribute the traced step sets (``self._final_look = True``) fails
    dynamo's assertion "Attempted setattr on a user-defined object that does not have an AttributeMutation
    mutation_type" (pytorch/pytorch#171590), with or without ``fullgraph``: every compiled step and clip failed on
    the GPU machine's torch, while torch.optim's own optimizers, which set no attribute in ``step()``, compile
    there. torch 2.12's builder and later ones pass ``AttributeMutationExisting()`` (an object that existed before
    tracing, its writes replayed after the graph); this passes the same where the builder passed none, for our
    optimizers alone. A torch that passes one is left as it is; one without these classes, untouched."""
    try:  # (private API: the classes as in torch 2.11-2.14)
        from torch._dynamo.variables.base import AttributeMutationExisting
        from torch._dynamo.variables.optimizer import OptimizerVariable
    except ImportError:
        return
    built = OptimizerVariable.__init__
    if getattr(built, "_tritonshard_existing", False):
        return

    @functools.wraps(built)
    def __init__(self, value, *args, **kwargs):
        if (isinstance(value, ShardedOptimizer) and kwargs.get("source") is not None
                and kwargs.get("mutation_type") is None):
            kwargs["mutation_type"] = AttributeMutationExisting()
        built(self, value, *args, **kwargs)

    __init__._tritonshard_existing = True
    OptimizerVariable.__init__ = __init__


#: overlap_comm: completed buckets flushed together where none is launched at its completion (_flush_completed)
FLUSH_TOGETHER = 4

#: overlap_comm's per-bucket machinery also where there is nothing to overlap (one rank): for tests that exercise it
#: in one process (see ShardedOptimizer._overlap_machinery); never set in training
OVERLAP_MACHINERY_ON_ONE_RANK = False


@contextlib.contextmanager
def overlap_machinery_on_one_rank(on: bool = True):
    """Optimizers built inside run ``overlap_comm``'s machinery of many ranks also on one rank
    (:data:`OVERLAP_MACHINERY_ON_ONE_RANK`, read at construction): for the tests and benchmarks of that machinery
    in one process. Not for training: on one rank it only costs host time."""
    global OVERLAP_MACHINERY_ON_ONE_RANK
    before, OVERLAP_MACHINERY_ON_ONE_RANK = OVERLAP_MACHINERY_ON_ONE_RANK, bool(on)
    try:
        yield
    finally:
        OVERLAP_MACHINERY_ON_ONE_RANK = before


class ShardedOptimizer(ModelViewMixin, ParamStepsMixin, StateDictMixin, StateViewMixin, torch.optim.Optimizer):
    """Base class: buckets, gradient flattening, reduce-scatter, norm and clipping, all-gather.

    Subclasses define ``_state_names`` and ``_update(bucket, group, grad_scale, found_inf)``, and, where the update
    reads the step count, ``_update_slice`` (a parameter counting steps of its own: param_steps.py), or
    ``_reads_step`` False where it does not; an optimizer whose groups differ in kind (ShardedMuon) also overrides
    the per-group hooks ``_group_state_names``, ``_group_bucket_cap``, ``_group_owners`` and ``_group_keeps_step``.

    Args:
        params: parameters or param groups, as for any ``torch.optim.Optimizer``.
        defaults: default hyper-parameters of the groups.
        replica_group: hybrid sharding: the group of ranks holding the same shard (e.g. the same local rank on
            every node). Gradients are reduce-scattered in ``process_group`` (the shard group), then the shard is
            all-reduced over ``replica_group``; parameters are all-gathered in the shard group only.
        device_mesh: instead of the two groups, a 2-D DeviceMesh whose dims are (replicate, shard).
        process_group: the data-parallel group (None: the default group, or a single process when
            torch.distributed is not initialized).
        param_dtype: dtype of the model's parameters from now on (bf16, or fp16 with loss scaling).
        store_param_remainders: keep the fp32 master as the bf16 weight plus an int16 remainder (bf16 only).
        state_dtype: dtype of the optimizer state shards (fp32, or bf16 to halve them).
        state_rounding: how bf16 states are rounded: "stochastic" (unbiased; the default) or "nearest".
        loss_scale: dynamic loss scaling (:class:`LossScaleConfig`); on by default for fp16. Multiply the loss by
            ``opt.loss_scale`` (or use ``opt.scale_loss(loss)``) before backward; the unscale is folded into the
            update's ``grad_scale``, an overflow skips the step and backs off, all without a host sync. ``False``:
            off, also for fp16 (to use ``torch.amp.GradScaler`` instead: its recipe, ``unscale_`` included, works
            on every optimizer here, as on torch's fused ones).
        grad_dtype: dtype of the gradient buffers (bf16 or fp32).
        bucket_cap_mb: at most this many MiB of ``param_dtype`` per bucket (a larger parameter gets its own).
        ordered_reduce: sum the ranks' gradients in rank order, rounding after every add, instead of in the order
            the reduce-scatter chooses (gloo's and NCCL's rings start each chunk at a different rank, so an
            element's order follows the shard it lands in, which follows ``bucket_cap_mb``). Then results are bit
            for bit the same for every bucket size and match the single-process reference at every world size.
            Costs: the reduce-scatter becomes an all-to-all (the same bytes on the wire) whose (d, shard) output
            is added by the norm pass (+2 B/param read per step), into two scratch buffers of the largest bucket.
            Off by default until a GPU run measures it. With 1 or 2 ranks the collective is already exact (one
            correctly rounded add): this changes nothing there.
        align: view alignment inside buckets, in elements (see :data:`tritonshard.buffer.DEFAULT_ALIGN`).
        check_collectives: shake hands before every collective entry point (:class:`tritonshard.comm.EntryCheck`),
            so ranks in different calls get a CollectiveMismatchError instead of a hang. Costs two 40-byte gloo
            all-gathers per step with more than one rank; False saves them (every rank must pass the same), and
            then a parameter without a gradient on every rank is updated with zeros instead of skipped (the
            handshake is how the ranks agree on it; see ``_without_grad_everywhere``).
        init_sync: start every rank from rank 0's weights, as ``DistributedDataParallel`` does at construction
            (its ``init_sync``): the parameters given (trainable and frozen, on the optimizer's device; also those
            of a group added later) are broadcast before the fp32 masters are taken from them, and the model's
            buffers at ``attach``. A loop that seeds each rank differently before building the model (nanoGPT's
            ``torch.manual_seed(1337 + rank)``) relies on DDP for this; without it, each rank would take its
            shard's master from its own initialization and the model would be stitched together from all of them.
            Costs one broadcast of the parameters, in their dtype, at construction; False skips it where every rank
            holds the same weights already (every rank must pass the same).
        foreach, fused, capturable: torch.optim's implementation switches, accepted so that a torch.optim call site
            (``AdamW(params, lr=..., fused=True)``) runs unchanged, and without effect: the update here is one fused
            kernel launch per group whatever they say, and its results do not depend on them (as torch.optim's do
            not); a step that CUDA graphs capture is ``cuda_graph=True``. ``differentiable=True`` is a ValueError.
        cuda_graph: capture a steady step's device work in CUDA graphs and replay them (see
            :mod:`tritonshard.optim.graphs`: what is captured, what stays eager, when a step is not captured).
            Needs CUDA parameters, the compiled kernels, NCCL with more than one rank, ``overlap_comm=False``,
            ``ordered_reduce=False``, no replica group, and an update rule with a single-launch form (ShardedAdamW,
            ShardedSGD, ShardedLion). Same results bit for bit; the host time of a step drops to the handshakes,
            the checks and two graph launches.
    """

    _state_names: tuple[str, ...] = ()
    #: torch.amp.GradScaler's protocol for optimizers that unscale inside their step, as torch's fused ones do: the
    #: scaler's inf check runs on our placeholders (the reduced gradients' non-finite flag), ``unscale_``'s inverse
    #: scale is folded into the update's grad_scale, and ``scaler.step`` sets ``grad_scale`` / ``found_inf`` on the
    #: optimizer for the duration of ``step()``, which folds in the first and skips on the second, on the device
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults: dict, *, process_group: Optional[dist.ProcessGroup] = None,
                 replica_group: Optional[dist.ProcessGroup] = None, device_mesh=None,
                 param_dtype: torch.dtype = torch.bfloat16, grad_dtype: torch.dtype = torch.bfloat16,
                 bucket_cap_mb: float = 25.0, align: int = DEFAULT_ALIGN, overlap_comm: bool = False,
                 loss_scale: Optional[LossScaleConfig] = None, store_param_remainders: bool = False,
                 state_dtype: torch.dtype = torch.float32, state_rounding: str = "stochastic",
                 ordered_reduce: bool = False, check_collectives: bool = True, cuda_graph: bool = False,
                 init_sync: bool = True, foreach: Optional[bool] = None, fused: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False):
        if differentiable:
            raise ValueError(f"differentiable=True: {type(self).__name__}'s step is not differentiable (it updates "
                             "its buffers in place, outside autograd); use torch.optim for a differentiable step")
        del foreach, fused, capturable  # torch.optim's implementation switches (see the docstring)
        for name, flag in (("overlap_comm", overlap_comm), ("ordered_reduce", ordered_reduce),
                           ("store_param_remainders", store_param_remainders), ("cuda_graph", cuda_graph),
                           ("check_collectives", check_collectives), ("init_sync", init_sync)):
            # (until session 49 overlap_comm and store_param_remainders took any value's truth: the string "False"
            # of a config file switched overlap_comm on)
            check_flag(name, flag, "")
        if device_mesh is not None and (process_group is not None or replica_group is not None):
            raise ValueError("pass either device_mesh or process_group/replica_group, not both")
        for name, group in (("process_group", process_group), ("replica_group", replica_group)):
            if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):  # (until
                # session 49 an AttributeError on .size())
                raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        if device_mesh is not None:
            from torch.distributed.device_mesh import DeviceMesh
            if not isinstance(device_mesh, DeviceMesh):
                raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got "
                                f"{type(device_mesh).__name__}")
        if param_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype must be torch.bfloat16 or torch.float16, got {param_dtype}")
        if store_param_remainders and param_dtype != torch.bfloat16:
            raise ValueError("store_param_remainders=True needs param_dtype=torch.bfloat16 (the master's high half)")
        self.store_param_remainders = store_param_remainders
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        if state_rounding not in ("stochastic", "nearest"):
            raise ValueError(f"state_rounding must be 'stochastic' or 'nearest', got {state_rounding!r}")
        self.state_dtype, self.state_rounding = state_dtype, state_rounding
        if loss_scale is not None and loss_scale is not False and not isinstance(loss_scale, LossScaleConfig):
            raise TypeError(f"loss_scale must be a LossScaleConfig, None (the default: on for fp16 weights) or False "
                            f"(off), got {type(loss_scale).__name__}")
        if grad_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"grad_dtype must be torch.bfloat16 or torch.float32, got {grad_dtype}")
        if (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0
                or not math.isfinite(bucket_cap_mb)):
            raise ValueError(f"bucket_cap_mb must be a finite number > 0, got {bucket_cap_mb!r}")
        params = param_list(params)
        _reject_duplicates(params)  # before torch.optim, which only warns about duplicates
        super().__init__(params, defaults)
        if not _EAGERLY:
            _run_backward_hooks_eagerly()
            _let_dynamo_write_our_attributes()
            _EAGERLY.update(((name, why), torch.compiler.disable(fn, reason=_EAGER_REASONS[why]))
                            for name, fn, whys in (("step", _step_eagerly, ("here", "ranks")),
                                                   ("clip", _clip_eagerly, ("here", "ranks")),
                                                   ("norm", _norm_eagerly, ("here", "ranks")),
                                                   ("zero_grad", _zero_grad_eagerly, ("grads",)))
                            for why in whys)
            # (unbound: a bound method kept in the optimizer made a reference cycle, so `del opt` left it, its hooks
            # and a DDP wrapper's reduction switched off alive until the garbage collector ran, on each rank when
            # it did: until session 28)
            _EAGERLY.update(((name, "forward"), torch.compiler.disable(fn, reason=_EAGER_REASONS["forward"]))
                            for name, fn in (("buffers", ShardedOptimizer._broadcast_model_buffers),
                                             ("ddp_forward", ShardedOptimizer._on_ddp_forward)))
        self._init_state_view()
        self._check_params()

        if device_mesh is not None:
            if device_mesh.ndim != 2:
                raise ValueError(f"device_mesh must be 2-D (replicate, shard), got {device_mesh.ndim} dims")
            replica_group, process_group = device_mesh.get_group(0), device_mesh.get_group(1)
        self.process_group = process_group
        self.world_size = comm.group_size(process_group)
        self.rank = comm.group_rank(process_group)
        self.replica_group = replica_group
        self.replica_size = comm.group_size(replica_group) if replica_group is not None else 1
        self.replica_rank = comm.group_rank(replica_group) if replica_group is not None else 0
        # (a step compiled by torch.compile runs eagerly then: see _eager_when_compiled)
        self._many_ranks = comm.is_initialized() and self.world_size * self.replica_size > 1
        # every option that changes the collectives (their dtypes, kinds, order or count) must agree across ranks,
        # checked before any collective depends on it: a different overlap_comm hung, a different grad_dtype
        # aborted gloo (issue 23)
        self._check_options_agree({
            "optimizer": type(self).__name__, "overlap_comm": overlap_comm, "grad_dtype": str(grad_dtype),
            "param_dtype": str(param_dtype), "ordered_reduce": ordered_reduce, "state_dtype": str(state_dtype),
            "store_param_remainders": self.store_param_remainders, "loss_scale": loss_scale is not None and loss_scale is not False,
            "check_collectives": check_collectives, "cuda_graph": cuda_graph, "init_sync": init_sync,
            "bucket_cap_mb": float(bucket_cap_mb), "align": align, "replica_size": self.replica_size,
            "param_groups": len(self.param_groups),
            "trainable_params": sum(p.requires_grad for g in self.param_groups for p in g["params"]),
            "parameters": _layout_digest(self.param_groups)}, hints=_LAYOUT_HINT)
        # the handshake at every entry point that runs collectives (comm.EntryCheck): ranks in different calls get
        # a CollectiveMismatchError on every rank instead of a hang or gloo's "Received data size doesn't match"
        self._entry = comm.EntryCheck([(self.process_group, self.world_size), (self.replica_group, self.replica_size)]
                                      if check_collectives else [])
        #: gradients are averaged over every data-parallel rank (shard group x replicas); the shards hold the SUM
        self._grad_average = 1.0 / (self.world_size * self.replica_size)
        self.param_dtype, self.grad_dtype = param_dtype, grad_dtype
        self.bucket_cap_mb = bucket_cap_mb
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self.device = trainable[0].device if trainable else torch.device("cpu")

        self._align = align
        self._retired_by: Optional[str] = None  # what took this optimizer's parameters over (_take_over)
        self._settings_cache = None  # the last step's hyper-parameters and their digest (_step_settings)
        # dynamic loss scaling: on by default for fp16 weights, whose gradients underflow without it
        if loss_scale is None and param_dtype == torch.float16:
            loss_scale = LossScaleConfig()
        elif loss_scale is False:  # off, also for fp16 weights (e.g. to use torch.amp.GradScaler instead)
            loss_scale = None
        self.loss_scale_config = loss_scale
        held = _held_grads(trainable)  # (laying the parameters out drops them; torch.optim's first step uses them)
        plain = [p for p, g in held if not isinstance(g, ShardedGrad)]  # (zeros and spent markers need no scale)
        if plain and loss_scale is not None:
            raise ValueError(
                f"{len(plain)} parameters hold gradients from a backward run before this {type(self).__name__} "
                "existed, and it scales the loss itself (fp16 weights, or loss_scale given): those gradients were "
                "not multiplied by its loss scale, so its first step would divide them by it. Zero them first "
                "(model.zero_grad()), or build the optimizer before the first backward")
        self._take_over(self._holders([p for g in self.param_groups for p in g["params"]]))
        self._init_sync = init_sync
        self._sync_initial_weights([p for g in self.param_groups for p in g["params"]])
        self._flags = _StepFlags()  # (before the buckets, which refer to it)
        self.buckets: list[_Bucket] = []
        for gi in range(len(self.param_groups)):
            self.buckets += self._lay_out_group(gi)
        # step counters (b.step): one per param group, shared by its buckets and by every parameter that took each
        # of the group's steps (one increment per counter and step, and coefficients computed once per counter:
        # _once_per_step); buckets laid out later for parameters unfrozen after construction share one of their own
        # (_adopt_unfrozen). _step_units lists the buckets of each counter (_set_gather_order)
        self._own_steps: dict = {}  # ... and one per parameter whose count left its bucket's (param_steps.py)
        self._own_plan: list = []
        # what the step-flags launch advances where no counter counts the step (a table needs an address)
        self._idle_counter = torch.zeros((), dtype=torch.float32, device=self.device)
        self._step_cache: dict = {}  # per-step values shared by a group's buckets; cleared by _reset_step_state
        # fp64 [sum_sq, non-finite]: all-reduced in fp64, so the per-rank sums' grouping (the layout) cannot show
        self._norm_totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.ordered_reduce = ordered_reduce
        if ordered_reduce and self.replica_size > 2:
            raise ValueError(f"ordered_reduce=True with a replica group of {self.replica_size} ranks is not supported "
                             "(the replicas' all-reduce would still add in the ring's order); use at most 2 replicas")
        self._scratch: list = []
        self._scratch_user: list = [None, None]  # the bucket whose all-to-all output a scratch holds
        self.overlap_comm = overlap_comm  # (a bool: checked first thing)
        self._launch_order: list[int] = []  # (filled by _index_buckets, which says how)
        self._next_launch = 0  # _launch_order[:_next_launch] have their reduce-scatter launched this step
        self._defer_gathers = False  # attach() with overlap_comm: all-gathers are waited for in the next forward
        #: reduce-scatters launched so far (observable: lets a trace or test see them start during backward)
        self.reduce_scatters_launched = 0

        self._scale = (torch.full((), float(loss_scale.init_scale), dtype=torch.float32, device=self.device)
                       if loss_scale is not None else None)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=self.device)
        # consecutive overflowing steps with the scale at its floor; read by the host one step late (no sync)
        self._overflows_at_min = torch.zeros((), dtype=torch.int32, device=self.device)
        self._overflows_at_min_host = (torch.zeros((), dtype=torch.int32).pin_memory()
                                       if self.device.type == "cuda" else None)
        self._overflows_at_min_event = None

        # device-side bookkeeping: nothing here is ever read on the host inside step()
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.last_step_skipped = torch.zeros((), dtype=torch.bool, device=self.device)
        self._reduced: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (global sum_sq, found_inf) this step
        # a reduction before step() (a clip, a norm, GradScaler.unscale_): step() looks at param.grad again
        # (_check_grads_since_reduction)
        self._reduced_early = False
        self._prepared_state = None  # (param versions, state dict) from prepare_state_dict(), until step()/loads
        self._final_look = False  # step()'s look at the model (sync_from_model): fp32 notes are taken whole there
        self._look_for_trainer = self.world_size * self.replica_size > 1
        self._clip_coef: Optional[torch.Tensor] = None
        self._no_sync_depth = 0
        self._flush_queued = False
        self._grads_this_backward = False
        self._grads_consumed_event = None  # CUDA: recorded by step() after the updates (streams, rule 3)
        self._events: dict = {}  # (_step_event's)
        # CUDA: the streams the gradients of this backward were handed over on, noted by the hook (streams, rule 4),
        # raw stream -> Stream
        self._grad_streams: dict = {}
        self._raw_stream = (functools.partial(torch._C._cuda_getCurrentRawStream, self.device.index)
                            if self.device.type == "cuda" else None)
        # The hot path (compiled kernels, eager): every launch is bound once and replayed (kernels/_launch.py), so
        # what changes per step lives in tensors that keep their storage: found_inf, grad_scale and per-group
        # coefficients are copied into these each step (one small op per step, not per bucket)
        self._found_inf_buf = torch.zeros((), dtype=torch.float32, device=self.device)
        self._grad_scale_buf = torch.zeros((), dtype=torch.float32, device=self.device)
        # ... and every other per-step value lives in a tensor of its own, written in place: after the first step a
        # step allocates nothing on the device but what it hands the user (clip_grad_norm_'s norm) and copies
        # nothing from the host (issue 20.6: what capturing the step in a CUDA graph needs;
        # tests/optim/test_steady_state.py)
        scalar = functools.partial(torch.zeros, (), device=self.device)
        # (sum_sq, found_inf): two views of one tensor, which the norm's finalize writes directly where no all-reduce
        # of the fp64 totals comes between (one rank: _reduce_phase)
        self._reduced_pair = torch.zeros(2, dtype=torch.float32, device=self.device)
        self._reduced_bufs = tuple(self._reduced_pair.unbind())
        self._nonfinite_buf = scalar(dtype=torch.bool)
        self._clip_buf = scalar(dtype=torch.float32)
        self._not_skipped_buf = scalar(dtype=torch.float32)
        self._counter_table = None  # (the step counters, their addresses' table): _launch_step_flags
        self._scalar_launches: dict = {}  # its bound launch, the clip coefficient's, the norm totals' rounding
        self._found_long_buf = scalar(dtype=torch.int64)
        self._pinned_buf = scalar(dtype=torch.bool)
        self._persistent: dict = {}
        # collectives straight through comm (no per-call group checks) on the hot path: the Buffers checked the
        # group and the layout across ranks when they were built
        self._direct_collectives = comm.is_initialized() and self.world_size > 1
        # A shard group of one rank (one GPU under torchrun, or no process group): the reduce-scatter and the
        # all-gather are the identity on the buffers (the local shard is the whole buffer), so none is issued and
        # each bucket's handle is a completed one. Until session 32 a 1-rank NCCL group got every call: on the H200
        # ~50 us of host time each, one reduce-scatter and one all-gather per bucket and step with overlap_comm
        self._solo = self.world_size == 1
        # overlap_comm's machinery runs where a shard group of more than one rank has something to overlap: each
        # bucket flushed as backward completes it and its reduce-scatter launched, the all-gathers left in flight
        # for the next forward, whose modules each wait for their own (a forward pre-hook per module holding
        # parameters, guarded attribute reads). On one rank both collectives are the identity (a replica group's
        # all-reduce runs in step() either way), and the machinery only cost host time: on the H200 the 302M
        # example ran at 1.01-1.08x torch AMP's speed with overlap_comm on one GPU, 1.38-1.44x without (session
        # 32). There the backward flattens every bucket at its end, as without overlap_comm (one launch, one hook
        # per parameter), and step() leaves no gather in flight; overlap_comm's rules stay, so a loop that runs on
        # one GPU runs on many: the end of the last backward launches the reductions, and a gradient arriving
        # after it (a backward outside no_sync()) is the same error
        self._overlap_machinery = self.overlap_comm and (self.world_size > 1 or OVERLAP_MACHINERY_ON_ONE_RANK)
        #: ... straight through the ProcessGroup's methods (comm.reduce_scatter_async: not even torch's wrapper)
        self._pg = comm.group_object(self.process_group) if self._direct_collectives else None
        self._reduce_entered = False  # this step's "reduce" handshake is done (_enter_reduce)
        self._step_entered = False  # ... and its "step" one (_without_grad_everywhere)
        self._reduction_started = False  # this step's reduction ran past its checks (_run_reduction)
        # overlap_comm: a backward's end launched reduce-scatters, and no flush came since (_forget_discarded_launches);
        # a later backward took a placeholder of a launched bucket to accumulate onto it (an error at the flush)
        self._launched_by_backward = False
        self._taken_after_launch = False
        # the placed parameters whose placeholder stands for zeros, not for a backward's gradient (zeroed: by
        # zero_grad(set_to_none=False), or param.grad.zero_(); since the last flush): not the middle of a step
        # (_holds_placed_gradients)
        self._zeroed: dict = {}
        #: parameter -> (its plain gradient, that gradient's version) as ``zero_grad(set_to_none=False)`` zeroed it in
        #: place (one set by hand, not flushed yet): the flush that takes it unchanged marks it ``_zeroed``
        self._zeroed_plain: dict = {}
        # this step: torch code multiplied or clamped param.grad over its own list of gradients (an error at step()
        # if the ranks' lists differ: _without_grad_everywhere), and the parameters without a gradient here that
        # have one on another rank (found by step(); they get a SpentGrad here too, as under DDP)
        self._list_dependent = False
        self._missing_here: list = []
        self._multipliers_folded = 0  # (this step's: how many coefficients torch code multiplied param.grad by)
        # this step: the loop cleared every gradient a reduction before step() held (a clip, a norm, unscale_), so
        # this rank steps none of them; another rank that kept its own would step with the reduction, which holds
        # this rank's (an error at step() on every rank: _without_grad_everywhere)
        self._cleared_after_reduction = False
        # cuda_graph=True: the step's two phases captured and replayed (graphs.py); _lr_filled: each trained
        # group's lr tensor was written for this step before the phase that reads it
        self._graphs = self._make_graphs(cuda_graph)
        self._lr_filled = False

        # ---- the model's view (model_sync.py): names, aliasing and versions, gradient placeholders
        self._param_list: list = []
        self._param_names: dict = {}
        # what step() checks against: the view each parameter must alias, and its version counter (bumped by
        # every in-place write through the parameter, e.g. model.load_state_dict; not by our buffer writes)
        self._param_views: dict = {}
        self._param_ptrs: list = []  # (per parameter, in _param_list's order)
        self._param_versions: list = []
        self._frozen_at_build: list = []
        self._model_params: list = []  # (module, attribute name, parameter), filled by attach()
        self._named_by_model: set = set()
        self._attached: Optional[tuple] = None  # (model, the handles attach() returned), for add_param_group
        self._root_handles = 0  # how many of those handles are the root hooks (the first ones)
        self._attach_options: dict = {}  # (the attach() keyword arguments it was made with)
        self._broadcast_buffers = False  # attach(broadcast_buffers=): rank 0's buffers before every training forward
        # a DistributedDataParallel around the attached model: the one whose forward this backward follows, where
        # its gradients of the parameters no tritonshard optimizer holds are to be averaged as DDP would (its own
        # reduction is off: _before_model_forward); the DDP whose such parameters have our hook, and the handles
        self._ddp_pending = None
        #: (weak ref to the DDP, its parameters no tritonshard optimizer held then, the handles of our hooks on
        #: them, bucket.HOLDERS_GONE then): :meth:`_ddp_unheld`'s cache
        self._ddp_unheld_cache: Optional[tuple] = None
        self._in_ddp_no_sync = False  # its require_backward_grad_sync set False: one level of _no_sync_depth
        # overlap_comm + attach: whether a submodule was set in a guarded module since the last look
        # (model_sync._modules_changed; _hook_new_modules)
        self._new_modules = False
        self._buffer_slots: tuple = (None, [])  # (the attached model, its (module, buffer name) pairs)
        self._buffers_seen: Optional[list] = None  # (tensor, version) of each after the last broadcast
        self._placeholders: dict = {}
        self._placeholder_list: list = []  # (in _param_list's order)
        # a grad dtype wider than the weights' (grad_dtype=torch.float32) and hooks of the loop's on a parameter: the
        # parameters whose next accumulation _show_sum shows the sum to those hooks, the sums shown (what the hooks
        # found, kept until the flush: _settle_shown), and each parameter's ShowSumHook (its handle's id)
        self._sums_to_show: set = set()
        self._sums_shown: dict = {}
        self._show_hooks: dict = {}
        self._param_buckets: list = []  # each parameter's bucket (in _param_list's order)
        # param.grad after step() until cleared (model_sync.SpentGrad): each parameter's marker; whether step() left
        # markers that are not listed yet (the listing, _list_spent, is needed only where the loop did not call
        # opt.zero_grad()); the parameters listed holding theirs; those whose marker a backward replaced (torch.optim
        # would hold the sum of that backward's gradient and the spent one)
        self._spent_grads: dict = {}
        self._spent_unlisted = False
        self._spent: dict = {}
        self._stale: dict = {}
        self._grad_multipliers: dict = {}  # param -> coefficients torch code multiplied its gradient by
        # ... or, where each multiply was of every gradient the optimizer holds (torch's foreach clip over
        # model.parameters(), GradScaler's unscale_), the coefficients in order, once for all (one of the two is
        # empty: model_view._fold_grad_multipliers)
        self._all_multipliers: list = []
        self._reciprocals: dict = {}  # id(divisor) -> (divisor, 1 / divisor) of this step's p.grad.div_(divisor)
        self._norm_cache: dict = {}        # norm_type -> per-parameter global gradient norms of this step
        self._clamped = False  # clip_grad_value_ clamped this step's reduced gradients (the reduction's sum_sq is stale)
        # this step's reduction ran its norm pass over the pieces (_consume_all_reduced): their partials are there
        # for torch's per-parameter norms (_piece_sums_of_squares)
        self._partials_of_pieces = False
        self._state_exposed = False
        self._hooks: list = []
        self._grad_accumulators: list = []  # the parameters' AccumulateGrad nodes, alive with their pre-hooks
        # every structure derived from the buckets (norm workspace, lookups, launch order and plans, the model's
        # view), rebuilt for the new buckets by add_param_group after construction
        self._index_buckets(self.buckets, range(len(self.param_groups)))
        self._note_group_lists(own=True)
        _LIVE.add(self)
        self._restore_grads(held)
        self._adopt_marked()
        # a transformers.Trainer building its optimizer itself (optimizer_cls_and_kwargs) wraps the model in DDP
        # before training, with nothing of the user's in between to attach it: its callback attaches the model at
        # the start of training (and gathers the state before the Trainer's saves)
        self._look_for_trainer_once(last=False)

    # ------------------------------------------------------------------ another optimizer over the same parameters
    def _holders(self, params: list) -> list:
        """The other live optimizers holding some of ``params`` (in their buckets, or frozen in their groups), as
        ``[(optimizer, [its names of those parameters])]``; a RuntimeError if one of them is between a backward and
        its step() (that backward's gradients are in its buffers, on their way to an update that would not come)."""
        ids = {id(p) for p in params}
        found = []
        for other in list(_LIVE):
            if other is self or other._retired_by is not None:
                continue
            held = [p for p in (*other._param_list, *other._frozen_at_build) if id(p) in ids]
            if not held:
                continue
            names = [other._param_names[p] for p in held]
            if other._mid_step():
                raise RuntimeError(
                    f"a {type(self).__name__} over {_names(names)}, which a {type(other).__name__} still holds "
                    "between a backward and its step(): that backward's gradients are in the other's buffers. Build "
                    "the new optimizer after step() or zero_grad()")
            found.append((other, names))
        return found

    def _take_over(self, holders: list) -> None:
        """Retire the optimizers of :meth:`_holders`: a tritonshard parameter is a view of one optimizer's buffer,
        so the optimizer built later over it (replacing the optimizer for a second phase of training, a notebook
        cell run again while a scheduler still holds the old one) trains it, and the older one no longer can.
        Its all-gathers in flight are waited for (they write the parameters' values, which the new optimizer takes
        as its masters), its hooks on the parameters and the model are removed (they would flatten the gradients
        into its buffers), the model's guards stop pointing at it, and from then on every call that would train,
        save or load through it raises (:meth:`_check_not_retired`) instead of reading stale buffers or taking the
        parameters back."""
        for other, names in holders:
            other._retire(f"a {type(self).__name__} built later over the same parameters ({_names(names)}) took "
                          "them over. A tritonshard parameter lives in one optimizer's buffers; use the new "
                          "optimizer (and let go of this one, e.g. an LR scheduler or a list that still refers to it)")

    def _retire(self, why: str) -> None:
        """Stop training: wait for the all-gathers in flight (they write the parameters' values, which whatever
        trains them next takes as its masters), remove the hooks on the parameters and the model (they would
        flatten the gradients into this optimizer's buffers; the AccumulateGrad nodes held for them go too, so a
        parameter given another shape gets a new one), drop the model's guards, and from then on raise ``why``
        from every call that would train, save or load (:meth:`_check_not_retired`)."""
        self.wait_for_params()
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._grad_accumulators = [], []
        if self._attached is not None:
            model, handles = self._attached
            for handle in handles:
                handle.remove()
            around = model_sync.ddp_around(model)  # (a DDP's guard too: its no_sync() and its average)
            for module in [*model.modules(), *([around] if around is not None else [])]:
                guarding = module.__dict__.get("_tritonshard_guarding")
                if guarding:
                    object.__setattr__(module, "_tritonshard_guarding",
                                       tuple((r, i) for r, i in guarding if r() is not self))
            self._attached = None
        self._retired_by = why
        for b in self.buckets:  # (an fp32 copy into a parameter it laid out is kept for the next that does)
            b.retired = True

    def _param_reshaped(self, p: torch.Tensor, shape: torch.Size) -> None:
        """``p.data = t`` with ``t`` of another shape than ``p``'s (Hugging Face's ``resize_token_embeddings``
        writes the resized matrix into the same Parameter this way), called before the assignment: this optimizer
        retires (:meth:`_retire`), and its next step(), state_dict() or load names the parameter and the way that
        works. torch.optim trains on where the parameter has no state yet and fails at the step after otherwise
        (its moments keep the old shape); here the parameter's piece of the flat buffers, its master and its state
        have the old shape from construction on, and the AccumulateGrad node held for its hooks kept the old
        shape, so until session 46 the next backward failed inside autograd ("returned an invalid gradient ...
        expected shape compatible with [128, 64]"), naming neither. An optimizer built after the resize, over
        the model, takes the parameters over and trains the new shape (the old one's hooks are gone)."""
        name = self._param_names[p]
        self._retire(
            f"parameter {name} was given a tensor of shape {tuple(shape)} in place of its {tuple(p.shape)} "
            "(p.data = t, e.g. model.resize_token_embeddings()) after the optimizer was built, and a tritonshard "
            "optimizer lays each parameter out in its flat buffers at its shape then. Build a new optimizer over "
            "the model after the change (or make the change before building this one)")

    def _mid_step(self) -> bool:
        """Between a backward and its step(): that backward's gradients are taken into the buffers (placeholders
        placed, a reduce-scatter launched) or reduced already. (Gradients zeroed since, by either
        zero_grad(set_to_none=False), leave placeholders standing for zeros, which are not in the way; launched
        reductions of gradients the loop cleared since are forgotten first, see _forget_discarded_launches.)"""
        if self._flags.compiled_unfinished:
            self._finish_compiled_step()
        if self._launched_by_backward:  # (reductions of gradients the loop cleared since are not in the way)
            self._forget_discarded_launches(at_flush=False)
        if self._reduced_early:  # (a reduction whose gradients the loop all cleared since: gone)
            self._check_grads_since_reduction("forget")
        if self._reduced is not None or any(b.rs_launched for b in self.buckets):
            return True
        return self._holds_placed_gradients()

    def _holds_placed_gradients(self) -> bool:
        """Whether some ``param.grad`` still holds the placeholder a flush placed there for a backward's (or a
        hand-set) gradient: not cleared since by the loop (``model.zero_grad()``, ``p.grad = None``), nor zeroed
        (``_zeroed``)."""
        placeholders, zeroed = self._placeholders, self._zeroed
        return any(p.grad is placeholders[p] and p not in zeroed for b in self.buckets for p in b.placed)

    def __reduce_ex__(self, protocol):
        """Pickling or copying the optimizer (``torch.save(opt)``, ``copy.deepcopy(opt)``): a TypeError naming the way
        that works. torch.optim's ``__getstate__`` carries its defaults, state and groups only, so until session 27
        the copy was an optimizer without its buffers and hooks: an AttributeError at its first step(), long after.
        (Its state is sharded over the ranks, in buffers the model's parameters are views of.)"""
        raise TypeError(
            f"a {type(self).__name__} cannot be pickled or copied (torch.save(opt), copy.deepcopy(opt), pickle): its "
            "state is this rank's shard, in buffers that the model's parameters are views of. Save its state_dict() "
            "instead (torch.save(opt.state_dict(), path), or tritonshard.checkpoint.save_sharded(opt, path) on "
            "every rank) and load it into an optimizer built over the model (opt.load_state_dict(...))")

    def _check_not_retired(self) -> None:
        if self._retired_by is not None:
            raise RuntimeError(
                f"this {type(self).__name__} no longer trains its parameters: {self._retired_by}")

    # ------------------------------------------------------------------ construction helpers
    def _lay_out_group(self, gi: int, params: Optional[list] = None) -> list[_Bucket]:
        """The buckets of ``params`` of param group ``gi`` (default: its trainable ones), appended to
        ``self.buckets`` by the caller (each bucket's Philox key depends on how many buckets exist before it)."""
        group = self.param_groups[gi]
        cap = max(1, int(self.bucket_cap_mb * 2 ** 20) // torch.empty((), dtype=self.param_dtype).element_size())
        if params is None:
            params = [p for p in group["params"] if p.requires_grad]
        made = []
        for chunk in split_into_buckets(params, self._group_bucket_cap(group, cap)):
            made.append(self._make_bucket(gi, chunk, self._align, len(self.buckets) + len(made)))
        return made

    def _restore_grads(self, held: list) -> None:
        """The gradients of :func:`_held_grads` back, for the next step to use as torch.optim would use the
        ``param.grad`` it finds: a plain one in the parameter's new dtype (autograd requires it; rounded once),
        taken as a gradient set by hand, with its graph where it has one (``backward(create_graph=True)``: a
        penalty on it differentiates through it; until session 40 detached here, where a parameter unfrozen since
        the optimizer was built is laid out at the end of that backward, so the penalty missed every term through
        that gradient, silently: found by tests.optim.loop_fuzz_long); another optimizer's placeholder
        (``zero_grad(set_to_none=False)``, its only meaning between steps) as a gradient of zeros, in this
        optimizer's placeholder; another optimizer's spent marker (its last step() used that gradient, nothing
        cleared it since) as this optimizer's, so that a step or a clip that would apply it again is the same error
        (torch.optim would apply it again)."""
        for p, g in held:
            if type(g) is SpentGrad:
                set_grad(p, self._spent_grads[p])
                self._spent_unlisted = True
            elif isinstance(g, ShardedGrad):
                self._hold_zeros(self._bucket_of[p][0], [p])
            else:
                set_grad(p, (g if g.requires_grad else g.detach()).to(dtype=p.dtype))

    def _add_buckets(self, gi: int, params: list, groups) -> None:
        """New buckets of ``params`` (of param group ``gi``) join the optimizer after construction (``groups``: see
        :meth:`_index_buckets`). A gradient one of them already holds is kept, in bf16, for the next step, as
        torch.optim would use it (laying the buckets out drops it)."""
        held = _held_grads(params)
        new = self._lay_out_group(gi, params)
        self.buckets += new
        self._index_buckets(new, groups)
        self._new_buckets_added(new)
        if self._attached is not None:
            model, handles = self._attached
            handles += self._attach_buckets(model, new)
        self._prepared_state = None
        self._state_exposed = False  # the next step() shows the new parameters' state too (none before, as torch)
        self._restore_grads(held)
        self._flags.eager_step_needed = True  # (new buckets, without gradients yet)

    def _adopt_unfrozen(self) -> None:
        """Parameters that were frozen when the optimizer was built (in its groups, with requires_grad=False) and are
        trainable now, or hold a gradient (set by hand, or left from before they were frozen: torch.optim steps every
        parameter whose ``.grad`` is not None, frozen or not), start to train, as with torch.optim: laid out in new
        buckets of their group, with their fp32 master taken from their current values, zero state and a step count of
        their own from 0 (torch.optim counts from their first step: the new buckets' counter, so the flat update of
        those buckets applies it, one launch per counter as for any group), and any gradient they hold kept for the
        step. Runs at the end of the backward that first gives them a gradient, before anything is reduced (or at the
        next ``step()`` or state_dict, where nothing is reduced yet). A collective: every rank unfreezes the same
        parameters."""
        unfrozen = [p for p in self._frozen_at_build if p.requires_grad or p.grad is not None]
        if not unfrozen:
            return
        if self._reduced_early and not self._many_ranks:
            # (one rank: a reduction none of whose gradients is held any more, each replaced by hand or cleared, is
            # forgotten first, as a flush forgets it, and these parameters are laid out as before any. Not on more
            # ranks: whether it is forgotten is each rank's own, and a rank laying out alone would wait in the
            # layout's handshake for ranks that raise below: every rank raises, where some may have forgotten)
            self._check_grads_since_reduction("forget")
        if self._reduced is not None:  # unfrozen after this step's reduction (clip_grad_norm_ before step())
            with_grad = [p for p in unfrozen if p.grad is not None]
            if not with_grad:
                return  # torch.optim would skip them in this step too (no gradient): taken in at the next backward
            raise RuntimeError(
                f"{_names([self._param_names[p] for p in with_grad])}: frozen when the optimizer was built and "
                "holding a gradient now, but this step's gradients were already reduced (by clip_grad_norm_ or "
                "grad_norm) without it; unfreeze it (or set its gradient) before that reduction, or clear every "
                "gradient first (opt.zero_grad())")
        self._lay_out_frozen(unfrozen, "is trainable now (or holds a gradient)")

    def _adopt_marked(self) -> None:
        """Frozen parameters that hold another optimizer's gradient marker (the optimizer this one took them over
        from: its spent gradient, or its placeholder for the zeros of ``zero_grad(set_to_none=False)``), laid out
        at once, so that the marker becomes this optimizer's as for the trainable parameters (``_restore_grads``):
        torch.optim steps every parameter whose ``.grad`` is not None, frozen or not. Left to
        :meth:`_adopt_unfrozen` (the next backward or step), as a plain gradient is, the marker stayed the old
        optimizer's until then: zeroing it (``model.zero_grad(set_to_none=False)``) raised once that optimizer was
        gone, ``opt.zero_grad(set_to_none=False)`` did not make it zeros, and a step applied a spent gradient
        again where it is an error (found by tests/optim/test_loop_fuzz.py in session 21)."""
        marked = [p for p in self._frozen_at_build if isinstance(p.grad, ShardedGrad)]
        if marked:
            self._lay_out_frozen(marked, "holds a gradient marker of the optimizer it was taken over from")

    def _lay_out_frozen(self, unfrozen: list, why: str) -> None:
        """Parameters frozen when the optimizer was built, laid out now in new buckets of their groups (see
        :meth:`_adopt_unfrozen`; ``why``: what made them needed, for the errors). A collective: every rank lays out
        the same parameters (compared, with a handshake first)."""
        for p in unfrozen:
            if p.device != self.device or not p.is_floating_point():
                raise RuntimeError(f"{self._param_names[p]} was frozen when the optimizer was built and {why}, but "
                                   f"it is a {p.dtype} tensor on {p.device}; the optimizer's buffers are on "
                                   f"{self.device}")
        self._entry("unfreeze")
        names = [self._param_names[p] for p in unfrozen]  # (the same parameters on every rank: new buckets' layout)
        self._check_options_agree(
            {"unfrozen parameters": f"{_names(names)}; {_layout_digest([{'params': unfrozen, 'param_names': names}])}"},
            verb="unfroze parameters of", hints={"unfrozen parameters": "every rank must unfreeze the same parameters "
                                                                        "before the same backward"})
        taken = {id(p) for p in unfrozen}
        self._frozen_at_build = [p for p in self._frozen_at_build if id(p) not in taken]
        group_of = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        by_group: dict = {}
        for p in unfrozen:
            by_group.setdefault(group_of[p], []).append(p)
        for gi, params in by_group.items():  # (their new buckets' counter, from 0, is not the group's: see above)
            self._add_buckets(gi, params, [])
        # State code gave them in opt.state while they were held frozen (kept there, as torch.optim keeps it, and
        # unflagged once a step had passed it by) is state given before their first step now: flagged, so that the
        # next step's _follow_state_edits raises on it before anything changes, where their first exposure would
        # have shown their own state over it unseen (until session 51). A load that lays them out shows the loaded
        # state over it, as torch.optim's load replaces the state.
        state = self.__dict__["state"]
        if isinstance(state, dict) and any(isinstance(entry := dict.get(state, p), dict) and entry for p in unfrozen):
            self._state_edits.seen = True

    def _index_buckets(self, new: list, groups) -> None:
        """Everything derived from ``self.buckets``, once buckets ``new`` are in it: every bucket at construction,
        after it a new group's (:meth:`add_param_group`, ``groups`` its index: names and frozen parameters are read
        from the groups in ``groups``) or unfrozen parameters' (:meth:`_adopt_unfrozen`). Launch plans, fused
        launches and captured graphs that covered the old set of buckets are dropped (rebuilt at the next step)."""
        buckets = self.buckets
        for i, b in enumerate(buckets):
            b.index = i
        first: dict = {}
        for b in new:  # new buckets of one group share a counter, the first one's: a new one, whatever came before
            lead = first.setdefault(b.group_index, b)
            b.step, b.counter_index = lead.step, lead.index  # (the index names the counter in keys: stable, an int)
        # the read-only norm pass: every bucket writes its per-program partials into its slice of one workspace,
        # then one finalize per step adds them all into [sum_sq, non-finite]: no allocation, one launch per bucket
        self._norm_workspace, slices = shared_sum_sq_workspace([b.grad_buffer.shard_numel for b in buckets],
                                                               self.device)
        for b, partials in zip(buckets, slices):
            b.norm_partials = partials
        # ordered_reduce: the all-to-all's (d, shard) outputs, two of them: the third launch in a step first
        # consumes (folds) the bucket that used its scratch two launches before (see _consume_reduced)
        self._ordered = self.ordered_reduce and self.world_size > 2 and bool(buckets)
        largest = max((b.grad_buffer.padded_numel for b in buckets), default=0)
        if self._ordered and (not self._scratch or self._scratch[0].numel() < largest):
            self._scratch = [torch.empty(largest, dtype=self.grad_dtype, device=self.device) for _ in range(2)]
        self._bucket_of = {p: (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._bucket_by_id = {id(p): b for b in buckets for p in b.params}  # (the optimizer keeps p alive)
        # the param-group dicts themselves (LR schedulers and load_state_dict update them in place), reached without
        # going through self.param_groups: under torch.compile that attribute makes dynamo wrap every parameter's
        # .grad, which holds a ShardedGrad placeholder after backward
        self._group_of_bucket = [self.param_groups[b.group_index] for b in buckets]
        #: (index, dict) of the groups with buckets, which step() validates (a group with nothing to train never
        #: reaches a kernel); held here for the same reason as _group_of_bucket
        self._trained_groups = sorted({b.group_index: g for b, g in zip(buckets, self._group_of_bucket)}.items())
        # all-gather (and update) order: the order the forward uses parameters, approximated by their order in the
        # param groups here and by the model's registration order once attach() knows the model
        self._set_gather_order([p for g in self.param_groups for p in g["params"]])
        # reduce-scatters are launched in _launch_order (the same on every rank): bucket order at first, then the
        # order in which buckets completed in the first backward (rank 0's, broadcast), adopted from step 2 on
        # (after add_param_group: observed again in the next backward)
        self._launch_order += [b.index for b in new]
        self._observed_order: Optional[list[int]] = [] if self._overlap_machinery else None
        # Without overlap_comm every bucket is reduced at once, in step() (or clip_grad_norm_), on every rank, and
        # gathered at once after the updates: one coalesced call each instead of one per bucket (issue 20.3: a
        # collective cost ~67 us of host time per bucket on the H200, the reduce-scatter and the all-gather
        # alike). With overlap_comm, buckets are launched as backward completes them (how many at once depends on
        # timing, which differs between ranks: no coalescing there, as gloo pairs calls one to one); ordered_reduce
        # launches all-to-alls into two scratch buffers in turn
        self._coalesce = (not self.overlap_comm and not self._ordered and self._direct_collectives
                          and comm.coalesced_available() and len(buckets) > 1)
        # Each param group's buckets are updated by one segmented launch where the update rule has one (ShardedAdamW,
        # SGD, Lion; _update_buckets), groups in the order of their first bucket in the gather order; the merged
        # launches are kept per group (_launch_segmented). Without overlap_comm the gathers follow, all at once
        # (_update_together). With it they follow too, one per bucket in the forward's order: the next forward's
        # kernels queue behind every update on the stream anyway, so per-bucket updates would only start the first
        # gather one bucket's update earlier, at a launch per bucket of host time (issue 20.3). (overlap_comm on one
        # rank: as without it, every gather the identity)
        self._update_together = not self._overlap_machinery and len(buckets) > 1
        self._rounding_seeds = [b.sr_seed for b in buckets if b.sr_seed is not None]  # (kept, written in place)
        self._merge_updates = len(buckets) > 1
        self._segmented: dict = {}
        self._flush_launches: dict = {}  # the flatten launches of _flush_buckets (several buckets' gradients)
        # overlap_comm, where nothing is launched at a bucket's completion (inside no_sync(), or on one rank, where
        # a reduce-scatter is the identity): the completed buckets not flushed yet, flushed FLUSH_TOGETHER at a
        # time; and the flatten launches of each such group (by its buckets' indices: the same groups come back
        # every backward, in the same order)
        self._completed: list = []
        self._group_launches: dict = {}
        self._norm_spec = None  # the norm pass of every bucket in one launch (_consume_all_reduced), once built
        self._norm_launches: dict = {}
        self._finalize_specs: dict = {}  # its finalize, bound on the hot path, by launch key (workspace)
        self._step_cache.clear()
        if self._graphs is not None:
            self._graphs.forget()
        # the model's view (model_sync.py): names, aliasing and versions, gradient placeholders
        added = [p for b in new for p in b.params]
        self._param_list += added
        self._param_index = {p: i for i, p in enumerate(self._param_list)}
        self._param_by_id = {id(p): p for p in self._param_list}  # (bucket.DATA_READS holds ids)
        # (each parameter's index by id: a look-up without Tensor.__hash__, a Python method, per parameter)
        self._index_by_id = {id(p): i for i, p in enumerate(self._param_list)}
        for gi in groups:
            for j, p in enumerate(self.param_groups[gi]["params"]):
                self._param_names[p] = param_name(self.param_groups[gi], gi, j, p)
                if not p.requires_grad:
                    self._frozen_at_build.append(p)
                    HELD_FROZEN[p] = True  # (an fp32 copy into it waits for its layout: WatchedParameter.copy_)
        for b in new:
            self._param_views.update(zip(b.params, b.param_buffer.get_views()))
        self._param_ptrs += [self._param_views[p].data_ptr() for p in added]
        self._param_versions += [p._version for p in added]
        self._placeholders.update({p: ShardedGrad(p, self) for p in added})
        self._placeholder_list += [self._placeholders[p] for p in added]
        self._param_buckets = [self._bucket_of[p][0] for p in self._param_list]  # (in _param_list's order)
        self._spent_grads.update({p: SpentGrad(p, self) for p in added})
        for b in new:
            b.grad_placeholders = [self._placeholders[p] for p in b.params]
            b.spent_markers = [self._spent_grads[p] for p in b.params]
            b.all_placed = dict.fromkeys(b.params, True)
        # every non-empty piece of the grad shards as a view, and its parameter index on the device (see
        # _param_grad_norms): made at the first per-parameter norm, again after new buckets
        self._norm_pieces: Optional[tuple] = None
        self._piece_norm_plan = None  # (their launches and workspace: model_view._PiecePlan)
        for p in added:
            frozen = not p.requires_grad  # (adopted for a gradient it holds: _adopt_unfrozen)
            if frozen:  # torch checks requires_grad only when a hook is registered; the hook stays on the tensor,
                p.requires_grad_(True)  # for when it is unfrozen
            try:
                if self._overlap_machinery:  # (its flush needs the accumulated gradient: after accumulation)
                    self._hooks.append(torch.Tensor.register_post_accumulate_grad_hook(  # (not noted: ours)
                        p, model_sync.GradReadyHook(self)))
                # the placeholder goes in a pre-hook of the parameter's AccumulateGrad node, which runs only where
                # a backward accumulates into param.grad: a tensor hook runs in torch.autograd.grad(loss, params)
                # too, which leaves param.grad as it is (until session 29 that removed the placeholder, so torch's
                # clip after such a call found no gradients and returned 0, silently). The node lives while a
                # reference holds it, and its hooks with it: the optimizer holds it, as DDP's reducer does.
                # Without overlap_comm it is the only hook: it notes the arrival too (nothing reads the gradient
                # before the end of the backward, and the pre-hook runs where the post-accumulate one would).
                accumulator = model_sync.grad_accumulator(p)
                self._grad_accumulators.append(accumulator)
                self._hooks.append(accumulator.register_prehook(model_sync.ClearPlaceholderHook(
                    self, p, self._param_index[p], arriving=not self._overlap_machinery)))
            finally:
                if frozen:
                    p.requires_grad_(False)

    def _make_bucket(self, gi, params, align, index: int) -> _Bucket:
        # Stochastic rounding: the 64-bit Philox key of this bucket at step t is seed + t (step() advances it on
        # the device), distinct for every (rank, bucket, step) until 2^32 steps: rank in bits 48+, bucket in bits
        # 32-47. The state tensors of one update use disjoint 16-bit halves of each element's random word.
        rank_id = self.rank + self.world_size * self.replica_rank
        seed = ((rank_id + 1) << 48) + (index << 32) + 0x5EED
        group = self.param_groups[gi]
        b = _Bucket(gi, params, self.rank, self.world_size, self.param_dtype, self.grad_dtype, self.device,
                    align, self.process_group, self._group_state_names(group), self.store_param_remainders,
                    self.state_dtype, self.state_rounding, seed, owners=self._group_owners(group, params))
        b.step_flags = self._flags  # (a gradient the loop assigns: WatchedParameter.__setattr__)
        b.seen_version = weakref.WeakMethod(self._seen_version)  # (an in-place call's start: _Bucket.before_call)
        b.reshaped = weakref.WeakMethod(self._param_reshaped)  # (p.data = t of another shape: WatchedParameter)
        return b

    def _make_graphs(self, cuda_graph) -> Optional[_graphs.StepGraphs]:
        """The StepGraphs of ``cuda_graph=True`` (None when off), once every option it needs is checked."""
        if not cuda_graph:  # (a bool: checked first thing in __init__)
            return None
        backend = dist.get_backend(self.process_group) if self._direct_collectives else None
        reason = _graphs.unsupported(self.device, backend) or self._uncapturable_options()
        if reason is not None:
            raise ValueError(f"cuda_graph=True: {reason}")
        return _graphs.StepGraphs(self)

    def _uncapturable_options(self) -> Optional[str]:
        """Why this optimizer's options keep its step out of a CUDA graph, or None."""
        if self._overlap_machinery:  # (one rank leaves it out: its step is the one without overlap_comm, captured)
            return ("overlap_comm=True on more than one rank launches each bucket's reduce-scatter from the backward "
                    "hooks, outside step(), and waits for the all-gathers in the next forward; use "
                    "overlap_comm=False (on one rank, where there is nothing to overlap, the two go together)")
        if self.ordered_reduce:
            return "ordered_reduce=True is not supported with it"
        if self.replica_group is not None:
            return "hybrid sharding (replica_group / a 2-D device_mesh) is not supported with it"
        if self._segments is None:
            return (f"{type(self).__name__}'s update has no single-launch form to capture (ShardedAdamW, ShardedSGD "
                    "and ShardedLion have one)")
        return None

    # per-group hooks (one kind of group per optimizer unless a subclass says otherwise)
    def _group_state_names(self, group: dict) -> tuple[str, ...]:
        """The state tensors of the buckets of ``group``."""
        return self._state_names

    def _group_bucket_cap(self, group: dict, cap_elems: int) -> int:
        """At most this many elements per bucket of ``group`` (a larger parameter gets a bucket of its own)."""
        return cap_elems

    def _group_owners(self, group: dict, params: list) -> Optional[list[int]]:
        """None (equal contiguous shards), or the rank that owns each of ``params`` whole (see Layout)."""
        return None

    def _group_keeps_step(self, group: dict) -> bool:
        """Whether torch.optim's state for ``group`` has a ``step`` entry (state_dict() writes it then)."""
        return True

    def _check_options_agree(self, options: dict, verb: str = "built", hints: Optional[dict] = None) -> None:
        """One all-gather of a hash of ``options`` per group; on a mismatch, the options themselves, and a
        ValueError on every rank naming the first option that differs and the ranks' values (``verb``: what the
        ranks did with them, for the message; ``hints``: what to say instead of the default advice, by option)."""
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        device = trainable[0].device if trainable else comm.local_device()
        groups = [(self.process_group, self.world_size)]
        if self.replica_group is not None:
            groups.append((self.replica_group, self.replica_size))
        text = repr(sorted(options.items()))
        digest = comm.digest(text.encode())
        for group, size in groups:
            if not comm.is_initialized() or size == 1:
                continue
            mine = torch.tensor([digest], dtype=torch.int64, device=device)
            everyone = torch.empty(size, dtype=torch.int64, device=device)
            comm.all_gather_single(everyone, mine, group=group)
            if bool((everyone == everyone[0]).all()):
                continue
            theirs = [dict(ast.literal_eval(t)) for t in comm.all_gather_text(text, group, size, device)]
            for key in options:
                values = [t.get(key) for t in theirs]
                if len(set(map(repr, values))) > 1:
                    listing = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
                    advice = (hints or {}).get(key, "every rank must pass the same options (they decide the "
                                                         "collectives)")
                    raise ValueError(f"the ranks {verb} {type(self).__name__} with different {key} ({listing}); "
                                     f"{advice}")
            raise ValueError(f"the ranks {verb} the optimizer with different options")

    def _sync_initial_weights(self, params: list) -> None:
        """``init_sync``: every rank takes rank 0's values of ``params`` (those on the optimizer's device, trainable
        or frozen), before their masters are taken."""
        if self._init_sync:
            self._from_rank_0([p.detach() for p in params if p.device == self.device])

    def _sync_model_buffers(self, model: torch.nn.Module) -> None:
        """``init_sync``, at ``attach``: every rank takes rank 0's values of the model's buffers on the optimizer's
        device (BatchNorm's statistics, a randomly initialized buffer), as DDP's construction broadcasts them. The
        ranks first compare the buffers' names, shapes and dtypes (a ValueError on every rank where they differ)."""
        if not self._init_sync or not comm.is_initialized() or self.world_size * self.replica_size == 1:
            return
        named = [(n, b) for n, b in model.named_buffers() if b.device == self.device]
        self._check_options_agree({"buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in named]},
                                  verb="attached models to", hints={"buffers": (
                                      "attach() broadcasts rank 0's buffers (init_sync), so every rank's model must "
                                      "have the same ones")})
        self._from_rank_0([b.detach() for _, b in named])

    def _from_rank_0(self, tensors: list) -> None:
        """Overwrite ``tensors`` with rank 0's: one coalesced broadcast over the group, then over the replica group
        (nothing without a process group)."""
        if not comm.is_initialized():
            return
        with torch.no_grad():
            for group, size in ((self.process_group, self.world_size), (self.replica_group, self.replica_size)):
                if size > 1:
                    comm.broadcast_coalesced(tensors, group)

    def _check_params(self) -> None:
        devices = set()
        for gi, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"param_groups[{gi}] holds a {type(p).__name__}, expected torch.nn.Parameter")
                if not p.is_floating_point():
                    raise TypeError(f"parameters must be floating point; param_groups[{gi}] has one of dtype "
                                    f"{p.dtype} and shape {tuple(p.shape)}")
                if p.requires_grad:
                    if p.device.type == "meta":
                        raise ValueError(
                            f"param_groups[{gi}]['params'][{j}] {_shape(p)} is on the meta device: it has no values to "
                            "train. Materialize the model first (model.to_empty(device=...), then initialize or load "
                            "its weights), then build the optimizer")
                    devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(f"all trainable parameters must be on one device, got {sorted(map(str, devices))}")

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``: a new group (its keys, or the defaults) whose parameters
        train from the next ``step()`` on. Typical use: unfreezing part of a model during training (Lightning's
        ``BackboneFinetuning``), the parameters left out of the optimizer until then.

        After construction it is a collective (every rank adds the same group, as in a data-parallel loop), between
        steps: not between a backward and its ``step()`` (that backward's gradients are on their way through the
        old buffers' reduction; after ``zero_grad()``, of either kind, is fine). The group's trainable parameters
        become bf16 views of new buffers, with their fp32 master taken from their current values and fresh state
        (step count 0), exactly as at construction; a gradient one of them already holds (trainable outside the
        optimizer until now) is kept, in bf16, for the next step, as torch.optim would use it. The other groups'
        buffers, masters and state are untouched. With ``attach``, the new parameters get their names, guards and
        hooks in the attached model. Launch plans and CUDA graphs are rebuilt at the next step.
        """
        if not hasattr(self, "buckets"):  # (torch.optim's __init__ adds the constructor's groups)
            super().add_param_group(param_group)  # fills in the defaults
            self._check_group(self.param_groups[-1], f" (param_groups[{len(self.param_groups) - 1}])")
            return
        self._add_group_after_construction(param_group)

    def _add_group_after_construction(self, param_group: dict) -> None:
        self._check_not_retired()
        if self._mid_step():
            raise RuntimeError("add_param_group() between a backward and its step(): the gradients of that backward "
                               "are already in the buffers; add the group after step() (or zero_grad())")
        self._entry("add_param_group")
        self.wait_for_params()
        gi = len(self.param_groups)
        error, trainable = None, []
        try:  # every rank checks, then they compare: a group wrong on one rank only is an error on all of them
            super().add_param_group(param_group)  # torch.optim's checks (a parameter in two groups...), defaults
            group = self.param_groups[gi]
            self._check_group(group, f" (param_groups[{gi}])")
            self._check_params()
            trainable = [p for p in group["params"] if p.requires_grad]
            moved = next((p for p in trainable if p.device != self.device), None)
            if moved is not None:
                raise ValueError(f"param_groups[{gi}] has a parameter on {moved.device}, but the optimizer keeps its "
                                 f"buffers on {self.device} (an optimizer built with nothing to train: on the CPU)")
            self._check_new_group(group, f" (param_groups[{gi}])")
            holders = self._holders(trainable)
        except Exception as exc:
            error = exc
        try:
            self._check_options_agree({"add_param_group": gi, "error": None if error is None else repr(error),
                                       "trainable": [(tuple(p.shape), str(p.dtype)) for p in trainable],
                                       "parameters": None if error is not None else _layout_digest([group])},
                                      verb="added param groups to", hints=_LAYOUT_HINT)
        except BaseException:
            del self.param_groups[gi:]  # nothing was laid out: the optimizer is as it was
            raise
        if error is not None:
            del self.param_groups[gi:]
            raise error
        self._take_over(holders)
        self._sync_initial_weights(self.param_groups[gi]["params"])
        self._add_buckets(gi, trainable, [gi])
        self._note_group_lists(own=True)
        self._adopt_marked()

    def _check_new_group(self, group: dict, where: str) -> None:
        """What a subclass cannot add after construction (its state names are fixed, say): a ValueError."""

    def _new_buckets_added(self, new: list) -> None:
        """Per-bucket plans of a subclass for buckets ``new`` once they are laid out and indexed (after an add or an
        unfreeze; ShardedMuon calls it for every bucket at the end of its construction too)."""

    def _check_group(self, group: dict, where: str) -> None:
        """Validate one group's hyper-parameters (subclasses); ``where`` names the group in the message."""

    def _check_group_at_step(self, gi: int, group: dict) -> None:
        """:meth:`_check_group` of ``param_groups[gi]``, a trained group, at each step() before anything changes
        (ShardedMuon also checks there that the group is still the kind its buckets were laid out for)."""
        self._check_group(group, f" (param_groups[{gi}], at step())")

    # ------------------------------------------------------------------ gradients into the buffers
    def _queue_end_of_backward(self) -> None:
        """Flush every bucket once autograd has finished this backward. Queued by the first gradient hook, or
        earlier by a hook on the attached model's outputs, which runs in the outermost backward (a reentrant
        activation checkpoint runs an inner backward whose callbacks run when the inner one ends)."""
        if not self._flush_queued:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _forget_dead_backward(self) -> None:
        """Outside any backward, a queued end-of-backward that never ran belonged to a backward that raised (an
        error in a hook, an out-of-memory the loop caught): autograd drops its callbacks. Forget it, or no later
        backward would queue its own (no flush and, with ``overlap_comm``, no launch at its end; stale ``ready``
        sets flushing a bucket before its gradients are in)."""
        if torch._C._current_graph_task_id() == -1:
            self._flush_queued = self._grads_this_backward = False
            self._completed = []
            for b in self.buckets:
                b.ready.clear()

    def _grad_arriving(self, param: torch.Tensor, index: int) -> None:
        """Without ``overlap_comm``: a gradient is about to be accumulated into ``param.grad`` (the AccumulateGrad
        pre-hook, the optimizer's only hook on the parameter then): the placeholder out, the arrival noted."""
        self._take_placeholder(param, index)
        self._on_grad_ready(param)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._queue_end_of_backward()
        self._grads_this_backward = True
        if self._raw_stream is not None and not torch.compiler.is_compiling():  # streams, rule 4
            stream = self._raw_stream()
            if stream not in self._grad_streams:
                self._grad_streams[stream] = torch.cuda.current_stream(self.device)
        if self._overlap_machinery:  # (keyed by id: Tensor.__hash__ is a Python method; this runs per parameter)
            key = id(param)
            bucket = self._bucket_by_id[key]
            bucket.ready.add(key)
            if len(bucket.ready) == len(bucket.params):  # the bucket's last gradient of this backward
                if self._observed_order is not None and bucket.index not in self._observed_order:
                    self._observed_order.append(bucket.index)
                # param.grad stays: backward(create_graph=True) (_end_of_backward), or a hook of the loop's after
                # this one reads it (_hand_back_grad)
                if _grad_enabled() or (id(param) in POST_HOOKED and self._user_post_hooks(param)):
                    return
                if self._no_sync_depth:  # (one rank runs this machinery in tests and benchmarks only: there as on
                    # many, a flush and a launch per bucket outside no_sync(), each launch the identity)
                    self._flush_completed(bucket)
                    return
                self._flush_bucket(bucket)
                if not self._no_sync_depth:
                    bucket.launch_wanted = True
                    self._launch_in_order()

    def _flush_completed(self, bucket: _Bucket) -> None:
        """overlap_comm, a bucket completed where nothing is launched for it now (inside ``no_sync()``): flushed with
        the next completed ones, FLUSH_TOGETHER buckets in one flush (one flatten launch, one pass of the Python
        around it), the rest at the end of the backward. A flush of its own per bucket cost ~45 us of host time on
        the GPU path (session 32: with the 302M example's 26 buckets, four at a time saved ~1.3 ms per backward on
        this repo's CPU machine, flushing all at the end ~3 ms); waiting for FLUSH_TOGETHER keeps at most
        FLUSH_TOGETHER - 1 more buckets' gradients alive than a flush per bucket (75 MB at the default
        ``bucket_cap_mb``), where flushing only at the end would keep the whole model's."""
        done = self._completed
        done.append(bucket)
        if len(done) < FLUSH_TOGETHER:
            return
        self._completed = []
        key = tuple(b.index for b in done)
        launches = self._group_launches.get(key)
        if launches is None:  # a new group: the oldest is forgotten once there are as many as buckets (a static
            # model brings back the same few groups every backward; one whose buckets complete in changing orders,
            # e.g. experts routed anew each step, would otherwise keep a plan per order it ever saw)
            groups = self._group_launches
            if len(groups) >= max(8, len(self.buckets)):
                del groups[next(iter(groups))]
            launches = groups[key] = {}
        self._flush_buckets(done, launches)

    def _end_of_backward(self) -> None:
        self._flush_queued = False
        self._completed = []  # (flushed below with every other bucket)
        got_grads, self._grads_this_backward = self._grads_this_backward, False
        if got_grads and _grad_enabled():
            # backward(create_graph=True) (autograd runs its callbacks in the backward's grad mode): torch leaves each
            # gradient in param.grad with its graph, for code that differentiates it again (a gradient penalty on
            # the parameters' gradients, a Hessian-vector product) and for a later backward to add onto. So does
            # this optimizer: the gradients stay there as gradients set by hand do, for the next flush (the next
            # backward's end, or the reduction's), and so do those of earlier backwards that this one did not reach
            # (the pre-hooks handed back those it reached), which torch's param.grad holds too and a penalty over
            # every param.grad reads. Until session 39 they were taken into the buffers, and reading them was an
            # error
            got_grads = False
            if self._reduced is None:
                for b in self.buckets:
                    if b.placed and not b.rs_launched:
                        for p, placeholder in zip(b.params, b.grad_placeholders):
                            if p.grad is placeholder:
                                self._hand_back_grad(p)
        if self._frozen_at_build:  # (parameters unfrozen since: their buckets are flushed and launched below)
            self._adopt_unfrozen()
        if got_grads:  # buckets some of whose parameters got no gradient in this backward
            self._flush_buckets(self.buckets)
        # (none of ours got one, e.g. torch.autograd.grad through the model: gradients set by hand stay in param.grad
        # as torch.optim leaves them, for the next flush or the reduction's; until session 35 this flush took them,
        # and a hand-set gradient zeroed by zero_grad(set_to_none=False) became a placeholder that refused a new
        # optimizer over the parameters "between a backward and its step()", found by tests.optim.loop_fuzz_long)
        unwaited = None
        for b in self.buckets:
            if b.ready:  # (overlap_comm: gradients of this backward)
                if b.ag_work is not None:  # ... of parameters whose all-gather no forward waited for
                    unwaited = (unwaited or []) + [p for p in b.params if id(p) in b.ready]
                b.ready.clear()
        if self._grad_streams:  # every gradient they were noted for is in a buffer now
            self._grad_streams.clear()
        # a backward that reached none of our parameters (torch.autograd.grad through the model's outputs, or a
        # rank whose loss did not use them) launches nothing here; step() launches what is left on every rank
        if self.overlap_comm and not self._no_sync_depth and got_grads:
            # every bucket is reduced after the last micro-batch, including one that got no gradient at all, so
            # every rank issues the same collectives in the same order
            self._launch_all()
        if self._reduce_entered and self._reduced is None:
            self._launched_by_backward = True
        if self._ddp_pending is not None:
            self._average_for_ddp()
        self._note_eager_step()
        if unwaited:
            self._raise_unwaited(unwaited)

    def _raise_unwaited(self, params: list) -> None:
        """The end of a backward (``overlap_comm``) found gradients of ``params``, whose all-gather, launched by the
        last step(), no forward waited for: the forward read them without the wait that a hooked module's pre-hook,
        a guarded attribute read or the model's listings make, so it may have seen the last step's values in some
        elements (the gather writes them in the background). Until session 27 that trained on, silently. Seen on
        every rank alike (the same model and code); the gathers are waited for now, so the loop can go on after a
        fix. Costs nothing where every gather was waited for (one look per bucket given gradients)."""
        self.wait_for_params()
        raise RuntimeError(
            f"tritonshard: {_names([self._param_names[p] for p in params])} got gradients from a forward that read "
            "them before their all-gather (launched by the last step(), overlap_comm=True) was waited for, so it may "
            "have used the last step's values in some elements. Nothing that used them waited: a module made or "
            "swapped in after attach() (SyncBatchNorm.convert_sync_batchnorm, quantization-aware training's "
            "prepare, a submodule replaced by another holding the same parameters), or a tensor taken from the "
            "model before step() (a list of parameters kept for a regularizer). Change the model before building "
            "the optimizer, read parameters through the model (model.fc.weight, model.parameters()), or call "
            "opt.wait_for_params() before such a forward.")

    def _flush_bucket(self, b: _Bucket) -> None:
        """Move the bucket's pending ``param.grad`` s into its grad buffer; the first flush since zero_grad()
        overwrites (parameters without a gradient get zeros), later ones accumulate."""
        if self._launched_by_backward:
            self._forget_discarded_launches()
        pending = self._take_pending(b)
        if pending is not None:
            self._flatten_one(b, pending)

    def _flatten_one(self, b: _Bucket, pending: list) -> None:
        """The flatten of ``b``'s ``pending`` gradients by a launch of its own, then their placeholders."""
        grads, offsets = [g for _, g, _ in pending], [off for _, _, off in pending]
        others = self._wait_for_grad_streams()
        # the unchecked flatten only for gradients of the buffer's device and a source dtype the kernel reads (a
        # model moved or converted after construction goes through the checked launcher, which names the problem)
        if self._hot_path() and self._flattenable(grads):
            _flatten_unchecked(b.grad_buffer.get_data(), grads, offsets, b.has_grads, launches=b.launches)
        else:
            kernels().flatten_into(b.grad_buffer.get_data(), grads, offsets, accumulate=b.has_grads)
        self._release_to_grad_streams(others)
        self._place_all_placeholders([(b, pending)])

    def _flush_buckets(self, buckets, launches: Optional[dict] = None, model_checked: bool = False) -> None:
        """:meth:`_flush_bucket` for each of ``buckets``, with one flatten launch for all of them (per accumulate
        mode) instead of one per bucket where the Triton kernels run, outside torch.compile (issue 20.3: the end of
        backward without overlap_comm flushes every bucket at once; ~4 us of host time per launch saved per bucket).

        The kernel writes through a destination offset per tensor from its ``out``: bucket 0's grad buffer, and
        every other bucket's tensors at their buffer's distance from it (in elements; the buffers share the grad
        dtype and the allocator's alignment, so the distance is exact and keeps the 16-byte classes). Each element
        gets the same arithmetic as in a per-bucket launch, so the buffers hold the same bits. ``launches``: the
        launch plans' dict for this set of buckets (default: the one for the end of a backward). ``model_checked``:
        sync_from_model() has just passed (a reduction's flush), so every parameter is on the buffers' device in
        their dtype, and so is every gradient (torch's ``param.grad`` setter and autograd give a dense gradient
        its parameter's dtype and device): the per-gradient look at them is skipped (~0.25 us per gradient)."""
        if not buckets:
            return
        if self._launched_by_backward:
            self._forget_discarded_launches()
        if not self._flatten_together():
            for b in buckets:
                self._flush_bucket(b)
            return
        out = self.buckets[0].grad_buffer.get_data()
        base, size = out.data_ptr(), out.element_size()
        jobs: dict[bool, tuple[list, list]] = {}
        flushed = []
        for b in buckets:
            pending = self._take_pending(b)
            if pending is None:
                continue
            grads = [g for _, g, _ in pending]
            distance, rest = divmod(b.grad_buffer.get_data().data_ptr() - base, size)
            if rest or not (model_checked or self._flattenable(grads)):  # (a moved or converted model: the checked
                # launcher names it)
                self._flatten_one(b, pending)
                continue
            all_grads, all_offsets = jobs.setdefault(b.has_grads, ([], []))
            all_grads += grads
            all_offsets += [off + distance for _, _, off in pending]
            flushed.append((b, pending))
        others = self._wait_for_grad_streams() if jobs else ()
        for accumulate, (grads, offsets) in jobs.items():
            with _trace("tritonshard.kernel.flatten_into"):  # (the launcher's range name, as a profile shows it)
                _flatten_unchecked(out, grads, offsets, accumulate,
                                   launches=self._flush_launches if launches is None else launches)
        self._release_to_grad_streams(others)
        self._place_all_placeholders(flushed)

    def _place_all_placeholders(self, flushed: list) -> None:
        """The second half of every flush: :meth:`_place_placeholders` for each ``(bucket, pending)``, the usual
        buckets (each of their parameters in ``pending``) in one loop under one context (~3 us of host time less
        per bucket than a call each); any other, or one where torch's setter refuses a placeholder, through it."""
        if torch.compiler.is_compiling():
            for b, pending in flushed:
                self._place_placeholders(b, pending)
            return
        rest = []
        with _PLAIN_ATTRS():
            for b, pending in flushed:
                if len(pending) != len(b.params):
                    rest.append((b, pending))
                    continue
                try:
                    for p, placeholder in zip(b.params, b.grad_placeholders):
                        set_grad(p, placeholder)
                except RuntimeError:  # (converted, moved or resized since construction: the call sorts it out,
                    rest.append((b, pending))  # setting again what was set)
                    continue
                b.placed.update(b.all_placed)  # (from a dict: no Tensor.__hash__ per parameter)
                b.has_grads = True
        for b, pending in rest:
            self._place_placeholders(b, pending)
        if self._zeroed or self._zeroed_plain:  # (as in _place_placeholders)
            self._forget_zeroed([x for _, pending in flushed for x in pending])

    def _flatten_together(self) -> bool:
        """Whether :meth:`_flush_buckets` flattens several buckets in one launch: on the Triton kernels (compiled,
        or the interpreter, where the CPU tests run them), outside torch.compile (whose step records each bucket's
        flatten as a custom op)."""
        return triton_kernels_run(self.device)

    def _flattenable(self, grads: list) -> bool:
        """Gradients the unchecked flatten takes: on the buffers' device, of a source dtype the kernel reads."""
        device = self.device
        return all(g.device == device and g.dtype in _FLAT_SOURCES for g in grads)

    def _take_pending(self, b: _Bucket) -> Optional[list]:
        """The first half of a flush: ``b``'s pending gradients as (parameter, gradient, offset in the grad buffer)
        (None when there are none), checked, with the buffer made ready for them (zeros for parameters without a
        gradient on the first flush since zero_grad(), the streams ordered). :meth:`_place_placeholders` is the
        second half, after the flatten."""
        if self._flags.compiled_unfinished:
            self._finish_compiled_step()
        if self._reduced_early:  # (a reduction whose gradients the loop all cleared since: gone)
            self._check_grads_since_reduction("forget")
        if self._sums_shown:
            self._settle_shown(b)
        placed = b.placed
        if self._spent_unlisted:  # (a reduction lists them again first: _check_no_spent_grads)
            self._list_spent()
        # markers: where some param.grad may still hold its spent marker (SpentGrad), which stands for no gradient
        # of this backward (by identity: the listing may be older than the loop's last clear or assignment)
        markers = self._spent_grads if self._spent else None
        if placed:
            self._take_back_cleared(b)
            if len(placed) == len(b.params):  # (each param.grad is its placeholder, checked just now: every
                return None  # gradient is in the buffer already)
        with _PLAIN_ATTRS():
            if placed or markers is not None:
                pending = [(p, g, off) for p, off in zip(b.params, b.grad_buffer.offsets)
                           if (g := p.grad) is not None and p not in placed
                           and (markers is None or g is not markers[p])]
            else:
                pending = [(p, g, off) for p, off in zip(b.params, b.grad_buffer.offsets)
                           if (g := p.grad) is not None]
        if not pending:
            return None
        sparse = next((p for p, g, _ in pending if g.layout != torch.strided), None)
        if sparse is not None:
            raise RuntimeError(
                f"the gradient of {self._param_names[sparse]} is {sparse.grad.layout}: tritonshard flattens dense "
                "gradients only (e.g. build nn.Embedding with sparse=False)")
        if self._reduced is not None:  # (first: without overlap_comm, the reduce-scatters ran in clip_grad_norm_)
            raise RuntimeError("gradients arrived after clip_grad_norm_() reduced them and before step(); "
                               "call step() (or zero_grad()) first")
        if b.rs_launched:
            raise RuntimeError(
                f"gradients for bucket {b.index} arrived after its reduce-scatter was launched: with "
                "overlap_comm=True, run every backward of an accumulation but the last inside opt.no_sync(), also "
                "where one step has several backward() calls (losses backpropagated one by one, retain_graph=True) "
                "(with a reentrant activation checkpoint, also call opt.attach(model))")
        self._after_last_step_readers()
        if not b.has_grads and len(pending) < len(b.params):
            for p, view in zip(b.params, b.grad_buffer.get_views()):  # (a marker's part of the buffer still holds
                if p.grad is None or (markers is not None and p.grad is markers[p]):  # the gradient its step used)
                    view.zero_()  # no gradient this time: contributes zeros
                    b.no_grad[p] = True
                    self._flags.eager_step_needed = True
        elif b.no_grad:  # a later micro-batch's gradients, for some that had none
            for p, _, _ in pending:
                b.no_grad.pop(p, None)
        return pending

    def _wait_for_grad_streams(self) -> tuple:
        """Streams, rule 4, before a flatten: the noted streams other than the current one, which the current
        stream now waits for (their gradients are complete on them); () where there are none (the usual case: one
        stream for the forward, the backward and the flush)."""
        streams = self._grad_streams
        if not streams:
            return ()
        current = self._raw_stream()
        others = tuple(stream for raw, stream in streams.items() if raw != current)
        if others:
            flush_stream = torch.cuda.current_stream(self.device)
            for stream in others:
                flush_stream.wait_stream(stream)
        return others

    def _release_to_grad_streams(self, others: tuple) -> None:
        """Streams, rule 4, after a flatten and before ``param.grad`` lets the gradients go: the streams they belong
        to wait for the flatten, so the caching allocator's reuse of their memory there comes after it."""
        if others:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            for stream in others:
                stream.wait_event(event)

    def _place_placeholders(self, b: _Bucket, pending: list) -> None:
        """The second half of a flush, once ``pending`` (from :meth:`_take_pending`) is in the buffer:
        ``param.grad`` lets the gradients go. The general case (under torch.compile, some of the bucket's
        parameters only, a placeholder torch's setter refuses), reached through :meth:`_place_all_placeholders`."""
        if torch.compiler.is_compiling():
            for p in b.params:
                p.grad = None
        else:  # param.grad says "there is a gradient, in tritonshard's buffer" (see ShardedGrad)
            placed, every = b.placed, len(pending) == len(b.params)
            param_dtype, device = self.param_dtype, self.device
            if every:  # every parameter of the bucket, in its order (the usual flush)
                pairs = zip(b.params, b.grad_placeholders)
            else:
                placeholders = self._placeholders
                pairs = ((p, placeholders[p]) for p, _, _ in pending)
            refused = []
            with _PLAIN_ATTRS():
                for p, placeholder in pairs:
                    try:  # (torch's setter checks the dtype, device and shape against the parameter's)
                        set_grad(p, placeholder)
                    except RuntimeError:
                        if p.dtype == param_dtype and p.device == device and p.shape == placeholder.shape:
                            raise  # (not one of the three: torch's error is the one to see)
                        set_grad(p, None)  # converted, moved or resized since construction: step() raises, naming
                        refused.append(p)  # it (sync_from_model)
                    else:
                        if not every:
                            placed[p] = True
            if every:  # (a dict's update from a dict copies its keys' hashes: no Tensor.__hash__ per parameter)
                placed.update(b.all_placed)
                for p in refused:
                    del placed[p]
        b.has_grads = True
        if self._zeroed or self._zeroed_plain:
            self._forget_zeroed(pending)

    def _forget_zeroed(self, flushed: list) -> None:
        """``flushed`` (a flush's ``(param, gradient, offset)``) hold a backward's (or a hand-set) gradient now, not
        the zeros of a ``zero_grad(set_to_none=False)``; the other zeroed parameters still hold zeros, which are in
        nobody's way (:meth:`_mid_step`). Until session 43 every flush forgot them all: a loop that then cleared the
        flushed gradients (``p.grad = None``) could not build another optimizer over the parameters, refused as if
        a gradient waited (found by tests.optim.loop_fuzz_long). A gradient set by hand and zeroed in place by
        ``zero_grad(set_to_none=False)`` is flushed as one, but holds those zeros where the flush takes it unchanged
        (the same tensor, its version as zeroed: ``_zeroed_plain``): zeroed too (until session 46 a backward that
        did not reach it counted it as its gradient, and the same refusal followed; found the same way)."""
        zeroed, plain = self._zeroed, self._zeroed_plain
        if len(flushed) == len(self._param_list):  # (the usual flush: every parameter)
            zeroed.clear()
        else:
            for p, _, _ in flushed:
                zeroed.pop(p, None)
        if plain:  # (looked up, not taken: a bucket's flush may pass here twice, _flush_buckets)
            for p, g, _ in flushed:
                kept = plain.get(p)
                if kept is not None and kept[0] is g and g._version == kept[1]:
                    zeroed[p] = True

    def _after_last_step_readers(self) -> None:
        """Streams, rule 3: before the first write into a grad buffer after ``step()``, the current stream waits for
        the last step's kernels that read the grad shards (a no-op on CPU and on the step's own stream)."""
        if self._grads_consumed_event is not None and not torch.compiler.is_compiling():
            torch.cuda.current_stream(self.device).wait_event(self._grads_consumed_event)
            self._grads_consumed_event = None

    def _take_placeholder(self, param: torch.Tensor, index: int) -> None:
        """A new gradient for ``param`` (``_param_list[index]``) is about to be accumulated: remove the placeholder,
        so autograd stores it (the earlier gradients are in the grad buffer, which the next flush accumulates
        onto). Per parameter and backward: its placeholder and bucket by index, not looked up by the tensor."""
        if self._flags.compiled_unfinished:
            self._finish_compiled_step()
        grad = param.grad
        if grad is None:  # (the first backward after zero_grad())
            return
        if grad is self._placeholder_list[index]:
            b = self._param_buckets[index]
            if ((_grad_enabled() or (POST_HOOKED and id(param) in POST_HOOKED and self._user_post_hooks(param)))
                    and not b.rs_launched and self._reduced is None):
                if self.grad_dtype != self.param_dtype and not _grad_enabled():
                    self._show_after_accumulation(param, b)  # (the hand-back would round the sum to the weights'
                    return  # dtype, and the next backward's add would too)
                self._hand_back_grad(param)  # backward(create_graph=True), or a post-accumulate hook of the loop's,
                return  # onto an earlier backward's gradient
            set_grad(param, None)
            b.placed.pop(param, None)
            if b.rs_launched:  # accumulating onto a launched reduction: an error at the flush (_take_pending)
                self._taken_after_launch = True
        elif (self._spent_unlisted or self._spent) and grad is self._spent_grads.get(param):
            set_grad(param, None)  # torch.optim would add this gradient to the spent one: an error if the sum is used
            self._spent.pop(param, None)
            self._stale[param] = True

    def _user_post_hooks(self, param: torch.Tensor) -> bool:
        """Whether ``param`` has post-accumulate-grad hooks other than this optimizer's (``overlap_comm``'s machinery
        has one per parameter): the loop's own (``p.register_post_accumulate_grad_hook``: gradient statistics, a
        per-parameter clamp), which read ``param.grad`` as torch's autograd leaves it, the sum over the backwards so
        far. Asked only for the parameters in :data:`~tritonshard.optim.bucket.POST_HOOKED`."""
        hooks = param._post_accumulate_grad_hooks
        return hooks is not None and len(hooks) - (param in self._show_hooks) > self._overlap_machinery

    def _hand_back_grad(self, param: torch.Tensor) -> None:
        """A backward is about to add onto ``param``'s gradient, which an earlier backward (a micro-batch's) left in
        the grad buffer, and code will read the sum in ``param.grad``, as torch's autograd leaves it there: a backward
        with ``create_graph=True`` (the sum, with the new gradient's graph, is what code differentiating
        ``param.grad`` reads, a penalty on it), or a post-accumulate-grad hook of the loop's (:meth:`_user_post_hooks`;
        until session 39 it read this backward's gradient alone, and a hook writing it, a clamp, changed that part
        only, silently). So it goes back into ``param.grad``, a plain tensor in the parameter's dtype, its part of
        the buffer zeroed; the next flush takes the sum, as it takes a gradient set by hand (onto the zeros: the
        bits of an accumulation in the buffer where the grad buffer has the parameter's dtype). Before a reduction
        only (after one the buffer holds shards of the sum over the ranks: the pre-hook takes the placeholder out as
        for any backward, and the flush's error follows)."""
        b, i = self._bucket_of[param]
        self._after_last_step_readers()
        view = b.grad_buffer.get_views()[i]
        grad = view.to(param.dtype, copy=True)
        view.zero_()
        b.placed.pop(param, None)
        set_grad(param, grad)

    def _show_after_accumulation(self, param: torch.Tensor, b: _Bucket) -> None:
        """:meth:`_hand_back_grad` where the grad buffer's dtype is wider than the parameter's (``grad_dtype=
        torch.float32`` beside bf16 weights): a backward is about to add onto ``param``'s gradient, and a hook of the
        loop's reads the sum. Handed back, the fp32 sum would be rounded to bf16 in ``param.grad`` and the new
        gradient added to it in bf16 (two roundings of the sum per micro-batch the loop chose fp32 to avoid:
        ~2.8e-5 on the masters after three steps of four micro-batches at lr 1e-3 with a hook only reading the
        gradient's norm, against 7e-9 without the hook, before session 44). Instead autograd stores this backward's
        gradient alone, and a hook of ours ahead of the loop's (:class:`~.model_sync.ShowSumHook`, moved to the
        front of the parameter's post-accumulate-grad hooks) adds it into the buffer in fp32 and shows the loop's
        hooks the sum's rounding (:meth:`_show_sum`); the flush keeps the fp32 sum where they left that rounding
        and takes their value where they wrote one (:meth:`_settle_shown`)."""
        hooks = param._post_accumulate_grad_hooks
        key = self._show_hooks.get(param)
        if key is None or key not in hooks:
            key = self._show_hooks[param] = param.register_post_accumulate_grad_hook(model_sync.ShowSumHook(self)).id
        if next(iter(hooks)) != key:  # (torch runs them in the order of the dict under the OrderedDict, which
            # move_to_end leaves as it was: the same dict, its entries inserted again, ours first)
            entries, ours = list(hooks.items()), hooks[key]
            hooks.clear()
            hooks[key] = ours
            hooks.update((k, hook) for k, hook in entries if k != key)
        set_grad(param, None)
        b.placed.pop(param, None)
        self._sums_to_show.add(param)

    def _show_sum(self, param: torch.Tensor) -> None:
        """:class:`~.model_sync.ShowSumHook`'s work: ``param``'s new gradient (``param.grad`` now, autograd's) added
        into its grad buffer view, and ``param.grad`` made the sum in the parameter's dtype for the loop's hooks."""
        if param not in self._sums_to_show:
            return
        self._sums_to_show.discard(param)
        grad = param.grad
        if grad is None or grad.layout != torch.strided:  # (a sparse one: the flush names it)
            return
        b, i = self._bucket_of[param]
        self._after_last_step_readers()
        view = b.grad_buffer.get_views()[i]
        view.add_(grad)
        shown = view.to(param.dtype, copy=True)
        set_grad(param, shown)
        self._sums_shown[param] = shown.clone()

    def _settle_shown(self, b: _Bucket) -> None:
        """At the flush of ``b``: each of its parameters whose sum :meth:`_show_sum` showed the loop's hooks. Where
        ``param.grad`` is still what they were shown, the buffer's fp32 sum stays; where a hook wrote (a clamp), its
        value is taken, as torch's autograd leaves the hook's write in ``param.grad``; cleared (``p.grad = None``):
        the gradient is gone. Then ``param.grad`` is its placeholder again."""
        for p in [p for p in self._sums_shown if self._bucket_of[p][0] is b]:
            shown = self._sums_shown.pop(p)
            view = b.grad_buffer.get_views()[self._bucket_of[p][1]]
            g = p.grad
            if g is None or type(g) is not torch.Tensor or g.shape != shown.shape or g.dtype != shown.dtype:
                view.zero_()  # (cleared, or replaced by a gradient of the loop's own: the flush takes it whole, as a
                continue  # gradient set by hand)
            view.copy_(torch.where(g != shown, g, view))
            set_grad(p, self._placeholders[p])
            b.placed[p] = True

    def _take_back_cleared(self, b: _Bucket) -> None:
        """torch semantics for code that cleared or replaced ``param.grad`` after we took the gradient
        (``model.zero_grad()``, ``p.grad = None``, ``p.grad = t``): the gradient in the buffer is discarded."""
        placed = b.placed
        with _PLAIN_ATTRS():
            if len(placed) == len(b.params):  # (every one: the lists made for that, no look-ups)
                cleared = [p for p, placeholder in zip(b.params, b.grad_placeholders) if p.grad is not placeholder]
            else:
                placeholders = self._placeholders
                cleared = [p for p in placed if p.grad is not placeholders[p]]
        for p in cleared:
            placed.pop(p)
            self._discard_grad(p, keep_placeholder=False)

    def _discard_grad(self, param: torch.Tensor, keep_placeholder: bool = True) -> None:
        """Zero ``param``'s gradient in the grad buffer (``param.grad.zero_()``, or a cleared ``param.grad``)."""
        if self._flags.compiled_unfinished:  # (a compiled step's gradient: spent, see SpentGrad.zero_())
            self._finish_compiled_step()
            if param.grad is self._spent_grads[param]:
                self._zero_spent(param)
                return
        b, i = self._bucket_of[param]
        if b.rs_launched or self._reduced is not None:
            raise RuntimeError(
                f"the gradient of {self._param_names[param]} was zeroed, cleared or replaced after it was reduced "
                "(by clip_grad_norm_, or by overlap_comm=True at the end of backward); change gradients before "
                "clipping, and with overlap_comm=True before the last backward of the step")
        if self._stale:
            self._stale.pop(param, None)  # (the sum torch.optim would hold is cleared or zeroed: nothing stale)
        if b.has_grads:
            self._after_last_step_readers()
            b.grad_buffer.get_views()[i].zero_()
            if keep_placeholder and param in b.placed:
                self._zeroed[param] = True
            if not keep_placeholder and param.grad is None:  # cleared (not zeroed, not replaced): no gradient,
                b.no_grad[param] = True                       # as for torch.optim
                self._flags.eager_step_needed = True
        if not keep_placeholder and param.grad is self._placeholders[param]:
            set_grad(param, None)

    def _forget_discarded_launches(self, at_flush: bool = True) -> None:
        """The first flush after a backward whose end launched reduce-scatters (``overlap_comm``), before anything
        used them: if the loop cleared every gradient since (``model.zero_grad()``, ``p.grad = None``; the
        discriminator's ``netD.zero_grad()`` in a GAN loop, whose generator's backward ran through it), the launched
        reductions hold nothing torch.optim would use, and they are finished and forgotten as ``opt.zero_grad()``
        forgets them. Otherwise nothing changes: gradients cleared in part, or one accumulated onto a launched
        bucket, stay the flush's errors (a reduction cannot take a gradient back). ``at_flush=False``: a look
        from outside a flush (another optimizer asking whether this one is mid-step), which leaves the question
        open for a later look (the loop may still clear them) unless it forgot them."""
        if self._taken_after_launch or self._reduced is not None or self._holds_placed_gradients():
            if at_flush:
                self._launched_by_backward = False
            return
        self._launched_by_backward = False
        self._reset_step_state()
        self._stale = {}  # (their sums were cleared with the rest)

    def _list_spent(self) -> None:
        """``_spent`` = the parameters whose ``param.grad`` still holds the marker step() left there: not cleared or
        replaced since (``model.zero_grad()``, ``p.grad = None`` or ``= t``). One look per parameter, in the first
        flush or reduction after a step() that no ``opt.zero_grad()`` followed."""
        markers = self._spent_grads
        self._spent = {p: True for p in self._param_list if p.grad is markers[p]}
        self._spent_unlisted = False

    def _check_no_spent_grads(self) -> None:
        """Before a reduction (``step()``, a clip, a norm): a RuntimeError where torch.optim would use a gradient
        that the last step consumed: a marker still in ``param.grad`` (torch.optim would apply it again), or a
        backward's gradient added to one (torch.optim would use the sum)."""
        if self._spent_unlisted or self._spent:
            self._list_spent()
        if self._spent:
            p = next(iter(self._spent))
            raise model_sync.spent_error(
                self._param_names[p], f"step(), a clip or a norm while the param.grad of {len(self._spent)} "
                "parameters still holds the last step()'s gradient")
        placeholders = self._placeholders
        for p in [p for p in self._stale if p.grad is not placeholders[p]]:
            del self._stale[p]  # cleared, zeroed or replaced after that backward: no sum with the spent gradient
        if self._stale:
            p = next(iter(self._stale))
            raise model_sync.spent_error(
                self._param_names[p], f"step(), a clip or a norm after a backward that added to the last step()'s "
                f"gradients ({len(self._stale)} parameters; no zero_grad() in between)")

    def _zero_spent(self, param: torch.Tensor) -> None:
        """``param.grad.zero_()`` on a :class:`~.model_sync.SpentGrad` (``model.zero_grad(set_to_none=False)``):
        as in torch.optim, ``param`` has a gradient of zeros from now on, which a backward adds to and a step
        applies (weight decay, momentum); ``param.grad`` becomes its placeholder again."""
        self._check_not_retired()
        self._spent.pop(param, None)
        self._hold_zeros(self._bucket_of[param][0], [param])

    def _hold_zeros(self, b: _Bucket, params: list, buffer_zeroed: bool = False) -> None:
        """``params`` (of bucket ``b``) hold a gradient of zeros from now on, as torch's zeroed ``param.grad``:
        their part of the grad buffer zeroed and their placeholder in ``param.grad`` (a backward adds to it, step()
        applies it). The bucket's first gradient since the last reset zero-fills the buffer and marks the others as
        without one (a later flush gives them one). ``buffer_zeroed``: the caller zero-filled the buffers without
        gradients already (zero_grad(set_to_none=False): all of them in one launch)."""
        self._after_last_step_readers()
        filled = not b.has_grads
        if filled:
            if not buffer_zeroed:
                b.grad_buffer.get_data().zero_()
            b.no_grad = {p: True for p in b.params if p not in b.placed}
            b.has_grads = True
            self._flags.eager_step_needed = True
        views, placeholders, zeroed = b.grad_buffer.get_views(), self._placeholders, self._zeroed
        for p in params:
            if not filled:
                views[self._bucket_of[p][1]].zero_()
            b.no_grad.pop(p, None)
            set_grad(p, placeholders[p])
            b.placed[p] = zeroed[p] = True

    def _launch_all(self) -> None:
        """Every bucket may be reduced now; launch all that are not yet in flight, in launch order."""
        for b in self.buckets:
            b.launch_wanted = True
        if self._coalesce and self._next_launch == 0 and not torch.compiler.is_compiling():
            self._launch_coalesced()
        else:
            self._launch_in_order()

    def _launch_coalesced(self) -> None:
        """Every bucket's reduce-scatter in one collective call (``_coalesce``), sharing one work handle."""
        self._enter_reduce()
        for b in self.buckets:
            self._zero_if_no_grads(b)
        order = [self.buckets[i] for i in self._launch_order]
        with _trace("tritonshard.reduce_scatter[coalesced]"):
            work = comm.SharedWork(comm.reduce_scatter_coalesced(
                [b.grad_buffer.get_local_shard() for b in order], [b.grad_buffer.get_data() for b in order],
                group=self._pg))
        for b in order:
            b.rs_work, b.rs_launched = work, True
        self.reduce_scatters_launched += len(order)
        self._next_launch = len(order)

    def _zero_if_no_grads(self, b: _Bucket) -> None:
        """Before ``b``'s reduction: no gradient since zero_grad() means the buffer still holds the previous
        step's, so it contributes zeros instead."""
        if not b.has_grads:
            self._after_last_step_readers()
            b.grad_buffer.zero_()
            b.has_grads = True
            b.no_grad = dict.fromkeys(b.params, True)
            self._flags.eager_step_needed = True

    def _launch_in_order(self) -> None:
        """Launch the wanted reduce-scatters, strictly in bucket order (the same order on every rank)."""
        direct = None  # (decided once per call, when there is something to launch)
        while (self._next_launch < len(self.buckets)
               and self.buckets[self._launch_order[self._next_launch]].launch_wanted):
            b = self.buckets[self._launch_order[self._next_launch]]
            if self._next_launch == 0:
                self._enter_reduce()
            if direct is None:
                direct = self._direct_collectives and not self._ordered and self._hot_path()
            self._zero_if_no_grads(b)
            with _trace("tritonshard.reduce_scatter[bucket {}]", b.index):
                if self._solo:
                    b.rs_work = COMPLETED
                elif direct:
                    # the hot path: the group was checked when the Buffer was built (layout check included)
                    b.rs_work = comm.reduce_scatter_async(b.grad_buffer.get_local_shard(), b.grad_buffer.get_data(),
                                                          self._pg)
                elif self._ordered:
                    slot = self._next_launch % 2
                    if self._scratch_user[slot] is not None:
                        self._consume_reduced(self._scratch_user[slot])
                    b.rs_slot, self._scratch_user[slot] = slot, b
                    data = b.grad_buffer.get_data()
                    b.rs_work = comm.all_to_all_single(self._scratch[slot][:data.numel()], data,
                                                       group=self.process_group, async_op=True)
                else:
                    b.rs_work = b.grad_buffer.reduce_scatter(op=dist.ReduceOp.SUM, async_op=True)
            b.rs_launched = True
            self.reduce_scatters_launched += 1
            self._next_launch += 1

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate the backward passes inside into the grad buffers without communicating (as in DDP).

        With ``overlap_comm=True`` the reduce-scatters start during the first backward outside ``no_sync()``, so
        every backward of an accumulation but the last must be inside it (a late gradient raises). Without
        overlap, communication happens only in ``clip_grad_norm_()`` / ``step()``; reducing or stepping inside
        ``no_sync()`` raises instead of silently reducing a partial accumulation.
        """
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    # ------------------------------------------------------------------ reduction, norm, clipping
    def _reduce_grads(self, for_step: bool = False, recheck: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce-scatter + 1/d scale + global sum of squares and non-finite flag; once per step. An error before
        its collectives (a check of the gradients) is told to the other ranks (:meth:`_tell_peers`).

        ``for_step`` (step()) and ``recheck`` (the loop's own entry points: opt.clip_grad_norm_, grad_norm,
        GradScaler.unscale_) look again at the gradients of a reduction made earlier in the step
        (:meth:`_check_grads_since_reduction`); the placeholders' ops (torch's clip: a norm, then a multiply per
        parameter) do not: that look reads every param.grad, and per parameter it would cost the square of their
        number, while step() looks in any case."""
        self._check_not_retired()  # (also where a step() that raised it took part in the others' reduction first)
        if self._flags.compiled_unfinished and not torch.compiler.is_compiling():
            self._finish_compiled_step()
        if self._flags.traced_reduction and self._reduced is None:
            self._adopt_traced_reduction()
        if self._reduced_early and (for_step or recheck):
            self._recheck_reduction("step" if for_step else "norm")
        if self._reduced is not None and self._frozen_at_build and not torch.compiler.is_compiling():
            # (unfrozen since the reduction: an error if it would miss a gradient; on one rank a reduction that
            # holds no gradient any more is forgotten there first, and this step's is made below, with the new
            # buckets: until session 47 the forgotten one was returned, None, and step() failed unpacking it)
            self._adopt_unfrozen()
        if self._reduced is not None:
            return self._reduced
        shaken = self._entry.position()
        try:
            reduced = self._reduce_now()
        except Exception as exc:
            self._tell_peers(exc, shaken)
            raise
        if not for_step and not torch.compiler.is_compiling():
            self._reduced_early = self._flags.eager_step_needed = True
        elif not for_step:  # (step() in the same graph clears these: _reset_step_state)
            self._flags.traced_reduction = True
            self._flags.traced_state = (reduced, self._next_launch, self._reduce_entered, self._reduction_started)
            self._flags.traced_clip_coef = None
        return reduced

    def _recheck_reduction(self, mode: str) -> None:
        """:meth:`_check_grads_since_reduction`, its error told to the other ranks (:meth:`_tell_peers`)."""
        shaken = self._entry.position()
        try:
            self._check_grads_since_reduction(mode)
        except Exception as exc:
            self._tell_peers(exc, shaken)
            raise

    def _check_grads_since_reduction(self, mode: str) -> bool:
        """Whether ``param.grad`` is still what a reduction made before ``step()`` (by a clip, a norm,
        ``GradScaler.unscale_``) took. torch.optim steps with whatever ``param.grad`` holds at its step, and a
        reduction cannot take a gradient back. ``mode`` says who asks: ``"step"``, ``"norm"`` (a clip or a norm
        after the reduction), ``"forget"`` (a backward's flush, or another optimizer or ``add_param_group`` asking
        whether this one is mid-step). True where the reduction stands (or was forgotten):

        * nothing changed: it stands (``"forget"``: unless it holds no gradient, below);
        * none of its gradients is held any more (the loop cleared them all, ``model.zero_grad()``, or replaced
          each by hand): at ``"forget"``, or where gradients were set by hand since, it is forgotten, as
          ``opt.zero_grad()`` forgets it, and what ``param.grad`` holds now (the next backward's, the hand-set
          ones) is reduced afresh, as torch.optim would step with it; a clip or a norm reduces afresh too (torch's
          finds no gradient). Where they were only cleared, ``"step"`` keeps the reduction and skips its
          parameters, which have no gradient now (on every rank: the step's handshake agrees, as for any parameter
          without one; where another rank kept gradients, the step would apply the reduction, which holds this
          rank's cleared ones: an error on every rank, see ``_without_grad_everywhere``; a rank that had no
          gradient to clear could not tell a reduction afresh from none, and its collectives would not pair: for a
          clip after such a clear, a CollectiveMismatchError there);
        * some are held and some changed (replaced, cleared or set by hand: torch.optim would step with a mix the
          reduction cannot give): a RuntimeError naming the first such parameter (``"forget"``: False).

        One look at each ``param.grad``, only in steps reduced before ``step()`` (gradients zeroed since the
        reduction are an error of their own, at the zeroing)."""
        # After the reduction each parameter's param.grad was its placeholder (it had a gradient: placed) or None
        # (gradients set by hand were flushed; a spent marker is an error before any reduction): read with map(),
        # compared with the placeholders in _param_list's order (~0.1 us per parameter, once per step)
        params = self._param_list
        with torch._C.DisableTorchFunctionSubclass():
            now = list(map(_GRAD, params))
        own = list(map(operator.is_, now, self._placeholder_list))
        held = own.count(True)  # (not now.count(None): list.count compares with ==, which a placeholder refuses)
        placed = sum(len(b.placed) for b in self.buckets)
        if held == placed == len(now) and mode != "forget":  # (the usual step: every one its placeholder still)
            return True
        empty = list(map(operator.is_, now, itertools.repeat(None))).count(True)
        set_since = len(now) - empty - held  # (gradients that are neither None nor the parameter's placeholder)
        unchanged = held == placed and set_since == 0
        if unchanged and mode != "forget":
            return True
        # (a backward adding onto a reduced gradient took its placeholder out of param.grad: still held, an error)
        if not held and not self._taken_after_launch:
            if mode != "step" or set_since:
                self._reset_step_state()  # none of the reduction's gradients is left: as after opt.zero_grad()
                self._stale = {}
                return True
            for b in self.buckets:  # ("step": no gradient left to step with, as for torch.optim)
                for p in b.placed:
                    b.no_grad[p] = True
            self._flags.eager_step_needed = True
            self._cleared_after_reduction = placed > 0  # (for the step's handshake: another rank may have kept its)
            return True
        if unchanged:
            return True
        if mode == "forget":
            return False
        placed_set = {id(p) for b in self.buckets for p in b.placed}
        changed = [(p, placeholder if id(p) in placed_set else None, new)
                   for p, placeholder, new, mine in zip(params, self._placeholder_list, now, own)
                   if not mine and (id(p) in placed_set or new is not None)]
        p, old, new = next((c for c in changed if c[2] is not None), changed[0])
        how = "cleared (param.grad = None; others were not)" if new is None else "replaced" if old is not None else "set"
        raise RuntimeError(
            f"the gradient of {self._param_names[p]} was {how} after the gradients were reduced (by a clip, a norm "
            f"or GradScaler.unscale_(opt)) and before step(): torch.optim would step with param.grad as it is now "
            f"({len(changed)} parameters changed), and the reduction cannot take it back. Set, replace or clear "
            "gradients before clipping or unscaling, or clear them all (opt.zero_grad()) and run the backward again")

    def _reduce_now(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._no_sync_depth:
            raise RuntimeError("clip_grad_norm_()/step() inside no_sync(): leave the context first" + (
                " (here: the DistributedDataParallel's require_backward_grad_sync was set False; set it True before "
                "the last micro-batch's forward, as DDP needs)" if self._in_ddp_no_sync else ""))
        if self._spent_unlisted or self._spent or self._stale:
            self._check_no_spent_grads()
        self.sync_from_model()
        if not torch.compiler.is_compiling():  # (a compiled step takes the gradients its backward flushed)
            self._flush_buckets(self.buckets, model_checked=True)  # gradients set by hand, without a backward
        return self._run_reduction()

    def _run_reduction(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reduction itself, after :meth:`_reduce_now`'s checks (its collectives come first: the "reduce"
        handshake, unless ``overlap_comm`` shook hands at the end of backward)."""
        self._reduction_started = True
        if self._graphs is not None and not torch.compiler.is_compiling():
            # cuda_graph=True: what runs on the host stays out of the graph (the handshake, a buffer that got no
            # gradient zeroed), the rest is captured once and replayed (graphs.py)
            self._enter_reduce()
            for b in self.buckets:
                self._zero_if_no_grads(b)
            self._graphs.run("reduce", True, self._reduce_phase, self._after_reduce_replay)
        else:
            self._reduce_phase()
        self._reduced = self._reduced_bufs
        return self._reduced

    def _reduce_phase(self) -> None:
        """The device work of :meth:`_reduce_grads`: every bucket's reduce-scatter, the norm pass, its finalize, the
        all-reduce of the totals, and the fp32 ``(sum_sq, found_inf)`` in ``_reduced_bufs``."""
        self._launch_all()
        self._adopt_observed_order()
        self._partials_of_pieces = False
        if not self._consume_all_reduced():
            for i in self._launch_order:
                self._consume_reduced(self.buckets[i])
        # rounded to fp32 once, after the fp64 sums over blocks, buckets and ranks: the same bits for any layout
        # (also blocks cut at the pieces instead of the shards). On one rank the finalize's store rounds (into
        # _reduced_pair, the fp32 (sum_sq, found_inf)); with more, after the all-reduce of the fp64 totals, in one
        # launch (kernels/scalars.py)
        many = comm.is_initialized() and self.world_size > 1
        totals = self._norm_totals if many else self._reduced_pair
        if self._partials_of_pieces:
            workspace, key = self._piece_norm_plan.workspace, "finalize pieces"
        else:
            workspace, key = self._norm_workspace, "finalize"
        if self._hot_path():  # one launch for every bucket, bound (the same tensors every step)
            spec = self._finalize_specs.get(key)
            if spec is None:
                spec = self._finalize_specs[key] = finalize_launch_spec(workspace, totals)
            _launch.launch(self._norm_launches, key, spec, lambda: kernels().finalize_sum_sq_(workspace, totals))
        else:
            kernels().finalize_sum_sq_(workspace, totals)
        if many:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.process_group)
            if self._scalar_kernels_run():  # (one bound launch instead of three ops, kernels/scalars.py)
                args = (totals, self._reduced_pair)
                _scalars.round_totals_kernel(_scalars.round_totals_launch_spec(*args), self._scalar_launches,
                                             lambda: _scalars.round_totals_(*args))
            else:
                sum_sq, found_inf = self._reduced_bufs
                sum_sq.copy_(totals[0])
                found_inf.copy_(torch.gt(totals[1], 0, out=self._nonfinite_buf))

    def _after_reduce_replay(self) -> None:
        """The host state :meth:`_reduce_phase` leaves, set after a replay of its graph: every bucket launched and
        waited for (the checks of a late or cleared gradient read it). With ``overlap_comm`` on one rank the end of
        the backward launched them already (each the identity there, its bookkeeping on the host): counted once."""
        self.reduce_scatters_launched += sum(not b.rs_launched for b in self.buckets)
        for b in self.buckets:
            b.launch_wanted = b.rs_launched = True
        self._next_launch = len(self.buckets)

    def _enter_reduce(self) -> None:
        """The "reduce" handshake (comm.EntryCheck), once per step: at the first reduce-scatter launch, or before a
        captured reduction, whose replay runs no Python."""
        if not self._reduce_entered:
            self._reduce_entered = True
            self._entry("reduce")

    def _consume_all_reduced(self) -> bool:
        """:meth:`_consume_reduced` for every bucket, the norm passes in one launch, where the kernels allow (see
        :meth:`_flatten_together`). Its blocks are cut at the pieces of the shards (each parameter's part of this
        rank's shard, :meth:`_make_norm_pieces`), their partials in the pieces' workspace, which the finalize
        sums (``_partials_of_pieces``), so torch's per-parameter norms later in the step add those partials up
        instead of reading the gradients again (:meth:`_piece_sums_of_squares`); else (no piece plan, a cuda_graph
        capture, whose replays run no Python) each grad shard's partials into its slice of the workspace, the same
        values as per bucket. False, having done nothing, where each bucket takes its own steps: with
        ``ordered_reduce`` (a fold per bucket) or a replica group (an all-reduce per bucket), or one bucket."""
        if self._ordered or self.replica_size > 1 or len(self.buckets) < 2 or not self._flatten_together():
            return False
        plan = self._piece_plan() if self._graphs is None else None
        spec = plan.spec(self._grad_average) if plan is not None else None
        if spec is not None:
            for i in self._launch_order:
                self._wait_reduced(self.buckets[i])

            def checked_pieces():
                for v, part in zip(plan.views, plan.slices):
                    kernels().sum_sq_partials_(v, self._grad_average, part)
            with _trace("tritonshard.kernel.sum_sq_partials_"):
                _launch.launch(self._norm_launches, "norm pieces", spec, checked_pieces)
            self._partials_of_pieces = True
            return True
        shards = [b.grad_buffer.get_local_shard() for b in self.buckets]
        if self._norm_spec is None:  # built once: the shards and the workspace never move, the factor is 1/d
            self._norm_spec = partials_multi_launch_spec(
                shards, self._grad_average, [b.norm_partials for b in self.buckets]) or False
        if self._norm_spec is False:
            return False
        for i in self._launch_order:
            self._wait_reduced(self.buckets[i])

        def checked_launches():
            for b, shard in zip(self.buckets, shards):
                kernels().sum_sq_partials_(shard, self._grad_average, b.norm_partials)
        with _trace("tritonshard.kernel.sum_sq_partials_"):
            _launch.launch(self._norm_launches, "norm", self._norm_spec, checked_launches)
        return True

    def _wait_reduced(self, b: _Bucket) -> bool:
        """Wait for ``b``'s reduction (on the device: the current stream waits); False when none was in flight."""
        if b.rs_work is None:
            return False
        with _trace("tritonshard.wait_reduce_scatter[bucket {}]", b.index):
            b.rs_work.wait()
        b.rs_work = None
        return True

    def _consume_reduced(self, b: _Bucket) -> None:
        """Wait for ``b``'s reduction and run its norm pass (partials into its slice of the shared workspace);
        with ``ordered_reduce``, that pass also adds the all-to-all's rows into the shard and frees the scratch."""
        if not self._wait_reduced(b):
            return
        shard = b.grad_buffer.get_local_shard()
        bound = self._hot_path()
        if self._ordered:
            rows = self._scratch[b.rs_slot][:b.grad_buffer.padded_numel].view(self.world_size, -1)
            if bound:
                rows = b.scratch_rows.setdefault(b.rs_slot, rows)  # the same view object every step: bindable
                _launch.launch(b.launches, ("fold", b.rs_slot),
                               fold_rows_launch_spec(rows, shard, self._grad_average, b.norm_partials),
                               lambda: kernels().fold_rows_(rows, shard, self._grad_average, b.norm_partials))
            else:
                kernels().fold_rows_(rows, shard, self._grad_average, b.norm_partials)
            self._scratch_user[b.rs_slot] = None
            if self.replica_size == 1:
                return  # the fold took the norm pass's statistics
            # hybrid: the replicas' sum (at most 2 replicas, checked at construction: one exact add), then the
            # statistics of that sum below, replacing the fold's
        if self.replica_size > 1:  # hybrid: the same shard on every replica, summed over them
            dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=self.replica_group)
        # read-only: the shard keeps the SUM; the 1/d average is applied in the update's grad_scale
        # the bucket's per-program partials into its slice of one workspace, allocating nothing
        if bound:
            _launch.launch(b.launches, "norm", partials_launch_spec(shard, self._grad_average, b.norm_partials),
                           lambda: kernels().sum_sq_partials_(shard, self._grad_average, b.norm_partials))
        else:
            kernels().sum_sq_partials_(shard, self._grad_average, b.norm_partials)

    def _adopt_observed_order(self) -> None:
        """Once, after the first backward: launch later steps' reduce-scatters in the order buckets completed
        (rank 0's observation, broadcast, so every rank agrees); buckets that never completed go last. The one
        host read of the whole optimizer (``tolist()``), in the first step only."""
        if self._observed_order is None:
            return
        # every rank takes part in the broadcast, also one whose backward produced no gradient (nothing observed),
        # so the collectives stay matched; rank 0's observation decides
        seen = self._observed_order
        order = seen + [i for i in range(len(self.buckets)) if i not in seen]
        self._observed_order = None
        if comm.is_initialized() and self.world_size > 1:
            t = torch.tensor(order, dtype=torch.int64, device=self.device)
            src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
            dist.broadcast(t, src=src, group=self.process_group)
            order = t.tolist()
        self._launch_order = order

    def _reset_step_state(self, spent: bool = False) -> None:
        """Forget this step's gradients: ``param.grad`` None (``zero_grad()``), or with ``spent=True`` (``step()``)
        each placeholder replaced by the parameter's :class:`~.model_sync.SpentGrad` marker."""
        compiling = torch.compiler.is_compiling()
        if self._flush_queued and not compiling:
            self._forget_dead_backward()
        if (self._many_ranks and self._reduce_entered and self._reduced is None and not self._reduction_started
                and not compiling and any(b.rs_work is not None for b in self.buckets)):
            # overlap_comm: the end of a backward launched this step's reduction, and this rank drops it unused
            # (zero_grad(), or every gradient cleared: _forget_discarded_launches). Another rank that keeps its
            # own runs the rest of the reduction's collectives in its step(), so this one takes part in them too:
            # until session 25 it went on into its next call's collectives instead, and the ranks waited for each
            # other for good (a hang). Now that rank's step meets this one's next call at the handshake: a
            # CollectiveMismatchError on both; where every rank drops it, they all take part, as before in effect.
            self._run_reduction()  # (its result goes with the rest below)
        for b in self.buckets:
            if b.rs_work is not None:  # launched but never consumed (zero_grad() after backward): finish it
                b.rs_work.wait()
            b.rs_work, b.rs_launched, b.launch_wanted, b.has_grads = None, False, False, False
        self._scratch_user = [None, None]
        placeholders, markers = self._placeholders, (self._spent_grads if spent else None)
        if self._missing_here:
            if spent and not compiling:  # (DDP would have put the average in their param.grad: used, so spent)
                for p in self._missing_here:
                    if p.grad is None:
                        set_grad(p, markers[p])
                        self._spent_unlisted = True
            self._missing_here = []
        self._list_dependent = self._cleared_after_reduction = False
        # (inside a backward, the gradients it has given so far are still this backward's: a reset from its flush,
        # which forgets a reduction the loop cleared since, keeps them, or a bucket half-ready then would wait for
        # the end of the backward to launch)
        in_backward = not compiling and torch._C._current_graph_task_id() != -1
        if not in_backward:  # (the sums shown to the loop's hooks go with the gradients; inside a backward, its flush
            self._sums_to_show.clear()  # settles them next)
            self._sums_shown.clear()
        if compiling:  # (the markers need the parameters: the next eager call places them)
            self._flags.compiled_unfinished = self._flags.compiled_unfinished or spent
        else:
            self._flags.compiled_unfinished = False  # (placed below)
        for b in self.buckets:
            if not in_backward:
                b.ready.clear()
            if not compiling:  # step() and zero_grad() consume the gradients (see SpentGrad for step()'s markers)
                if spent and b.placed:
                    self._spent_unlisted = True
                with _PLAIN_ATTRS():
                    if len(b.placed) == len(b.params):  # (every one: walk the lists made for that, no look-ups)
                        for p, placeholder, marker in zip(b.params, b.grad_placeholders,
                                                          b.spent_markers if spent else itertools.repeat(None)):
                            if p.grad is placeholder:
                                set_grad(p, marker)
                    else:
                        for p in b.placed:
                            if p.grad is placeholders[p]:
                                set_grad(p, markers[p] if markers is not None else None)
                b.placed.clear()
            if b.no_grad:
                b.no_grad = {}
        self._next_launch = 0
        self._flags.eager_step_needed = True  # (nothing has a gradient now)
        self._flags.traced_reduction = False
        self._flags.traced_state = self._flags.traced_clip_coef = None
        self._reduce_entered = self._step_entered = self._lr_filled = self._reduction_started = False
        self._launched_by_backward = self._taken_after_launch = False
        if not compiling:  # (keyed by the parameters, which dynamo would wrap, and their param.grad, which it
            # cannot: the eager rerun after a compiled step clears it, _finish_compiled_step)
            self._zeroed.clear()
            self._zeroed_plain.clear()
        self._reduced, self._clip_coef, self._reduced_early = None, None, False
        self._clamped = self._partials_of_pieces = False
        self._step_cache.clear()
        self._grad_multipliers.clear()
        self._all_multipliers.clear()
        self._reciprocals.clear()
        self._norm_cache.clear()

    # ------------------------------------------------------------------ parameter all-gathers
    def wait_for_params(self, buckets=None) -> None:
        """Wait until the all-gather of every bucket in ``buckets`` (default: all) has landed in the parameters.
        ``buckets``: the optimizer's buckets (``opt.buckets``), or parameters (the buckets that hold them), or both;
        anything else is a TypeError, a parameter this optimizer does not hold a ValueError, before any wait."""
        if buckets is None:
            chosen = self.buckets
        else:
            if isinstance(buckets, (torch.Tensor, _Bucket)):
                buckets = [buckets]
            chosen = []
            for i, item in enumerate(buckets):
                if isinstance(item, _Bucket):
                    chosen.append(item)
                elif isinstance(item, torch.Tensor):
                    b = self._bucket_by_id.get(id(item))
                    if b is None:
                        raise ValueError(f"wait_for_params: buckets[{i}] is a tensor of shape {tuple(item.shape)} "
                                         "that no bucket of this optimizer holds (frozen, or another optimizer's)")
                    chosen.append(b)
                else:
                    raise TypeError(f"wait_for_params: buckets[{i}] must be a bucket of this optimizer (opt.buckets) "
                                    f"or a parameter, got {type(item).__name__}")
        self._wait_buckets(chosen)

    def _wait_buckets(self, buckets) -> None:
        """:meth:`wait_for_params` over buckets of this optimizer, unchecked (the guards' read paths)."""
        for b in buckets:
            if b.ag_work is not None:
                b.wait_gather()

    def attach(self, model: torch.nn.Module, *, cast_forward_inputs: bool = True,
               broadcast_buffers: bool = True) -> list:
        """Tell the optimizer which model it trains: recommended for every model, needed for some idioms.

        * ``cast_forward_inputs=True``: the floating-point tensors among the model's inputs (positional and keyword,
          through tuples, lists and dicts) are cast to ``param_dtype`` before its forward, as FSDP2's
          ``MixedPrecisionPolicy(cast_forward_inputs=True)`` does: construction made the weights bf16 (or fp16),
          and fp32 inputs would fail the first matmul. Integer inputs (token ids, masks) are left alone. Pass
          False to feed the inputs as they are (e.g. under ``torch.autocast``, or a model that casts itself).

        * Errors name parameters by their names in ``model`` (``model.layers.0.mlp.up_proj.weight``).
        * ``model`` must hold some of the optimizer's parameters (a ValueError otherwise: another model's training
          would step nothing); it may hold others (a frozen base model around trained adapters).
        * ``step()`` checks that the model still holds the optimizer's parameters (``load_state_dict(...,
          assign=True)`` or ``setattr`` would replace them: an error, not a model that silently stops training).
        * A ``DistributedDataParallel`` wrapped around the model later (accelerate's ``prepare``, Lightning) keeps
          working: its own gradient reduction is switched off at its first forward, as tritonshard reduces the
          gradients already; the gradients of the model's parameters that no tritonshard optimizer holds are
          averaged at the end of each backward DDP would have reduced, as DDP would; its
          ``require_backward_grad_sync`` flag set False (nanoGPT) is ``opt.no_sync()``; ``join()`` is refused.
          ``model`` may also be such a wrapper.
        * ``model.no_sync()`` is ``opt.no_sync()`` (accelerate's ``accumulate()`` calls it): of every optimizer
          attached to the model.
        * With ``init_sync`` (the default) and more than one rank, the model's buffers take rank 0's values, as DDP's
          construction broadcasts them (the parameters did at the optimizer's construction): a collective, every
          rank attaches the same model.
        * ``broadcast_buffers=True`` (DDP's name and default): so they do again at the start of every forward run
          with grad enabled outside ``no_sync()``, as DDP's forward does: every such forward starts from rank 0's
          BatchNorm statistics, so the ranks' differ by at most their last batch's update. Per such forward of a
          model with buffers on the optimizer's device (nothing where it has none, or at one rank): a handshake,
          and one coalesced broadcast where any rank's buffers changed since the last (see
          ``_broadcast_model_buffers``); forwards under ``torch.no_grad()`` (evaluation, generation, on some ranks
          only) run neither. False: each rank keeps its own. Buffers registered after ``attach`` are not broadcast
          (DDP's list is made at its construction too); those ``.to()`` replaces are.
        * With ``overlap_comm=True``: the parameter all-gathers that ``step()`` launches overlap with the next
          forward (a forward pre-hook on every module owning parameters waits for its buckets only), and the
          end-of-backward flush is queued from the model's outputs, so reentrant activation checkpointing works.
          Until the next forward, the model's own read and write paths wait for the gathers first:
          ``state_dict()`` (so ``save_pretrained``), ``load_state_dict()``, ``.to()`` and friends, pickling;
          ``parameters()`` and ``named_parameters()`` each parameter's as they hand it out, a parameter read as an
          attribute (``model.lm_head.weight``) or through ``.data`` its own (``model.zero_grad()``, which reads
          no weight, none). A parameter taken from the model *before* ``step()`` and used after it otherwise
          (a list of them made earlier) needs ``opt.wait_for_params()`` first.

        The model's class is replaced by a subclass of it (as FSDP2's ``fully_shard`` does; ``isinstance`` holds,
        pickles and deep copies get the original class). Returns the hook handles.
        """
        self._check_not_retired()
        ddp_type = torch.nn.parallel.DistributedDataParallel
        if isinstance(model, ddp_type):
            # ddp.parameters() reads the inner model's tensors directly; and tritonshard reduces the gradients:
            # the guard switches DDP's reduction off
            model_sync.guard_model(model, self)
            model = model.module
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"attach() takes the torch.nn.Module being trained, got {type(model).__name__}")
        for name, value in (("cast_forward_inputs", cast_forward_inputs), ("broadcast_buffers", broadcast_buffers)):
            check_flag(name, value, "")
        options = {"cast_forward_inputs": cast_forward_inputs, "broadcast_buffers": broadcast_buffers}
        if self._attached is not None and self._attached[0] is model:
            # attached already (the loop's attach and an integration's, or a DDP made since and attached too): the
            # same hooks. A second set ran the root hooks twice per forward (the buffers broadcast twice, until
            # session 27)
            if options != self._attach_options:
                raise ValueError(f"attach(): the model is attached already, with {self._attach_options}; got "
                                 f"{options} (its hooks are made once: pass the same options)")
            return self._attached[1]
        frozen = {id(p) for p in self._frozen_at_build}  # (the bucketed ones: _param_by_id)
        if not any(id(p) in self._param_by_id or id(p) in frozen for p in model.parameters()):
            # (another model than the one the optimizer was built over: its training would step nothing, silently)
            raise ValueError(f"attach(): {type(model).__name__} holds none of this optimizer's parameters; attach "
                             "the model whose parameters the optimizer was built over")
        # a wrapper around the model attached before (torch.compile's OptimizedModule, PEFT's PeftModel, a user's
        # nn.Module): its root hooks give way to the wrapper's, which run first and around the whole forward, and
        # its modules keep their waits. Until session 30 both sets ran: two buffer handshakes and broadcasts per
        # forward on >1 rank, two waits per module with overlap_comm (the results were the same)
        wrapped = (self._attached if self._attached is not None and any(m is self._attached[0] for m in model.modules())
                   else None)
        self._check_norm_statistics(model)
        self._sync_model_buffers(model)
        self._broadcast_buffers = broadcast_buffers
        # where the buffers live, found once (a walk over a 24-layer Llama's 319 modules costs ~185 us per forward);
        # read there at every forward, so .to() and friends, which replace the tensors, are followed. Buffers
        # registered after attach are not broadcast (DDP's list is made at construction too)
        self._buffer_slots = (model, [(m, name) for _, m in model.named_modules() for name in m._buffers])
        self._buffers_seen = None  # (the first training forward broadcasts)
        cast_to = self.param_dtype if cast_forward_inputs else None
        handles = [model.register_forward_pre_hook(model_sync.RootForwardPreHook(self, cast_to), with_kwargs=True)]
        if self.overlap_comm:
            handles.append(model.register_forward_hook(model_sync.RootForwardHook(self)))
            self._defer_gathers = self._overlap_machinery
        if wrapped is not None:
            _, old_handles = wrapped
            for handle in old_handles[:self._root_handles]:
                handle.remove()
            handles += old_handles[self._root_handles:]  # (its modules' waits: the wrapper's forward runs them)
        self._root_handles = 1 + self.overlap_comm  # (the first handles of _attached's list: see above)
        handles += self._attach_buckets(model, self.buckets)
        self._attached = (model, handles)
        self._attach_options = options
        ddp = model_sync.ddp_around(model)
        if ddp is not None:  # (a DDP guarded around it already, for another optimizer: this one's too from here, in
            # the no_sync() it is in; until session 28 only from its next forward, so a ddp.no_sync() entered
            # before that left this optimizer out, an error at the next micro-batch with overlap_comm)
            model_sync.guard_model(ddp, self)
        return handles

    def _attach_buckets(self, model: torch.nn.Module, buckets: list) -> list:
        """attach()'s work per bucket, for ``buckets`` (all of them, or those add_param_group made after attach):
        the parameters' names in the model, the gather order, the guards, and with overlap_comm a forward pre-hook
        on each module owning some of them that waits for their gathers. Returns the new hook handles."""
        known = set(self._bucket_of) | set(self._frozen_at_build)
        for name, p in model.named_parameters(remove_duplicate=False):
            if p in known and p not in self._named_by_model:
                self._named_by_model.add(p)
                self._param_names[p] = repr(name)
        self._model_params = [(module, local, p) for module in model.modules()
                              for local, p in module._parameters.items() if p is not None and p in known]
        handles = []
        if self._overlap_machinery:
            indices = {b.index for b in buckets}
            for module in model.modules():
                owned = sorted({self._bucket_of[p][0].index for p in module.parameters(recurse=False)
                                if p in self._bucket_of} & indices - self._waited_buckets(module))
                if owned:
                    handles.append(module.register_forward_pre_hook(model_sync.WaitForParamsHook(self, owned)))
        self._set_gather_order([p for _, p in model.named_parameters(remove_duplicate=False)])
        self._guard_modules(model)
        return handles

    def _waited_buckets(self, module: torch.nn.Module) -> set:
        """The buckets whose gathers a WaitForParamsHook of this optimizer on ``module`` waits for already (made by
        an attach of a model inside the one attached now, or by add_param_group)."""
        return {i for h in module._forward_pre_hooks.values()
                if type(h) is model_sync.WaitForParamsHook and h.optimizer() is self for i in h.bucket_indices}

    def _hook_new_modules(self) -> None:
        """overlap_comm + attach, at the model's first forward after a submodule was set in one of its guarded
        modules: a module holding some of the parameters without a WaitForParamsHook (made or swapped in after
        attach, holding the same Parameter objects: SyncBatchNorm.convert_sync_batchnorm, ``model.fc =
        Wrapper(model.fc)``) gets one, and the guards; until session 27 its forward read the parameters while
        their all-gathers wrote them (since 38599c2 an error at its backward, which a swap bypassing
        ``__setattr__``/``add_module``, e.g. ``model._modules[k] = m``, still gets)."""
        self._new_modules = False
        model, handles = self._attached
        for module in model.modules():
            if self._waited_buckets(module):
                continue  # (hooked by attach or add_param_group)
            owned = sorted({self._bucket_of[p][0].index for p in module.parameters(recurse=False)
                            if p in self._bucket_of})
            if owned:
                handles.append(module.register_forward_pre_hook(model_sync.WaitForParamsHook(self, owned)))
        self._guard_modules(model)

    def _guard_modules(self, model: torch.nn.Module) -> None:
        """Guard ``model`` and every module inside it that holds some of the optimizer's parameters, each waiting
        for the all-gathers of its own buckets: a wrapper's inner model (torch.compile's ``_orig_mod``, PEFT's
        ``base_model.model``, DDP's ``module``) and any block a user reads on its own (``model.layers[3]
        .state_dict()``, an EMA over ``model.transformer.parameters()``) see the new weights right after step()."""
        every = len(self.buckets)
        for module in model.modules():
            owned = {self._bucket_of[p][0].index for p in module.parameters() if p in self._bucket_of}
            # (with overlap_comm, a module holding some of them itself guards its attributes too)
            attributes = self._overlap_machinery and any(p in self._bucket_of for p in module._parameters.values())
            if module is model or len(owned) == every:
                model_sync.guard_model(module, self, attributes=attributes)
            elif owned:
                model_sync.guard_model(module, self, sorted(owned), attributes=attributes)

    def _set_gather_order(self, params_in_forward_order: list) -> None:
        """Buckets sorted by the earliest position of any of their parameters in ``params_in_forward_order``."""
        position = {}
        for i, p in enumerate(params_in_forward_order):
            position.setdefault(p, i)
        first_use = [min((position.get(p, len(position)) for p in b.params), default=0) for b in self.buckets]
        self._gather_order = sorted(range(len(self.buckets)), key=lambda i: (first_use[i], i))
        self._group_step_units()

    def _group_step_units(self) -> None:
        """:attr:`_step_units` from the buckets' counters, in gather order."""
        units: dict = {}
        for i in self._gather_order:
            b = self.buckets[i]
            units.setdefault(b.counter_index, []).append(b)
        #: (group index, its buckets that share a step counter, in gather order), in the order of their first
        #: bucket: what one segmented update launch covers (one per param group, but where parameters unfrozen
        #: after construction, or loaded with another count, count their own steps: param_steps.py)
        self._step_units = [(buckets[0].group_index, buckets) for buckets in units.values()]

    def _before_model_forward(self, module: torch.nn.Module) -> None:
        """Root forward pre-hook. A DistributedDataParallel wrapper running this forward would all-reduce the
        gradients a second time: turn its reduction off before its post-forward prepares one
        (:meth:`_on_ddp_forward`). Then, in a training forward, rank 0's buffers (``broadcast_buffers``)."""
        if self._flush_queued and not torch.compiler.is_compiling():
            self._forget_dead_backward()
        if self._new_modules and self._overlap_machinery and not torch.compiler.is_compiling():
            self._hook_new_modules()
        ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if ddp is not None and ddp.module is module:
            # (eagerly under a compiled DDP: it looks at the parameters, whose placeholder grads dynamo cannot wrap)
            if torch.compiler.is_compiling():
                _EAGERLY["ddp_forward", "forward"](self, ddp)
            else:
                self._on_ddp_forward(ddp)
        if (self._broadcast_buffers and torch.is_grad_enabled() and not self._no_sync_depth
                and self.world_size * self.replica_size > 1):
            # (a collective: eager under a compiled model, as DDP runs its own outside it)
            _EAGERLY["buffers", "forward"](self, module)

    def _on_ddp_forward(self, ddp) -> None:
        """A forward of ``ddp``, around the attached model: its reduction off (the guard, put on here where it was
        wrapped after attach: accelerate's prepare), ``join()`` refused, and its unheld parameters noted. DDP also
        averages the gradients of the parameters no tritonshard optimizer holds (a torch.optim optimizer over some
        of the model, or none), which this optimizer's reduction does not cover. So the end of the backward that
        follows a training forward outside ``no_sync()`` averages those (:func:`model_sync.average_like_ddp`),
        done by the optimizer attached last (one per wrapper). Until session 27 they kept each rank's own
        gradient: the replicas of those parameters drifted apart, silently. Nothing to do, and no cost beyond
        this call, for a model that no DDP wraps."""
        guards = ddp._tritonshard_guards() if isinstance(ddp, model_sync._GuardedModule) else ()
        if not any(opt is self for opt, _ in guards):  # (each optimizer attached to the model: until session 28
            # the first one's only, so where it was deleted DDP reduced again, beside the others' reduction)
            model_sync.guard_model(ddp, self)  # (its reduction off from here: its flag reads False)
            guards = ddp._tritonshard_guards()
        model_sync.check_not_joined(ddp)
        if not guards or guards[-1][0] is not self or not torch.is_grad_enabled() or self._no_sync_depth:
            self._ddp_pending = None
            return
        self._ddp_pending = ddp if self._ddp_unheld(ddp) else None

    def _ddp_unheld(self, ddp) -> list:
        """``ddp``'s parameters that no tritonshard optimizer held when first asked (trainable or not), each with a
        hook that queues the end-of-backward callback: found once per wrapper, not per step (~80 us for 300
        parameters on this repo's CPU machine). One of them held since (an optimizer built or a group added over
        it later) is left out where they are averaged (:meth:`_average_for_ddp`); where a holder has gone since
        (``del`` of another tritonshard optimizer, a torch.optim one training its parameters from here) they are
        looked for again (until session 28 not: their gradients stayed each rank's own, silently)."""
        cached = self._ddp_unheld_cache
        if cached is not None and cached[0]() is ddp and cached[3] == HOLDERS_GONE[0]:
            return cached[1]
        if cached is not None:
            for handle in cached[2]:
                handle.remove()
        params = model_sync.unheld(model_sync.ddp_params(ddp))
        hook = model_sync.QueueEndOfBackwardHook(self)
        handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
        self._ddp_unheld_cache = (weakref.ref(ddp), params, handles, HOLDERS_GONE[0])
        return params

    def _ddp_wants_sync(self, wants: bool) -> None:
        """The loop wrote ``wants`` to ``require_backward_grad_sync`` of a DDP around the attached model
        (model_sync._GuardedDDP): False is this optimizer's ``no_sync()`` until True comes."""
        if not wants and not self._in_ddp_no_sync:
            self._no_sync_depth += 1
            self._in_ddp_no_sync = True
        elif wants and self._in_ddp_no_sync:
            self._no_sync_depth -= 1
            self._in_ddp_no_sync = False

    def _average_for_ddp(self) -> None:
        """The end of a backward after :meth:`_on_ddp_forward`: average the unheld parameters' gradients."""
        ddp, self._ddp_pending = self._ddp_pending, None
        params = [p for p in self._ddp_unheld(ddp) if p.requires_grad and not model_sync.held(p)]
        model_sync.average_like_ddp(params, ddp.process_group)

    def _check_norm_statistics(self, model: torch.nn.Module) -> None:
        """A BatchNorm (or an InstanceNorm keeping statistics) whose weight construction made ``param_dtype`` while
        its running statistics stayed float32 fails its first forward, in training and evaluation, on CPU with
        "expected scalar type BFloat16 but found Float" (torch's batch_norm takes parameters and statistics of one
        dtype, or a low-precision input with float32 parameters and statistics). A ValueError here instead, naming
        the module and the two ways out. On CUDA the H200 run of 2026-12-04 found a training forward with a bf16
        input running; whether the backward and an eval forward do too is what benchmarks.sync_check's probe asks
        at the next GPU run (its FAILED line says the check is too strict there). Until then it holds everywhere:
        a clear error where a loop might fail later in torch."""
        for name, m in model.named_modules():
            if not isinstance(m, torch.nn.modules.batchnorm._NormBase) or m.running_mean is None:
                continue
            weight = m.weight  # (None without affine)
            if weight is not None and weight in self._param_names and m.running_mean.dtype != weight.dtype:
                raise ValueError(
                    f"attach(): {type(m).__name__} {name or '(the model)'!r} has its weight in {weight.dtype} (this "
                    f"optimizer's param_dtype) and its running statistics in {m.running_mean.dtype}; torch's "
                    f"batch_norm takes them in one dtype, so its first forward would fail. Either cast the model "
                    f"before building the optimizer (model.to({weight.dtype}): the statistics in {weight.dtype} "
                    f"too), or leave the normalization's parameters out of this optimizer (they stay "
                    f"{m.running_mean.dtype}, which batch_norm takes with {weight.dtype} inputs; FSDP1's mixed "
                    f"precision keeps BatchNorm in float32 the same way)")

    def _broadcast_model_buffers(self, module: torch.nn.Module) -> None:
        """``attach(broadcast_buffers=True)``, before a training forward: the model's buffers on the optimizer's
        device take rank 0's values (DDP's ``_sync_buffers``; a DDP the optimizer turned off no longer does it: its
        forward broadcasts only while it reduces gradients itself).

        A handshake first (the "buffers" entry): a rank training on while another calls ``state_dict()`` alone
        gets a CollectiveMismatchError there, not a broadcast that waits forever. Its flag says whether any
        rank's buffers changed since the last broadcast (a tensor's version counter moved, or a tensor was
        replaced): where none did (a rotary embedding's ``inv_freq``, a causal mask), the broadcast is skipped, and
        the forward costs the handshake alone (40 bytes per rank on CPU). With ``check_collectives=False``, no
        handshake and a broadcast every time."""
        model, slots = self._buffer_slots
        found = (m._buffers.get(name) for m, name in slots) if model is module else module.buffers()
        buffers = list({id(b): b for b in found if b is not None and b.device == self.device}.values())
        if not buffers or not comm.is_initialized():
            return
        seen = self._buffers_seen
        changed = seen is None or len(seen) != len(buffers) or any(
            b is not was or b._version != version for b, (was, version) in zip(buffers, seen))
        # (without the handshake, check_collectives=False, the ranks cannot agree on skipping: every time, as DDP)
        if self._entry("buffers", flag=changed) if self._entry.active else True:
            self._from_rank_0([b.detach() for b in buffers])
        self._buffers_seen = [(b, b._version) for b in buffers]  # (after the broadcast, which wrote them)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over all ranks (padding excluded), as a device tensor; clip to ``max_norm``.

        The clipping itself is folded into the update's ``grad_scale`` (no extra pass over the gradients). With
        ``norm_type=2`` the norm comes from the sums of squares the scale kernel produced; other norms take one
        extra read of the gradient shards. A non-finite norm means the step will be skipped.
        """
        if torch.compiler.is_compiling() and (why := self._eager_when_compiled()) is not None:
            return _EAGERLY["clip", why](self, max_norm, norm_type)
        return self._clip_grad_norm(max_norm, norm_type)

    def _clip_grad_norm(self, max_norm, norm_type):
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
        norm_type = float(norm_type)
        sum_sq, _ = self._reduce_grads(recheck=True)
        if (norm_type == 2.0 and not self._clamped and self._scale is None and self._clip_coef is None
                and not self._grad_multipliers and not self._all_multipliers and self._scalar_kernels_run()):
            # the usual clip: the norm, a new tensor at every call as torch's (which the bound launch takes afresh),
            # and its coefficient in one launch (kernels/scalars.py), the same bits as torch's ops: compiled, the
            # norm's sqrt is in it too (no torch op; until session 36 a sqrt and a clone), under the interpreter it
            # is torch's (on a CPU tensor not always correctly rounded: see there)
            self._common_multiplier()  # (None, as no torch code multiplied the gradients; it notes that)
            compiled = compiled_path(self.device)
            norm = torch.empty((), dtype=torch.float32, device=self.device) if compiled else torch.sqrt(sum_sq)
            args, options = (norm, self._clip_buf, max_norm), (dict(sum_sq=sum_sq) if compiled else {})
            _scalars.clip_coefficient_kernel(_scalars.clip_coefficient_launch_spec(*args, **options),
                                             self._scalar_launches,
                                             lambda: _scalars.clip_coefficient_(*args, **options))
            self._clip_coef = self._clip_buf
            if self._flags.traced_reduction:  # (under torch.compile: see _adopt_traced_reduction)
                self._flags.traced_clip_coef = self._clip_coef
            return norm
        if norm_type == 2.0 and not self._clamped:
            total = sum_sq.sqrt()
            if self._scale is not None:
                total = total / self._scale  # the norm of the true (unscaled) gradients
        else:  # from the per-parameter norms (averaged, unscaled; validates norm_type)
            per_param = self._param_grad_norms(norm_type)
            if not per_param.numel():
                total = torch.zeros((), dtype=torch.float32, device=self.device)
            elif norm_type == math.inf:
                total = per_param.amax()
            else:
                total = per_param.pow(norm_type).sum().pow(1.0 / norm_type)
        multiplier = self._common_multiplier()
        if multiplier is not None:  # torch code already scaled the gradients (e.g. torch's clip_grad_norm_)
            total = total * multiplier
        earlier = self._clip_coef
        if earlier is not None:  # a second clip this step: of the gradients the first one clipped, as torch's
            total = total * earlier  # (until session 26 it saw them unclipped, and returned their norm)
        # torch.nn.utils.clip_grad_norm_'s coefficient, kept on the device: clamp(max_norm / (total + 1e-6), max=1),
        # with the same ops (Python's max_norm / t is t.reciprocal() * max_norm), in place
        coef = torch.add(total, 1e-6, out=self._clip_buf if earlier is None else None)
        coef = coef.reciprocal_().mul_(max_norm).clamp_(max=1.0)
        self._clip_coef = coef if earlier is None else earlier.mul_(coef)  # (earlier is _clip_buf)
        if self._flags.traced_reduction:  # (under torch.compile: see _adopt_traced_reduction)
            self._flags.traced_clip_coef = self._clip_coef
        return total

    def grad_norm(self) -> torch.Tensor:
        """Global 2-norm of the gradients as ``param.grad`` holds them now (averaged over ranks, unscaled; after
        this step's clips, ``GradScaler.unscale_`` and other multiplies of ``param.grad``): what
        ``torch.nn.utils.get_total_norm`` returns with torch.optim. It clips nothing; reduces the gradients if not
        yet done."""
        if torch.compiler.is_compiling() and (why := self._eager_when_compiled()) is not None:
            return _EAGERLY["norm", why](self)
        return self._grad_norm()

    def _grad_norm(self) -> torch.Tensor:
        norm = self._reduce_grads(recheck=True)[0].sqrt()
        if self._clamped:  # (clip_grad_value_ changed them since the reduction's sums of squares)
            norm = self._param_grad_norms(2.0).square().sum().sqrt()
        elif self._scale is not None:
            norm = norm / self._scale
        # what torch code and opt.clip_grad_norm_ multiplied param.grad by since (until session 26 left out: after
        # GradScaler.unscale_ this was the scaled gradients' norm, after a clip the unclipped one)
        multiplier = self._common_multiplier()
        if multiplier is not None:
            norm = norm * (multiplier.abs() if torch.is_tensor(multiplier) else abs(multiplier))
        return norm * self._clip_coef if self._clip_coef is not None else norm

    @property
    def loss_scale(self) -> Optional[torch.Tensor]:
        """The current loss scale (a 0-d device tensor), or None without loss scaling."""
        return self._scale

    def _check_no_own_loss_scale(self, by: str) -> None:
        if self._scale is not None:
            raise RuntimeError(
                f"{by} on a {type(self).__name__} that scales the loss itself (loss_scale="
                f"{self.loss_scale_config}; on by default with param_dtype=torch.float16): the gradients would be "
                "unscaled twice. Either drop torch's GradScaler and backward opt.scale_loss(loss) (clipping and "
                "the skip on inf/NaN work the same; opt.clip_grad_norm_ and torch's clip_grad_norm_ see unscaled "
                "norms), or build the optimizer with loss_scale=False to let GradScaler do it")

    def _amp_unscale(self, params: list, found_inf: torch.Tensor, inv_scale: torch.Tensor,
                     placeholders: Optional[list] = None) -> None:
        """``torch._amp_foreach_non_finite_check_and_unscale_`` (GradScaler's inf check and ``unscale_``) on the
        placeholders of ``params``: reduce the gradients (once per step), OR the global non-finite flag into the
        scaler's ``found_inf``, and fold ``inv_scale`` into the update like any multiplier of ``param.grad`` (so
        torch's ``clip_grad_norm_`` after ``unscale_`` sees unscaled norms). All on the device."""
        self._check_no_own_loss_scale("torch.amp.GradScaler")
        _, ours = self._reduce_grads(recheck=True)
        found_inf.copy_(torch.maximum(found_inf, ours.to(found_inf.dtype)))
        # _fold_grad_multiplier's work, once for the list (it was ~1 us per parameter per step, each call
        # re-entering the cached reduction and clearing the norm cache). Gradients set by hand (plain tensors in
        # GradScaler's list) were flushed by the reduction: they are unscaled with the others here, by the update
        # (model_sync._amp_unscale calls this before torch's op unscales the plain tensors, no longer in param.grad)
        self._fold_grad_multipliers(params, inv_scale, placeholders, every_placed=True)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (``loss`` itself without loss scaling): call ``.backward()`` on this."""
        return loss * self._scale if self._scale is not None else loss

    # ------------------------------------------------------------------ step
    @staticmethod
    def profile_hook_step(func):
        """torch.optim's wrapper of ``step`` (torch.optim.Optimizer's __init__ wraps each optimizer class's ``step``
        with it once), with its ``Optimizer.step#<class>.step`` profiler range entered only while a profiler records
        (torch's own wrapper then, and under torch.compile, which traces it): torch enters the range at every call,
        with no profiler too (issue 20: a host-bound step on the H200). On this repo's CPU machine that was ~8 us
        alone and 376 -> 328 us of ShardedAdamW's step on the GPU path (dry-run driver, the 125M layout, the two
        wrappers taking turns in one process, minima; 2026-12-05), the range's entry (~20 us) before the update's
        launch. Otherwise the same: the global and the optimizer's step pre-hooks (one may return new ``(args,
        kwargs)``), the step, torch's ``_optimizer_step_code`` (the profiler's entry point), the post-hooks."""
        traced = torch.optim.Optimizer.profile_hook_step(func)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled:
                return traced(*args, **kwargs)
            self = args[0]
            for pre_hook in itertools.chain(_optim_hooks._global_optimizer_pre_hooks.values(),
                                            self._optimizer_step_pre_hooks.values()):
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), but got "
                                           f"{result}.")
                    args, kwargs = result
            out = func(*args, **kwargs)
            self._optimizer_step_code()
            for post_hook in itertools.chain(self._optimizer_step_post_hooks.values(),
                                             _optim_hooks._global_optimizer_post_hooks.values()):
                post_hook(self, args, kwargs)
            return out
        return wrapper

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce (unless ``clip_grad_norm_`` did), update every shard, all-gather the parameters.

        Never waits on the device: the non-finite flag gates the update inside the kernel.

        Under ``torch.compile`` a step runs eagerly where it must look at the parameters or shake hands with the
        other ranks (:meth:`_eager_when_compiled`): a graph break, or dynamo's error under ``fullgraph=True``.
        """
        if torch.compiler.is_compiling():
            why = self._eager_when_compiled()
            if why is not None:
                return _EAGERLY["step", why](self, closure)
        return self._run_step(closure)

    def _eager_when_compiled(self) -> Optional[str]:
        """Under torch.compile: why step() (and a clip or a norm before it, which must reach that step) runs eagerly,
        a key of :data:`_EAGER_REASONS`, or None (a traced step; dynamo guards on what this reads).

        "ranks": on more than one rank, always. The step's handshakes (the parameters without a gradient on every
        rank, the ranks' hyper-parameters, the order of the collectives) are host code, and dynamo cannot trace
        the ProcessGroup's collectives (torch 2.13: an InternalTorchDynamoError, UnsafeScriptObjectError; until
        session 24 a compiled step on two ranks raised it, even with fullgraph=False: untested till then).
        "here": in one process, where the step must look at the parameters (:meth:`_note_eager_step`)."""
        if self._many_ranks:
            return "ranks"
        # (opt.state edited as a dict since the last look: sync_from_model follows it, state_view.py)
        return "here" if self._flags.eager_step_needed or self._state_edits.seen else None

    def _adopt_traced_reduction(self) -> None:
        """After a reduction traced by torch.compile in a graph without the step (``torch.compile(opt
        .clip_grad_norm_)`` or ``grad_norm`` on their own; a clip and a step that dynamo compiled as separate graphs,
        which it does where an LR scheduler wraps step() or where the compiled function also ran the backward):
        dynamo dropped what the reduction set on the optimizer, but replayed its copy in :class:`_StepFlags`, which
        is taken back here, so the step (eager or traced) uses that reduction and the clip's coefficient, as in one
        graph. Until session 23 such a step reduced again and did not clip, silently; in session 23 it raised, also
        in the common loop of a compiled clip + step with an LR scheduler. Eagerly, the step then looks at the
        gradients again as after an eager clip (``_reduced_early``)."""
        flags = self._flags
        self._reduced, self._next_launch, self._reduce_entered, self._reduction_started = flags.traced_state
        if flags.traced_clip_coef is not None:
            self._clip_coef = flags.traced_clip_coef
        if not torch.compiler.is_compiling():
            # (and so the next compiled clip, norm or step runs eagerly: its look at the gradients again reads
            # param.grad, which dynamo cannot trace; until session 35 a compiled clip after an eager per-parameter
            # norm read traced it and failed, found by tests.optim.loop_fuzz_long's TracedTrainingLoop)
            self._reduced_early = self._flags.eager_step_needed = True

    def _finish_compiled_step(self) -> None:
        """What a step traced by torch.compile left undone, since it needs the parameters (dynamo would wrap them),
        and what dynamo dropped of it (its writes to the optimizer's attributes, see :class:`_StepFlags`): the
        step's reset, run again eagerly, so that each gradient it consumed gets its :class:`~.model_sync.SpentGrad`
        marker in ``param.grad``, as after an eager step (unless the loop cleared or replaced it since), and the
        optimizer's state is that of after a step; and opt.state shows the state. Called by the
        first eager look at the gradients after it: a backward's hooks and flush, a reduction (a clip; the next
        step's, before anything reads a gradient), a new optimizer or group asking whether this one is mid-step, a
        zero_() on a placeholder, ``zero_grad()`` (which then clears the markers), an access of ``opt.state``.
        Until session 23 nothing did: the placeholders stayed, so a second step without zero_grad() skipped every
        parameter where torch.optim applies the gradients again (eager steps raise the spent-gradient error), a
        clip did not raise it, and a new optimizer refused to be built (found by the loop fuzzer's compiled
        machine)."""
        self._reset_step_state(spent=True)  # (again, eagerly: it clears the flag)
        if not self._state_exposed:
            self._expose_state()

    def _note_eager_step(self) -> None:
        """:attr:`_flags`.eager_step_needed, at the end of a backward: whether a step now could skip a parameter, as
        torch.optim skips one whose grad is None: one without a gradient since zero_grad() (a bucket without any, or
        parameters in a bucket's ``no_grad``; a parameter frozen since construction is one of them unless it got a
        gradient, which step() applies), or whose weights or opt.state the loop wrote (:meth:`_model_changed`).
        Every other change that gives a parameter no gradient sets the flag (a reset, a clear, a new bucket, the
        loop's ``param.grad = ...`` or ``.data``: WatchedParameter), and so do the last step's gradients where
        nothing cleared them (the step must raise the spent-gradient error), and an eager reduction before step()
        (torch's clip_grad_norm_ over the placeholders, opt.clip_grad_norm_, GradScaler.unscale_: step() then looks
        at every param.grad again, and folds in what torch code multiplied them by), so False means: every
        parameter holds a gradient of the last backward, not reduced yet, and the model is as the last step left it.

        Why: a step compiled by torch.compile cannot look at the parameters (dynamo would wrap them, and their
        placeholder gradients), so it cannot leave out the pieces of those it must skip. Until session 23 it updated
        them with zero gradients (their weight decay and momentum applied, their step counted), silently. Now a
        compiled step reads this flag (dynamo guards on it) and, where it is set, runs the step eagerly
        (:func:`_step_eagerly`); with more ranks every compiled step does (:meth:`_eager_when_compiled`), so
        nothing is looked at there. Cost, in one process: one look per bucket and ~0.13 us per parameter
        (:meth:`_model_changed`) per backward."""
        if self._many_ranks:
            return
        self._flags.eager_step_needed = bool(self._spent_unlisted or self._spent or self._stale) or any(
            b.no_grad or not b.has_grads for b in self.buckets) or self._model_changed()

    def _run_step(self, closure=None):
        """:meth:`step`'s work (eager, or traced by torch.compile). Where it raises, the arguments
        ``torch.amp.GradScaler.step(opt)`` set on the optimizer for this call go with it: GradScaler deletes them
        only when the step returns, and the next ``scaler.step(opt)`` multiplies its scale by what it finds (until
        session 25 a step retried after an error unscaled by the square of the scale, silently)."""
        try:
            return self._step_work(closure)
        except BaseException:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise

    def _step_work(self, closure=None):
        loss = None
        if closure is not None and self._retired_by is None:
            with torch.enable_grad():
                loss = closure()
        shaken = self._entry.position()
        self._final_look = True
        try:
            self._check_not_retired()  # (the other ranks are told: a retirement on some ranks only)
            found_inf, amp_scale, amp_found_inf, multiplier, frozen = self._before_update()
        except Exception as exc:
            self._tell_peers(exc, shaken)
            raise
        finally:
            self._final_look = False
        if self._flags.precise_notes and not torch.compiler.is_compiling():  # (taken by this step's look)
            self._forget_precise_notes()
        self._prepared_state = None
        compiling = torch.compiler.is_compiling()
        if self._graphs is not None and not compiling:
            # cuda_graph=True: the phase's key names what a capture freezes (None: this step runs eagerly); the
            # values the host sets are written first, into the tensors the captured ops read
            key = self._update_graph_key(amp_scale, amp_found_inf, multiplier, frozen)
            if key is not None:
                self._write_lrs()
                if multiplier is not None:
                    multiplier = self._persistent_tensor(
                        ("multiplier", multiplier.dtype), lambda: torch.empty((), dtype=multiplier.dtype,
                                                                              device=self.device)).copy_(multiplier)
            self._graphs.run("update", key, functools.partial(
                self._update_phase, found_inf, amp_scale, amp_found_inf, multiplier, frozen), _nothing)
        else:
            self._update_phase(found_inf, amp_scale, amp_found_inf, multiplier, frozen)
        if self.device.type == "cuda" and not compiling:  # streams, rule 3 (after the last reader of the shards)
            self._grads_consumed_event = self._step_event("grads consumed")
        if self._scale is not None and self._overflows_at_min_host is not None and not compiling:
            # to the host without a sync: the next step() reads it if the copy has landed by then
            self._overflows_at_min_host.copy_(self._overflows_at_min, non_blocking=True)
            self._overflows_at_min_event = self._step_event("overflows at min copied")
        self._reset_step_state(spent=True)  # the next flatten overwrites: no zero-fill pass
        if not self._state_exposed and not torch.compiler.is_compiling():
            self._expose_state()
        return loss

    def _look_for_trainer_once(self, last: bool) -> None:
        """With more than one rank and transformers imported: a ``transformers.Trainer`` up the stack (building this
        optimizer, or at its first step) gets :class:`~tritonshard.integrations.hf.ShardedOptimizerCallback`
        (:func:`~tritonshard.integrations.hf.adopt_trainer`). Looked for until one is found, or the ``last`` time."""
        if not self._look_for_trainer:
            return
        found = False
        if "transformers" in sys.modules and not torch.compiler.is_compiling():
            from ..integrations import hf
            found = hf.adopt_trainer(self, skip_frames=2)
        self._look_for_trainer = not (found or last)

    def _before_update(self) -> tuple:
        """What :meth:`step` checks and reduces before it changes anything (an error here is told to the other
        ranks: :meth:`_tell_peers`): ``(found_inf, amp_scale, amp_found_inf, multiplier, frozen)``."""
        self._check_loss_scale_floor()
        self._look_for_trainer_once(last=True)  # a transformers.Trainer saves the optimizer on one rank only
        # every group's hyper-parameters (a scheduler or the user may have changed them) before anything changes:
        # a bad value in group 1 must not leave group 0 updated and the step counters advanced
        for gi, group in self._trained_groups:
            self._check_group_at_step(gi, group)
        # (by a clip, a norm: sync_from_model ran then; or traced by torch.compile in a graph without this step,
        # which could not look at the model, and which _reduce_grads takes back: until session 36 that step did not
        # look either, so a weight written since was overwritten from the masters and an opt.state edit followed
        # only after the update, found by tests.optim.loop_fuzz_long's CompiledTrainingLoop)
        reduced_before = self._reduced is not None or self._flags.traced_reduction
        _, found_inf = self._reduce_grads(for_step=True)
        if reduced_before:
            # the model as it is now: weights written since the clip (until session 21 the update overwrote them
            # from the masters, silently), parameters replaced or appended, opt.state edited
            self.sync_from_model()
        if self._clamped and self._scale is None:  # clip_grad_value_ may have made an inf finite
            self._recheck_finite()
        # torch.amp.GradScaler.step(opt) sets these two around this call (see _step_supports_amp_scaling): the scale
        # the loss was multiplied by, unless unscale_() folded its inverse in already, and its inf flag
        amp_scale, amp_found_inf = self.__dict__.get("grad_scale"), self.__dict__.get("found_inf")
        if amp_found_inf is not None and not isinstance(amp_found_inf, torch.Tensor):
            # GradScaler's sum over the devices it found gradients on: the number 0 where it found none
            amp_found_inf = torch.tensor(float(amp_found_inf), device=self.device)
        if amp_scale is not None or amp_found_inf is not None:
            self._check_no_own_loss_scale("torch.amp.GradScaler.step(opt)")
        self.wait_for_params()  # the update rewrites the param shards the last all-gather reads
        multiplier = self._common_multiplier()
        # parameters frozen since construction (requires_grad=False now), and those without a gradient on every
        # rank: torch.optim skips them (no grad), so their weights and state must come out of the flat update
        # unchanged
        # (two disjoint lists: the second holds parameters that require grad; the "step" handshake is in it)
        frozen = self._frozen_since_build() + self._without_grad_everywhere()
        return found_inf, amp_scale, amp_found_inf, multiplier, frozen

    def _step_event(self, key: str):
        """A CUDA event of this optimizer's (one per ``key``, made once: not an event object and a CUDA event per
        step), recorded now on the current stream. Recording it again later is safe: a stream's wait_event, and a
        query, concern the record made last before them."""
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _tell_peers(self, exc: BaseException, shaken: tuple) -> None:
        """``exc`` was raised on this rank before the step's collectives: tell the other ranks through the
        handshake they will meet next (the "reduce" one, or the "step" one after a reduction), so that they raise
        too (:class:`~tritonshard.comm.PeerFailedError`, naming this rank's error) instead of waiting in collectives
        this rank will not join. With ``overlap_comm`` the reduce handshake ran at the end of backward: this rank
        first takes part in the reduction the others are in, then tells them at the "step" one. Nothing where it
        is past both, or where its reduction had started (an error in it: a bug, not a check), nor where it shook
        hands since the call began (``shaken``, the handshake counts then: the ranks met, so the error came after,
        from that handshake or on every rank)."""
        if not self._entry.active or torch.compiler.is_compiling() or self._entry.position() != shaken:
            return
        if not self._reduce_entered:
            entry, self._reduce_entered = "reduce", True
        elif self._reduced is None and not self._reduction_started:
            # overlap_comm: the end of backward shook hands and launched the reduce-scatters, so the others are
            # (or will be) in the reduction's collectives, and the handshake they meet next is the "step" one:
            # this rank takes part in the reduction (its result is never used) and then tells them there
            try:
                self._run_reduction()
            except Exception:  # noqa: BLE001 -- (this rank's own error is the one to raise)
                return
            entry, self._step_entered = "step", True
        elif self._reduced is not None and not self._step_entered:
            entry, self._step_entered = "step", True
        else:
            return
        self._entry.tell(entry, exc)

    def _update_phase(self, found_inf: torch.Tensor, amp_scale, amp_found_inf, multiplier, frozen: list) -> None:
        """The device work of :meth:`step` after the reduction: ``grad_scale``, the step counters, the updates, the
        all-gathers (waited for here unless the next forward waits), the skip bookkeeping and the loss scale."""
        if amp_found_inf is not None:  # (the flag of the step, not the reduction's: _found_inf_buf, below)
            found_inf = torch.maximum(found_inf, (amp_found_inf > 0).to(found_inf.dtype))
        bound = self._hot_path()
        # The updates (one segmented launch per param group where the rule has one), then the all-gathers. With
        # overlap_comm, one gather per bucket in the order the next forward needs the buckets (the first module's
        # first): on NCCL one group's collectives run in issue order, so the gather of the embedding's bucket must
        # not queue behind every other bucket's; a bucket updated on its own is gathered right after its update.
        # Without it, every gather is launched at once (one coalesced call) and waited for before step() returns.
        flags_fused = (amp_found_inf is None and amp_scale is None and self._scale is None and multiplier is None
                       and not frozen and not self._own_plan and self._scalar_kernels_run()
                       and bool(self._step_units))  # (no counter: no table, whose address would be 0)
        if flags_fused:  # the usual step: its scalars in one launch (kernels/scalars.py), the same bits as below
            grad_scale, found_inf = self._launch_step_flags(found_inf)
            redo, idle, keep = {}, frozenset(), []
        else:
            # the reduce-scatter SUMmed; the average is one more factor of the update's grad_scale (no pass, no
            # rounding) (each factor a tensor op into _grad_scale_buf, in place, in the order and with the ops of
            # coef * average / scale * multiplier / amp_scale; a plain number while there is no tensor factor)
            grad_scale = self._grad_average
            if self._clip_coef is not None:
                grad_scale = torch.mul(self._clip_coef, grad_scale, out=self._grad_scale_buf)
            if self._scale is not None:  # unscale folded into the same multiply as the clip coefficient
                grad_scale = _scale_in_place(grad_scale, self._scale, self._grad_scale_buf, torch.div)
            if multiplier is not None:  # torch.nn.utils.clip_grad_norm_ on param.grad: its coefficient, folded in
                grad_scale = _scale_in_place(grad_scale, multiplier, self._grad_scale_buf, torch.mul)
            if amp_scale is not None:  # GradScaler.step without unscale_(): the gradients are still scaled
                grad_scale = _scale_in_place(grad_scale, amp_scale, self._grad_scale_buf, torch.div)
            # the bound (or segmented) update launches read found_inf and grad_scale from these tensors (__init__)
            found_inf = self._found_inf_buf.copy_(found_inf)
            not_skipped = torch.neg(found_inf, out=self._not_skipped_buf).add_(1.0)  # 1 - found_inf
            # the step counts (skipped steps do not count), and the pieces of parameters whose own count differs
            # from their bucket's, saved now and updated again after the flat update with their count
            # (param_steps.py); the buckets of a counter none of whose parameters trains this step (idle) are not
            # updated at all; the pieces of the other skipped parameters are saved before the update and put back
            # after it
            redo, idle, keep = self._count_steps(frozen, not_skipped)
        kept = self._snapshot_pieces(keep) if keep else {}
        compiling = torch.compiler.is_compiling()
        together = self._update_together and not compiling  # every update first, then the gathers
        coalesce = self._coalesce and not compiling  # ... in one call
        if together:  # each param group's buckets in one call (ShardedAdamW, SGD, Lion: one segmented launch)
            self._next_rounding_seeds()
            for gi, buckets in self._step_units:
                if buckets[0].index in idle:
                    continue
                with _trace("tritonshard.update[group {}]", gi):
                    self._update_buckets(buckets, self.param_groups[gi], grad_scale, found_inf)
            for pieces in kept.values():
                self._restore_pieces(pieces)
            for i, pieces in redo.items():
                self._update_again(self.buckets[i], pieces, grad_scale, found_inf)
            order = [self.buckets[i] for i in self._gather_order]
            if coalesce:
                with _trace("tritonshard.all_gather[coalesced]"):
                    work = comm.SharedWork(comm.all_gather_coalesced(
                        [b.param_buffer.get_data() for b in order], [b.param_buffer.get_local_shard() for b in order],
                        group=self._pg))
                for b in order:
                    b.ag_work = work
            else:
                direct = self._direct_collectives and bound
                for b in order:
                    with _trace("tritonshard.all_gather[bucket {}]", b.index):
                        b.ag_work = self._all_gather(b, direct)
        else:  # with overlap_comm (or one bucket, or torch.compile): the gathers one by one (see above)
            self._next_rounding_seeds()
            merged = set()  # buckets whose param group went in one segmented launch
            for gi, buckets in self._step_units if self._segments is not None and self._segmented_path() else ():
                if buckets[0].index in idle:
                    continue
                with _trace("tritonshard.update[group {}]", gi):
                    if self._update_merged(buckets, self.param_groups[gi], grad_scale, found_inf):
                        merged.update(b.index for b in buckets)
            direct = self._direct_collectives and bound
            for i in self._gather_order:
                b = self.buckets[i]
                # (ShardedMuon, a group of one bucket): its own update, then its gather
                if i not in merged and i not in idle:
                    with _trace("tritonshard.update[bucket {}]", b.index):
                        self._update(b, self._group_of_bucket[b.index], grad_scale, found_inf)
                self._restore_pieces(kept.get(i, ()))
                if i in redo:
                    self._update_again(b, redo[i], grad_scale, found_inf)
                with _trace("tritonshard.all_gather[bucket {}]", b.index):
                    b.ag_work = self._all_gather(b, direct)
        if not flags_fused:  # (the fused launch counted them)
            self.skipped_steps.add_(self._found_long_buf.copy_(found_inf))
            torch.gt(found_inf, 0, out=self.last_step_skipped)
        if self._scale is not None:  # back off on overflow, grow after growth_interval clean steps; on device
            cfg = self.loss_scale_config
            # overflowed although at the floor: (found_inf > 0) & (scale <= min_scale)
            pinned = torch.le(self._scale, cfg.min_scale, out=self._pinned_buf).logical_and_(self.last_step_skipped)
            torch._amp_update_scale_(self._scale, self._growth_tracker, found_inf, cfg.growth_factor,
                                     cfg.backoff_factor, cfg.growth_interval)
            self._scale.clamp_(min=cfg.min_scale)
            # where(pinned, count + 1, 0) = (count + 1) * pinned
            self._overflows_at_min.add_(1).mul_(pinned)
        if not self._defer_gathers:
            self.wait_for_params()  # nobody would wait before the next forward

    #: param-group entries a captured update does not freeze: the lr is read from its device tensor
    _NOT_FROZEN = frozenset(("params", "lr", "param_names"))

    def _scalar_kernels_run(self) -> bool:
        """Whether a step's scalars (:func:`~tritonshard.kernels.scalars.step_flags_`), a clip's coefficient
        (:func:`~tritonshard.kernels.scalars.clip_coefficient_`) and, with more ranks, the rounding of the norm's
        all-reduced totals (:func:`~tritonshard.kernels.scalars.round_totals_`) go in one launch each: where the
        Triton kernels run (compiled, or the interpreter, where the CPU tests run them), outside torch.compile
        (which records the torch ops)."""
        return triton_kernels_run(self.device)

    def _launch_step_flags(self, found_inf: torch.Tensor) -> tuple:
        """The usual step's scalars in one launch, bound (kernels/scalars.py): ``_found_inf_buf`` = ``found_inf``,
        ``_not_skipped_buf`` = 1 - it, every counter of :attr:`_step_units` that counts the step
        (:meth:`_counts_step`) advanced by that, ``skipped_steps`` and ``last_step_skipped``, and after a clip
        ``_grad_scale_buf`` = coef * average: 8 small torch ops before (the counters one each). Returns
        ``(grad_scale, found_inf)`` for the updates: the buffer, or the average as a number where the loop did not
        clip."""
        # (ShardedSGD: the groups with momentum)
        counters = tuple(buckets[0].step for buckets in self._counting_units()) or (self._idle_counter,)
        cached = self._counter_table
        if cached is None or len(cached[0]) != len(counters) or not all(map(operator.is_, cached[0], counters)):
            # (kept with the counters it points to, so their storage lives as long as the table)
            cached = self._counter_table = (counters, _scalars.counter_table(counters, self.device))
        coef = self._clip_coef
        grad_scale = self._grad_average if coef is None else self._grad_scale_buf
        args = (found_inf, self._found_inf_buf, self._not_skipped_buf, self.skipped_steps, self.last_step_skipped)
        rest = (coef, self._grad_average, None if coef is None else grad_scale)
        _scalars.step_flags_kernel(_scalars.step_flags_launch_spec(*args, cached[1], *rest), self._scalar_launches,
                                  lambda: _scalars.step_flags_(*args, list(counters), *rest, table=cached[1]))
        return grad_scale, self._found_inf_buf

    def _update_graph_key(self, amp_scale, amp_found_inf, multiplier, frozen: list):
        """What a capture of :meth:`_update_phase` freezes, hashable: whether the loop clipped, the dtype of the
        multiplier torch code folded in, every trained group's hyper-parameters but the lr. None where this step
        must run eagerly: GradScaler's values (new tensors every step), parameters left out of this step (their
        pieces are saved and restored around the update) or counting steps of their own (param_steps.py), a
        multiplier that is not a 0-d tensor on our device, an lr given as a tensor, or a hyper-parameter that is a
        tensor or unhashable (a list, e.g. ``betas=[0.9, 0.95]``, counts as the tuple of its items)."""
        if amp_scale is not None or amp_found_inf is not None or frozen or self._own_plan:
            return None
        if multiplier is not None and not (isinstance(multiplier, torch.Tensor) and multiplier.dim() == 0
                                           and multiplier.device == self.device):
            return None
        groups = []
        for gi, group in self._trained_groups:
            items = []
            for name, value in group.items():
                if name in self._NOT_FROZEN:
                    continue
                if isinstance(value, list):
                    value = tuple(value)
                if (isinstance(value, torch.Tensor) or not isinstance(value, collections.abc.Hashable)
                        or (isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value))):
                    return None
                items.append((name, value))
            if isinstance(group["lr"], torch.Tensor):
                return None
            groups.append((gi, tuple(sorted(items, key=lambda item: item[0]))))
        return (self._clip_coef is not None, None if multiplier is None else multiplier.dtype, tuple(groups))

    def _write_lrs(self) -> None:
        """Every trained group's lr into its float64 device tensor (:meth:`_lr_tensor`), before a captured phase
        that reads them: the one value of a step the host sets (a scheduler changes it every step)."""
        for gi, group in self._trained_groups:
            self._lr_tensor(group, gi)
        self._lr_filled = True

    def _lr_source(self, group: dict, group_index: int):
        """The lr an update's coefficients are computed from: the number, or where :meth:`_write_lrs` wrote them for
        this step (cuda_graph), the group's float64 device tensor, so a captured phase reads this step's value."""
        if self._lr_filled:
            return self._lr_tensor(group, group_index)
        return float(group["lr"])

    def _next_rounding_seeds(self) -> None:
        """A fresh Philox key per step for every bucket with stochastically rounded state (see _make_bucket): one op
        for all of them, not one per bucket."""
        seeds = self._rounding_seeds
        if seeds:
            torch._foreach_add_(seeds, 1)

    def _all_gather(self, b: _Bucket, direct: bool):
        """Launch ``b``'s param all-gather; returns its work handle. ``direct``: on the hot path, straight through
        the ProcessGroup method (the Buffer checked the group and the layout when it was built)."""
        if self._solo:
            return COMPLETED
        if direct:
            return comm.all_gather_async(b.param_buffer.get_data(), b.param_buffer.get_local_shard(), self._pg)
        return b.param_buffer.all_gather(async_op=True)

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        raise NotImplementedError

    #: an update rule whose kernel has a segmented (MULTI) mode: (its kernel module's SEGMENTS, its launcher's
    #: name), with ``_launch(bucket, group, grad_scale, found_inf) -> (spec or None, checked launch)``
    _segments: Optional[tuple[dict, str]] = None

    def _update_buckets(self, buckets: list, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        """The updates of ``buckets``, all of one param group (without overlap_comm, where nothing waits for a
        single bucket's): one segmented launch where the update rule has one (``_segments``), else one by one."""
        if not self._update_merged(buckets, group, grad_scale, found_inf):
            for b in buckets:
                self._update(b, group, grad_scale, found_inf)

    def _update_merged(self, buckets: list, group: dict, grad_scale, found_inf: torch.Tensor) -> bool:
        """The updates of ``buckets`` (one param group) in one segmented launch; False, having launched nothing,
        where the update rule has no segmented mode (``_segments``) or they cannot go together."""
        if self._segments is None:
            return False
        launch = functools.partial(self._launch, group=group, grad_scale=grad_scale, found_inf=found_inf)
        return self._launch_segmented(buckets, launch, *self._segments)

    def _launch_segmented(self, buckets: list, launch, segments: dict, op: str) -> bool:
        """One segmented launch (kernels/_launch.segmented_spec) for the updates of ``buckets`` (one param group),
        where ``launch(bucket)`` gives a bucket's (spec, checked launch). False when they cannot go together (the
        caller then updates bucket by bucket): one bucket, no segmented path here, or launches that do not merge.

        The merged launch is built once per variant of the first bucket's spec and kept (the other buckets' tensors
        never change, and everything else their launches take is the first one's: the group's scalars and
        coefficients, grad_scale, found_inf), so a step builds one spec and compares it, whatever the number of
        buckets. A new variant (new betas, a grad_scale that became a tensor) first goes through every bucket's
        checked launcher, which validates and launches, as a new bound launch does. The last
        ``_SEGMENTED_VARIANTS`` variants are kept, each with its tables and its bound launch: a loop that clips
        every other step switches between two, and a CUDA graph captured with one replays that one's tables
        (:meth:`_graph_references` keeps them alive while the graph lives). ``op``: the kernel's launcher, whose
        name the launch's profiler range carries (``tritonshard.kernel.<op>``, as the launcher's)."""
        if len(buckets) < 2 or not self._segmented_path():
            return False
        first, _ = launch(buckets[0])
        variants = self._segmented.setdefault(buckets[0].index, [])  # [(first spec, merged spec, its launches)]
        # (a variant differs in more than floats: a float, e.g. a beta OneCycleLR cycles, is this step's in the
        # merged launch, which replays with it: _launch.launch)
        kept = next((v for v in variants if _same_spec_but_floats(v[0], first)), None)
        if kept is None:
            specs = [first] + [launch(b)[0] for b in buckets[1:]]
            kept = (first, _launch.segmented_spec(specs, block=first[3]["BLOCK"], **segments), {})
            variants.insert(0, kept)
            del variants[self._SEGMENTED_VARIANTS:]
        merged = kept[1]
        if merged is None:
            return False
        if first is not kept[0]:  # (the group's floats of this step: every bucket's spec has the first's)
            kernel, grid, args, kwargs = merged
            merged = (kernel, grid, tuple(a if type(a) is not float else b for a, b in zip(args, first[2])), kwargs)

        def checked_launches():
            for b in buckets:
                launch(b)[1]()
        with _trace("tritonshard.kernel.{}", op):
            _launch.launch(kept[2], "merged", merged, checked_launches)
        return True

    #: merged launches kept per param group (see _launch_segmented)
    _SEGMENTED_VARIANTS = 4

    def _graph_references(self) -> list:
        """What a captured phase's kernels read through pointers the host made for them, beyond the buffers and
        per-step tensors this optimizer keeps for its lifetime: the merged launches' tables (a variant evicted
        from ``_segmented`` would free its tables under a graph that replays them). StepGraphs holds these with the
        graph."""
        return [variant for variants in self._segmented.values() for variant in variants]

    def _check_loss_scale_floor(self) -> None:
        """Raise when the last steps all overflowed with the loss scale at its floor (LossScaleConfig). On a GPU the
        count is read from its asynchronous copy once that has landed (at most a step late), never with a sync."""
        if self._scale is None or torch.compiler.is_compiling():
            return
        if self._overflows_at_min_host is not None:
            event = self._overflows_at_min_event
            if event is None or not event.query():
                return
            count = int(self._overflows_at_min_host)
        else:
            count = int(self._overflows_at_min)
        cfg = self.loss_scale_config
        if count >= cfg.max_overflows_at_min_scale:
            raise FloatingPointError(
                f"the last {count} steps all had inf/NaN gradients with the loss scale at its floor "
                f"(LossScaleConfig.min_scale={cfg.min_scale:g}); every one was skipped, and lowering the scale "
                "cannot help any more: the model diverged or the inputs hold inf/NaN. Lower the lr, check the data, "
                "or resume from an earlier checkpoint (max_overflows_at_min_scale sets how many to allow)")

    def _hot_path(self) -> bool:
        """The compiled kernels, eagerly: launches are bound once per bucket and replayed (kernels/_launch.py;
        ``_launch.set_bound_launches(False)`` sends the same launches through Triton's dispatch instead), the
        per-step scalars live in persistent tensors, and collectives and the flatten skip the per-call checks."""
        return compiled_path(self.device) and not torch.compiler.is_compiling()

    def _segmented_path(self) -> bool:
        """Whether each param group's updates go in one segmented launch (``_merge_updates``: more than one bucket),
        on the Triton kernels (compiled, or the interpreter, where the CPU tests run them), outside torch.compile."""
        return self._merge_updates and triton_kernels_run(self.device)

    def _persistent_args(self) -> bool:
        """Whether the update launches take their per-step values from tensors that keep their storage (found_inf,
        grad_scale, coefficients, the lr): so that a bound or segmented launch, or a captured phase, stays valid
        from step to step."""
        return self._hot_path() or self._segmented_path() or self._graphs is not None

    def _persistent_tensor(self, key, make):
        """A tensor made once and kept (a bound launch's per-step input, rewritten in place every step)."""
        t = self._persistent.get(key)
        if t is None:
            t = self._persistent[key] = make()
        return t

    def _lr_tensor(self, group: dict, group_index: int) -> torch.Tensor:
        """``group["lr"]`` in a float64 device tensor (one per group, kept): what the checked launchers of a bound
        update get, so that they compile the same specialization as the bound launch (lr read from memory). Kept
        by the group's index (a load_state_dict that replaced the group dicts would leave a tensor behind if it
        were kept by the dict's id)."""
        t = self._persistent_tensor(("lr", group_index),
                                    lambda: torch.empty((), dtype=torch.float64, device=self.device))
        if self._lr_filled:  # written for this step already, outside a captured phase (_write_lrs)
            return t
        return t.fill_(float(group["lr"]))

    def _once_per_step(self, key, compute):
        """``compute()`` the first time ``key`` is asked for in this step, the cached value after that: what the
        buckets of one param group share (e.g. AdamW's bias-corrected coefficients, small float64 device ops)."""
        if key not in self._step_cache:
            self._step_cache[key] = compute()
        return self._step_cache[key]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients, of every parameter in the param groups (as torch.optim does; frozen
        ones included). ``set_to_none=True`` costs nothing for ours (the next backward overwrites the buffers);
        ``False`` zeroes the gradients that exist, as torch.optim does: the grad buffers are zero-filled, the
        parameters that had one (in the buffers, or spent by the last step, see SpentGrad) get their placeholder
        back, standing for zeros that the next backward adds to and step() applies, and any other ``param.grad`` is
        zeroed; a parameter whose ``param.grad`` was None keeps None (step() skips it). Under torch.compile it runs
        eagerly (a graph break)."""
        if torch.compiler.is_compiling():
            return _EAGERLY["zero_grad", "grads"](self, set_to_none)
        return self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        self._check_not_retired()
        if self._flags.compiled_unfinished:  # (its markers, cleared below; and opt.state shown, as after a step)
            self._finish_compiled_step()
        if not set_to_none:  # (before the reset takes the placeholders away)
            had = {p: True for b in self.buckets for p in b.params if isinstance(p.grad, ShardedGrad)}
        self._reset_step_state()  # placeholders first: they hold no storage to zero
        to_zero = []
        with _PLAIN_ATTRS():
            for g in self.param_groups:
                for p in g["params"]:
                    grad = p.grad
                    if grad is not None:
                        if set_to_none or type(grad) is SpentGrad:  # (the buffers are zero-filled below)
                            set_grad(p, None)
                        else:
                            to_zero.append((p, grad))
        for _, grad in to_zero:  # (outside: a torch op, which a subclass' own __torch_function__ may handle)
            grad.zero_()
        if to_zero:  # (gradients set by hand, zeroed in place: what the next flush takes of them, _forget_zeroed)
            self._zeroed_plain = {p: (grad, grad._version) for p, grad in to_zero}
        self._spent_unlisted, self._spent, self._stale = False, {}, {}
        if not set_to_none:  # those that had a gradient have one of zeros now (torch's: step() updates with them)
            # (every buffer without gradients yet zero-filled in one multi-tensor launch, not one fill per bucket)
            empty = [b.grad_buffer.get_data() for b in self.buckets if not b.has_grads]
            if empty:
                self._after_last_step_readers()
                torch._foreach_zero_(empty)
            # (a gradient set by hand is still in param.grad, zeroed there: the next flush takes it; every other
            # has none)
            for b in self.buckets:
                self._hold_zeros(b, [p for p in b.params if p in had], buffer_zeroed=True)

    # ------------------------------------------------------------------ introspection
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by role: ``params``, ``grads`` (full buffers, padding included), ``master``,
        ``state`` (shards), and ``total``."""
        def nbytes(t):
            return t.numel() * t.element_size()
        out = {
            "params": sum(nbytes(b.param_buffer.get_data()) for b in self.buckets),
            "grads": sum(nbytes(b.grad_buffer.get_data()) for b in self.buckets),
            "master": sum(nbytes(b.master if b.master_remainder is None else b.master_remainder)
                          for b in self.buckets),
            "state": sum(nbytes(t) for b in self.buckets for t in b.state.values()),
        }
        workspace = sum(nbytes(b.workspace) for b in self.buckets if b.workspace is not None)
        if workspace:  # e.g. ShardedMuon's bf16 Newton-Schulz input/output shard
            out["workspace"] = workspace
        out["total"] = sum(out.values())
        return out


def _held_grads(params: list) -> list:
    """``(parameter, its .grad)`` for the parameters among ``params`` that hold a gradient, before laying them out
    in buffers drops it (see :meth:`ShardedOptimizer._restore_grads`): a plain tensor, or another optimizer's
    marker: a :class:`~.model_sync.SpentGrad`, or a placeholder, which between steps stands for zeros
    (``zero_grad(set_to_none=False)``). A placeholder standing for a backward's gradients is a RuntimeError:
    here for an optimizer that is gone or retired (its buffers cannot be trusted to hold them), in ``_holders``
    for a live one. Steps traced by torch.compile are finished first (their gradients' markers placed:
    :meth:`ShardedOptimizer._finish_compiled_step`), or their placeholders would be taken for zeros."""
    for other in list(_LIVE):
        if other._flags.compiled_unfinished:
            other._finish_compiled_step()
    held = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, ShardedGrad) and type(g) is not SpentGrad:
            owner = g._optimizer()
            if owner is None or (owner._retired_by is not None and owner._mid_step()):
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} holds the gradient placeholder of a tritonshard optimizer "
                    f"that {'no longer exists' if owner is None else 'was replaced'}, from a backward that no step() "
                    "used: that gradient is gone. Clear it (model.zero_grad()) and run the backward again")
        held.append((p, g))
    return held
