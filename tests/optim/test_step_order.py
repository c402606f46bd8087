"""The order in which step() issues its work: per bucket, the update and at once its all-gather, in the order the
next forward needs the buckets. On NCCL one process group's collectives run in issue order, so the first module's
gather must be issued first, not behind every other bucket's update and gather. Traced with the profiler ranges
step() opens around each update and each all-gather (what a GPU trace shows too)."""

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
    order, seen = [], set()
    for p in model.parameters():  # forward order
        i = opt._bucket_of[p][0].index
        if i not in seen:
            seen.add(i)
            order += [f"tritonshard.update[bucket {i}]", f"tritonshard.all_gather[bucket {i}]"]
    return order


def test_each_bucket_is_updated_then_gathered_in_forward_order():
    torch.manual_seed(0)
    model = Forward()
    opt = ShardedAdamW(model.parameters(), lr=1e-3, bucket_cap_mb=1e-9)  # one parameter per bucket
    # buckets are filled in reverse (the order backward produces gradients): the embedding is in the last one
    assert opt._bucket_of[model.emb.weight][0].index == len(opt.buckets) - 1
    assert _traced_step(opt, model) == _expected(opt, model)


def test_with_param_groups_attach_orders_the_gathers_by_the_model():
    """Weight-decay groups interleave across modules: the model's registration order decides, once attached."""
    torch.manual_seed(0)
    model = Forward()
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = ShardedAdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3,
                       bucket_cap_mb=1e-9)
    opt.attach(model)
    traced = _traced_step(opt, model)
    assert traced == _expected(opt, model)
    assert traced[1] == f"tritonshard.all_gather[bucket {opt._bucket_of[model.emb.weight][0].index}]"
