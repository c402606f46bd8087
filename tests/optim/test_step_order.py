"""The order in which step() issues its work: each param group's update in one launch (groups in the order of
their first bucket), then the all-gathers, one per bucket in the order the next forward needs the buckets. On NCCL
one process group's collectives run in issue order, so the first module's gather must be issued first, not behind
every other bucket's. With overlap_comm the same (issue 20.3: the next forward's kernels queue behind every update
on the stream anyway, so an update per bucket would only start the first gather one bucket's update earlier, at a
launch per bucket); without it every gather is also waited for before step() returns. Traced with the profiler
ranges step() opens around each update and each all-gather (what a GPU trace shows too)."""

import pytest
import torch
from torch import nn

from tritonshard import ShardedAdamW


class Forward(nn.Module):
    """Parameters registered in the order the forward uses them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 12)
        self.fc1 = nn.Linear(12, 29)
        self.norm = nn.LayerNorm(29)
        self.fc2 = nn.Linear(29, 13)

    def forward(self, idx):
        return self.fc2(self.norm(torch.relu(self.fc1(self.emb(idx))))).float().logsumexp(-1).mean()


def _traced_step(opt, model):
    model(torch.randint(0, 13, (4, 7), generator=torch.Generator().manual_seed(0))).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    events = sorted((e.time_range.start, e.name) for e in prof.events()
                    if e.name.startswith(("tritonshard.update[", "tritonshard.all_gather[")))
    return [name for _, name in events]


def _expected(opt, model):
    order, seen, groups = [], set(), []
    for p in model.parameters():  # forward order
        b = opt._bucket_of[p][0]
        if b.index not in seen:
            seen.add(b.index)
            order.append(f"tritonshard.all_gather[bucket {b.index}]")
            if b.group_index not in groups:
                groups.append(b.group_index)
    # the groups' updates (in the order of their first bucket), then every gather
    return [f"tritonshard.update[group {g}]" for g in groups] + order


@pytest.mark.parametrize("overlap", [True, False])
def test_the_updates_then_each_buckets_gather_in_forward_order(overlap):
    torch.manual_seed(0)
    model = Forward()
    opt = ShardedAdamW(model.parameters(), lr=1e-3, bucket_cap_mb=1e-9,  # one parameter per bucket
                       overlap_comm=overlap)
    # buckets are filled in reverse (the order backward produces gradients): the embedding is in the last one
    assert opt._bucket_of[model.emb.weight][0].index == len(opt.buckets) - 1
    assert _traced_step(opt, model) == _expected(opt, model)


@pytest.mark.parametrize("overlap", [True, False])
def test_with_param_groups_attach_orders_the_gathers_by_the_model(overlap):
    """Weight-decay groups interleave across modules: the model's registration order decides, once attached."""
    torch.manual_seed(0)
    model = Forward()
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = ShardedAdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3,
                       bucket_cap_mb=1e-9, overlap_comm=overlap)
    opt.attach(model)
    traced = _traced_step(opt, model)
    assert traced == _expected(opt, model)
    first_gather = next(n for n in traced if "all_gather" in n)
    assert first_gather == f"tritonshard.all_gather[bucket {opt._bucket_of[model.emb.weight][0].index}]"
