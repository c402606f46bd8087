"""``cuda_graph=True`` (issue 20.6): the step's two phases captured once and replayed.

On the CPU the graphs are emulated (tests/optim/graph_emulation.py): each "replay" runs the phase again and must
make the same ops and launches, with the same tensors and numbers, as its capture, and the optimizer's host state
is put back after it, as after a real replay. The scenario is ``benchmarks.sync_check.graph_check``, which the GPU
check runs with real CUDA graphs (stage 2): the same bits as without graphs through an lr that changes every step, a
skipped step, a recapture and three ways of clipping, with the captures and replays counted."""

import pytest
import torch

import tritonshard
from benchmarks import sync_check
from tritonshard.optim import ShardedOptimizer, graphs

from ..distributed import run_on_ranks
from . import graph_emulation


@pytest.fixture
def emulated(monkeypatch):
    graph_emulation.install(monkeypatch)


def _small(device):  # odd sizes; at bucket_cap_mb=0.005, 3 buckets (2 in the weights' group)
    return torch.nn.Sequential(torch.nn.Linear(37, 211), torch.nn.GELU(), torch.nn.Linear(211, 13)).to(device)


def _check(name):
    return sync_check.graph_check(name, sync_check.GRAPH_CONFIGS[name], torch.device("cpu"), model=_small, width=37,
                                   bucket_cap_mb=0.005)


@pytest.mark.parametrize("name", list(sync_check.GRAPH_CONFIGS))
def test_graphed_steps_give_the_eager_bits(emulated, name):
    assert "bit for bit" in _check(name)


def test_graphed_steps_across_an_unfreeze_give_the_eager_bits(emulated):
    """A layer frozen at construction and unfrozen at step 2: the steps after it are captured and replayed, update
    included (its parameters count on their buckets' own counter; until session 14 they ran eagerly)."""
    assert "bit for bit" in sync_check.unfreeze_graph_check(torch.device("cpu"), model=_small, width=37,
                                                            bucket_cap_mb=0.005)


def test_a_number_a_graph_would_freeze_fails_the_emulated_replay(emulated, monkeypatch):
    """The check can fail: with the lr written into its tensor inside the captured phase (a fill_ with this step's
    value, which a real graph would replay with the captured step's; _write_lrs writes it before the phase), the
    first replay after the lr moved raises. (The coefficients kernel reads that tensor; until session 31 the
    coefficients were torch ops, and this test handed them the lr as a number through _lr_source.)"""
    def lr_filled_inside(self, group, group_index):
        t = self._persistent_tensor(("lr", group_index),
                                    lambda: torch.empty((), dtype=torch.float64, device=self.device))
        return t.fill_(float(group["lr"]))
    monkeypatch.setattr(ShardedOptimizer, "_lr_tensor", lr_filled_inside)
    with pytest.raises(AssertionError, match="replay op .* differently from its capture"):
        _check("ShardedAdamW")


def test_a_late_gradient_after_a_replayed_reduction_raises(emulated):
    """After a replayed reduction the host knows the gradients were reduced (``_reduced`` is set outside the graph,
    the buckets' flags by _after_reduce_replay): a gradient arriving before step() raises as it does eagerly,
    instead of being left out of the update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-3, cuda_graph=True)
    for step in range(3):
        model(torch.randn(2, 5).bfloat16()).sum().backward()
        opt.clip_grad_norm_(1.0)
        if step == 2:
            assert opt._graphs.replays == 1  # the reduction was replayed
            with pytest.raises(RuntimeError, match="gradients arrived after clip_grad_norm_"):
                model(torch.randn(2, 5).bfloat16()).sum().backward()
            break
        opt.step()
        opt.zero_grad()


def test_graphed_steps_at_two_ranks_give_the_eager_bits():
    """Two gloo ranks (the collectives inside the emulated phases run for real), against the same run without
    graphs: every weight after every step."""
    run_on_ranks(_two_ranks, 2)


def _trainer(graphed: bool, sizes: tuple, bucket_cap_mb: float, gamma: float, data_seed: int):
    """A two-layer model from seed 0, its attached ShardedAdamW (lr 1e-2) and a StepLR, and a data generator."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.Linear(sizes[1], sizes[2]))
    opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=bucket_cap_mb, cuda_graph=graphed)
    opt.attach(model)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
    return model, opt, schedule, torch.Generator().manual_seed(data_seed)


def _two_ranks(rank, world_size):
    with pytest.MonkeyPatch.context() as monkeypatch:
        graph_emulation.install(monkeypatch)
        runs = []
        for graphed in (False, True):
            # each rank its own data: the reduction matters
            model, opt, schedule, data = _trainer(graphed, (13, 7, 5), 0.0002, 0.7, 10 + rank)
            weights = []
            for _ in range(5):
                model(torch.randn(4, 13, generator=data)).float().square().mean().backward()
                opt.clip_grad_norm_(0.1)
                opt.step()
                schedule.step()
                opt.zero_grad()
                weights.append([p.detach().clone() for p in model.parameters()])
            runs.append((weights, opt))
        (eager, _), (graphed, opt) = runs
        assert len(opt.buckets) > 1
        for a, b in zip(eager, graphed):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        assert (opt._graphs.captures, opt._graphs.replays) == (2, 6)  # steps 0 eager, 1 capture, 2-4 replay


def test_options_a_graph_cannot_capture_are_refused_by_name(emulated):
    """... overlap_comm with the machinery of many ranks (until session 39 also on one rank, where the machinery is
    out and the step is the one without overlap_comm: GRAPH_CONFIGS' "overlap_comm, one rank" captures it)."""
    from tests.helpers import overlap_machinery
    params = lambda: torch.nn.Linear(4, 3).parameters()  # noqa: E731
    with overlap_machinery(), pytest.raises(ValueError, match="cuda_graph=True: overlap_comm=True on more than one"):
        tritonshard.ShardedAdamW(params(), cuda_graph=True, overlap_comm=True)
    assert tritonshard.ShardedAdamW(params(), cuda_graph=True, overlap_comm=True)._graphs is not None
    with pytest.raises(ValueError, match="cuda_graph=True: ordered_reduce=True"):
        tritonshard.ShardedAdamW(params(), cuda_graph=True, ordered_reduce=True)
    with pytest.raises(ValueError, match="cuda_graph=True: ShardedMuon's update"):
        tritonshard.ShardedMuon(torch.nn.Linear(4, 3, bias=False).parameters(), cuda_graph=True)
    with pytest.raises(TypeError, match="cuda_graph must be True or False, got 1"):
        tritonshard.ShardedAdamW(params(), cuda_graph=1)


def test_a_cpu_model_gets_a_clear_error():
    with pytest.raises(ValueError, match="cuda_graph=True: the parameters must be on a CUDA device"):
        tritonshard.ShardedAdamW(torch.nn.Linear(4, 3).parameters(), cuda_graph=True)
    assert graphs.unsupported(torch.device("cpu"), None) is not None


def test_steps_the_graph_cannot_freeze_run_eagerly(emulated):
    """A parameter frozen after construction (its pieces are saved and put back around the update, on the host),
    and once unfrozen, its own step count (its pieces updated again with it: param_steps.py): those steps are
    never captured (key None), and still give the eager bits."""
    runs = []
    for graphed in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
        opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-2, cuda_graph=graphed)
        opt.attach(model)
        for step in range(6):
            # frozen at steps 2-3 (its pieces kept around the update), then trained on its own count
            model[0].weight.requires_grad_(step < 2 or step > 3)
            model(torch.randn(3, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append(([p.detach().clone() for p in model.parameters()], opt))
    (a, _), (b, opt) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert float(opt.state[model[0].weight]["step"]) == 4 and float(opt.state[model[0].bias]["step"]) == 6
    # the reduction was captured (step 1) and replayed; the update: steps 0 and 1 captured as usual, 2-5 eager
    assert opt._graphs.captures == 2


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.00002])
def test_keys_that_alternate_are_each_captured_on_their_second_sight(emulated, bucket_cap_mb):
    """A loop that clips every other step has two keys, neither seen twice in a row: each is captured the second
    time it comes and replayed after, with the eager bits. With several buckets the merged update launch has a
    variant per key (grad_scale a tensor or a number): each capture must keep replaying its own variant's tables
    (the emulated replay fails on a table rebuilt at another address)."""
    runs = []
    for graphed in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
        opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=bucket_cap_mb,
                                       cuda_graph=graphed)
        opt.attach(model)
        for step in range(8):
            model(torch.randn(3, 6)).square().sum().backward()
            if step % 2 == 0:
                opt.clip_grad_norm_(0.01)
            opt.step()
            opt.zero_grad()
        runs.append(([p.detach().clone() for p in model.parameters()], opt))
    (a, _), (b, opt) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert (len(opt.buckets) > 2) == (bucket_cap_mb < 1)
    # reduce: step 0 eager, 1 captured, 2-7 replayed; update: steps 0 and 1 eager (first sights), 2 and 3 captured,
    # 4-7 replayed
    assert (opt._graphs.captures, opt._graphs.replays) == (3, 6 + 4)


def test_what_the_key_freezes(emulated):
    """The update's key: the hyper-parameters but the lr, a list counting as its tuple (so betas given as a list are
    captured too); None, an eager step, for an lr or a hyper-parameter given as a tensor."""
    model = torch.nn.Linear(4, 3)
    opt = tritonshard.ShardedAdamW([{"params": [model.weight], "betas": [0.9, 0.95]}, {"params": [model.bias]}],
                                   lr=1e-3, cuda_graph=True)
    key = opt._update_graph_key(None, None, None, [])
    assert key is not None and ("betas", (0.9, 0.95)) in key[2][0][1]
    opt.param_groups[1]["lr"] = 5e-4  # the lr is not frozen: the same key
    assert opt._update_graph_key(None, None, None, []) == key
    opt.param_groups[1]["eps"] = 1e-6
    assert opt._update_graph_key(None, None, None, []) != key
    opt.param_groups[1]["lr"] = torch.tensor(5e-4)
    assert opt._update_graph_key(None, None, None, []) is None
    opt.param_groups[1]["lr"] = 5e-4
    opt.param_groups[0]["betas"] = (torch.tensor(0.9), 0.95)
    assert opt._update_graph_key(None, None, None, []) is None


def test_a_checkpoint_loaded_mid_run_keeps_the_captures_valid(emulated):
    """Rolling back to a checkpoint (optimizer and model state_dicts taken after step 2, loaded after step 4) in an
    optimizer that has captured its phases: the loads write in place, so the graphs stay valid (the emulated replay
    fails on any tensor a load replaced), and the run matches the same run without graphs bit for bit."""
    import copy
    runs = []
    for graphed in (False, True):
        model, opt, schedule, data = _trainer(graphed, (9, 7, 3), 0.0001, 0.8, 3)
        weights, saved = [], None
        for step in range(8):
            model(torch.randn(4, 9, generator=data)).square().mean().backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            schedule.step()
            opt.zero_grad()
            if step == 2:
                saved = copy.deepcopy((opt.state_dict(), model.state_dict()))
            if step == 4:
                opt.load_state_dict(saved[0])
                model.load_state_dict(saved[1])
            weights.append([p.detach().clone() for p in model.parameters()])
        runs.append((weights, opt))
    (eager, _), (graphed, opt) = runs
    assert len(opt.buckets) > 1
    for a, b in zip(eager, graphed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert opt._graphs.replays == 2 * 6  # steps 2-7 replayed both phases, after the load too


def test_the_torch_api_the_real_capture_calls_exists():
    """graphs.CudaGraph runs only on a GPU: what it calls must exist with these arguments in this torch (2.13), as
    in the GPU machine's 2.11 (torch.cuda.graph has taken capture_error_mode since 2.1)."""
    import inspect
    assert "capture_error_mode" in inspect.signature(torch.cuda.graph).parameters
    assert callable(getattr(torch.cuda.CUDAGraph, "replay", None))
    assert graphs.make_graph is graphs.CudaGraph  # (the emulation is the tests' only, through their fixture)
