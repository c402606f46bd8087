"""``StateViewMixin``: ``opt.state`` as torch.optim code sees it, and what that code does to it.

``opt.state[p]`` holds live views of the pieces of ``p``'s state this rank owns (see :meth:`_expose_state`). Code
written for torch.optim also edits it: it resets the state (``opt.state.clear()``, ``opt.state =
defaultdict(dict)``, ``del opt.state[p]``; torch.optim then starts those parameters afresh at the next step),
restarts a count (``opt.state[p]["step"] = torch.tensor(0.)``) or replaces a tensor (``opt.state[p]["exp_avg"] =
torch.zeros_like(...)``). The state itself lives in the buckets, so such an edit would silently change nothing.
The dicts here are dict subclasses that raise a flag on every write; the next ``sync_from_model`` (every
``step()``, ``state_dict()``, save and load) sees the flag and carries the edits into the buckets as torch.optim
would, or raises where it cannot (:meth:`_follow_state_edits`). Unflagged, a step pays three attribute reads.
"""

from __future__ import annotations

import collections

import torch

__all__ = ["StateViewMixin"]


class _Edits:
    """The flag that the dicts of one optimizer's ``state`` share."""

    __slots__ = ("seen",)

    def __init__(self):
        self.seen = False


_WRITES = ("__setitem__", "__delitem__", "pop", "popitem", "clear", "update", "setdefault", "__ior__")


def _flagging(cls):
    """Make every write method of the dict subclass ``cls`` raise ``self._edits.seen`` first."""
    for name in _WRITES:
        def write(self, *args, _name=name, **kwargs):
            self._edits.seen = True
            return getattr(super(cls, self), _name)(*args, **kwargs)
        write.__name__ = name
        setattr(cls, name, write)
    return cls


@_flagging
class _StateEntry(dict):
    """``opt.state[p]``."""

    __slots__ = ("_edits",)

    def __init__(self, items=(), edits: _Edits = None):
        dict.__init__(self, items)
        self._edits = edits if edits is not None else _Edits()

    def __reduce__(self):  # (pickles and copies as a plain dict: the flag is this optimizer's)
        return dict, (dict(self),)


@_flagging
class _StateDict(collections.defaultdict):
    """``opt.state``: torch.optim's ``defaultdict(dict)``, flagging writes. A read of a parameter without state
    inserts an empty dict, as torch's does, without raising the flag (a logger may read the frozen parameters'
    every step)."""

    __slots__ = ("_edits",)

    def __init__(self, default_factory=dict, items=(), edits: _Edits = None):
        collections.defaultdict.__init__(self, default_factory, items)
        self._edits = edits if edits is not None else _Edits()

    def __missing__(self, key):
        # (an entry that flags writes too: state set before a parameter's first step, which torch.optim would take,
        # must not be dropped unseen: _follow_state_edits)
        value = _StateEntry((), self._edits)
        dict.__setitem__(self, key, value)
        return value

    def __reduce__(self):
        return collections.defaultdict, (self.default_factory, dict(self))


_GONE = object()


class StateViewMixin:
    """Methods of :class:`~tritonshard.optim.base.ShardedOptimizer` about ``opt.state``."""

    @property
    def state(self):
        """``opt.state`` (torch.optim's attribute; kept in the instance's ``__dict__`` under the same name). A step
        traced by torch.compile cannot show it (dynamo would wrap the parameters): reading the attribute first
        finishes such a step (``_finish_compiled_step``), so that code reading or editing ``opt.state`` right after
        it finds the state an eager step shows. Until session 24 it found an empty dict after a first compiled step,
        and an edit of it then (``opt.state.clear()``, an LR finder's reset) was lost when the state was shown."""
        flags = self.__dict__.get("_flags")
        if flags is not None and flags.compiled_unfinished and not torch.compiler.is_compiling():
            self._finish_compiled_step()
        return self.__dict__["state"]

    @state.setter
    def state(self, value) -> None:
        self.__dict__["state"] = value

    def _init_state_view(self) -> None:
        self._state_edits = _Edits()
        self.state = _StateDict(dict, self.state, edits=self._state_edits)
        #: parameter -> (the entry shown in opt.state, {key: the object shown under it})
        self._shown: dict = {}

    def _expose_state(self, params=None) -> None:
        """``opt.state[p]``: live views of the pieces of ``p``'s state this rank owns (1-D, in the order of
        ``p.reshape(-1)[shard_range[0]:shard_range[1]]``), with ``step`` and, unless remainders are stored, the fp32
        ``master``. A parameter this rank owns nothing of has empty pieces and ``shard_range == (0, 0)``.
        ``params``: only those (default: every parameter in a bucket)."""
        state, edits = self.state, self._state_edits
        for b in self.buckets:
            owned = {piece.tensor_index: piece for piece in b.param_buffer.shard_pieces()}
            tensors = dict(b.state)
            if b.master_remainder is None:
                tensors["master"] = b.master
            for i, p in enumerate(b.params):
                if params is not None and p not in params:
                    continue
                piece = owned.get(i)
                sl = slice(piece.shard_start, piece.shard_end) if piece else slice(0, 0)
                entry = _StateEntry({"step": self._param_step(p), **{name: t[sl] for name, t in tensors.items()},
                                     "shard_range": (piece.tensor_start, piece.tensor_end) if piece else (0, 0)},
                                    edits)
                dict.__setitem__(state, p, entry)
                self._shown[p] = (entry, dict(entry))
        if params is None:
            self._state_exposed = True

    def _show_step(self, p: torch.Tensor, step: torch.Tensor) -> None:
        """``opt.state[p]["step"]`` is ``p``'s counter now (one of its own, or its bucket's again)."""
        shown = self._shown.get(p)
        if shown is not None:
            dict.__setitem__(shown[0], "step", step)
            shown[1]["step"] = step

    def _state_edited(self) -> bool:
        """Whether code wrote to ``opt.state`` (or replaced it) since it was last shown. (Reads the attribute as it
        is: the end of a backward asks, where the ``state`` property must not finish a compiled step.)"""
        state = self.__dict__["state"]
        return self._state_edits.seen or type(state) is not _StateDict or state._edits is not self._state_edits

    @torch.no_grad()
    def _follow_state_edits(self) -> None:
        """Carry what code did to ``opt.state`` into the buckets, as torch.optim would act on it at the next step:

        * a parameter whose entry is gone or empty (``opt.state.clear()``, ``opt.state = defaultdict(dict)``,
          ``del opt.state[p]``, ``opt.state[p] = {}``, ``opt.state[p].clear()``) starts afresh: its pieces of every
          state tensor zeroed, its step count 0 (torch.optim makes its state anew at its next step; SGD's momentum
          takes that step's gradient, as without state). The master weights stay (they are the weights);
        * ``opt.state[p]["step"] = n``: ``p`` counts on from ``n`` (its bias corrections follow);
        * a state tensor replaced by another of the same shape (``torch.zeros_like(opt.state[p]["exp_avg"])``):
          its values are copied into the piece, which stays shown; ShardedSGD's ``momentum_buffer`` set on a
          parameter that has not stepped with momentum counts as made (count 1), as torch.optim.SGD takes a buffer
          it finds;
        * an entry replaced by a dict of other contents, a key deleted, a tensor of another shape: a RuntimeError
          naming it (write into the shown views in place, or use ``load_state_dict``).

        Entries of parameters without state here (frozen ones, read by a logger) are kept as they are. State given
        to a laid-out parameter before its first step, which torch.optim would take, is a RuntimeError: the pieces
        are shown from the first step on (before, ``opt.state`` is empty, as torch.optim's). Each rank edits its
        own pieces: code that edits the state on one rank only diverges, as under DDP."""
        state, fresh, counts, copies, made = self.state, [], {}, [], []
        read = (lambda key: dict.get(state, key)) if isinstance(state, dict) else state.get
        for p, entry in (state.items() if hasattr(state, "items") else ()):
            if p in self._bucket_of and p not in self._shown and isinstance(entry, dict) and entry:
                raise RuntimeError(
                    f"opt.state[{self._param_names[p]}] was given {sorted(map(str, entry))} before the parameter's "
                    "first step: torch.optim would take that state at the step, but tritonshard keeps the state in "
                    "its buffers and shows this rank's pieces of it in opt.state from the first step on. Load state "
                    "with opt.load_state_dict(...), or write into what opt.state shows after a step")
        for p, (entry, shown) in self._shown.items():  # (first every check, then every change)
            name = self._param_names[p]
            now = read(p)
            if now is None or (isinstance(now, dict) and not now):  # (gone, replaced by {}, or cleared)
                fresh.append(p)
                continue
            if now is not entry:
                raise RuntimeError(
                    f"opt.state[{name}] was replaced by {type(now).__name__} with keys {sorted(map(str, now))}: "
                    "tritonshard keeps the state in its buffers and shows this rank's piece of it there. Write into "
                    "the tensors shown in place (opt.state[p]['exp_avg'].zero_()), delete the entry to start the "
                    "parameter afresh, or load a state dict")
            for key, was in shown.items():
                value = dict.get(now, key, _GONE)
                if value is was:
                    continue
                if value is _GONE:
                    raise RuntimeError(f"opt.state[{name}][{key!r}] was deleted: tritonshard keeps the state in its "
                                       "buffers (delete the whole entry to start the parameter afresh)")
                if key == "step":
                    if float(value) != float(was):
                        counts[p] = float(value)
                elif isinstance(was, torch.Tensor):
                    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(was.shape):
                        what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                                else type(value).__name__)
                        raise RuntimeError(
                            f"opt.state[{name}][{key!r}] was replaced by {what}: it shows this rank's piece of the "
                            "state kept in tritonshard's buffers, so a new value must be a tensor of the piece's "
                            f"shape {tuple(was.shape)} (or write into it in place)")
                    copies.append((was, value))  # (also from another device: Lightning's teardown moves the state)
                    if key in self._MADE_BY_FIRST_STEP:
                        made.append(p)
                elif value != was:
                    raise RuntimeError(f"opt.state[{name}][{key!r}] was changed to {value!r}: it says which part of "
                                       f"the parameter this rank's pieces cover, {was!r}")
        for was, value in copies:
            was.copy_(value)
        for p in fresh:
            b, i = self._bucket_of[p]
            for piece in b.param_buffer.shard_pieces():
                if piece.tensor_index == i:
                    for t in b.state.values():
                        t[piece.shard_start:piece.shard_end].zero_()
            counts[p] = 0.0
        now = self._counts_now() if made or counts else {}
        for p in made:  # a buffer set at count 0 is made, as torch's (ShardedSGD: state_io._MADE_BY_FIRST_STEP)
            if p not in counts and now[p] == 0:
                counts[p] = 1.0
        if counts:
            self._load_steps({**now, **counts})
        kept = {p: v for p, v in (state.items() if hasattr(state, "items") else ()) if p not in self._shown}
        self.state = _StateDict(dict, kept, edits=self._state_edits)
        shown, self._shown = set(self._shown), {}
        self._expose_state(shown)
        self._state_edits.seen = False
