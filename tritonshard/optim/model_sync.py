"""What the user's model sees of a sharded optimizer, and how the two stay consistent.

The model's parameters are views into the optimizer's param buffers, and its gradients move into the grad buffers
at the end of backward; the fp32 master shards are the truth. The user's code does not know that, so this module
keeps every torch idiom either correct or loud (never silently wrong):

* :class:`ShardedGrad` is what ``param.grad`` holds once tritonshard has taken the gradient: a placeholder without
  storage. ``torch.nn.utils.clip_grad_norm_`` (and so accelerate's and the HF Trainer's clipping) works on it: a
  norm of it is the parameter's *global* gradient norm (reduced over ranks), and ``mul_`` by the clip coefficient
  is folded into the next update. ``zero_()`` discards the parameter's gradient. Any other use raises an error
  that says where the gradient is; so does any access from below Python (``DistributedDataParallel``'s reducer,
  autograd accumulating into it), instead of reading or writing garbage.
* :class:`SpentGrad` is what ``param.grad`` holds after ``step()`` until the loop clears it: where torch.optim
  would use that gradient again (a second step, a backward adding to it, a norm), an error instead.
* The hooks tritonshard puts on the user's parameters and modules are small objects holding the optimizer
  weakly: the model does not keep the optimizer alive, and a pickled or deep-copied model carries inert hooks.
* :func:`guard_model` (used by ``ShardedOptimizer.attach``) makes the model's own read and write paths
  (``parameters()``, ``named_parameters()``, ``state_dict()``, ``load_state_dict()``, ``.to()`` and friends,
  pickling; with ``overlap_comm`` a parameter read as an attribute) wait for in-flight parameter all-gathers, as
  FSDP2's ``fully_shard`` does, by swapping the model's class for a subclass of it.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from typing import Optional

import torch

from .bucket import OWNER, WatchedParameter, landed, owner_of

__all__ = ["ShardedGrad", "SpentGrad", "guard_model", "iter_tensors"]


class _OptimizerRef:
    """Base of the hook objects: a weak reference to the optimizer that pickles (and deep-copies) as None."""

    __torch_unserializable__ = True  # tensor hooks are not saved with a tensor; say so to torch, no warning

    def __init__(self, optimizer):
        self._ref = weakref.ref(optimizer) if optimizer is not None else None

    def optimizer(self):
        return self._ref() if self._ref is not None else None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_ref"] = None  # a copy of the model is not attached to this optimizer
        return state


class GradReadyHook(_OptimizerRef):
    """Post-accumulate-grad hook on a parameter: its gradient of this backward is complete."""

    def __call__(self, param):
        ref = self._ref
        opt = ref() if ref is not None else None
        if opt is not None:
            opt._on_grad_ready(param)


class ShowSumHook(_OptimizerRef):
    """Post-accumulate-grad hook on a parameter whose gradients accumulate in a wider dtype than its own
    (``grad_dtype=torch.float32`` beside bf16 weights) and which has hooks of the loop's: the first of its hooks,
    it puts the sum over the backwards so far into ``param.grad`` for them (``ShardedOptimizer._show_sum``)."""

    def __call__(self, param):
        ref = self._ref
        opt = ref() if ref is not None else None
        if opt is not None:
            opt._show_sum(param)


def grad_accumulator(param: torch.Tensor):
    """The AccumulateGrad node of a leaf tensor that requires grad (``torch.autograd.graph.get_gradient_edge``'s,
    which needs grad mode, also where the optimizer is built under ``no_grad()`` or ``inference_mode()``)."""
    with torch.inference_mode(False), torch.enable_grad():
        return torch.autograd.graph.get_gradient_edge(param).node


class ClearPlaceholderHook(_OptimizerRef):
    """Pre-hook of a parameter's AccumulateGrad node, run before autograd accumulates a new gradient into
    ``param.grad`` (and only then: not in ``torch.autograd.grad``): a :class:`ShardedGrad` there (the previous
    micro-batch's gradient, already in the grad buffer) is removed, so autograd stores the new gradient instead of
    accumulating into a placeholder.

    ``arriving``: the optimizer's only hook on the parameter (without ``overlap_comm``, where nothing waits for
    the accumulated gradient before the end of the backward): it also notes the gradient's arrival
    (``ShardedOptimizer._grad_arriving``), which a :class:`GradReadyHook` does after the accumulation otherwise.
    One hook instead of two saves ~1 us of host time per parameter and backward (the C++ -> Python call)."""

    _arriving = False  # (an instance pickled before the attribute existed)

    def __init__(self, optimizer, param, index: int, arriving: bool = False):
        super().__init__(optimizer)
        self._param = weakref.ref(param)
        self._index = index  # the parameter's position in the optimizer's _param_list
        self._arriving = arriving

    def __getstate__(self):
        return {"_ref": None, "_param": None, "_index": self._index, "_arriving": self._arriving}

    def __call__(self, grad_outputs):
        # (per parameter and backward: the weak references read inline, not through optimizer())
        ref, param_ref = self._ref, self._param
        opt = ref() if ref is not None else None
        param = param_ref() if param_ref is not None else None
        if opt is not None and param is not None:
            if self._arriving:
                opt._grad_arriving(param, self._index)
            else:
                opt._take_placeholder(param, self._index)
        return None


class WaitForParamsHook(_OptimizerRef):
    """Forward pre-hook: wait for the all-gathers of the buckets holding this module's parameters."""

    def __init__(self, optimizer, bucket_indices):
        super().__init__(optimizer)
        self.bucket_indices = tuple(bucket_indices)

    def __call__(self, module, args):
        ref = self._ref  # (per module and forward: no list, no call where nothing is in flight, ~1 us less)
        opt = ref() if ref is not None else None
        if opt is not None:
            buckets = opt.buckets
            for i in self.bucket_indices:
                b = buckets[i]
                if b.ag_work is not None:
                    b.wait_gather()


class QueueEndOfBackwardHook(_OptimizerRef):
    """Post-accumulate-grad hook on a parameter of a ``DistributedDataParallel`` model that no tritonshard
    optimizer holds: a backward reaching only such parameters still ends in the optimizer's end-of-backward
    callback, which averages their gradients as DDP would (:func:`average_like_ddp`)."""

    def __call__(self, param):
        opt = self.optimizer()
        if opt is not None:
            opt._queue_end_of_backward()


def ddp_params(ddp) -> list:
    """The parameters ``ddp`` (a ``DistributedDataParallel``) looks after: its module's, without those it was told
    to ignore, each once (those of them with ``requires_grad`` are what its reducer reduces; read from DDP where
    it keeps the list)."""
    params = getattr(ddp, "_module_parameters", None)
    return list(params) if params is not None else list(ddp.module.parameters())


def average_like_ddp(params: list, group) -> None:
    """Average the gradients of ``params`` over ``group`` in place, as ``DistributedDataParallel``'s reducer does
    (each rank's ``param.grad`` multiplied by 1 / the group's size in its own dtype, then summed; with
    ``find_unused_parameters``' rule for a parameter without a gradient here: zeros from this rank, and a
    gradient after all where another rank had one; None where no rank had). For the parameters of a DDP model
    that no tritonshard optimizer holds, whose reduction ``attach`` switched off with the rest of DDP's (the
    optimizer reduces its own): a torch.optim optimizer stepping them, or a log line of their gradients, sees
    DDP's average, not this rank's own. Every rank must call it with the same list (DDP's, the same model): one
    all-reduce per gradient dtype and one of the flags."""
    size = torch.distributed.get_world_size(group)
    if size == 1 or not params:
        return
    device = params[0].device
    had = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
    torch.distributed.all_reduce(had, group=group)
    by_dtype: dict = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    averaged: dict = {}
    for dtype, indices in by_dtype.items():
        flat = torch.cat([(params[i].grad if params[i].grad is not None
                           else torch.zeros_like(params[i], memory_format=torch.contiguous_format)).reshape(-1)
                          for i in indices])
        flat.mul_(1.0 / size)  # (DDP's reducer: mul_out by the wrapped scalar 1 / world size, as it copies)
        torch.distributed.all_reduce(flat, group=group)
        for i, piece in zip(indices, flat.split([params[i].numel() for i in indices])):
            averaged[i] = piece
    used = had.tolist()
    for i, p in enumerate(params):
        if not used[i]:
            continue  # (no rank had a gradient: it stays None, as DDP leaves it)
        if p.grad is None:
            p.grad = averaged[i].view_as(p).clone()
        else:
            p.grad.copy_(averaged[i].view_as(p.grad))


def held(p: torch.Tensor) -> bool:
    """Whether a live tritonshard optimizer holds ``p``: its entry in :data:`OWNER` refers to a live bucket. (An
    entry may be stale, its parameter gone and the id reused by ``p``; but then its bucket, which held that
    parameter, is gone too: a live bucket keeps its parameters, and so their ids, alive.)"""
    return owner_of(p) is not None


def unheld(params: list) -> list:
    """Those of ``params`` that no tritonshard optimizer holds (each reduces its own)."""
    return [p for p in params if not held(p)]


class RootForwardPreHook(_OptimizerRef):
    """Forward pre-hook on the attached model (registered ``with_kwargs=True``): a ``DistributedDataParallel``
    wrapped around it must not reduce the gradients a second time, and with ``cast_to`` set, the floating-point
    tensors among the inputs are cast to the parameters' dtype (as FSDP2's ``cast_forward_inputs``): the model
    holds bf16 (or fp16) weights from construction on, and fp32 inputs would fail its first matmul."""

    def __init__(self, optimizer, cast_to: Optional[torch.dtype] = None):
        super().__init__(optimizer)
        self.cast_to = cast_to

    def __call__(self, module, args, kwargs):
        opt = self.optimizer()
        if opt is None:
            return None
        opt._before_model_forward(module)
        if self.cast_to is None:
            return None
        dtype = self.cast_to
        if not any(t.is_floating_point() and t.dtype != dtype for t in iter_tensors((args, kwargs))):
            return None  # nothing to cast (integer token ids, inputs already in the weights' dtype)
        return _cast_floating((args, kwargs), dtype)


def _cast_floating(obj, dtype: torch.dtype, _depth: int = 0):
    """``obj`` with every floating-point tensor in it (through tuples, lists and dicts) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if _depth > 8:
        return obj
    if isinstance(obj, dict):
        return type(obj)((k, _cast_floating(v, dtype, _depth + 1)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_cast_floating(v, dtype, _depth + 1) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(v, dtype, _depth + 1) for v in obj)
    return obj


class RootForwardHook(_OptimizerRef):
    """Forward hook on the attached model: a gradient hook on its outputs queues the end-of-backward callback in
    the outermost backward (a hook on a parameter inside a reentrant activation checkpoint would queue it in the
    checkpoint's inner backward, which ends before the outer one has produced every gradient)."""

    def __call__(self, module, args, output):
        opt = self.optimizer()
        if opt is None or not torch.is_grad_enabled():
            return None
        hook = OutputGradHook(opt)
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(hook)
        return None


class OutputGradHook(_OptimizerRef):
    def __call__(self, grad):
        opt = self.optimizer()
        if opt is not None:
            opt._queue_end_of_backward()
        return None


def iter_tensors(obj, _depth: int = 0):
    """The tensors in a model output: a tensor, or nested tuples / lists / dicts (Hugging Face ``ModelOutput`` is
    a dict) of them."""
    if _depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v, _depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v, _depth + 1)


# ---------------------------------------------------------------------------------------------- param.grad
_METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "layout", "is_sparse", "is_cuda", "is_cpu",
    "ndim", "is_meta", "is_quantized", "is_nested", "is_mkldnn", "is_xpu", "is_mps", "grad", "names", "_base",
    "is_sparse_csr", "output_nr", "_version", "itemsize", "nbytes",
})
_METADATA_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "is_contiguous",
    "get_device", "requires_grad_", "detach_", "__format__", "__len__", "is_signed", "_is_view", "is_inference",
    "is_neg", "is_conj", "_is_zerotensor", "is_pinned",
})
_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm}
#: what gives the same gradient back without autograd history: ``p.grad.data`` (read) and ``p.grad.detach()``, the
#: placeholder itself (``.norm()`` / ``.mul_()`` / ``.zero_()`` on it are the gradient's): Lightning's
#: ``grad_norm`` reads ``p.grad.data.norm(p)``, torch 1.x's clip_grad_norm_ multiplied ``p.grad.detach()``, and
#: older loops clip through ``p.grad.data.mul_`` (an error "reading .data" until session 38)
_ALIASES = {torch.Tensor.detach}
_REDUCING = {torch._foreach_norm, torch._amp_foreach_non_finite_check_and_unscale_}  # (with _NORMS: the reduction)


class ShardedGrad(torch.Tensor):
    """``param.grad`` after backward: the gradient lives in the optimizer's grad buffer (sharded after the
    reduce-scatter), not here. No storage; shape, dtype and device are the parameter's.

    Supported, with torch.optim's meaning: ``.data`` and ``.detach()`` (the placeholder again: an alias, as
    torch's are), ``torch.linalg.vector_norm`` / ``.norm()`` / ``torch._foreach_norm``
    (the parameter's gradient norm over all ranks, after averaging, unscaled), ``mul_`` / ``_foreach_mul_`` by one
    coefficient for every parameter (``torch.nn.utils.clip_grad_norm_``: folded into the update), ``clamp_`` /
    ``clamp_min_`` / ``clamp_max_`` / ``_foreach_clamp_min_`` / ``_foreach_clamp_max_``
    (``torch.nn.utils.clip_grad_value_``: the reduced gradient clamped where it lives), ``zero_()`` (discards this
    parameter's gradient), metadata (``shape``, ``dtype``...). Anything else raises.
    """

    @staticmethod
    def __new__(cls, param: torch.Tensor, optimizer):
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        t._optimizer = weakref.ref(optimizer)
        t._param = weakref.ref(param)
        return t

    @property
    def _name(self) -> str:
        """The parameter's name as the optimizer knows it (its name in the model after ``attach``)."""
        opt, param = self._optimizer(), self._param()
        if opt is not None and param is not None:
            return opt._param_names[param]
        return f"a parameter of shape {tuple(self.shape)}"  # (its optimizer is gone: no name to give)

    def __repr__(self, *, tensor_contents=None):
        return f"ShardedGrad(param={self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def _owner(self):
        opt, param = self._optimizer(), self._param()
        if opt is None or param is None:
            raise RuntimeError("this gradient belonged to a tritonshard optimizer that no longer exists")
        return opt, param

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        answer = _metadata(func, name, args, kwargs)
        if answer is not _NOT_METADATA:
            return answer
        if func in _ALIASES or (name == "__get__" and _attribute(func) == "data"):
            return args[0]
        if name == "__get__":
            raise _unsupported(args[0], f"reading .{_attribute(func)}")
        if func in _NORMS:
            return _norm(args[0], _norm_type(func, args, kwargs))
        if func is torch._foreach_norm:
            ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            return _foreach_norm(args[0], ord_)
        # the multiply of torch's clip, and p.grad /= n (a loop normalizing by its accumulation steps or token
        # count): folded into the update (a division as the multiply by 1 / n: exact where n is a power of two,
        # else within one bf16 rounding of torch's division of bf16 gradients, as for the clip coefficient)
        scale = _SCALE.get(func)
        if scale is not None and kwargs.get("rounding_mode") is None:
            scale(args[0], args[1] if len(args) > 1 else kwargs["other"])
            return args[0]
        scale = _FOREACH_SCALE.get(func)
        if scale is _mul and not isinstance(args[1], (list, tuple)):  # (torch's clip: one coefficient for all)
            _foreach_fold(args[0], args[1])
            return None
        if scale is not None:
            factors = args[1]
            for i, t in enumerate(args[0]):
                scale(t, factors[i] if isinstance(factors, (list, tuple)) else factors)
            return None
        if func in _CLAMPS:  # torch.nn.utils.clip_grad_value_ (one tensor at a time where foreach is not used)
            low, high = _clamp_bounds(func, args, kwargs)
            opt, param = args[0]._owner()
            opt._clamp_grads([param], low, high)
            return args[0]
        if func in _FOREACH_CLAMPS:  # ... and with foreach
            tensors, value = args[0], (args[1] if len(args) > 1 else kwargs.get("scalar", kwargs.get("scalars")))
            _foreach_clamp(func, tensors, value)
            return None
        if func is torch._amp_foreach_non_finite_check_and_unscale_:  # torch.amp.GradScaler
            grads, found_inf, inv_scale = (list(args) + [kwargs.get(k) for k in ("found_inf", "inv_scale")])[:3]
            _amp_unscale(grads, found_inf, inv_scale)
            return None
        if func is torch.Tensor.zero_:
            opt, param = args[0]._owner()
            opt._discard_grad(param)
            return args[0]
        placeholder = next((a for a in _flat(args, kwargs) if isinstance(a, ShardedGrad)), None)
        raise _unsupported(placeholder, f"{name or func}()")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        placeholder = next((a for a in _flat(args, kwargs or {}) if isinstance(a, ShardedGrad)), None)
        raise _unsupported(placeholder, f"{func} (called from C++)", below_python=True)


_CONVERSIONS = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.float, torch.Tensor.half,
                torch.Tensor.bfloat16, torch.Tensor.double, torch.Tensor.type}


class SpentGrad(ShardedGrad):
    """``param.grad`` after ``step()`` until the gradients are cleared: the gradient the step used, which is gone.

    torch.optim leaves ``param.grad`` in place after ``step()``, so a loop without ``zero_grad()`` between two steps
    applies that gradient again, or adds the next backward's to it. tritonshard's step consumes the reduced
    gradient (each rank keeps only its shard of it, and the update may scale it in place), so instead of silently
    training on something else this marker stands where torch's gradient would: clearing it (``opt.zero_grad()``,
    ``model.zero_grad()``, ``p.grad = None``) or zeroing it (``zero_grad(set_to_none=False)``) works as in torch;
    a backward onto it is noted and is an error only if the sum would be used (at the next reduction); a step or a
    clip that would use it again, or reading it, is an error saying so. It goes along with the model's own
    conversions (``model.to()``, ``.cpu()``, ``copy.deepcopy``: a copy has no gradient)."""

    def __repr__(self, *, tensor_contents=None):
        return f"SpentGrad(param={self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        answer = _metadata(func, name, args, kwargs)
        if answer is not _NOT_METADATA:
            return answer
        if name == "__get__":
            raise spent_error(args[0]._name, f"reading .{_attribute(func)} of param.grad")
        if name == "__set__" and _attribute(func) == "data" and len(args) > 1 and args[1] is args[0]:
            return None  # Module._apply's `param.grad.data = fn(param.grad)`, fn having returned the marker
        elif func in _CONVERSIONS:
            return args[0]  # Module._apply (model.to(), .cpu(), .float()...) carries the marker along
        elif func is torch._has_compatible_shallow_copy_type:  # (Module._apply asks, then sets .data)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        elif func is torch.Tensor.__deepcopy__:
            return None  # a deep copy of the model has no gradient (its hooks are inert too)
        elif func is torch.Tensor.zero_:
            opt, param = args[0]._owner()
            opt._zero_spent(param)
            return args[0]
        marker = next((a for a in _flat(args, kwargs) if isinstance(a, SpentGrad)), args[0] if args else None)
        error = spent_error(marker._name if isinstance(marker, ShardedGrad) else "a parameter",
                            f"{name or func}() on param.grad")
        opt = marker._optimizer() if isinstance(marker, ShardedGrad) else None
        if opt is not None and (func in _NORMS or func in _REDUCING):
            # torch's clip_grad_norm_ (or GradScaler.unscale_) on this rank: on the others it is in the gradient
            # reduction, whose handshake now tells them (PeerFailedError) instead of waiting for this rank
            opt._tell_peers(error, opt._entry.position())
        raise error

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        marker = next((a for a in _flat(args, kwargs or {}) if isinstance(a, SpentGrad)), None)
        raise spent_error(marker._name if marker is not None else "a parameter", f"{func} (called from C++)")


def spent_error(name: str, what: str) -> RuntimeError:
    """The error for a use of a gradient that a step() consumed (see :class:`SpentGrad`)."""
    return RuntimeError(
        f"tritonshard: {what}: the gradient of {name} was used by the last step() and is gone, and nothing "
        "cleared param.grad since. torch.optim keeps param.grad after step(), so there it would be used again "
        "(a second step() applies it again, a backward adds to it, a clip or a norm reads it); tritonshard's "
        "step() consumes it (each rank keeps only its shard of the reduced gradient). Call opt.zero_grad() (or "
        "model.zero_grad()) after step() and before the next backward, and read gradients before step().")


_NOT_METADATA = object()


def _attribute(func) -> str:
    """The attribute a ``__get__`` / ``__set__`` call of ``__torch_function__`` reads or writes."""
    return getattr(getattr(func, "__self__", None), "__name__", "")


def _metadata(func, name: str, args, kwargs):
    """What both markers answer alike: a metadata read or call (``shape``, ``dtype``, ``size()``...), with
    ``requires_grad_()`` and ``detach_()`` returning the marker, which never requires grad
    (``Module.zero_grad(set_to_none=False)`` asks); ``_NOT_METADATA`` for anything else."""
    if name == "__get__":
        if _attribute(func) not in _METADATA:
            return _NOT_METADATA
    elif name not in _METADATA_METHODS:
        return _NOT_METADATA
    elif name in ("requires_grad_", "detach_"):
        return args[0]
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _flat(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _norm_type(func, args, kwargs) -> float:
    if func is torch.linalg.vector_norm:
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    else:
        ord_ = args[1] if len(args) > 1 else kwargs.get("p", 2)
    if kwargs.get("dim") is not None or (func is not torch.linalg.vector_norm and len(args) > 2):
        raise _unsupported(args[0], "a norm over some dimensions (only the full norm is available)")
    return 2.0 if ord_ in (None, "fro") else float(ord_)


def _norm(t, ord_) -> torch.Tensor:
    if not isinstance(t, ShardedGrad):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.linalg.vector_norm(t, ord_)
    opt, param = t._owner()
    return opt._param_grad_norm(param, float(ord_))


_OPTIMIZER_REF, _PARAM_REF = operator.attrgetter("_optimizer"), operator.attrgetter("_param")
_call = getattr(operator, "call", lambda f: f())  # (operator.call: Python 3.11 on)


def _by_optimizer(tensors) -> tuple[list, list]:
    """The placeholders among ``tensors`` grouped by their optimizer, ``[(optimizer, positions, parameters)]``,
    and the positions of the other tensors. The usual list (torch's clip over ``model.parameters()``: every one a
    placeholder of one optimizer) in a few C-level passes, ~0.2 us per tensor less than the loop (twice per clip)."""
    if tensors and set(map(type, tensors)) == {ShardedGrad}:
        refs = set(map(_OPTIMIZER_REF, tensors))  # (one weak reference per optimizer: weakref.ref reuses it)
        opt = next(iter(refs))() if len(refs) == 1 else None
        if opt is not None:
            params = list(map(_call, map(_PARAM_REF, tensors)))
            if not any(map(operator.is_, params, itertools.repeat(None))):
                return [(opt, list(range(len(tensors))), params)], []
    groups, others, last = {}, [], None
    for i, t in enumerate(tensors):
        if not isinstance(t, ShardedGrad):
            others.append(i)
            continue
        opt, param = t._optimizer(), t._param()
        if opt is None or param is None:
            t._owner()  # (raises: the optimizer is gone)
        if last is None or last[0] is not opt:  # (a list is mostly one optimizer's, in a row)
            last = groups.get(id(opt))
            if last is None:
                last = groups[id(opt)] = (opt, [], [])
        last[1].append(i)
        last[2].append(param)
    return list(groups.values()), others


def _foreach_norm(tensors, ord_) -> list:
    """``torch._foreach_norm`` over a list holding placeholders (torch's clip_grad_norm_ on CUDA, where foreach is
    its default): each optimizer's parameters answered in one call (:meth:`_param_grad_norms_of`), not one call
    through the placeholder per parameter; the other tensors' norms by torch."""
    out = [None] * len(tensors)
    groups, others = _by_optimizer(tensors)
    for opt, positions, params in groups:
        for i, norm in zip(positions, opt._param_grad_norms_of(params, float(ord_))):
            out[i] = norm
    for i in others:
        out[i] = _norm(tensors[i], ord_)
    return out


def _foreach_fold(tensors, coef) -> None:
    """``torch._foreach_mul_(tensors, coef)`` with one coefficient (torch's clip: its clip coefficient): each
    optimizer's placeholders folded in one call (:meth:`_fold_grad_multipliers`), the other tensors multiplied."""
    groups, others = _by_optimizer(tensors)
    for opt, positions, params in groups:
        opt._fold_grad_multipliers(params, coef, [tensors[i] for i in positions])
    for i in others:
        tensors[i].mul_(coef)


def _mul(t, coef) -> None:
    if not isinstance(t, ShardedGrad):
        t.mul_(coef)
        return
    opt, param = t._owner()
    opt._fold_grad_multiplier(param, coef)


def _div(t, divisor) -> None:
    if not isinstance(t, ShardedGrad):
        t.div_(divisor)
        return
    opt, param = t._owner()
    opt._fold_grad_multiplier(param, opt._reciprocal(divisor))


#: in-place multiplies and divisions of a gradient by a number, and their foreach forms: how each is folded
_SCALE = {torch.Tensor.mul_: _mul, torch.Tensor.div_: _div}
_FOREACH_SCALE = {torch._foreach_mul_: _mul, torch._foreach_div_: _div}

_CLAMPS = {torch.Tensor.clamp_, torch.Tensor.clip_, torch.Tensor.clamp_min_, torch.Tensor.clamp_max_}
_FOREACH_CLAMPS = {torch._foreach_clamp_min_, torch._foreach_clamp_max_}


def _clamp_bounds(func, args, kwargs) -> tuple:
    """(min, max) of an in-place clamp call, None for a side it leaves open."""
    if func is torch.Tensor.clamp_min_:
        return (args[1] if len(args) > 1 else kwargs["min"]), None
    if func is torch.Tensor.clamp_max_:
        return None, (args[1] if len(args) > 1 else kwargs["max"])
    low = args[1] if len(args) > 1 else kwargs.get("min")
    high = args[2] if len(args) > 2 else kwargs.get("max")
    return low, high


def _foreach_clamp(func, tensors, value) -> None:
    """``torch._foreach_clamp_min_/max_`` over a mix of placeholders (each optimizer clamps its own, once per list
    and bound) and tensors."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * len(tensors)
    plain = [(t, v) for t, v in zip(tensors, values) if not isinstance(t, ShardedGrad)]
    with torch._C.DisableTorchFunctionSubclass():
        for t, v in plain:
            (t.clamp_min_ if func is torch._foreach_clamp_min_ else t.clamp_max_)(v)
    by_call: dict = {}
    for t, v in zip(tensors, values):
        if isinstance(t, ShardedGrad):
            opt, param = t._owner()
            key = (id(opt), id(v) if torch.is_tensor(v) else float(v))
            by_call.setdefault(key, (opt, v, []))[2].append(param)
    for opt, v, params in by_call.values():
        opt._clamp_grads(params, v if func is torch._foreach_clamp_min_ else None,
                         v if func is torch._foreach_clamp_max_ else None)


def _amp_unscale(grads, found_inf, inv_scale) -> None:
    """GradScaler's check-and-unscale over a mix of placeholders (each optimizer handles its own) and tensors.
    The optimizers first: their reduction takes the gradients set by hand on their parameters (plain tensors here)
    into the buffers, where the update unscales them with the rest; torch's op then unscales the plain tensors
    (those, now out of param.grad, and any other optimizer's)."""
    groups, others = _by_optimizer(grads)
    for opt, positions, params in groups:
        opt._amp_unscale(params, found_inf, inv_scale, [grads[i] for i in positions])
    plain = [grads[i] for i in others]
    if plain:
        with torch._C.DisableTorchFunctionSubclass():
            torch._amp_foreach_non_finite_check_and_unscale_(plain, found_inf, inv_scale)


def _compiling_now() -> bool:
    """Whether torch.compile is at work: tracing the code (``torch.compiler.is_compiling()``) or, around it, wrapping
    the tensors that code meets, where a placeholder's hooks run eagerly. torch 2.13 holds ``is_compiling()`` True
    for the whole compilation; torch 2.11 (the GPU machine's) only inside the traced code, so there a placeholder
    wrapped by dynamo (``model.zero_grad()`` of a model not attached, in a compiled function) got the message meant
    for eager code, naming no torch.compile. The compile context dynamo opens tells it on both."""
    return torch.compiler.is_compiling() or torch._guards.CompileContext.try_get() is not None


def _unsupported(placeholder: Optional[ShardedGrad], what: str, below_python: bool = False) -> RuntimeError:
    name = placeholder._name if placeholder is not None else "a parameter"
    where = (f"tritonshard: {what} on the gradient of {name}: after backward, tritonshard keeps gradients in its "
             "sharded buffers and param.grad is a placeholder without storage.")
    if placeholder is not None and placeholder._optimizer() is None:
        return RuntimeError(
            where + " The tritonshard optimizer that held it is gone (let go of between the backward and its step()), "
                    "and the gradient went with its buffers. Call step() of the old optimizer before letting it go, or "
                    "zero the gradients (model.zero_grad()) and run the backward again with the new optimizer.")
    if _compiling_now():
        return RuntimeError(
            where + " torch.compile is tracing code that reads param.grad, and dynamo cannot wrap the placeholder: "
            "torch's clip_grad_norm_ or clip_grad_value_, a loop over p.grad, or model.zero_grad() of a model not "
            "attached to the optimizer, in a compiled function (one that also runs the backward is compiled "
            "piecewise after it). Call these outside the compiled function, clip with opt.clip_grad_norm_, zero with "
            "opt.zero_grad(), or opt.attach(model) (an attached model's zero_grad() runs eagerly under compile).")
    if below_python:
        return RuntimeError(
            where + " A C++ access like this one means the model was wrapped in DistributedDataParallel (or FSDP) "
            "after the optimizer was built, without opt.attach(model): the wrapper would reduce the gradients a "
            "second time. Call opt.attach(model) before wrapping (it switches the wrapper's gradient reduction "
            "off), or don't wrap the model: tritonshard is the data parallelism. (A Hugging Face Trainer wraps it "
            "in train(): pass callbacks=[tritonshard.integrations.hf.ShardedOptimizerCallback()], which attaches "
            "it first.)")
    return RuntimeError(
        where + " It supports the norms and the multiply of torch.nn.utils.clip_grad_norm_, a division by a "
        "number (p.grad /= n, the same n for every parameter), the clamps of clip_grad_value_, and zero_(); for "
        "anything else read opt.grad_norm(), or clip with opt.clip_grad_norm_(max_norm). To change a gradient (rows "
        "masked, a layer's gradient scaled), do it in a hook on the parameter, which runs before the optimizer "
        "takes the gradient: p.register_hook(lambda g: g * mask).")


# ---------------------------------------------------------------------------------------------- the model
#: [_GuardedModule._zero_grad under torch.compiler.disable], made at the first compiled call (see zero_grad)
_EAGER_ZERO_GRAD: list = []


class _GuardedModule:
    """Mixin put in front of the attached model's class (``guard_model``): the model's own read and write paths wait
    for in-flight parameter all-gathers first. ``no_sync()`` is the optimizer's, so accelerate's ``accumulate()``
    (which calls ``model.no_sync()``) skips communication as it does with DDP. Several optimizers attached to one
    model (Muon's matrices and AdamW's rest in two, a GAN's two in one module): each guard is every one's (until
    session 27 the last attached one's only: ``model.no_sync()`` left the others reducing, an error at the next
    micro-batch with ``overlap_comm``, and ``state_dict()`` right after step() waited for one optimizer's
    all-gathers, not the others')."""

    def _tritonshard_wait(self) -> None:
        for opt, indices in self._tritonshard_guards():  # (indices None: every bucket)
            opt._wait_buckets(opt.buckets if indices is None else [opt.buckets[i] for i in indices])

    def _tritonshard_guards(self) -> list:
        """(optimizer, its bucket indices or None) of every live optimizer guarding this module, oldest first (a
        DDP wrapper's last one averages the parameters none of them holds)."""
        return [(opt, indices) for ref, indices in self.__dict__.get("_tritonshard_guarding", ())
                if (opt := ref()) is not None]

    def __setattr__(self, name, value):
        if isinstance(value, torch.nn.Module):  # (a submodule set or swapped in: module.fc = ..., model[2] = ...)
            _modules_changed(self)
        super().__setattr__(name, value)

    def add_module(self, name, module):  # (register_module, ModuleList.append, ModuleDict[k] = ...)
        _modules_changed(self)
        return super().add_module(name, module)

    def named_parameters(self, *args, **kwargs):  # (parameters() lists these too)
        """Each parameter's all-gather waited for as it is handed out, not all of them first: ``next(model
        .parameters())`` (Hugging Face's ``model.device`` and ``model.dtype``) waits for the first one's only, and
        :meth:`zero_grad`, which reads no weight, for none."""
        items = super().named_parameters(*args, **kwargs)
        if self.__dict__.get("_tritonshard_grads_only") or torch.compiler.is_compiling():
            return items
        return _landed_as_listed(items)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, without waiting for the in-flight all-gathers: it touches ``param.grad`` only, and the Hugging
        Face Trainer calls ``model.zero_grad()`` right after ``step()``, where waiting for every gather (as
        ``parameters()`` did until session 21) left nothing to overlap with the next forward. Under torch.compile
        it runs eagerly (a graph break): dynamo cannot wrap tritonshard's placeholder gradients."""
        if torch.compiler.is_compiling():
            if not _EAGER_ZERO_GRAD:
                _EAGER_ZERO_GRAD.append(torch.compiler.disable(_GuardedModule._zero_grad, reason=(
                    "tritonshard: model.zero_grad() of a model attached to a tritonshard optimizer runs eagerly under "
                    "torch.compile: each param.grad may hold tritonshard's placeholder, which dynamo cannot wrap")))
            return _EAGER_ZERO_GRAD[0](self, set_to_none)
        self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        object.__setattr__(self, "_tritonshard_grads_only", True)
        try:
            super().zero_grad(set_to_none)
        finally:
            object.__setattr__(self, "_tritonshard_grads_only", False)

    def state_dict(self, *args, **kwargs):
        self._tritonshard_wait()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self._tritonshard_wait()  # a gather landing after the load would overwrite the loaded weights
        return super().load_state_dict(*args, **kwargs)

    def _apply(self, *args, **kwargs):  # .to(), .float(), .cuda(), ... copy the parameters
        self._tritonshard_wait()
        return super()._apply(*args, **kwargs)

    def no_sync(self):
        opts = [opt for opt, _ in self._tritonshard_guards()]
        if not opts and hasattr(super(), "no_sync"):  # (every optimizer gone: a DDP's own, it reduces again)
            return super().no_sync()
        return opts[0].no_sync() if len(opts) == 1 else _all_no_sync(opts)

    def __reduce_ex__(self, protocol):
        self._tritonshard_wait()
        state = self.__getstate__()
        state.pop("_tritonshard_guarding", None)
        state.pop("_tritonshard_grads_only", None)
        if "_tritonshard_wants_sync" in state:  # (a DDP: its flag as the loop left it)
            state["require_backward_grad_sync"] = state.pop("_tritonshard_wants_sync")
        return _rebuild_module, (type(self)._tritonshard_base, state)


_is_compiling = torch.compiler.is_compiling
_ABSENT = object()  # (an attribute name not among a module's parameters)
_NO_PARAMETERS: dict = {}


class _GuardedAttributes(_GuardedModule):
    """:class:`_GuardedModule` for a model whose optimizer leaves its all-gathers in flight after ``step()``
    (``overlap_comm``): a parameter read as an attribute (``model.lm_head.weight``, a block's ``.weight``) waits
    for its own gather (:func:`~tritonshard.optim.bucket.landed`). Until session 21 a read there right after
    ``step()`` saw old weights in some elements, and a write (a padding row zeroed after each step, weight
    clipping) could be overwritten by the gather. Only modules that hold parameters themselves (a Linear, an
    Embedding, a norm: where a parameter is an attribute) get it, and only with ``overlap_comm``: a parameter read
    costs ~0.15 us more where no gather is in flight (0.45 -> 0.60 us for ``linear.weight`` on this repo's CPU
    machine; 0.80 until session 40, which called nn.Module's __getattr__ and ``landed`` from here; ~10 reads per
    transformer layer and forward), another attribute read of such a module one more Python frame."""

    def __getattr__(self, name):
        if _is_compiling():  # (dynamo traces this frame: nn.Module's own look, which it knows)
            return super().__getattr__(name)
        # nn.Module.__getattr__'s first look, its _parameters, inline; its buffers and submodules through it
        value = self.__dict__.get("_parameters", _NO_PARAMETERS).get(name, _ABSENT)
        if value is _ABSENT:
            return super().__getattr__(name)
        if type(value) is WatchedParameter:  # (landed(), inline)
            ref = OWNER.get(id(value))
            b = ref() if ref is not None else None
            if b is not None and b.ag_work is not None:
                b.wait_gather()
        return value


class _GuardedDDP(_GuardedModule):
    """:class:`_GuardedModule` for a ``DistributedDataParallel`` around the attached model. Its reduction stays off
    (tritonshard reduces what it holds: ``require_backward_grad_sync`` reads False), and what the loop writes to
    that flag goes to the optimizer as the ``no_sync()`` it means: nanoGPT's ``model.require_backward_grad_sync =
    (micro_step == last)``, and DDP's own ``no_sync()`` entered before the wrapper was guarded (accelerate's
    ``accumulate()`` around the first micro-batch, when ``prepare`` wrapped the model after ``attach``), whose exit
    writes the flag back. Until session 27 both were ignored: with ``overlap_comm`` the first micro-batch's
    backward launched the reduction, and the next one's gradients were an error."""

    def __setattr__(self, name, value):
        if name == "require_backward_grad_sync":
            object.__setattr__(self, "_tritonshard_wants_sync", bool(value))
            for opt, _ in self._tritonshard_guards():
                opt._ddp_wants_sync(bool(value))
            return
        super().__setattr__(name, value)

    @property
    def require_backward_grad_sync(self) -> bool:
        """False while a live tritonshard optimizer guards this wrapper; once none does (each one gone: ``del opt``,
        a torch.optim optimizer training the model from here), what the loop last wrote, so DDP reduces again as
        it would have without tritonshard. Until session 28 it stayed False: the gradients of the next optimizer
        were each rank's own, the replicas drifted apart, silently."""
        if self._tritonshard_guards():
            return False
        if self.__dict__.get("_tritonshard_marked_static"):
            raise RuntimeError(DDP_STATIC_GRAPH_ORPHANED)
        return self.__dict__.get("_tritonshard_wants_sync", True)

    def join_hook(self, **kwargs):
        """DDP's part in ``ddp.join()`` / ``torch.distributed.algorithms.Join([ddp])`` (uneven inputs): refused, on
        every rank at once (each enters it before its loop). A rank out of batches would shadow DDP's all-reduces,
        but not the optimizer's collectives, which DDP's reduction gave way to: the other ranks' next ``step()``
        would wait for it for good (a hang until session 27). A wrapper not guarded yet when ``join()`` was
        entered (wrapped after ``attach``) raises it at its first forward (``check_not_joined``)."""
        raise RuntimeError(DDP_JOIN_REFUSED)


#: a DDP(static_graph=True) whose first iterations ran under the guard, every tritonshard optimizer gone since
DDP_STATIC_GRAPH_ORPHANED = (
    "DistributedDataParallel(static_graph=True) around this model ran its first iterations while a tritonshard "
    "optimizer reduced the gradients, and no tritonshard optimizer is attached to it any more, so DDP would reduce "
    "again; but its reducer took those backwards for its own first iteration (static_graph counts the gradient "
    "hooks there) and would skip the all-reduce from its second one on, silently. Wrap the model in a new "
    "DistributedDataParallel (DistributedDataParallel(ddp.module, static_graph=True)), or keep a tritonshard "
    "optimizer attached to it.")

#: ddp.join() refused: why, and the way out
DDP_JOIN_REFUSED = (
    "DistributedDataParallel.join() (uneven inputs across ranks) is not supported for a model attached to a "
    "tritonshard optimizer: the gradients are reduced by the optimizer's step(), whose collectives a rank that ran "
    "out of batches would not join, so the others would wait for it. Give every rank the same number of batches "
    "(DistributedSampler(..., drop_last=True), or stop every rank at the shortest loader's length) and leave out "
    "join().")


def check_not_joined(ddp) -> None:
    """A forward of ``ddp`` inside ``ddp.join()`` (its join config enabled): :data:`DDP_JOIN_REFUSED`, on every rank
    at that forward (each rank's first one inside it, after DDP's own join all-reduce, which they all made)."""
    config = getattr(ddp, "_join_config", None)
    if config is not None and config.enable:
        raise RuntimeError(DDP_JOIN_REFUSED)


def _modules_changed(module) -> None:
    """A submodule was set in ``module`` (guarded: it holds some of its optimizers' parameters): each of them
    looks for modules without its hooks at the model's next forward (``_hook_new_modules``): one made or swapped in
    after attach holding the same parameters (SyncBatchNorm.convert_sync_batchnorm's add_module, ``model.fc =
    Wrapper(model.fc)``) would read them without waiting for their all-gathers."""
    for opt, _ in module._tritonshard_guards():
        opt._new_modules = True


@contextlib.contextmanager
def _all_no_sync(optimizers: list):
    """``no_sync()`` of each of ``optimizers`` (none: nothing to skip)."""
    with contextlib.ExitStack() as stack:
        for opt in optimizers:
            stack.enter_context(opt.no_sync())
        yield


def _landed_as_listed(items):
    for item in items:
        landed(item[1])
        yield item


def _rebuild_module(cls, state):
    module = cls.__new__(cls)
    module.__setstate__(state)
    return module


_GUARDED_CLASSES: dict[tuple, type] = {}

#: an attached model -> a weak reference to the DistributedDataParallel guarded around it (not one of the model's
#: modules): an optimizer attached to the model later guards it at once, one retired leaves its guards
_DDP_AROUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ddp_around(model: torch.nn.Module):
    """The guarded ``DistributedDataParallel`` around ``model`` (an attached model), or None."""
    ref = _DDP_AROUND.get(model)
    return ref() if ref is not None else None


def guard_model(model: torch.nn.Module, optimizer, buckets: Optional[tuple] = None, attributes: bool = False) -> None:
    """Swap ``model``'s class for a guarded subclass of it (same name, ``isinstance`` still holds) whose read and
    write paths wait for ``optimizer``'s in-flight all-gathers: of the buckets with these indices, or of all of them
    (None); with ``attributes`` its parameters read as attributes too (:class:`_GuardedAttributes`: for a module
    that holds parameters itself, where the optimizer leaves gathers in flight). Pickling and deep copies produce
    the original class, without the guard. Idempotent. A ``DistributedDataParallel``: :class:`_GuardedDDP`, its
    reduction switched off from here on, the ``no_sync()`` it is in (its flag) handed to the optimizer."""
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    mixin = (_GuardedDDP if ddp else
             _GuardedAttributes if attributes or isinstance(model, _GuardedAttributes) else _GuardedModule)
    if not isinstance(model, mixin):
        cls = type(model)._tritonshard_base if isinstance(model, _GuardedModule) else type(model)
        guarded = _GUARDED_CLASSES.get((cls, mixin))
        if guarded is None:
            guarded = type(cls.__name__, (mixin, cls),
                           {"_tritonshard_base": cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
            _GUARDED_CLASSES[(cls, mixin)] = guarded
        model.__class__ = guarded
    indices = None if buckets is None else tuple(buckets)
    guarding = [(ref, i) for ref, i in model.__dict__.get("_tritonshard_guarding", ())
                if ref() is not None and ref() is not optimizer]
    object.__setattr__(model, "_tritonshard_guarding", tuple(guarding) + ((weakref.ref(optimizer), indices),))
    if not ddp:
        return
    _DDP_AROUND[model.module] = weakref.ref(model)
    if "_tritonshard_wants_sync" not in model.__dict__:
        model.require_backward_grad_sync = model.__dict__.get("require_backward_grad_sync", True)
    else:  # (one more optimizer guarding it: in the no_sync() its flag says, as the others are)
        optimizer._ddp_wants_sync(model.__dict__["_tritonshard_wants_sync"])
    # static_graph=True: DDP's first backward would run its reducer's delayed all-reduce whatever the flag says
    # (queued by the _DDPSink its forward puts on the outputs until then), reading param.grad from C++, which
    # tritonshard's placeholders refuse (until session 27 an error, before it torch's INTERNAL ASSERT). Marked as
    # done (the reducer has nothing to do here); where the guard goes, this wrapper cannot reduce again
    # (DDP_STATIC_GRAPH_ORPHANED: until session 28 silently skipped all-reduces)
    if getattr(model, "static_graph", False) and not getattr(model, "_static_graph_delay_allreduce_enqueued", True):
        model._static_graph_delay_allreduce_enqueued = True
        object.__setattr__(model, "_tritonshard_marked_static", True)
