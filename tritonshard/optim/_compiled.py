"""What ShardedOptimizer does under ``torch.compile``: the kernels a call uses, the calls that run eagerly, and the
Python state a traced step keeps outside the optimizer.

* :func:`kernels`: the launchers, or under ``torch.compile`` the same kernels as ``torch.library`` custom ops;
* :data:`_EAGERLY`: ``step()``, a clip, a norm, ``zero_grad()`` and the collective work of the forward pre-hooks
  under ``torch.compiler.disable``, with the reason dynamo gives under ``fullgraph=True`` (:data:`_EAGER_REASONS`);
* :class:`_StepFlags`: what a traced step reads and sets, where dynamo would drop its writes to the optimizer.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels as _eager_kernels
from ..kernels import ops as _op_kernels

__all__ = ["kernels"]


def kernels():
    """The kernel entry points for this call: the launchers in eager mode; under ``torch.compile`` the same kernels
    as ``torch.library`` custom ops, which dynamo records as single nodes instead of tracing the launchers."""
    return _op_kernels if torch.compiler.is_compiling() else _eager_kernels


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
