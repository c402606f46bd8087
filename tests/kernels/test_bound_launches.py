"""ShardedAdamW with bound launches (replayed through the compiled launchers, issue 20) against the same training
with every launch through Triton's dispatch: the same bits.

Here in tests/kernels so that the GPU check (which runs tests/kernels compiled) runs it where the replays really
execute kernels: on a GPU it asserts that they happened. On a CPU the optimizer takes the interpreter or the
reference path, where nothing is bound, and the two runs must agree all the same; the argument-by-argument check
of the replays on a CPU is tests/optim/test_launch_plans.py (dry-run driver).
"""

import torch

from tests.helpers import assert_bitwise_equal
from tests.kernels.common import DEVICE
from tritonshard import ShardedAdamW
from tritonshard.kernels import _launch


def _train(bound: bool):
    previous = _launch.set_bound_launches(bound)
    try:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device=DEVICE)) for n in (4099, 199, 1, 12_289)]
        opt = ShardedAdamW([{"params": params[:2]}, {"params": params[2:], "lr": 5e-3, "weight_decay": 0.0}],
                           lr=1e-2, bucket_cap_mb=5000 * 2 / 2 ** 20, state_dtype=torch.bfloat16)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        before = _launch.replays
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16)
            if step != 3:  # one step without clipping: grad_scale becomes a number, the update rebinds
                opt.clip_grad_norm_(0.5)
            for group in opt.param_groups:  # new betas at every step (OneCycleLR's momentum cycling): the replays
                group["betas"] = (0.9 - 0.02 * step, 0.999 - 0.001 * step)  # take them anew (kernels/_launch.py)
            opt.step()
            sched.step()
            opt.zero_grad()
        return [p.detach().clone() for p in params], opt.state_dict()["state"], _launch.replays - before
    finally:
        _launch.set_bound_launches(previous)


def test_bound_launches_train_bit_for_bit_like_tritons_dispatch():
    params_bound, state_bound, replays = _train(True)
    params_dispatch, state_dispatch, no_replays = _train(False)
    assert no_replays == 0
    if DEVICE.type == "cuda":
        assert replays > 0, "on a GPU the optimizer's launches must be replayed"
    for i, (a, b) in enumerate(zip(params_bound, params_dispatch)):
        assert_bitwise_equal(a, b, f"parameter {i}")
    for i in state_dispatch:
        for name in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert_bitwise_equal(state_bound[i][name], state_dispatch[i][name], f"state[{i}][{name!r}]")


def test_what_a_bound_launch_takes_anew_and_what_binds_it_again():
    """kernels/_launch.py's rule (session 36): floats anywhere and the ``live`` ints and tensors replay with their
    new values, unless Triton would specialize them otherwise (an int's type; a tensor's dtype, device, or 16-byte
    alignment); any other change, a tensor at a position not live included, binds anew."""
    same = _launch._same_but_live
    t = torch.zeros(8)
    other, misaligned = torch.zeros(8), torch.zeros(9)[1:]
    assert same((t, 0.9, 1), (t, 0.8, 1))                       # a float: any value
    assert not same((t, 0.9, 1), (t, 0.9, 2))                   # an int not live
    assert same((t, 0.9, 2 ** 40), (t, 0.9, 2 ** 41), live=(2,))  # a live int of the same Triton type (i64)
    assert not same((t, 0.9, 2 ** 40), (t, 0.9, 0), live=(2,))    # ... but for one Triton types i32
    assert not same((t, 0.9), (other, 0.9))                     # a tensor not live: by identity
    assert same((t, 0.9), (other, 0.9), live=(0,))              # a live tensor of the same dtype and alignment
    assert not same((t, 0.9), (misaligned, 0.9), live=(0,))     # ... not one 4 bytes off 16-byte alignment
    assert not same((t, 0.9), (other.double(), 0.9), live=(0,))  # ... nor one of another dtype
    assert not same((t, 0.9), (t, 1), live=(1,))                # a float that became an int: another type
