"""``ShardedOptimizer``: the bucketed, sharded mixed-precision pipeline that every tritonshard optimizer shares.

Where its parts live (one job per file):

* ``base.py`` (here): construction: the options checked, the parameters laid out in buckets (again where a group
  is added, a parameter unfrozen or taken over from another optimizer), ``zero_grad()``, ``memory_bytes()``; the
  pipeline's other stages are mixins, one file each, in the order a training iteration meets them:
  ``attach.py`` (``attach()``, the forward's waits for the parameters' all-gathers), ``backward.py`` (gradients
  into the grad buffers, during and at the end of backward), ``reduction.py`` (the reduce-scatters, the norm
  pass, clipping and loss scaling), ``step.py`` (``step()``: the checks, the updates and the all-gathers);
* ``bucket.py``: one bucket's storage (param and grad Buffers, fp32 master and state shards);
* ``model_view.py``: keeping the user's model and the master consistent (outside writes, ``param.grad`` as seen by
  torch code, frozen parameters); ``model_sync.py``: the hooks and placeholder it relies on; ``state_view.py``:
  ``opt.state``; ``param_steps.py``: the per-parameter step counts;
* ``state_io.py``: ``state_dict()`` / ``load_state_dict()`` in torch.optim's format;
* ``graphs.py``: the CUDA graphs of ``cuda_graph=True``; ``_compiled.py``: what changes under ``torch.compile``;
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
import contextlib
import dataclasses
import functools
import hashlib
import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from ..buffer import DEFAULT_ALIGN
from ..kernels.scale import shared_sum_sq_workspace
from ._compiled import (_EAGER_REASONS, _EAGERLY, _StepFlags, _clip_eagerly, _norm_eagerly, _step_eagerly,
                        _zero_grad_eagerly)
from ._hparams import check_flag
from . import graphs as _graphs
from . import model_sync
from .attach import AttachMixin
from .backward import BackwardMixin
from .bucket import HELD_FROZEN, _Bucket, set_grad, split_into_buckets
from .bucket import plain_attrs as _PLAIN_ATTRS
from .model_sync import ShardedGrad, SpentGrad
from .model_view import ModelViewMixin, _names
from .param_steps import ParamStepsMixin
from .reduction import ReductionMixin
from .state_io import StateDictMixin
from .state_view import StateViewMixin
from .step import StepMixin

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


class ShardedOptimizer(BackwardMixin, ReductionMixin, StepMixin, AttachMixin, ModelViewMixin, ParamStepsMixin,
                       StateDictMixin, StateViewMixin, torch.optim.Optimizer):
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
