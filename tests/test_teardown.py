"""``tritonshard.comm.destroy_process_group()`` frees the group when it is called, not at interpreter shutdown.

A gloo group freed at shutdown joins its worker threads where they can abort the process ("terminate called without
an active exception": CI's run of the step benchmark on 2026-12-02, after every figure had been printed) or hang.
Each check runs in a fresh interpreter: the pin below depends on what was imported before ``init_process_group``,
which the pytest process has long since settled.
"""

import subprocess
import sys

from tests.helpers import REPO

_SCRIPT = r"""
import sys, weakref
import torch, torch.distributed as dist
import tritonshard
from tritonshard import comm

def pinned(group):
    # torch.distributed.nn.functional binds group=group.WORLD as a default argument at import; torch._dynamo imports
    # it, and the first torch.optim add_param_group imports torch._dynamo
    functions = vars(sys.modules["torch.distributed.nn.functional"]).values()
    return any(d is group for f in functions for d in (getattr(f, "__defaults__", None) or ()))

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 15, 101)]
opt = tritonshard.ShardedAdamW(params, lr=1e-3, bucket_cap_mb=0.0001)  # built after init, as users do
for p in params:
    p.grad = torch.randn_like(p).bfloat16()
opt.step()
world = dist.group.WORLD
print("pinned", pinned(world))
group = weakref.ref(world)
del world, opt, params  # (the optimizer is held in reference cycles: only a collection frees it)
comm.destroy_process_group()
print("freed", group() is None)

# the functions whose default was the destroyed group work on the next one (they would raise on the destroyed one)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
import torch.distributed.nn.functional as F
t = torch.arange(5.0)
print("reinit", torch.equal(F.all_reduce(t), torch.arange(5.0)))
comm.destroy_process_group()
"""


def test_destroy_frees_the_group_an_optimizer_and_torch_distributed_nn_held():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    # the situation guarded against: if this torch no longer pins the group, that half of the helper can go
    assert lines["pinned"] == "True", proc.stdout
    assert lines["freed"] == "True", "a reference to the destroyed group outlived destroy_process_group()"
    assert lines["reinit"] == "True", proc.stdout
