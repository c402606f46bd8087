"""overlap_comm=True: reduce-scatters launched from backward hooks, all-gathers overlapped with the next forward.

Results must be bit-identical to the non-overlapped path (same kernels, same collectives, only issued earlier),
for bucket sizes from one parameter per bucket to one bucket for everything, at 2 and 4 gloo ranks.

The tests in this process run the machinery of many ranks (``with_overlap_machinery``): on one rank there is
nothing to overlap, and the optimizer leaves it out (tests/optim/test_one_rank.py).
"""

import contextlib
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.distributed import run_on_ranks
from tests.optim.training import LR, loss_fn, make_model, param_groups, schedule, train_step
from tritonshard import ShardedAdamW

pytestmark = pytest.mark.usefixtures("with_overlap_machinery")

BUCKET_CAPS = [1e-9, 200 * 2 / 2 ** 20, 25.0]  # one parameter per bucket, ~200 elements, one bucket per group


class TiedCheckpointed(nn.Module):
    """Tied embedding/head (one parameter used twice) and an activation-checkpointed block."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 12)
        self.block = nn.Sequential(nn.Linear(12, 29), nn.GELU(), nn.Linear(29, 12))
        self.head = nn.Linear(12, 13, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        x = x + checkpoint(self.block, x, use_reentrant=False)
        return self.head(x).float().logsumexp(-1).mean()


def _bits(opt):
    return [b.param_buffer.get_data().clone() for b in opt.buckets], [b.master.clone() for b in opt.buckets]


def _run_net(rank, overlap, cap, steps=3, ordered=False):
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=cap, overlap_comm=overlap, ordered_reduce=ordered)
    if overlap:
        opt.attach(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(steps):
        train_step(model, opt, sched, rank, step)
    opt.wait_for_params()
    return torch.cat([p.detach().reshape(-1).float() for g in param_groups(model) for p in g["params"]]), opt


def _run_tied(rank, overlap, cap, steps=3):
    torch.manual_seed(0)
    model = TiedCheckpointed()
    opt = ShardedAdamW(model.parameters(), lr=LR, bucket_cap_mb=cap, overlap_comm=overlap)
    if overlap:
        opt.attach(model)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        for micro in range(2):
            idx = torch.randint(0, 13, (4, 9), generator=g)
            with opt.no_sync() if micro == 0 else contextlib.nullcontext():
                model(idx).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]), opt


def _bit_identical(rank, world_size):
    for run in (_run_net, _run_tied):
        for cap in BUCKET_CAPS:
            plain, _ = run(rank, False, cap)
            overlapped, opt = run(rank, True, cap)
            assert opt.reduce_scatters_launched == 3 * len(opt.buckets)
            assert torch.equal(plain.view(torch.int32), overlapped.view(torch.int32)), \
                f"{run.__name__}, bucket_cap_mb={cap}: overlapped training differs from the plain path"


@pytest.mark.parametrize("world_size", [2, 4])
def test_bit_identical_to_the_non_overlapped_path(world_size):
    run_on_ranks(_bit_identical, world_size)


def _ordered_bit_identical(rank, world_size):
    # ordered_reduce with overlap: the third reduction launched in a backward first folds the first one (two
    # scratch buffers), inside the backward hooks. Same bits as the plain ordered path, and for every bucket size.
    results = []
    for cap in (BUCKET_CAPS[0], BUCKET_CAPS[-1]):  # one parameter per bucket (two scratch buffers reused), one bucket
        plain, _ = _run_net(rank, False, cap, ordered=True)
        overlapped, opt = _run_net(rank, True, cap, ordered=True)
        assert opt.reduce_scatters_launched == 3 * len(opt.buckets)
        assert torch.equal(plain.view(torch.int32), overlapped.view(torch.int32)), \
            f"ordered_reduce, bucket_cap_mb={cap}: overlapped training differs from the plain path"
        results.append(plain)
    assert torch.equal(results[1].view(torch.int32), results[0].view(torch.int32)), \
        f"ordered_reduce: bucket_cap_mb={BUCKET_CAPS[-1]} differs from {BUCKET_CAPS[0]}"


def test_ordered_reduce_with_overlap_is_bit_identical_and_bucket_invariant():
    run_on_ranks(_ordered_bit_identical, 4)


def _first_reduce_scatter_before_backward_ends(rank, world_size):
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9, overlap_comm=True)  # a bucket per param
    x = torch.randn(6, 13).to(torch.bfloat16)
    # step 1: bucket order puts the never-used parameter's bucket first, which holds every launch back until the
    # end of backward; the order observed in this backward is adopted for the next steps
    loss_fn(model, x).backward()
    opt.step()
    opt.zero_grad()
    assert opt.buckets[opt._launch_order[-1]].params[0] is model.unused
    seen = []
    # fc1 is the first layer: its backward runs last. Record how many reduce-scatters had started by then.
    model.fc1.register_full_backward_hook(lambda mod, gin, gout: seen.append(opt.reduce_scatters_launched))
    before = opt.reduce_scatters_launched
    loss_fn(model, x).backward()
    in_flight = seen[0] - before
    # fc2's weight and bias and the norm's two parameters complete before fc1's backward: 4 buckets in flight
    assert in_flight >= 4, f"only {in_flight} reduce-scatters were in flight when the last layer's backward ran"
    assert opt.reduce_scatters_launched - before == len(opt.buckets), "all buckets launched by the end of backward"
    opt.step()


def test_trace_first_reduce_scatter_is_issued_before_backward_finishes():
    run_on_ranks(_first_reduce_scatter_before_backward_ends, 2)


def _misuse(rank, world_size):
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, overlap_comm=True)
    x = torch.randn(6, 13).to(torch.bfloat16)
    loss_fn(model, x).backward()  # outside no_sync: reduce-scatters launched
    with pytest.raises(RuntimeError, match="no_sync"):
        loss_fn(model, x).backward()
    opt.zero_grad()  # recovers: waits for the in-flight collectives, forgets the gradients
    loss_fn(model, x).backward()
    opt.step()


def test_second_backward_outside_no_sync_is_a_clear_error():
    run_on_ranks(_misuse, 2)


def _no_stale_forward(rank, world_size):
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9, overlap_comm=True)
    opt.attach(model)
    reference = make_model(0)
    ref_opt = ShardedAdamW(param_groups(reference), lr=LR, bucket_cap_mb=1e-9)  # waits in step()
    x = torch.randn(6, 13).to(torch.bfloat16)
    for m, o in ((model, opt), (reference, ref_opt)):
        loss_fn(m, x).backward()
        o.step()
        o.zero_grad()
    assert any(b.ag_work is not None for b in opt.buckets), "all-gathers are still in flight after step()"
    out = model(x)  # the pre-hooks wait for exactly what each module needs
    assert all(b.ag_work is None for b in opt.buckets if not any(p is model.unused for p in b.params))
    assert torch.equal(out, reference(x)), "a forward after an overlapped step must see the updated weights"
    opt.wait_for_params()


def test_forward_never_runs_on_stale_weights():
    run_on_ranks(_no_stale_forward, 2)


def _one_rank_without_backward(rank, world_size):
    # rank 1 has no data this step (no backward, so no hook fires there); the collectives must still match:
    # it launches the same reduce-scatters in the same order from step(), and joins the launch-order broadcast
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9, overlap_comm=True)
    if rank == 0:
        loss_fn(model, torch.randn(6, 13).to(torch.bfloat16)).backward()
    opt.step()
    opt.zero_grad()
    loss_fn(model, torch.randn(6, 13).to(torch.bfloat16)).backward()
    opt.step()
    assert opt.reduce_scatters_launched == 2 * len(opt.buckets)


def test_a_rank_without_gradients_does_not_desynchronize_the_collectives():
    run_on_ranks(_one_rank_without_backward, 2)


# ---------------------------------------------------------------------------------------------- a GAN's loop
def _gan_weights(overlap: bool, clear: str, steps: int = 3, seed: int = 0) -> list:
    """PyTorch's DCGAN tutorial loop (sharded): the generator's backward runs through the discriminator, giving it
    gradients after its step, which the next iteration's ``netD.zero_grad()`` clears. With ``overlap_comm`` that
    backward's end launches the discriminator's reduce-scatters; torch.optim (and DDP) simply drop that gradient.
    ``clear``: "model" (the tutorial's ``netD.zero_grad()``), or "opt" (``optD.zero_grad()``)."""
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 7))
    net_d = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 1))
    opt_g = ShardedAdamW(net_g.parameters(), lr=1e-2, bucket_cap_mb=1e-9, overlap_comm=overlap)
    opt_d = ShardedAdamW(net_d.parameters(), lr=1e-2, bucket_cap_mb=1e-9, overlap_comm=overlap)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        real, noise = torch.randn(5, 7, generator=gen).bfloat16(), torch.randn(5, 4, generator=gen).bfloat16()
        net_d.zero_grad() if clear == "model" else opt_d.zero_grad()
        fake = net_g(noise)
        (net_d(real).float().mean() - net_d(fake.detach()).float().mean()).backward()
        opt_d.step()
        net_g.zero_grad() if clear == "model" else opt_g.zero_grad()
        (-net_d(fake).float().mean()).backward()  # through net_d: its gradients, launched with overlap_comm
        opt_g.step()
    return [p.detach().clone() for p in (*net_g.parameters(), *net_d.parameters())]


def _gan_on_ranks(rank, world_size):
    expected = _gan_weights(False, "opt", seed=rank)
    for got in (_gan_weights(True, "model", seed=rank), _gan_weights(True, "opt", seed=rank)):
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_a_gan_loop_that_clears_the_discriminator_with_model_zero_grad_trains_as_without_overlap():
    # Before: "the gradient of ... was zeroed, cleared or replaced after it was reduced" from netD.zero_grad()'s
    # next backward, with overlap_comm only
    for a, b in zip(_gan_weights(True, "model"), _gan_weights(False, "opt")):
        assert torch.equal(a, b)
    run_on_ranks(_gan_on_ranks, 2)


def _dropped_on_some_ranks(rank, world_size, how, dropping):
    """The ranks in ``dropping`` drop the step's gradients after the backward launched their reduce-scatters
    (``model.zero_grad()``, or ``opt.zero_grad()``: a loop skipping a batch whose loss it found bad on that rank
    only), then every rank calls step(). Until session 25 the ranks waited for each other for good (a hang: the
    dropping ranks' step reduced afresh, its handshake against the others' collectives of the launched reduction).
    Now the dropping ranks take part in those collectives when they drop it, and the ranks meet at the next
    handshake: a CollectiveMismatchError on every rank, at once; they train on together after a zero_grad() (the
    same weights on every rank). Where every rank drops them, the step changes nothing, as before."""
    from tritonshard.comm import CollectiveMismatchError
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9, overlap_comm=True)
    opt.attach(model)
    gen = torch.Generator().manual_seed(rank)
    loss_fn(model, torch.randn(6, 13, generator=gen).to(torch.bfloat16)).backward()
    if rank in dropping:
        model.zero_grad() if how == "model.zero_grad()" else opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    start = time.monotonic()
    if len(dropping) == world_size:
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a step with nothing to apply"
    else:
        with pytest.raises(CollectiveMismatchError, match="must be dropped on every rank"):
            opt.step()
        assert time.monotonic() - start < 20, "the ranks waited for each other"
    opt.zero_grad()
    for _ in range(2):
        loss_fn(model, torch.randn(6, 13, generator=gen).to(torch.bfloat16)).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered), "the ranks' weights after the refused step"


@pytest.mark.parametrize("how", ["model.zero_grad()", "opt.zero_grad()"])
@pytest.mark.parametrize("dropping", [(0,), (0, 1)], ids=["one rank", "every rank"])
def test_a_step_dropped_after_the_launch_on_some_ranks_is_an_error_not_a_hang(how, dropping):
    run_on_ranks(_dropped_on_some_ranks, 2, how, dropping, timeout_s=60)


def test_a_step_dropped_after_the_launch_on_two_of_four_ranks():
    run_on_ranks(_dropped_on_some_ranks, 4, "model.zero_grad()", (1, 2), timeout_s=60)


def test_gradients_cleared_after_their_reduce_scatters_launched_are_dropped_whole_or_an_error_in_part():
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9, overlap_comm=True)
    x = torch.randn(6, 13).to(torch.bfloat16)
    loss_fn(model, x).backward()  # launched
    model.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # torch.optim: no gradient anywhere, nothing moves
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert all(float(opt.state[p].get("step", 0)) == 0 for p in model.parameters())
    opt.zero_grad()
    loss_fn(model, x).backward()  # launched
    model.fc1.weight.grad = None  # one only: its part of the launched reduction cannot be taken back
    with pytest.raises(RuntimeError, match="zeroed, cleared or replaced after it was reduced"):
        opt.step()
    opt.zero_grad()
    loss_fn(model, x).backward()
    opt.step()
    assert not torch.equal(before[0], model.fc1.weight.detach())


@pytest.mark.parametrize("cap", [25.0, 1e-9], ids=["one bucket", "a bucket per parameter"])
def test_a_second_backward_after_the_launch_is_an_error_also_when_it_reached_every_bucket_first(cap):
    # the gradients a backward adds onto launched reduce-scatters are not "cleared" ones: with one bucket, every
    # placeholder is taken by the second backward before the bucket's flush, which must still refuse, not forget
    # the first backward's gradients
    model = make_model(0)
    opt = ShardedAdamW(model.parameters(), lr=LR, bucket_cap_mb=cap, overlap_comm=True)
    x = torch.randn(6, 13).to(torch.bfloat16)
    loss_fn(model, x).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        loss_fn(model, x).backward()
    opt.zero_grad()  # recovers
    loss_fn(model, x).backward()
    opt.step()


def _train_skipping_a_failed_backward(overlap: bool, fail: bool) -> list:
    """Four steps; at step 1 the backward raises part way (a hook's error: an out-of-memory the loop catches), and
    the loop zeroes the gradients and skips that batch, as its ``except`` branch would."""
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9, overlap_comm=overlap)
    for step in range(4):
        x = torch.randn(6, 13, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        if step == 1:
            if not fail:
                continue
            h = model.fc1(x)
            h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("out of memory (simulated)")))
            try:
                model.fc2(torch.relu(model.norm(h))).float().square().mean().backward()  # fc2's gradients first
            except RuntimeError as e:
                assert "simulated" in str(e)
            opt.zero_grad()
            continue
        before = opt.reduce_scatters_launched
        loss_fn(model, x).backward()
        if overlap:  # the end of this backward launched every bucket, as after any backward
            assert opt.reduce_scatters_launched - before == len(opt.buckets), f"step {step}"
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap_comm"])
def test_a_backward_that_raised_leaves_the_next_ones_as_they_were(overlap):
    # autograd drops the end-of-backward callback of a backward that raised; before, the optimizer kept waiting for
    # it, so no later backward queued its own: with overlap_comm nothing was launched at a backward's end any more
    failed, skipped = _train_skipping_a_failed_backward(overlap, True), _train_skipping_a_failed_backward(overlap, False)
    for a, b in zip(failed, skipped):
        assert torch.equal(a, b)


def test_a_new_optimizer_after_launched_gradients_were_cleared_takes_the_parameters_over():
    # torch: gradients cleared after a backward leave nothing between the optimizers. Here that backward launched
    # the reduce-scatters (overlap_comm); before, the new optimizer refused, "between a backward and its step()"
    model = make_model(0)
    old = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9, overlap_comm=True)
    x = torch.randn(6, 13).to(torch.bfloat16)
    loss_fn(model, x).backward()
    model.zero_grad()
    new = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9, overlap_comm=True)
    with pytest.raises(RuntimeError, match="no longer trains its parameters"):
        old.step()
    loss_fn(model, x).backward()
    new.step()


def test_a_backward_after_launched_gradients_were_cleared_still_launches_its_buckets_during_it():
    # model.zero_grad() between a backward (overlap_comm: its end launched every reduce-scatter) and the next one (the
    # GAN loop's netD.zero_grad()): that backward's first full bucket forgets the launched reduction. Until session 23
    # that reset also emptied the other buckets' record of which of their gradients this backward had given, so a
    # bucket half-ready then was launched only at the end of the backward: no overlap for it (results unchanged)
    torch.manual_seed(0)
    c, a, b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    model = nn.Sequential(c, a, b).to(torch.bfloat16)
    c.requires_grad_(False)
    opt = ShardedAdamW([a.bias, b.bias, a.weight, b.weight], lr=LR, bucket_cap_mb=32 * 2 / 2 ** 20,
                       overlap_comm=True)  # (32 bf16 elements: the two weights, then the two biases)
    # the backward reaches b's parameters first, one in each bucket, then a's, which complete both buckets
    layout = [[id(p) for p in bk.params] for bk in opt.buckets]
    assert layout == [[id(a.weight), id(b.weight)], [id(a.bias), id(b.bias)]], "not the layout this test needs"
    x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    model(x).float().square().sum().backward()  # its end launches both reduce-scatters
    model.zero_grad()
    seen = []
    h = c(x)
    # (c's backward runs after a's gradients are accumulated: autograd runs AccumulateGrad nodes first)
    h.register_hook(lambda g: seen.append([bk.rs_launched for bk in opt.buckets]))
    b(a(h)).float().square().sum().backward()
    assert seen == [[True, True]], f"launched when the backward had given every gradient: {seen}"
    before = [p.detach().clone() for p in (a.weight, b.weight)]
    opt.step()
    assert not any(torch.equal(p0, p.detach()) for p0, p in zip(before, (a.weight, b.weight)))


def test_wait_for_params_takes_buckets_or_parameters_and_names_anything_else():
    """``opt.wait_for_params(...)`` took bucket objects only: the parameters a user holds (the natural thing to
    wait for) failed on an attribute of the tensor. Now parameters wait for their own buckets, and anything else is
    named before any wait (session 51)."""
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9, overlap_comm=True)
    opt.attach(model)
    loss_fn(model, torch.randn(6, 13).to(torch.bfloat16)).backward()
    opt.step()
    in_flight = [b for b in opt.buckets if b.ag_work is not None]
    assert len(in_flight) > 2, "all-gathers are still in flight after step()"
    first, second = in_flight[0], in_flight[1]
    with pytest.raises(TypeError, match=r"buckets\[1\] must be a bucket of this optimizer \(opt.buckets\) or a "
                                        r"parameter, got str"):
        opt.wait_for_params([first.params[0], "weight"])
    with pytest.raises(ValueError, match=r"buckets\[0\] is a tensor of shape \(2, 3\) that no bucket of this "
                                         r"optimizer holds"):
        opt.wait_for_params([torch.zeros(2, 3), first.params[0]])
    assert first.ag_work is not None, "a call that raised waited for nothing"
    opt.wait_for_params(first.params[0])  # (one parameter: its bucket)
    assert first.ag_work is None and second.ag_work is not None
    opt.wait_for_params([second])  # (buckets, as before)
    assert second.ag_work is None and all(b.ag_work is not None for b in in_flight[2:])
    opt.wait_for_params()
    assert all(b.ag_work is None for b in opt.buckets)
