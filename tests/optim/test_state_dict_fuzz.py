"""Random damage to a state dict (a converted, hand-edited, truncated or mixed-up optimizer checkpoint): whatever
``load_state_dict`` is given, it loads, and the next step runs, or it raises a ValueError or TypeError that says what
is wrong and changes nothing, the weights, the state and the groups as they were. Never another exception from deep
inside the load (an AttributeError on a ``str``, a KeyError on ``'params'``: session 52's run of this test found
those), never a load that leaves part of a dict behind.

The damage (one or two of them per example): a key of a parameter's state dropped, replaced by something else
(None, a string, a list, a number, a bool, a tensor of the wrong size), truncated, or cast to another dtype; a whole
entry replaced; state added for a key no group numbers; a hyper-parameter of a group replaced or dropped; the dict's
``state`` or ``param_groups`` replaced. Here a load that succeeds must leave an optimizer that steps: what it would
do with the loaded values (a dtype cast) is the other tests' (tests/optim/test_adamw.py)."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.optim.training import SMALL_KINDS, small_step, small_trained

JUNK = [None, "x", "0.1", -1.0, float("nan"), [1, 2], (0.9,), True, 0, 3, torch.tensor(0.5), torch.zeros(2), {}, [],
        1e30]
def _well_formed(d) -> bool:
    return (isinstance(d, dict) and isinstance(d.get("state"), dict) and isinstance(d.get("param_groups"), list)
            and bool(d["param_groups"]) and isinstance(d["param_groups"][0], dict) and bool(d["param_groups"][0]))


def _junk(draw):
    return copy.deepcopy(draw(st.sampled_from(JUNK)))  # (a later damage may write into a dict or list drawn here)


@st.composite
def _damage(draw, d) -> str:
    """Damages ``d`` in place; returns what it did (for the failure message)."""
    if not _well_formed(d):
        return "nothing (the dict is already beyond repair)"
    how = draw(st.sampled_from(["state tensor", "entry", "unknown key", "group value", "group key", "top",
                                "optimizer-wide"]))
    state, group = d["state"], d["param_groups"][0]
    if how == "state tensor" and state:
        key = draw(st.sampled_from(sorted(state, key=repr)))
        entry = state[key]
        if isinstance(entry, dict) and entry:
            name = draw(st.sampled_from(sorted(entry, key=str)))
            what = draw(st.sampled_from(["dropped", "replaced", "truncated", "cast"]))
            if what == "dropped":
                del entry[name]
            elif what == "replaced":
                entry[name] = _junk(draw)
            elif isinstance(entry[name], torch.Tensor) and what == "truncated":
                entry[name] = entry[name].reshape(-1)[:max(0, entry[name].numel() - 1)]
            elif isinstance(entry[name], torch.Tensor):
                entry[name] = entry[name].to(draw(st.sampled_from([torch.float16, torch.int64, torch.bool,
                                                                    torch.float64])))
            return f"state[{key!r}][{name!r}] {what}"
    if how == "entry" and state:
        key = draw(st.sampled_from(sorted(state, key=repr)))
        state[key] = _junk(draw)
        return f"state[{key!r}] replaced"
    if how == "unknown key":
        key = draw(st.sampled_from([4, -1, "0", "a", 1.0]))
        state[key] = {"step": torch.tensor(1.0)}
        return f"state[{key!r}] added"
    if how == "group value":
        key = draw(st.sampled_from(sorted(group)))
        group[key] = _junk(draw)
        return f"param_groups[0][{key!r}] replaced"
    if how == "group key":
        key = draw(st.sampled_from(sorted(group)))
        del group[key]
        return f"param_groups[0][{key!r}] dropped"
    if how == "optimizer-wide":  # (state_dict()["tritonshard"], and its copy in the first group: state_io.CARRIED)
        where = draw(st.sampled_from(["tritonshard", "param_groups[0]"]))
        holder = d if where == "tritonshard" else group
        what = draw(st.sampled_from(["dropped", "replaced", "a value replaced"]))
        if what == "dropped":
            holder.pop("tritonshard", None)
        elif what == "replaced":
            holder["tritonshard"] = _junk(draw)
        elif isinstance(holder.get("tritonshard"), dict):
            name = draw(st.sampled_from(["skipped_steps", "sr_steps", "loss_scale", "growth_tracker"]))
            holder["tritonshard"][name] = _junk(draw)
        return f"{where}'s optimizer-wide values: {what}"
    if how == "top":
        key = draw(st.sampled_from(["state", "param_groups"]))
        d[key] = copy.deepcopy(draw(st.sampled_from(JUNK + [[{}]])))
        return f"{key} replaced"
    return "nothing"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (an lr of 1e30 loads: a finite number)
@pytest.mark.parametrize("kind", sorted(SMALL_KINDS))
def test_a_damaged_state_dict_loads_and_steps_or_is_an_error_that_changes_nothing(kind):
    model, opt, good = small_trained(kind)
    small_step(model, opt)  # (the optimizer's state differs from the dict's now: a load that stops part-way shows)

    # (300 examples per optimizer, ~3 s each here: every kind of damage many times over; the search that found the
    # errors of session 52 ran 1,500 per run)
    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        damaged = copy.deepcopy(good)
        # (hypothesis prints each draw of a failing example: the damage done)
        done = [data.draw(_damage(damaged)) for _ in range(data.draw(st.integers(1, 2)))]
        before, weights = opt.state_dict(), [p.detach().clone() for p in model.parameters()]
        try:
            opt.load_state_dict(damaged)
        except (ValueError, TypeError):
            after = opt.state_dict()
            assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters())), f"weights changed: {done}"
            assert after["param_groups"] == before["param_groups"], f"groups changed: {done}"
            assert all(torch.equal(before["state"][k][n], after["state"][k][n])
                       for k in before["state"] for n in before["state"][k]), f"state changed: {done}"
            return
        small_step(model, opt)  # (any exception fails the example: a loaded dict must train)
        opt.load_state_dict(good)
        small_step(model, opt)  # (differs again; until session 53 every example started from the dict's own state,
        # so a load that raised after replacing some of it with the same values could not show)

    check()
